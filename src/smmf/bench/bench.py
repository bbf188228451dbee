"""``smmf bench``: step time, bandwidth and extra peak memory of SMMF against the strongest torch baselines.

From one run, with the candidates interleaved round by round (so that a noisy moment hits all of
them): each optimizer's median step time, as a ratio to the strongest Adam on the device
(``fused=True``: ``Adam`` on CPU, ``AdamW`` on CUDA) and to the physical limit — an in-place axpy
``a += 1e-9·b`` over as many fp32 elements as the parameters, which moves 12 B per element, the
access pattern of a bandwidth-bound SMMF step — and as achieved GB/s (the bytes each optimizer must
move ÷ time). Extra peak memory of one step over the parameter bytes: on CPU the RSS high-water
mark of one 8192×4096 step in a fresh process, on CUDA ``max_memory_allocated`` over each set.
Optimizer state of each set, counted as ``smmf compare`` counts it (distinct storages, quantized
tensor subclasses opened to their inner tensors). ``--peers`` adds torchao's and bitsandbytes' 8-bit
(and torchao's 4-bit) AdamW and adv_optm's factored AdamW, each skipped with a note when its package
is missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from functools import partial
from typing import Any, Callable, cast

import torch

from .. import SMMF
from ..kernels import available_backends
from .args import OneLineParser, comma_list, cuda_or_fail, fail, writable_dir
from .fresh_process import report, run_child
from .machine import describe
from .optimizers import PEERS, missing_package, optimizer_specs
from .storage import optimizer_state_bytes
from .procfs import reset_peak_rss, status_kib
from .progress import progress
from .shapes import (
    gpt2_like_shapes,
    gpt2_xl_like_shapes,
    gpt2_xl_subset_shapes,
    make_params,
    many_small_shapes,
    resnet50_shapes,
)
from ..table import format_table

OptimFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
PEAK_SHAPE = (8192, 4096)
SHAPE_SETS = {
    "gpt2-52M": gpt2_like_shapes,
    "resnet50": resnet50_shapes,
    "gpt2-xl-1.3B": gpt2_xl_like_shapes,
    "gpt2-xl-8-blocks": gpt2_xl_subset_shapes,
    "256x64x64": many_small_shapes,
}
LIMIT = "axpy (limit)"
# Bytes per fp32 parameter that one step must move: read the gradient, read and write the weight
# and every state tensor of the parameter's size (SMMF: the 1-bit signs, 2 × 1/8 B).
# The magnitude flag's two passes read the gradient twice and its bits once more (16.5 B); the levels
# code reads and writes a 4-bit code per element (13 B; its bf16 scales, 1/64 B, are left out).
# 8-bit moments: 2 × 2 B read and written; 4-bit: 2 × 2 × 1/2 B; the factored AdamW_adv: SMMF's pattern.
BYTES_PER_PARAM = {"Adam": 28.0, "AdamW": 28.0, "Adafactor": 12.0, "SMMF": 12.25, "SMMF natural": 12.25,
                   "SMMF flag": 16.5, "SMMF natural+flag": 16.5, "SMMF levels": 13.0,
                   "SMMF levels stochastic": 13.0, "axpy": 12.0, "AdamW8bit": 16.0, "AdamW4bit": 14.0,
                   "AdamW_adv factored": 12.25}
# Beyond the paper, opt-in (``--momentum-codes``): SMMF's other codes for M on the fused kernel.
MOMENTUM_CODES: dict[str, dict[str, Any]] = {"SMMF natural": dict(momentum_shape="natural"), "SMMF flag": dict(magnitude_bits=1),
                  "SMMF natural+flag": dict(momentum_shape="natural", magnitude_bits=1),
                  "SMMF levels": dict(magnitude_bits=3),
                  "SMMF levels stochastic": dict(magnitude_bits=3, momentum_rounding="stochastic")}  # smmf.RECOMMENDED's code


def peer_factories(quiet: bool = False) -> dict[str, OptimFactory]:
    """The peers whose packages import here, as ``"AdamW8bit(torchao)"`` etc.: their library defaults
    with lr 1e-3 and no weight decay, as the torch baselines run. A missing one is left out, with a note
    on stderr."""
    table: dict[str, OptimFactory] = {}
    for name, spec in optimizer_specs("transformer").items():
        if name not in PEERS:
            continue
        why = missing_package(spec)
        label = spec.label.replace(" (", "(")  # "AdamW8bit(torchao)": the table's name(backend) form
        if why:
            if not quiet:
                print(f"{PROG}: skipping {label}: {why}", file=sys.stderr, flush=True)
            continue
        table[label] = partial(spec.build, lr=1e-3, weight_decay=0.0, **PEERS[name][3])
    return table


def optim_map(device: str, momentum_codes: bool = False, peers: bool = False, quiet: bool = False
              ) -> dict[str, OptimFactory]:
    """The candidates on ``device``, strongest baseline first; with ``momentum_codes``, SMMF's opt-in
    codes for M on the fused kernel too; with ``peers``, the peers that are installed."""
    adam, fused = ("AdamW", "triton") if device == "cuda" else ("Adam", "numba")
    smmf_on: Any = partial(SMMF, backend=cast(Any, fused))
    adam_cls = getattr(torch.optim, adam)
    table: dict[str, OptimFactory] = {
        f"{adam}(fused)": partial(adam_cls, fused=True),
        f"{adam}(foreach)": partial(adam_cls, foreach=True),
        "Adafactor(torch)": partial(torch.optim.Adafactor, foreach=True),
        "SMMF(torch)": partial(SMMF, backend="torch"),
    }
    if fused in available_backends():
        table[f"SMMF({fused})"] = smmf_on
        if momentum_codes:
            for name, options in MOMENTUM_CODES.items():
                table[f"{name}({fused})"] = partial(smmf_on, **options)
    if peers:
        table |= peer_factories(quiet)
    return table


def baseline_name(device: str) -> str:
    return next(iter(optim_map(device)))


def bytes_per_param(name: str) -> float:
    return BYTES_PER_PARAM[name.split("(")[0].strip()]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def interleaved_medians(
    factories: dict[str, OptimFactory], params: list[torch.nn.Parameter], repeats: int, device: str, limit: bool = True,
    state_bytes: dict[str, int] | None = None,
) -> dict[str, float]:
    """Median step seconds of each optimizer (and of the axpy limit), timed round-robin on the same params;
    each optimizer's state bytes go into ``state_bytes`` when given."""
    optimizers = {name: factory(params) for name, factory in factories.items()}
    for name, opt in optimizers.items():
        for _ in range(2):  # state creation and JIT compilation are not timed
            opt.step()
        if state_bytes is not None:
            state_bytes[name] = optimizer_state_bytes(opt)
    steps: dict[str, Callable[[], object]] = {name: opt.step for name, opt in optimizers.items()}
    if limit:
        numel = sum(p.numel() for p in params)
        a = torch.zeros(numel, device=device)
        b = torch.ones(numel, device=device)
        steps[LIMIT] = partial(a.add_, b, alpha=1e-9)
        steps[LIMIT]()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    del optimizers, steps
    gc.collect()
    return {name: statistics.median(t) for name, t in times.items()}


