"""One report from the runs of several ``smmf compare`` outputs: a study run a batch at a time.

Long studies (``stdlib-lm``: an hour or more per run on a 2-core CPU) are run a few runs per command, each into its
own folder. This reads the ``results.json`` of every folder given, keeps the runs of one task on one kind of device,
drops repeats (the same run kept by several ``--resume`` commands: same optimizer, seed, steps, hyperparameters,
pretraining), orders them by optimizer (AdamW and Adam, the references, first) and seed, and writes the report
``smmf compare`` writes for its own runs: ``results.md`` (mean ± std over each row's seeds, the worst seed's
loss@100), ``results.csv``, ``results.json`` and the curves with a band across seeds. Nothing is trained. Each run
keeps the commit it ran at; the report's header lists them. Rows differ in their number of seeds; the table's
"seeds" column says how many each has.

    python benchmarks/merge_results.py --task stdlib-lm --device cpu --out results/stdlib-lm-cpu/stdlib-cpu-all results/stdlib-lm-cpu/stdlib-cpu \
        results/stdlib-lm-cpu/stdlib-cpu-held-beta1 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from smmf.bench.compare import _code_version, _run_key, stored_results, write_outputs
from smmf.bench.optimizers import optimizer_specs


def merged_runs(folders: list[Path], task: str, device: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The distinct runs of ``task`` on ``device`` in ``folders`` (the first copy of each): AdamW's and Adam's,
    then the others in ``smmf compare``'s optimizer order, each by setting and seed; and the machines the folders'
    headers name."""
    runs: dict[tuple, dict[str, Any]] = {}
    machines: list[str] = []
    for folder in folders:
        try:
            found = stored_results(folder)
        except ValueError as err:
            raise SystemExit(f"merge_results: {err}") from None
        if not found:
            raise SystemExit(f"merge_results: {folder} has no results.json")
        for run in found:
            if run["task"] == task and run.get("device") == device and not run.get("skipped"):
                runs.setdefault(_run_key(run), run)
        machine = _header_machine(folder)
        if machine and machine not in machines:
            machines.append(machine)
    names = ["adamw", "adam", *(name for name in optimizer_specs("transformer") if name not in ("adamw", "adam"))]
    order = {name: i for i, name in enumerate(names)}  # the references first
    ordered = sorted(runs.values(), key=lambda r: (order.get(r["optimizer"], len(order)), r["optimizer"],
                                                  repr(sorted(r.get("kwargs", {}).items())), r["seed"]))
    return ordered, machines


def _header_machine(folder: Path) -> str:
    for line in (folder / "results.md").read_text().splitlines()[:4] if (folder / "results.md").exists() else []:
        if line.startswith("Machine: "):
            return line.removeprefix("Machine: ").strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of smmf compare")
    parser.add_argument("--task", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.out.resolve() in {folder.resolve() for folder in args.folders}:
        parser.error("--out must not be one of the folders read (its results.json would be replaced)")
    runs, machines = merged_runs(args.folders, args.task, args.device)
    if not runs:
        parser.error(f"no run of {args.task} on {args.device} in those folders")
    command = "python benchmarks/merge_results.py " + " ".join(
        [f"--task {args.task}", f"--device {args.device}", f"--out {args.out}", *map(str, args.folders)])
    meta = {"command": command, "code": _code_version(), "machine": "; ".join(machines) or "unknown",
            "device": args.device, "merged": True}
    write_outputs(runs, meta, args.out, plots=not args.no_plots)
    print(f"wrote {args.out}/results.md: {len(runs)} runs of {args.task} from {len(args.folders)} folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
