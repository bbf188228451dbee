"""The Triton step's geometry, tried on a GPU: every candidate (tile shape, warps, 16-byte hints, a
register cap, band height) timed
round-robin with ``AdamW(fused=True)`` and the in-place axpy over the same params, in one run, per shape
set and weight dtype; JSON with the medians and the ratios. First each candidate takes one step of a mix
of shapes (aligned and not, a conv, a vector) from the same state as the torch path: one that fails to
compile, to run or to match it is left out, with the reason in the JSON. ``--best`` names the candidate
with the lowest median over the sets, which :func:`configure` (or ``benchmarks/with_geometry.py``) applies.

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
               BAND_ROWS=table.BAND_ROWS, VECTOR_HINTS=table.VECTOR_HINTS, MAX_REGISTERS=table.MAX_REGISTERS)
CANDIDATES: dict[str, dict[str, Any]] = {
    "default (8x128 w8, prefetch, 80 registers)": {},
    "8x128 w8, prefetch, 96 registers": dict(MAX_REGISTERS=96),
    "8x128 w8, prefetch, 64 registers": dict(MAX_REGISTERS=64),
    "16x128 w8, prefetch": dict(BLOCK_ROWS=16),
    "8x256 w8, prefetch": dict(BLOCK_COLS=256),
    "8x128 w4, prefetch (2 rows a warp)": dict(WARPS=4),
    "4x128 w4, prefetch": dict(BLOCK_ROWS=4, WARPS=4),
    "8x128 w8, prefetch, bands of 1024": dict(BAND_ROWS=1024),
}
ADAMW = "AdamW(fused)"
AXPY = "axpy (limit)"


def configure(candidate: dict[str, Any]) -> None:
    for name, value in (DEFAULT | candidate).items():
        setattr(table, name, value)


def _candidate_step(opt: torch.optim.Optimizer, candidate: dict[str, Any]) -> None:
    configure(candidate)
    opt.step()


CHECK_SHAPES = ((1024, 768), (768, 3072), (64, 64, 3, 3), (1000, 3), (1000,), (37, 29))


def check(candidate: dict[str, Any], device: str = "cuda") -> str:
    """'' when one step of every CHECK_SHAPES tensor in one launch set, from the torch path's state,
    matches it (weights within 1e-6, factors within 1e-5 of their largest, sign bits but 1e-4 of them);
    else what differed or failed. A gate against a geometry that breaks the paper's code in fp32, not
    parity: the other codes, dtypes and shards are ``tests/triton_parity.py``'s, which the battery runs
    on the committed geometry."""
    from smmf.functional import StepConfig, torch_step_
    from smmf.kernels.triton_gpu import triton_steps_
    from smmf.state import MomentumCode, init_state

    gen = torch.Generator(device=device).manual_seed(0)
    cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                     maximize=False, stochastic_rounding=False, code=MomentumCode.SIGN)
    items, expected = [], []
    for shape in CHECK_SHAPES:
        p = torch.randn(shape, device=device, generator=gen)
        state = init_state(p, {"beta": 0.9, "vector_reshape": True})
        torch_step_(p, torch.randn(shape, device=device, generator=gen), state, cfg)  # a nonzero state
        g = torch.randn(shape, device=device, generator=gen)
        q, mine = p.clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        torch_step_(p, g, state, cfg)
        items.append((q, g, mine, cfg))
        expected.append((p, state))
    try:
        configure(candidate)
        triton_steps_(items)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (a candidate the compiler or the GPU refuses)
        return repr(error)
    finally:
        configure({})
    for (q, _, mine, _), (p, state), shape in zip(items, expected, CHECK_SHAPES):
        if not torch.allclose(q, p, rtol=1e-6, atol=1e-6):
            return f"{shape}: weights differ by {(q - p).abs().max().item():.3g}"
        for key in ("row_m", "col_m", "row_v", "col_v"):
            if not torch.allclose(mine[key], state[key], rtol=1e-5, atol=1e-5 * state[key].abs().max().item()):
                return f"{shape}: {key} differs by {(mine[key] - state[key]).abs().max().item():.3g}"
        if (mine["sign_m"] != state["sign_m"]).sum().item() > 1e-4 * state["sign_m"].numel():
            return f"{shape}: {(mine['sign_m'] != state['sign_m']).sum().item()} sign bytes differ"
    return ""


def time_set(set_name: str, dtype: torch.dtype, repeats: int, refused: dict[str, str],
             device: str = "cuda") -> dict[str, Any]:
    """Every candidate but the ``refused`` ones (by :func:`check`) timed on one shape set and dtype."""
    params = make_params(SHAPE_SETS[set_name](), device=device, dtype=dtype)
    steps: dict[str, Callable[[], object]] = {}
    failed = dict(refused)
    adamw = torch.optim.AdamW(params, lr=1e-6, fused=True)
    steps[ADAMW] = adamw.step
    for name, candidate in CANDIDATES.items():
        if name in failed:
            continue
        steps[name] = partial(_candidate_step, SMMF(params, lr=1e-6, backend="triton"), candidate)
    numel = sum(p.numel() for p in params)
    a, b = torch.zeros(numel, device=device, dtype=dtype), torch.ones(numel, device=device, dtype=dtype)
    steps[AXPY] = partial(a.add_, b, alpha=1e-9)
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
    parser.add_argument("--best", metavar="FILE", help="also write the fastest candidate's settings here (JSON)")
    parser.add_argument("--default-only", action="store_true",
                        help="time the committed geometry alone (with fused AdamW and the axpy)")
    args = parser.parse_args()
    if args.default_only:
        for name in list(CANDIDATES)[1:]:
            del CANDIDATES[name]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bytes_per_second": copy_bandwidth("cuda"),
                               "candidates": CANDIDATES, "default": DEFAULT, "sets": {}}
    refused = {name: reason for name, reason in ((name, check(c)) for name, c in CANDIDATES.items()) if reason}
    for dtype_name in args.dtypes.split(","):
        for set_name in args.sets.split(","):
            results["sets"][f"{set_name} {dtype_name}"] = time_set(set_name, getattr(torch, dtype_name), args.repeats,
                                                                   refused)
            torch.cuda.empty_cache()
            print(json.dumps({set_name: results["sets"][f"{set_name} {dtype_name}"]["ms"]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    if args.best:
        timed = [entry["over_fused_adamw"] for entry in results["sets"].values()]
        names = [name for name in CANDIDATES if all(name in ratios for ratios in timed)]
        best = min(names, key=lambda name: statistics.mean(ratios[name] for ratios in timed)) if names else None
        with open(args.best, "w") as f:  # none passed and ran everywhere: the committed geometry
            json.dump({"name": best or "committed", "settings": CANDIDATES[best] if best else {}}, f)
        print(f"fastest: {best}", file=sys.stderr)


if __name__ == "__main__":
    main()