def cuda_extra_peak(factory: OptimFactory, params: list[torch.nn.Parameter]) -> float:
    """Extra CUDA memory of one step (after state creation) over the parameter bytes."""
    opt = factory(params)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    del opt
    gc.collect()
    return extra / sum(p.numel() * p.element_size() for p in params)


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The device's copy bandwidth, bytes read + written per second (median of ``repeats``)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_timed(partial(dst.copy_, src), device) for _ in range(repeats))
    return 2 * nbytes / seconds


def set_threads(threads: int) -> None:
    """The CPU threads torch and (at its next step) the numba kernel use."""
    if not 1 <= threads <= (os.cpu_count() or 1):
        fail(PROG, f"--threads must be between 1 and this machine's {os.cpu_count()} CPUs, got {threads}")
    torch.set_num_threads(threads)


def _peak_child(name: str) -> None:
    """In a fresh process: extra RSS high-water mark of one step over the resident size before it."""
    params = make_params([PEAK_SHAPE])
    opt = optim_map("cpu", momentum_codes=True, peers=True, quiet=True)[name](params)
    opt.step()  # state and JIT first: the figure is the step's temporaries
    gc.collect()
    if not reset_peak_rss():
        raise RuntimeError("peak memory needs Linux /proc/self/clear_refs")
    before = status_kib("VmRSS") or 0
    opt.step()
    extra = ((status_kib("VmHWM") or 0) - before) * 1024
    report({"extra_bytes": extra, "param_bytes": params[0].numel() * 4})


