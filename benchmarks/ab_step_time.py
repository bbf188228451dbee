"""Interleaved A/B of the fused CPU step between two commits (or more: each against the first), on the 52M
GPT-2-like shape set (``--set resnet50``: ResNet-50's, many small tensors), under SMMF's defaults or
``--optimizer`` (an expression of ``params``).

Each commit is checked out into a temporary worktree; rounds alternate between them (ABBA: which
goes first alternates too), each a fresh process (warm numba cache: one untimed process per commit first) timing the median of ``--steps``
SMMF steps after 3 warm-up steps. Prints every round's medians, their median per commit and the
ratio. Run on a quiet machine; name the CPU with the figures.

    python benchmarks/ab_step_time.py 469c2fd HEAD --rounds 6 --steps 15
    python benchmarks/ab_step_time.py 469c2fd HEAD --optimizer "SMMF(params, **smmf.RECOMMENDED)"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable

from worktrees import checked_out


# A fresh process's median step over the 52M set (or $AB_SHAPES, a function of smmf.bench.shapes): argv[1]
# steps, argv[2] the optimizer (an expression of ``params``; SMMF's defaults when left out). Shared with
# code_step_time.py.
CHILD = r"""
import json, os, statistics, sys, time
import torch
import smmf
from smmf import SMMF
from smmf.bench import shapes
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s)) for s in getattr(shapes, os.environ.get("AB_SHAPES", "gpt2_like_shapes"))()]
for p in params:
    p.grad = torch.randn_like(p)
opt = eval(sys.argv[2]) if len(sys.argv) > 2 else SMMF(params, lr=1e-3)
for _ in range(3):
    opt.step()
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - start)
print(json.dumps({"median_s": statistics.median(times), "from": smmf.__file__}))
"""


def _time(tree: Path, steps: int, optimizer: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps), optimizer], env=env, capture_output=True,
                         text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["from"].startswith(str(tree)), f"imported {result['from']}, not the worktree's smmf"
    return result["median_s"]


def interleaved_rounds(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each run's result per round, the runs in order on odd rounds and reversed on even ones (ABBA: the
    second process of a round ran slower here, ~3%); prints every round. Shared with code_step_time.py."""
    medians: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs.items())
    for round_ in range(1, rounds + 1):
        for name, run in order if round_ % 2 else order[::-1]:
            medians[name].append(run())
        print(f"round {round_}: " + ", ".join(f"{n} {m[-1] * 1e3:.1f} ms" for n, m in medians.items()), flush=True)
    return medians


SETS = {"gpt2-52M": "gpt2_like_shapes", "resnet50": "resnet50_shapes"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="+", help="two or more commits; each is compared with the first")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--set", choices=list(SETS), default="gpt2-52M")
    parser.add_argument("--optimizer", default="SMMF(params, lr=1e-3)", help="an expression of params")
    args = parser.parse_args()
    if len(args.commits) < 2:
        parser.error("give two or more commits")
    os.environ["AB_SHAPES"] = SETS[args.set]
    with tempfile.TemporaryDirectory() as tmp, checked_out(args.commits, Path(tmp)) as trees:
        for tree in trees.values():
            _time(tree, 1, args.optimizer)  # compile and cache the kernels
        medians = interleaved_rounds(
            {name: partial(_time, tree, args.steps, args.optimizer) for name, tree in trees.items()}, args.rounds)
        summary = {name: statistics.median(m) for name, m in medians.items()}
        print(", ".join(f"{n}: median {s * 1e3:.1f} ms, best {min(medians[n]) * 1e3:.1f} ms"
                        for n, s in summary.items()))
        first = args.commits[0]
        for commit in args.commits[1:]:
            print(f"{commit} / {first}: {summary[commit] / summary[first]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
