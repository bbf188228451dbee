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
from smmf.bench.bench import SHAPE_SETS, _timed
from smmf.kernels import triton_gpu
from smmf.kernels.triton_gpu import table
from smmf.matrix import square_matricize_shape

DEFAULT = dict(BLOCK_ROWS=table.BLOCK_ROWS, BLOCK_COLS=table.BLOCK_COLS, WARPS=table.WARPS,
               BAND_ROWS=table.BAND_ROWS)
CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    # The default spills (255 registers and 328-1184 B of stack per thread, tests/triton_compile.py);
    # 16 x 128 on 8 warps compiles without spills for every code of M.
    "BR16-BC128-w8": dict(BLOCK_ROWS=16, BLOCK_COLS=128, WARPS=8),
    "BR16-BC128-w4": dict(BLOCK_ROWS=16, BLOCK_COLS=128, WARPS=4),
    "BR32-BC128-w4": dict(BLOCK_ROWS=32, BLOCK_COLS=128, WARPS=4),
    "BR16-BC256-w8": dict(BLOCK_ROWS=16, BLOCK_COLS=256, WARPS=8),
    "BR8-BC512-w8": dict(BLOCK_ROWS=8, BLOCK_COLS=512, WARPS=8),
    "BR16-BC512-w8": dict(BLOCK_ROWS=16, BLOCK_COLS=512, WARPS=8),
    "band 128 rows": dict(BAND_ROWS=128),
    "band 1024 rows": dict(BAND_ROWS=1024),
}


def _configure(candidate: dict[str, Any]) -> None:
    for name, value in (DEFAULT | candidate).items():
        setattr(table, name, value)
    table.layout.cache_clear()


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
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ms": {}}
    for set_name in args.sets.split(","):
        params = make_params(SHAPE_SETS[set_name](), device="cuda")
        row: dict[str, float] = {}
        for name, candidate in CANDIDATES.items():
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
            row["deterministic, batched, covered tensors"] = 1e3 * median_step(opt, args.repeats)
            one_at_a_time = lambda p, g, st, cfg: triton_gpu.triton_step_(p, g, st, cfg)  # noqa: E731 (one tensor per launch)
            for name, kernel in [("deterministic, one launch per tensor", one_at_a_time),
                                 ("atomic (old), one launch per tensor", module.triton_step_)]:
                original = optimizer_module.step_kernel
                optimizer_module.step_kernel = lambda backend, p, st, k=kernel: k  # type: ignore[misc]
                try:
                    row[name + ", covered tensors"] = 1e3 * median_step(SMMF(covered, backend="triton"), args.repeats)
                finally:
                    optimizer_module.step_kernel = original
        results["ms"][set_name] = row
        del params
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
