#!/usr/bin/env bash
# The GPU battery, in one go: Triton parity smoke test, the CUDA tests, `smmf bench --device cuda`
# (52M GPT-2-like, ResNet-50, 1.3B GPT-2-XL-like; the opt-in momentum codes on the 52M set), the Triton tile sweep, the measured CUDA state
# memory of the paper's models, then the rest of the test suite with CUDA present.
# Writes at most 9 files to $OUT (default ./gpu-out). Needs torch with CUDA, triton, numba,
# transformers, peft, pytest, hypothesis and pytorch_optimizer.
#   bash benchmarks/gpu_battery.sh
#   ATOMIC=old_kernel.py bash benchmarks/gpu_battery.sh   # also time an earlier atomic-sum kernel
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ERR="$OUT/errors.log"
stage() { echo "== $1 ($(date +%T))" | tee -a "$ERR"; }
python3 - <<'PY' > "$OUT/env.txt" 2>&1
import torch, triton, numba
print("torch", torch.__version__, "triton", triton.__version__, "numba", numba.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv >> "$OUT/env.txt" 2>&1
stage smoke
timeout 120 python3 tests/triton_parity.py > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?" | tee -a "$ERR"
stage "cuda tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_triton.py \
  tests/test_fused_kernels.py tests/test_checkpoint.py > "$OUT/tests_cuda.log" 2>&1; echo "cuda tests rc=$?" | tee -a "$ERR"
stage bench
timeout 130 python3 -m smmf.cli bench --device cuda --sets gpt2-52M,resnet50,gpt2-xl-1.3B --repeats 20 --json \
  > "$OUT/bench_cuda.json" 2>> "$ERR"; echo "bench rc=$?" | tee -a "$ERR"
stage "momentum codes"
timeout 45 python3 -m smmf.cli bench --device cuda --sets gpt2-52M --momentum-codes --no-peak --json \
  > "$OUT/bench_codes_cuda.json" 2>> "$ERR"; echo "momentum codes rc=$?" | tee -a "$ERR"
stage tune
timeout 100 python3 benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B ${ATOMIC:+--atomic "$ATOMIC"} \
  > "$OUT/tune.json" 2>> "$ERR"; echo "tune rc=$?" | tee -a "$ERR"
stage memory
timeout 130 python3 -m smmf.cli memory --measure cuda --format json > "$OUT/memory_cuda.json" 2>> "$ERR"
echo "memory rc=$?" | tee -a "$ERR"
stage "other tests"
timeout "${REST_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider -rs tests \
  --ignore tests/test_cuda.py --ignore tests/test_triton.py --ignore tests/test_fused_kernels.py \
  --ignore tests/test_checkpoint.py > "$OUT/tests_rest.log" 2>&1; echo "other tests rc=$?" | tee -a "$ERR"
stage done
