#!/usr/bin/env bash
# The GPU battery (its stages took 4 (cut at their limit), 1, 1 and 2–3 minutes on an H200: split them over two calls
# with STAGES where one call has less time): every CUDA path against the torch path
# (tests/triton_parity.py on CUDA beside the CUDA-related tests), the step geometry tried round-robin
# with fused AdamW (benchmarks/gpu_tune.py), `smmf bench --device cuda` (52M GPT-2-like, ResNet-50,
# 1.56B GPT-2-XL-like; the opt-in momentum codes), and `smmf bench --training --device cuda`
# (GPT-2 medium and large; the largest model within 24 GiB and within the card).
# Writes at most 8 files to $OUT (default ./gpu-out). Needs torch with CUDA, triton, numba, transformers,
# pytest, pytest-xdist, pytest-timeout and hypothesis.
#   bash benchmarks/gpu_battery.sh            # everything
#   STAGES="tests tune" bash benchmarks/gpu_battery.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
STAGES=${STAGES:-"tests tune bench training"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/battery.log"
stage() { echo "== $1 ($(date +%T))" | tee -a "$LOG"; }
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
{
  python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
} > "$OUT/env.txt" 2>&1
if wanted tests; then
  stage tests
  # Correctness only, so the two run side by side: the parity script and the CUDA-related tests
  # (test_triton.py would run the parity script again). -rf names each failure in the summary, and a
  # per-test limit keeps one hang from taking the stage (an H200 run once lost its summary to the stage's).
  timeout 240 python3 tests/triton_parity.py > "$OUT/parity.log" 2>&1 &
  parity=$!
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short --timeout 120 -n 8 tests/test_cuda.py \
    tests/test_fused_kernels.py tests/test_checkpoint.py > "$OUT/tests_cuda.log" 2>&1
  echo "cuda tests rc=$?" | tee -a "$LOG"
  wait $parity; echo "parity rc=$?" | tee -a "$LOG"
  tail -3 "$OUT/tests_cuda.log" >> "$LOG"; tail -2 "$OUT/parity.log" >> "$LOG"
fi
if wanted tune; then
  stage tune  # two JSON documents, fp32 then bf16
  { timeout 150 python3 benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B --dtypes float32 --repeats 15 \
      && timeout 90 python3 benchmarks/gpu_tune.py --sets gpt2-xl-1.3B --dtypes bfloat16 --repeats 10; } \
    > "$OUT/tune.json" 2>> "$LOG"; echo "tune rc=$?" | tee -a "$LOG"
fi
if wanted bench; then
  stage bench  # the paper's code with the baselines and peaks; then the other codes of M, apart, so that one failing loses nothing else
  timeout 120 python3 -m smmf.cli bench --device cuda --sets gpt2-52M,resnet50,gpt2-xl-1.3B --repeats 10 --json \
    > "$OUT/bench_cuda.json" 2>> "$LOG"; echo "bench rc=$?" | tee -a "$LOG"
  timeout 90 python3 -m smmf.cli bench --device cuda --sets gpt2-52M,gpt2-xl-1.3B --momentum-codes --no-peak \
    --repeats 10 --json > "$OUT/bench_codes.json" 2>> "$LOG"; echo "bench codes rc=$?" | tee -a "$LOG"
fi
if wanted training; then
  stage training
  timeout 200 python3 -m smmf.cli bench --training --device cuda --largest 24,card --json \
    > "$OUT/training_cuda.json" 2>> "$LOG"; echo "training rc=$?" | tee -a "$LOG"
fi
stage done
