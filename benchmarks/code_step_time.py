"""Interleaved A/B of the fused CPU step between codes of M, on the 52M GPT-2-like shape set, beside fused Adam.

Rounds alternate the order of the optimizers (each a fresh process on the installed ``smmf``, warm numba cache:
one untimed process per optimizer first), each timing the median of ``--steps`` steps after 3 warm-up steps.
Prints every round, the median per optimizer and the ratios to the paper's code and to fused Adam. Run on a
quiet machine; name the CPU with the figures.

    python benchmarks/code_step_time.py --rounds 6 --steps 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from functools import partial

# the timed child process and the interleaved rounds, shared with the A/B of two commits
from ab_step_time import CHILD, interleaved_rounds

OPTIMIZERS = {
    "SMMF (paper code)": "SMMF(params)",
    "SMMF magnitude_bits=3": "SMMF(params, magnitude_bits=3)",
    "SMMF magnitude_bits=3 stochastic": "SMMF(params, magnitude_bits=3, momentum_rounding='stochastic')",
    "Adam (fused)": "torch.optim.Adam(params, fused=True)",
}


def _time(build: str, steps: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps), build], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    for build in OPTIMIZERS.values():
        _time(build, 1)  # compile and cache the kernels
    medians = interleaved_rounds({name: partial(_time, build, args.steps) for name, build in OPTIMIZERS.items()},
                                 args.rounds)
    summary = {name: statistics.median(m) for name, m in medians.items()}
    paper, adam = summary["SMMF (paper code)"], summary["Adam (fused)"]
    for name, median in summary.items():
        print(f"{name}: median {median * 1e3:.1f} ms (best {min(medians[name]) * 1e3:.1f}), "
              f"{median / paper:.3f}× the paper code, {median / adam:.3f}× fused Adam")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
