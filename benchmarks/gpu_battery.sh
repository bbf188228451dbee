#!/usr/bin/env bash
# The GPU battery (on an H200 its stages took up to 4, 2, 2, 1 and 2–3 minutes: split them over calls with
# STAGES where one call has less time): every CUDA path against the torch path
# (tests/triton_parity.py on CUDA beside the CUDA-related tests), the step geometry tried round-robin
# with fused AdamW (benchmarks/gpu_tune.py, whose fastest candidate that matches the torch path the
# bench and profile stages then run under), `smmf bench --device cuda` (52M GPT-2-like, ResNet-50,
# 1.56B GPT-2-XL-like; the opt-in momentum codes), where a step's time goes (benchmarks/gpu_profile.py),
# opt-in, `bf16`: the committed geometry's step with bf16 params against fused AdamW's (benchmarks/gpu_tune.py
# --default-only); and, opt-in, `training`: `smmf bench --training --device cuda`
# (GPT-2 medium and large; the largest model within 24 GiB and within the card); opt-in, `study`:
# `smmf compare` on stdlib-lm and finetune-lm with the peers, 3 seeds, runs side by side on the GPU
# (partial results are kept when a task hits its limit), beside the tests; resumed from the runs committed in
# results/lm-study-gpu (`--resume` keeps those this command would make again), so that sessions add up.
# Writes at most 8 files to $OUT (default ./gpu-out). Needs torch with CUDA, triton, numba, transformers,
# pytest, pytest-xdist, pytest-timeout and hypothesis (the study: pytorch_optimizer and the peers, which
# may come on PYTHONPATH).
#   bash benchmarks/gpu_battery.sh            # tune bench profile, then tests (took 6 minutes on an H200)
#   STAGES="tests tune" bash benchmarks/gpu_battery.sh
#   STAGES="tests study" STUDY_S="330 180" bash benchmarks/gpu_battery.sh
#   STAGES="tests" TESTS_K="cuda or triton" bash benchmarks/gpu_battery.sh   # only the tests that run on CUDA
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
STAGES=${STAGES:-"tests tune bench profile"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/battery.log"
stage() { echo "== $1 ($(date +%T))" | tee -a "$LOG"; }
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
{
  python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
} > "$OUT/env.txt" 2>&1
tests() {
  # Correctness only, so it may run beside the study. The parity script first, alone: it prints each
  # failing check with its traceback as it goes (pytest prints tracebacks at its end, which a stage's
  # limit has cut off before). Then the CUDA-related tests; -v names every test as it ends, and a per-test
  # limit keeps one hang from taking the stage.
  timeout "${PARITY_S:-240}" python3 tests/triton_parity.py > "$OUT/parity_cuda.log" 2>&1
  echo "parity rc=$?" | tee -a "$LOG"; grep -E "^FAILED|PARITY" "$OUT/parity_cuda.log" >> "$LOG"
  timeout "${TESTS_S:-330}" python3 -m pytest -v -p no:cacheprovider -rfs --tb=short --timeout 200 -n "${WORKERS:-6}" \
    ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda.py tests/test_fused_kernels.py tests/test_checkpoint.py tests/test_step_in_backward.py \
    > "$OUT/tests_cuda.log" 2>&1
  echo "cuda tests rc=$?" | tee -a "$LOG"; grep -E "FAILED|ERROR" "$OUT/tests_cuda.log" >> "$LOG"
  tail -3 "$OUT/tests_cuda.log" >> "$LOG"
}
if wanted tests && wanted study; then  # beside the study; else after the timings, which it would disturb
  stage tests
  tests & tests_pid=$!
fi
if wanted study; then
  stage study
  read -r -a limits <<< "${STUDY_S:-330 180}"
  mkdir -p runs  # ignored by git: a fresh copy of the checkout has none
  i=0
  for task in stdlib-lm finetune-lm; do
    mkdir -p "runs/study-$task"
    [[ -f "runs/study-$task/results.json" ]] || cp "results/lm-study-gpu/$task/results.json" "runs/study-$task/" 2>/dev/null
    timeout "${limits[$i]:-180}" python3 -m smmf.cli compare --device cuda --tasks $task --seeds 3 --jobs 8 \
      --optimizers adamw,adam,adafactor,sm3,came,smmf,smmf-natural,smmf-natural-flag,smmf-recommended,torchao-adamw8bit,torchao-adamw4bit,bnb-adamw8bit,adv-adamw-factored \
      --cache runs/cache --out "runs/study-$task" --resume > "runs/study-$task.log" 2>&1
    echo "study $task rc=$? ($(date +%T))" | tee -a "$LOG"
    grep -v "it/s\]\|Warning\|warn" "runs/study-$task.log" | tail -25 >> "$LOG"
    if [[ -f "runs/study-$task/results.json" ]]; then cp "runs/study-$task/results.json" "$OUT/study-$task.json"
    else echo "study $task: no run finished" | tee -a "$LOG"; fi
    i=$((i + 1))
  done
  [[ -n "${tests_pid:-}" ]] && wait "$tests_pid"
fi
# The bench and profile stages run under the tune's fastest candidate that matched the torch path, or
# under the committed geometry where no tune ran.
# Kept in runs/ (ignored by git), not in $OUT (at most 8 files come back): a later call on the same warm
# machine that runs no tune takes it, a fresh machine the committed geometry.
BEST=runs/best.json
mkdir -p runs
if wanted tune || [[ ! -f "$BEST" ]]; then echo '{"name": "committed", "settings": {}}' > "$BEST"; fi
if wanted tune; then
  stage tune  # two JSON documents, fp32 then bf16
  { timeout "${TUNE_S:-150}" python3 benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B --dtypes float32 \
      --repeats 12 --best "$BEST" \
      && timeout 80 python3 benchmarks/gpu_tune.py --sets gpt2-xl-1.3B --dtypes bfloat16 --repeats 8; } \
    > "$OUT/tune.json" 2>> "$LOG"; echo "tune rc=$? best: $(cat "$BEST")" | tee -a "$LOG"
fi
if wanted bench; then
  stage bench  # the paper's code with the baselines and peaks; then the other codes of M, apart, so that one failing loses nothing else
  timeout 100 python3 benchmarks/with_geometry.py "$BEST" smmf.cli bench --device cuda --sets gpt2-52M,resnet50,gpt2-xl-1.3B --repeats 10 --json \
    > "$OUT/bench_cuda.json" 2>> "$LOG"; echo "bench rc=$?" | tee -a "$LOG"
  timeout "${CODES_S:-80}" python3 benchmarks/with_geometry.py "$BEST" smmf.cli bench --device cuda \
    --sets gpt2-52M,gpt2-xl-1.3B --momentum-codes --no-peak --repeats 8 --json > "$OUT/bench_codes.json" 2>> "$LOG"; echo "bench codes rc=$?" | tee -a "$LOG"
fi
if wanted bf16; then
  stage bf16
  timeout "${BF16_S:-60}" python3 benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B --dtypes bfloat16 --default-only \
    --repeats 8 > "$OUT/bf16.json" 2>> "$LOG"; echo "bf16 rc=$?" | tee -a "$LOG"
fi
if wanted profile; then
  stage profile
  timeout 60 python3 benchmarks/with_geometry.py "$BEST" gpu_profile --sets resnet50,gpt2-xl-1.3B \
    > "$OUT/profile.txt" 2>> "$LOG"; echo "profile rc=$?" | tee -a "$LOG"
fi
if wanted tests && ! wanted study; then
  stage tests
  tests
fi
if wanted training; then
  stage training
  timeout "${TRAINING_S:-200}" python3 -m smmf.cli bench --training --device cuda --largest 24,card --json \
    > "$OUT/training_cuda.json" 2>> "$LOG"; echo "training rc=$?" | tee -a "$LOG"
fi
stage done