def extra_peak_ratio(name: str) -> float:
    # Large temporaries must come from (and go back to) mmap, so that RSS sees each step afresh.
    result = run_child("smmf.bench.bench", ["--peak-child", name], f"the peak of one {name} step", 65536)
    return result["extra_bytes"] / result["param_bytes"]


def run(sets: list[str], repeats: int, device: str, peak: bool, show_progress: bool = True,
        momentum_codes: bool = False, peers: bool = False) -> dict[str, Any]:
    optims = optim_map(device, momentum_codes, peers)
    cpu_peak = peak and device == "cpu" and os.path.exists("/proc/self/clear_refs")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "machine": describe(device),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "baseline": baseline_name(device),
        "copy_bytes_per_second": copy_bandwidth(device),
        "params": {},
        "step_seconds": {},
        "state_bytes": {},
        "extra_peak_over_param_bytes": {},
    }
    jobs: list[tuple[str, str]] = [(s, "time") for s in sets]
    if peak and device == "cuda":
        jobs += [(s, name) for s in sets for name in optims]
    if cpu_peak:
        jobs += [("fresh process", name) for name in optims]
    params: list[torch.nn.Parameter] = []
    loaded = None
    for set_name, what in progress(jobs, "bench", len(jobs), show_progress):
        if set_name == "fresh process":
            results["extra_peak_over_param_bytes"].setdefault(set_name, {})[what] = extra_peak_ratio(what)
            continue
        if loaded != set_name:
            params = []
            gc.collect()
            params = make_params(SHAPE_SETS[set_name](), device=device)
            loaded = set_name
            results["params"][set_name] = sum(p.numel() for p in params)
        if what == "time":
            state = results["state_bytes"].setdefault(set_name, {})
            results["step_seconds"][set_name] = interleaved_medians(optims, params, repeats, device, state_bytes=state)
        else:
            results["extra_peak_over_param_bytes"].setdefault(set_name, {})[what] = cuda_extra_peak(optims[what], params)
    return results


def format_results(results: dict[str, Any], fmt: str = "table") -> str:
    baseline = results["baseline"]
    sets = list(results["step_seconds"])
    names = list(next(iter(results["step_seconds"].values())))
    states = results.get("state_bytes", {})
    headers = ["optimizer"]
    for s in sets:
        headers += [f"{s} ms", "ms/M params", f"/ {baseline}", "/ axpy", "GB/s"] + (["state MiB"] if s in states else [])
    peaks = results["extra_peak_over_param_bytes"]
    headers += [f"extra peak / param bytes ({s})" for s in peaks]
    rows = []
    for name in names:
        row: list[Any] = [name]
        for s in sets:
            times = results["step_seconds"][s]
            t = times[name]
            numel = results["params"][s]
            row += [t * 1e3, t * 1e9 / numel, t / times[baseline], t / times[LIMIT], bytes_per_param(name) * numel / t / 1e9]
            if s in states:
                row.append(states[s][name] / 2**20 if name in states[s] else None)
        row += [peaks[s].get(name) for s in peaks]
        rows.append(row)
    title = (
        f"median optimizer step, {results.get('machine', results['device'])}, {results['threads']} CPU threads, "
        f"{results['repeats']} interleaved repeats; device copy bandwidth {results['copy_bytes_per_second'] / 1e9:.0f} GB/s (read + write)\n"
    )
    return title + format_table(headers, rows, fmt)


