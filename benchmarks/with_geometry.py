"""Run a Python module under a Triton step geometry that ``benchmarks/gpu_tune.py --best`` chose:

    python benchmarks/with_geometry.py best.json smmf.cli bench --device cuda ...

applies the file's settings to :mod:`smmf.kernels.triton_gpu.table`, then runs the module as ``python -m``
would, with the remaining arguments."""

from __future__ import annotations

import json
import runpy
import sys

from smmf.kernels.triton_gpu import table


def main() -> None:
    path, module, *rest = sys.argv[1:]
    with open(path) as f:
        chosen = json.load(f)
    for name, value in chosen["settings"].items():
        if not hasattr(table, name):
            raise SystemExit(f"{path}: {name} is not a setting of smmf.kernels.triton_gpu.table")
        setattr(table, name, value)
    print(f"geometry: {chosen['name']}", file=sys.stderr)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
