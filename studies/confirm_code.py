"""Confirm a code of M on a task that was not used to choose it: 3 seeds, the same 3-point lr sweep for every
optimizer, each at its best learning rate.

The code (``levels3-128``: sign + 3-bit level + a bf16 max per 128 elements of a row) and its settings were chosen
on ``pydoc-lm`` and ``digits-cnn`` (``docs/momentum-diagnosis.md``). The held-out task, declared before it was
run, is ``stdlib-lm-small``: the ``pydoc-lm`` model (a 4-layer, 128-wide byte-level GPT-2, context 128, batches of
32) trained from scratch for 400 steps on the ``.py`` files of the interpreter's standard library (``stdlib-lm``'s
corpus and file split; loss on 128 windows of the held-out files) — code instead of English prose.

Every optimizer gets the transformer hyperparameters of ``smmf compare`` (weight decay 1e-2, decoupled for all:
AdamW, the candidate, its bound and the paper's code of M), its learning rate times 0.3, 1 and 3 (3e-4, 1e-3, 3e-3), and the same warmup +
cosine schedule. Runs are the study tool's (``studies/momentum_diagnosis.py``), whose ``levels3-128`` code is
tied to ``smmf.SMMF(magnitude_bits=3)`` by ``tests/test_momentum_diagnosis.py``.

    python studies/confirm_code.py --shard 0/2 &  python studies/confirm_code.py --shard 1/2  # two processes
    python studies/confirm_code.py --report

The second confirmation, of a code chosen for high learning rates on ``stdlib-lm-small`` and ``pydoc-lm`` at
3× the default lr (``docs/high-lr.md``), declared before its runs: ``c-headers-lm-small`` (the same model and
budget on the interpreter's C headers), the candidate against AdamW, the bound and ``levels3-128``:

    python studies/confirm_code.py --task c-headers-lm-small --candidate CODE --last levels3-128-decoupled-wd \
        --out docs/high-lr-confirmation --shard 0/2   # and --shard 1/2

The third, of β2's decay rate γ = −0.8 (the paper's value for Transformers) with that code, chosen on
``stdlib-lm-small`` at 3× the default lr, where SMMF's V with the tasks' γ = −0.5 held even a dense M 6% behind
AdamW (``docs/high-lr.md``), declared before its runs: ``c-headers-lm-small`` again (not used to choose γ), the
γ = −0.8 candidate against AdamW, its own bound (a dense M with γ = −0.8) and the code with γ = −0.5:

    python studies/confirm_code.py --task c-headers-lm-small --candidate levels3sr-128-decoupled-wd-g08 \
        --bound dense-m-decoupled-wd-g08 --last levels3sr-128-decoupled-wd --out results/high-lr/confirmation-g08 \
        --shard 0/2   # and --shard 1/2; AdamW's and the last row's runs are those of results/high-lr/confirmation

The fourth, of ``smmf.RECOMMENDED`` as a whole once β1 is held (``growth_rate=None``, chosen on ``stdlib-lm``,
``docs/momentum-diagnosis.md``), declared before its runs: ``cpp-headers-lm-small`` (the same model and budget on
the C++ headers that torch's wheel ships; no choice of a code was made on it), AdamW, the code's own bound (a dense
M, γ = −0.8, β1 held), the code, and last the code with β1's growth (the recommendation before):

    python studies/confirm_code.py --task cpp-headers-lm-small \
        --candidate levels3sr-128-decoupled-wd-g08-const-beta1 --bound dense-m-decoupled-wd-g08-const-beta1 \
        --last levels3sr-128-decoupled-wd-g08 --out results/code-of-m/recommended-confirmation --shard 0/2   # and --shard 1/2

It passes if, at each optimizer's best learning rate, the code's 3-seed mean held-out loss is within 2% of its
bound's at 25, 50 and 100% of the budget and within 2% of AdamW's at 100%.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from momentum_diagnosis import POINTS, VARIANTS, code_version, metric_at, study_task, train
from smmf.table import format_table

CANDIDATE = "levels3-128-decoupled-wd"
BOUND = "dense-m-decoupled-wd"  # the candidate with a dense fp32 M: what no code of M can beat
# The essential rows first, the paper's code last (a run cut short still has what the verdict needs); it
# gets the decoupled decay too, so that the rows differ in the code of M alone.
LAST = "decoupled-wd"
LR_SCALES = (0.3, 1.0, 3.0)
SEEDS = (0, 1, 2)
STEPS = 400


def optimizers(candidate: str = CANDIDATE, last: str = LAST, bound: str = BOUND) -> tuple[str, ...]:
    """The rows: AdamW, the bound (second), the candidate, the last."""
    return ("adamw", bound, candidate, last)


def plan(names: tuple[str, ...]) -> list[tuple[str, float, int]]:
    """(optimizer, lr scale, seed) of every run, in the order they are run."""
    essential = [(name, scale, seed) for seed in SEEDS for scale in LR_SCALES for name in names[:-1]]
    return essential + [(names[-1], scale, seed) for seed in SEEDS for scale in LR_SCALES]


def run_path(out: Path, name: str, scale: float, seed: int) -> Path:
    return out / "runs" / f"{name}__lr{scale:g}__seed{seed}.json"


def _stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd


def report(runs: list[dict[str, Any]], names: tuple[str, ...]) -> str:
    """Markdown: every (optimizer, lr) over its seeds with its ratio to the bound at that lr, then each
    optimizer at its best lr with ratios."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["variant"], r["lr_scale"]), []).append(r)
    head = (["optimizer", "lr ×", "seeds"] + [f"held-out loss @{int(f * 100)}%" for f in POINTS]
            + [f"÷ bound @{int(f * 100)}%" for f in POINTS])
    rows = []
    known = sorted(by.items(), key=lambda kv: (names.index(kv[0][0]) if kv[0][0] in names else len(names), kv[0][1]))
    for (name, scale), group in known:
        cells = ["{:.4f} ± {:.4f}".format(*_stats([metric_at(r, f) for r in group])) for f in POINTS]
        bound = by.get((names[1], scale))
        cells += [f"{_stats([metric_at(r, f) for r in group])[0] / _stats([metric_at(r, f) for r in bound])[0]:.3f}"
                  if bound and len(bound) == len(group) else "–" for f in POINTS]
        rows.append([f"`{name}`", f"{scale:g}", ",".join(str(r["seed"]) for r in group), *cells])
    out = ["All runs (mean ± standard deviation over the seeds):\n\n" + format_table(head, rows, "markdown")]
    best: dict[str, list[dict[str, Any]]] = {}
    for name in names:  # best lr: the lowest mean final loss among the lrs run on every seed
        complete = [g for (n, _), g in by.items() if n == name and len(g) == len(SEEDS)]
        if complete:
            best[name] = min(complete, key=lambda g: _stats([metric_at(r, 1.0) for r in g])[0])
    head = (["optimizer", "best lr ×"] + [f"@{int(f * 100)}%" for f in POINTS] + ["worst seed @25%"]
            + [f"÷ {ref} @{int(f * 100)}%" for ref in ("dense-M bound", "AdamW") for f in POINTS])
    rows = []
    for name, group in best.items():
        means = [_stats([metric_at(r, f) for r in group])[0] for f in POINTS]
        ratios = []
        for ref in (names[1], "adamw"):
            ref_means = [_stats([metric_at(r, f) for r in best[ref]])[0] for f in POINTS] if ref in best else None
            ratios += [f"{m / rm:.3f}" if ref_means else "–" for m, rm in zip(means, ref_means or means)]
        rows.append([f"`{name}`", f"{group[0]['lr_scale']:g}", *[f"{m:.4f}" for m in means],
                     f"{max(metric_at(r, 0.25) for r in group):.4f}", *ratios])
    out.append("Each optimizer at its best learning rate (means over the seeds; ratios of those means):\n\n"
               + format_table(head, rows, "markdown"))
    return "\n\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/code-of-m/code-confirmation")
    parser.add_argument("--task", default="stdlib-lm-small", help="the held-out task (a study task)")
    parser.add_argument("--candidate", default=CANDIDATE, choices=sorted(VARIANTS))
    parser.add_argument("--bound", default=BOUND, choices=sorted(VARIANTS), help="the candidate with a dense M")
    parser.add_argument("--last", default=LAST, choices=sorted(VARIANTS), help="the row run after the others")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th run of the plan, from the i-th")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--report", action="store_true", help="only rewrite results.md from OUT/runs")
    args = parser.parse_args(argv)
    names = optimizers(args.candidate, args.last, args.bound)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report:
        index, count = (int(x) for x in args.shard.split("/"))
        task = study_task(args.task)
        for name, scale, seed in plan(names)[index::count]:
            path = run_path(out, name, scale, seed)
            if path.exists():
                continue
            result = {**train(task, name, STEPS, seed, torch.device("cpu"), scale), "code": code_version()}
            path.write_text(json.dumps(result))
            print(f"{name} lr×{scale:g} seed {seed}: " + ", ".join(f"{metric_at(result, f):.4f}" for f in POINTS),
                  flush=True)
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    codes = ", ".join(sorted({str(r.get("code")) for r in runs}))
    given = " ".join(a for a in (sys.argv[1:] if argv is None else argv) if a != "--report")
    given = re.sub(r"\s*--shard[= ]\S+", "", given)
    text = (f"Runs: `python studies/confirm_code.py {given} --shard 0/2` and `--shard 1/2` (two processes, one "
            f"torch thread each; a run already in OUT/runs is skipped), then `--report`  \nCode of the runs: {codes}; "
            f"tables written at {code_version()}\n\n" + report(runs, names))
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
