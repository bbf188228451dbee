"""The Triton step's geometry, tried on a GPU: every candidate (tile shape, warps, 16-byte hints, a
register cap, band height) timed round-robin with ``AdamW(fused=True)`` and the in-place axpy over
the same params, in one run, per shape set and weight dtype; JSON with the medians and the ratios.
A candidate that fails to compile or run is left out, with its error in the JSON.

    python benchmarks/gpu_tune.py --sets gpt2-52M,gpt2-xl-1.3B --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from typing import Any, Callable

import torch

from smmf import SMMF
from smmf.bench.bench import SHAPE_SETS, _timed, copy_bandwidth
from smmf.bench.shapes import make_params
from smmf.kernels.triton_gpu import table

DEFAULT = dict(BLOCK_ROWS=table.BLOCK_ROWS, BLOCK_COLS=table.BLOCK_COLS, WARPS=table.WARPS,
               BAND_ROWS=table.BAND_ROWS, VECTOR_HINTS=table.VECTOR_HINTS, MAX_REGISTERS=table.MAX_REGISTERS,
               PIPELINE_STAGES=table.PIPELINE_STAGES)
CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "32x128 w8, no hints (the earlier geometry)": dict(BLOCK_ROWS=32, BLOCK_COLS=128, WARPS=8, VECTOR_HINTS=False,
                                                       PIPELINE_STAGES=1),
    "8x128 w8, 1 stage": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=1),
    "8x128 w8, 96 registers": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, MAX_REGISTERS=96, PIPELINE_STAGES=1),
    "8x128 w8, 2 stages": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=2),
    "8x128 w8, 3 stages": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=3),
    "8x128 w8, 2 stages, 96 registers": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=2, MAX_REGISTERS=96),
    "8x128 w8, 3 stages, 80 registers": dict(BLOCK_ROWS=8, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=3, MAX_REGISTERS=80),
    "16x128 w8, 2 stages": dict(BLOCK_ROWS=16, BLOCK_COLS=128, WARPS=8, PIPELINE_STAGES=2),
}
ADAMW = "AdamW(fused)"
AXPY = "axpy (limit)"


def configure(candidate: dict[str, Any]) -> None:
    for name, value in (DEFAULT | candidate).items():
        setattr(table, name, value)


def _candidate_step(opt: torch.optim.Optimizer, candidate: dict[str, Any]) -> None:
    configure(candidate)
    opt.step()


def time_set(set_name: str, dtype: torch.dtype, repeats: int, device: str = "cuda") -> dict[str, Any]:
    params = make_params(SHAPE_SETS[set_name](), device=device, dtype=dtype)
    steps: dict[str, Callable[[], object]] = {}
    adamw = torch.optim.AdamW(params, lr=1e-6, fused=True)
    steps[ADAMW] = adamw.step
    for name, candidate in CANDIDATES.items():
        steps[name] = partial(_candidate_step, SMMF(params, lr=1e-6, backend="triton"), candidate)
    numel = sum(p.numel() for p in params)
    a, b = torch.zeros(numel, device=device, dtype=dtype), torch.ones(numel, device=device, dtype=dtype)
    steps[AXPY] = partial(a.add_, b, alpha=1e-9)
    failed = {}
    for name, step in list(steps.items()):  # state, compilation and layouts are not timed
        try:
            for _ in range(2):
                step()
        except Exception as error:  # noqa: BLE001 (a candidate the compiler or the GPU refuses)
            failed[name] = repr(error)
            del steps[name]
    configure({})
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    configure({})
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return dict(params=numel, ms=ms, over_fused_adamw={name: t / ms[ADAMW] for name, t in ms.items()}, failed=failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="gpt2-52M,gpt2-xl-1.3B")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bytes_per_second": copy_bandwidth("cuda"),
                               "candidates": CANDIDATES, "default": DEFAULT, "sets": {}}
    for dtype_name in args.dtypes.split(","):
        for set_name in args.sets.split(","):
            results["sets"][f"{set_name} {dtype_name}"] = time_set(set_name, getattr(torch, dtype_name), args.repeats)
            torch.cuda.empty_cache()
            print(json.dumps({set_name: results["sets"][f"{set_name} {dtype_name}"]["ms"]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
