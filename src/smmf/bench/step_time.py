"""Step time and extra peak memory of SMMF against Adam and Adafactor.

Prints, from one run, each optimizer's median step time as a ratio to Adam's (foreach on CPU,
fused AdamW on CUDA), and the extra resident memory of one step relative to the parameter bytes,
each measured in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any, Callable

import torch

from .. import SMMF
from ..kernels import available_backends
from .procfs import reset_peak_rss, status_kib
from .progress import progress
from .shapes import gpt2_like_shapes, make_params, resnet50_shapes
from .table import format_table

OptimFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
PEAK_SHAPE = (8192, 4096)


def optim_map(device: str) -> dict[str, OptimFactory]:
    fused = "triton" if device == "cuda" else "numba"
    table: dict[str, OptimFactory] = {"Adam(foreach)": partial(torch.optim.Adam, foreach=True)}
    if device == "cuda":
        table["AdamW(fused)"] = partial(torch.optim.AdamW, fused=True)
    table["Adafactor(torch)"] = partial(torch.optim.Adafactor, foreach=True)
    table["SMMF(torch)"] = partial(SMMF, backend="torch")
    if fused in available_backends():
        table[f"SMMF({fused})"] = partial(SMMF, backend=fused)
    return table


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_step_seconds(factory: OptimFactory, params: list[torch.nn.Parameter], repeats: int, device: str) -> float:
    opt = factory(params)
    for _ in range(2):  # state creation and JIT compilation are not timed
        opt.step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    del opt
    gc.collect()
    return statistics.median(times)


def _peak_child(name: str) -> None:
    """In a fresh process: extra RSS high-water mark of one step over the resident size before it."""
    params = make_params([PEAK_SHAPE])
    opt = optim_map("cpu")[name](params)
    opt.step()  # state and JIT first: the figure is the step's temporaries
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("peak memory needs Linux /proc/self/clear_refs")
    before = status_kib("VmRSS") or 0
    opt.step()
    extra = ((status_kib("VmHWM") or 0) - before) * 1024
    print(json.dumps({"extra_bytes": extra, "param_bytes": params[0].numel() * 4}))


def extra_peak_ratio(name: str) -> float:
    # Large temporaries must come from (and go back to) mmap, so that RSS sees each step afresh.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-m", "smmf.bench.step_time", "--peak-child", name],
        capture_output=True, text=True, check=True, env=env,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["extra_bytes"] / result["param_bytes"]


def run(sets: list[str], repeats: int, device: str, peak: bool, show_progress: bool = True) -> dict[str, Any]:
    shape_sets = {"gpt2-52M": gpt2_like_shapes, "resnet50": resnet50_shapes}
    optims = optim_map(device)
    jobs = [(s, name) for s in sets for name in optims]
    peak_jobs = list(optims) if peak and device == "cpu" and os.path.exists("/proc/self/clear_refs") else []
    results: dict[str, Any] = {
        "device": device,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "step_seconds": {s: {} for s in sets},
        "extra_peak_over_param_bytes": {},
    }
    params_cache: dict[str, list[torch.nn.Parameter]] = {}
    for set_name, name in progress(jobs + [("peak", n) for n in peak_jobs], "bench", len(jobs) + len(peak_jobs), show_progress):
        if set_name == "peak":
            results["extra_peak_over_param_bytes"][name] = extra_peak_ratio(name)
            continue
        if set_name not in params_cache:
            params_cache.clear()
            params_cache[set_name] = [p.to(device) if device != "cpu" else p for p in make_params(shape_sets[set_name]())]
        params = params_cache[set_name]
        if device != "cpu":
            for p in params:
                p.grad = p.grad.to(device)
        results["step_seconds"][set_name][name] = median_step_seconds(optims[name], params, repeats, device)
    return results


def format_results(results: dict[str, Any], fmt: str = "table") -> str:
    baseline = "AdamW(fused)" if results["device"] == "cuda" else "Adam(foreach)"
    sets = list(results["step_seconds"])
    names = list(next(iter(results["step_seconds"].values())))
    headers = ["optimizer"]
    for s in sets:
        headers += [f"{s} ms", f"{s} / {baseline}"]
    headers.append("extra peak / param bytes")
    rows = []
    for name in names:
        row: list[Any] = [name]
        for s in sets:
            t = results["step_seconds"][s][name]
            row += [t * 1e3, t / results["step_seconds"][s][baseline]]
        row.append(results["extra_peak_over_param_bytes"].get(name))
        rows.append(row)
    title = f"median optimizer step, {results['device']}, {results['threads']} threads, {results['repeats']} repeats\n"
    return title + format_table(headers, rows, fmt)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="gpt2-52M,resnet50", help="comma-separated: gpt2-52M, resnet50")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--format", default="table", choices=["table", "markdown", "csv"])
    parser.add_argument("--peak-child", help=argparse.SUPPRESS)
    return parser


def main(args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args()
    if args.peak_child:
        _peak_child(args.peak_child)
        return 0
    results = run(args.sets.split(","), args.repeats, args.device, not args.no_peak)
    print(json.dumps(results, indent=2) if args.json else format_results(results, args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
