"""Tile sizes of the Triton kernel, tried on a GPU: median SMMF(triton) step per shape set for each
candidate geometry, in one run, as JSON. ``--atomic FILE`` also times an earlier kernel that summed
with atomics (a module exposing ``triton_step_``) on the sets' shapes that it covers, to measure
what the deterministic reduction costs.

    python benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B [--atomic old_kernel.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from typing import Any

import torch

import smmf.optimizer as optimizer_module
from smmf import SMMF
from smmf.bench.shapes import make_params
from smmf.bench.step_time import SHAPE_SETS, _timed
from smmf.kernels import triton_gpu
from smmf.matrix import square_matricize_shape

CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "BR16-BC128-w4": {"table": {128: (16, 128, 4)}},
    "BR64-BC128-w8": {"table": {128: (64, 128, 8)}},
    "BR8-BC256-w4": {"table": {128: (8, 256, 4)}},
    "BR16-BC256-w8": {"table": {128: (16, 256, 8)}},
    "2 programs/SM": {"programs_per_sm": 2},
    "8 programs/SM": {"programs_per_sm": 8},
}


def _configure(candidate: dict[str, Any]) -> None:
    triton_gpu.TILE_TABLE.update(candidate.get("table", {}))
    triton_gpu.PROGRAMS_PER_SM = candidate.get("programs_per_sm", 4)
    triton_gpu._plan.cache_clear()


def median_step(opt: torch.optim.Optimizer, repeats: int) -> float:
    for _ in range(2):
        opt.step()
    return statistics.median(_timed(opt.step, "cuda") for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="gpt2-52M,gpt2-xl-1.3B")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--atomic", help="an earlier kernel module with triton_step_, timed for comparison")
    args = parser.parse_args()
    default_table = dict(triton_gpu.TILE_TABLE)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ms": {}}
    for set_name in args.sets.split(","):
        params = make_params(SHAPE_SETS[set_name](), device="cuda")
        row: dict[str, float] = {}
        for name, candidate in CANDIDATES.items():
            triton_gpu.TILE_TABLE.clear()
            triton_gpu.TILE_TABLE.update(default_table)
            _configure(candidate)
            row[name] = 1e3 * median_step(SMMF(params, backend="triton"), args.repeats)
        _configure({})
        if args.atomic:
            # Only the tensors the old kernel covers (width a multiple of 8), both kernels alike.
            covered = [p for p in params if square_matricize_shape(p.numel())[1] % 8 == 0]
            spec = importlib.util.spec_from_file_location("atomic_kernel", args.atomic)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            opt = SMMF(covered, backend="triton")
            row["deterministic, covered tensors"] = 1e3 * median_step(opt, args.repeats)
            original = optimizer_module.step_kernel
            optimizer_module.step_kernel = lambda backend, p, st: module.triton_step_  # type: ignore[assignment]
            try:
                row["atomic (old), covered tensors"] = 1e3 * median_step(SMMF(covered, backend="triton"), args.repeats)
            finally:
                optimizer_module.step_kernel = original
        results["ms"][set_name] = row
        del params
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
