#!/usr/bin/env bash
# The GPU battery: CUDA tests (the whole suite), `smmf bench --device cuda`, the Triton tile sweep and
# the measured CUDA state memory of the paper's models. Writes logs and JSON to $OUT (default ./gpu-out).
# Needs torch with CUDA, triton, numba, transformers, peft, pytest, hypothesis and pytorch_optimizer.
#   bash benchmarks/gpu_battery.sh            # everything
#   ATOMIC=old_kernel.py bash ...             # also time an earlier atomic-sum kernel
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' > "$OUT/env.txt" 2>&1
import torch, triton, numba
print("torch", torch.__version__, "triton", triton.__version__, "numba", numba.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv >> "$OUT/env.txt" 2>&1
step() { echo "== $1 ($(date +%T))"; }
step tests
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs tests > "$OUT/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tests.log"
step bench
timeout 300 python3 -m smmf.cli bench --device cuda --sets gpt2-52M,resnet50,gpt2-xl-1.3B --repeats 20 --json \
  > "$OUT/bench_cuda.json" 2> "$OUT/bench_cuda.err"; echo "bench rc=$?"
step tune
timeout 240 python3 benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B ${ATOMIC:+--atomic "$ATOMIC"} \
  > "$OUT/tune.json" 2> "$OUT/tune.err"; echo "tune rc=$?"
step memory
timeout 300 python3 -m smmf.cli memory --measure cuda --format json > "$OUT/memory_cuda.json" 2> "$OUT/memory_cuda.err"
echo "memory rc=$?"
step done
