"""What bf16 weights cost: the bf16 study's tables, from ``smmf compare`` runs of the bf16-weight rows.

    python studies/bf16_study.py results/bf16/pydoc-lm-cpu results/bf16/finetune-lm-cpu ... [--out report.md]

For each task, each configuration's held-out loss (mean over seeds) at 25%, 50% and 100% of the budget, and its
ratio to the same optimizer with fp32 weights (``smmf-recommended-bf16-sr`` against ``smmf-recommended``,
``adamw-bf16-master`` against ``adamw``); the worst seed's ratio beside it; and the bytes per parameter of the
weights and the optimizer's state together (bf16 weights 2, fp32 4; the state as ``smmf compare`` measured it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PHASES = (0.25, 0.5, 1.0)
# Each configuration's fp32-weight counterpart, and its rows in the order the tables show them.
FP32_OF = {"smmf-recommended": "smmf-recommended", "smmf-recommended-bf16": "smmf-recommended",
           "smmf-recommended-bf16-sr": "smmf-recommended", "adamw": "adamw", "adamw-bf16": "adamw",
           "adamw-bf16-sr": "adamw", "adamw-bf16-master": "adamw"}


def _loss_at(result: dict[str, Any], fraction: float) -> float:
    """The held-out loss at the evaluation nearest ``fraction`` of the run's budget (at or before it)."""
    target = fraction * result["steps"]
    evals = [e for e in result["evals"] if e["step"] <= target + 1e-9]
    return evals[-1]["held_out_loss"]


def _params(task: str) -> int:
    from smmf.bench.tasks import make_task

    return sum(p.numel() for p in make_task(task).build_model(0).parameters())


def report(folders: list[Path]) -> str:
    lines = []
    for folder in folders:
        data = json.loads((folder / "results.json").read_text())
        results = [r for r in data["results"] if r["optimizer"] in FP32_OF]
        task = results[0]["task"]
        numel = _params(task)
        by: dict[str, dict[int, dict[str, Any]]] = {}
        for r in results:
            by.setdefault(r["optimizer"], {})[r["seed"]] = r
        lines += [f"## {task}, {results[0]['steps']} steps, seeds {sorted(by[results[0]['optimizer']])}", "",
                  f"{data['meta']['command']}  ", f"code {data['meta']['code']}; {data['meta']['machine']}", "",
                  "| configuration | " + " | ".join(f"held-out loss at {int(p * 100)}%, ÷ fp32 weights (worst seed)"
                                                    for p in PHASES) + " | weights + state, bytes/param |",
                  "|---|" + "---|" * (len(PHASES) + 1)]
        for name in FP32_OF:
            if name not in by:
                continue
            cells = []
            for phase in PHASES:
                seeds = sorted(set(by[name]) & set(by[FP32_OF[name]]))
                losses = [_loss_at(by[name][s], phase) for s in seeds]
                ratios = [_loss_at(by[name][s], phase) / _loss_at(by[FP32_OF[name]][s], phase) for s in seeds]
                cells.append(f"{statistics.fmean(losses):.4f}, {statistics.fmean(ratios):.4f} ({max(ratios):.4f})")
            run = next(iter(by[name].values()))
            weights = 2 if run.get("weights") == "bf16" else 4
            cells.append(f"{weights + run['state_bytes'] / numel:.2f}")
            lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the tables here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = report(args.folders)
    print(text)
    if args.out:
        args.out.write_text(f"Command: python {' '.join(sys.argv)}\n\n{text}\n")


if __name__ == "__main__":
    main()