PROG = "smmf bench"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--sets", default="gpt2-52M,resnet50", help=f"comma-separated, of: {', '.join(SHAPE_SETS)}")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, help="CPU threads for torch and numba (default: torch's)")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--momentum-codes", action="store_true",
                        help="also SMMF's opt-in codes for M on the numba kernel (natural shape, + magnitude flag, "
                             "the levels code)")
    parser.add_argument("--peers", action="store_true",
                        help="also torchao AdamW8bit/AdamW4bit, bitsandbytes AdamW8bit and adv_optm's factored AdamW_adv "
                             "(each skipped, with a note, when its package is missing)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--format", default="table", choices=["table", "markdown", "csv"])
    parser.add_argument("--training", action="store_true",
                        help="instead: peak memory of training steps (CPU: GPT-2 medium and small, fresh processes; "
                             "CUDA: GPT-2 medium and large at 1x512 and 8x512 under bf16 autocast, with tokens/s)")
    parser.add_argument("--plot", help="with --training on CPU: write a stacked-bar PNG here")
    parser.add_argument("--largest", metavar="GIB[,GIB|card]",
                        help="with --training: also the deepest GPT-2-shaped model whose training fits in each budget "
                             "(GiB; on CUDA also 'card': the GPU's free memory), for the baseline and SMMF + step in "
                             "backward with bf16 weights")
    parser.add_argument("--peak-child", help=argparse.SUPPRESS)
    return parser


def _budgets(text: str | None, device: str) -> list[float | str]:
    """``--largest``'s budgets: GiB (positive numbers), or on CUDA ``card``."""
    budgets: list[float | str] = []
    for item in (text or "").split(",") if text else []:
        if item == "card" and device == "cuda":
            budgets.append(item)
            continue
        try:
            gib = float(item)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            fail(PROG, f"--largest takes positive numbers of GiB{' or card' if device == 'cuda' else ''}, got {item!r}")
        budgets.append(gib)
    return budgets


def _training(args: argparse.Namespace) -> int:
    cuda_or_fail(PROG, args.device)
    budgets = _budgets(args.largest, args.device)
    if args.plot:  # last: it creates the plot's folder
        if args.device == "cuda":
            fail(PROG, "--plot is for --training on CPU")
        writable_dir(PROG, "--plot", os.path.dirname(os.path.abspath(args.plot)))
    if args.device == "cuda":
        from . import training_cuda as on_cuda

        device = torch.device("cuda")
        found = on_cuda.run(device)
        free = torch.cuda.mem_get_info(device)[0]
        largest = [on_cuda.largest_fitting(c, free, device, on_cuda.CARD_WIDTH, on_cuda.CARD_HEADS) if b == "card"
                   else on_cuda.largest_fitting(c, int(float(b) * 2**30), device)
                   for b in budgets for c in on_cuda.LARGEST]
        format_results = on_cuda.format_results
    else:
        from . import training_memory as on_cpu

        found = on_cpu.run(list(on_cpu.MODELS), list(on_cpu.CONFIGS), args.device)
        largest = [on_cpu.largest_fitting(c, int(float(b) * 2**30), args.device)
                   for b in budgets for c in ("Adam(foreach=False)", "SMMF + step in backward, bf16 weights (SR)")]
        format_results = on_cpu.format_results
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                          "machine": describe(args.device), "runs": found, "largest": largest}, indent=2))
    else:
        print(format_results(found, args.format))
        print(f"measured on {describe(args.device)}")
        for entry in largest:
            print(f"largest within {entry['budget'] / 2**30:.1f} GiB, {entry['config']}: {entry['layers']} layers, "
                  f"{entry['params'] / 1e6:.0f}M params, peak {(entry['peak'] or 0) / 2**30:.2f} GiB")
    if args.plot:  # refused above for CUDA
        from .training_memory import plot

        plot(found, args.plot)
    return 0


def main(args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args()
    if args.peak_child:
        _peak_child(args.peak_child)
        return 0
    if args.training:
        if args.threads is not None:
            fail(PROG, "--threads is for the step benchmarks; --training runs its children on torch's default")
        return _training(args)
    for flag, value in (("--plot", args.plot), ("--largest", args.largest)):
        if value is not None:
            fail(PROG, f"{flag} is for --training")
    sets = comma_list(PROG, "--sets", args.sets, list(SHAPE_SETS))
    if args.repeats < 1:
        fail(PROG, f"--repeats must be at least 1, got {args.repeats}")
    cuda_or_fail(PROG, args.device)
    if args.threads is not None:
        set_threads(args.threads)
    results = run(sets, args.repeats, args.device, not args.no_peak, momentum_codes=args.momentum_codes,
                  peers=args.peers)
    print(json.dumps(results, indent=2) if args.json else format_results(results, args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
