"""The magnitude flag's fused CPU step against the fused SMMF step of an earlier commit (the target
"≤ 1.3× the fused SMMF step on the 52M shape set" was set against e49283b's) and against today's:
one process, the optimizers timed round-robin on the same parameters
(``smmf.bench.bench.interleaved_medians``), with fused Adam and the axpy limit beside them. The old
package is taken from git (``--commit``, default e49283b) into a temporary directory and imported
under another name.

    python studies/flag_vs_filed.py [--runs 3] [--repeats 15] [--threads 2] [--commit e49283b]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from smmf import SMMF
from smmf.bench.shapes import make_params
from smmf.bench.bench import SHAPE_SETS, interleaved_medians, set_threads

ROOT = Path(__file__).resolve().parents[1]


def old_package(commit: str, where: Path) -> object:
    """``src/smmf`` at ``commit``, importable as ``smmf_at_<commit>`` (its imports are relative)."""
    name = f"smmf_at_{commit}"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src/smmf"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "src" / "smmf").rename(where / name)
    sys.path.insert(0, str(where))
    return importlib.import_module(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="e49283b")
    parser.add_argument("--set", default="gpt2-52M", choices=sorted(SHAPE_SETS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old = old_package(args.commit, Path(tmp))
        filed = f"SMMF(numba) at {args.commit}"
        flag = "SMMF natural+flag(numba)"
        factories = {
            "Adam(fused)": partial(torch.optim.Adam, fused=True),
            filed: partial(old.SMMF, backend="numba"),  # type: ignore[attr-defined]
            "SMMF(numba)": partial(SMMF, backend="numba"),
            "SMMF natural(numba)": partial(SMMF, backend="numba", momentum_shape="natural"),
            flag: partial(SMMF, backend="numba", momentum_shape="natural", magnitude_bits=1),
        }
        params = make_params(SHAPE_SETS[args.set]())
        for run in range(args.runs):
            seconds = interleaved_medians(factories, params, args.repeats, "cpu")
            print(json.dumps({
                "run": run + 1, "threads": args.threads, "set": args.set,
                "ms": {name: round(s * 1e3, 2) for name, s in seconds.items()},
                "flag / SMMF when filed": round(seconds[flag] / seconds[filed], 3),
                "flag / SMMF now": round(seconds[flag] / seconds["SMMF(numba)"], 3),
                "flag / natural now": round(seconds[flag] / seconds["SMMF natural(numba)"], 3),
                "flag / Adam(fused)": round(seconds[flag] / seconds["Adam(fused)"], 3),
                "SMMF when filed / Adam(fused)": round(seconds[filed] / seconds["Adam(fused)"], 3),
            }), flush=True)


if __name__ == "__main__":
    main()
