"""``smmf bench --training``: the peak memory of training steps, not just the optimizer state.

Each (model, optimizer) configuration runs three training steps of a GPT-2-shaped model (from its
``transformers`` config, random weights) in a **fresh process**. On CPU the figure is the process's
resident high-water mark (``VmHWM``) with glibc's large blocks served by mmap
(``MALLOC_MMAP_THRESHOLD_=131072``), so that freed memory leaves the process and the figure
follows live memory; on CUDA it is ``torch.cuda.max_memory_allocated``. Beside it, a predicted
breakdown: weights, gradients alive at once, optimizer state, and the rest (activations, workspace,
the Python/torch runtime and, for SMMF on CPU, numba and its kernels). The kernels are compiled and
cached before the measured processes start (:func:`warm_kernel_cache`), as on any machine after its
first run.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any, Callable, Optional, cast

import torch

from ..memory import state_bytes
from ..table import format_table
from .fresh_process import report, run_child
from .procfs import status_kib
MIB = 2**20
PINNED_MMAP_THRESHOLD = 131072

# (n_layer, n_embd, n_head, batch, sequence)
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "gpt2-medium 1x128": (24, 1024, 16, 1, 128),  # weights dominate: fine-tuning a large model, small batch
    "gpt2-small 8x256": (12, 768, 12, 8, 256),  # activations dominate
}
CONFIGS: dict[str, dict[str, Any]] = {
    "Adam(foreach=False)": dict(optimizer="adam", foreach=False),
    "Adam(foreach=True)": dict(optimizer="adam", foreach=True),
    "Adafactor(torch)": dict(optimizer="adafactor"),
    "SMMF": dict(optimizer="smmf"),
    "SMMF + step in backward": dict(optimizer="smmf", in_backward=True),
    "SMMF + step in backward, bf16 weights (SR)": dict(optimizer="smmf", in_backward=True, bf16=True),
    # No optimizer state and no numba: the least any optimizer stepping inside backward can reach.
    "SGD + step in backward (floor)": dict(optimizer="sgd", in_backward=True),
}
STEPS = 3


def build_gpt2(n_layer: int, n_embd: int, n_head: int, bf16: bool,
               device: torch.device = torch.device("cpu")) -> Any:
    """A GPT-2-shaped ``transformers.GPT2LMHeadModel`` from its config (random weights, seed 0), built where it trains and in the dtype
    it trains in: bf16 weights are built as bf16, since an fp32 model cast (or moved) afterwards would set
    the peak while it is converted, and take minutes for a 774M model built on CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024, vocab_size=50257)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if bf16 else default)
    try:
        with device:
            return GPT2LMHeadModel(config)
    finally:
        torch.set_default_dtype(default)


def _optimizer(params: list[torch.nn.Parameter], config: dict[str, Any]) -> torch.optim.Optimizer:
    from .. import SMMF

    if config["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=config["foreach"])
    if config["optimizer"] == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if config["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=1e-4, foreach=False)
    return SMMF(params, lr=1e-4, decay_rate=-0.8, stochastic_rounding=config.get("bf16", False))


def _sgd_in_backward(params: list[torch.nn.Parameter], lr: float) -> None:
    """Plain SGD inside backward (the floor row): each weight steps and drops its gradient as soon as
    the gradient is complete; ``optimizer.step()`` then has no gradient left to use."""
    def hook(param: torch.Tensor) -> None:
        with torch.no_grad():
            param.add_(cast(torch.Tensor, param.grad), alpha=-lr)
        param.grad = None

    for param in params:
        param.register_post_accumulate_grad_hook(hook)


def _child(job: dict[str, Any]) -> dict[str, Any]:
    """Three steps in this (fresh) process; peak and predicted breakdown in bytes."""
    from .. import SMMF, step_in_backward

    n_layer, n_embd, n_head, batch, seq = job["shape"]
    config = CONFIGS[job["config"]]
    device = torch.device(job["device"])
    model = build_gpt2(n_layer, n_embd, n_head, config.get("bf16", False)).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, config)
    if config.get("in_backward"):
        if config["optimizer"] == "sgd":
            _sgd_in_backward(params, optimizer.param_groups[0]["lr"])
        else:
            step_in_backward(cast(SMMF, optimizer))
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = (status_kib("VmHWM") or 0) * 1024
    weights = sum(p.numel() * p.element_size() for p in params)
    # Gradients alive at once: all of them, or (inside backward) about the largest one.
    grads = max(p.numel() * p.element_size() for p in params) if config.get("in_backward") else weights
    state = state_bytes(optimizer)
    return dict(model=job["model"], config=job["config"], params=sum(p.numel() for p in params), peak=peak,
                weights=weights, grads=grads, state=state, rest=peak - weights - grads - state)


def run_fresh(model: str, config: str, shape: tuple[int, ...], device: str) -> dict[str, Any]:
    job = dict(model=model, config=config, shape=list(shape), device=device)
    return run_child("smmf.bench.training_memory", ["--child", json.dumps(job)], f"{config} on {model}",
                     PINNED_MMAP_THRESHOLD)


def run(models: list[str], configs: list[str], device: str, show_progress: bool = True) -> list[dict[str, Any]]:
    from .progress import progress

    warm_kernel_cache(configs, device)
    jobs = [(m, c) for m in models for c in configs]
    return [run_fresh(m, c, MODELS[m], device) for m, c in progress(jobs, "training memory", len(jobs), show_progress)]


# A GPT-2 small enough to train in a second, with every kind of tensor the measured ones have.
WARM_UP_SHAPE = (1, 64, 2, 1, 8)


def warm_kernel_cache(configs: list[str], device: str) -> None:
    """Measure what every process but a machine's first one pays: SMMF's numba kernels compile once
    per machine and are cached, so one throwaway process per SMMF configuration compiles them first."""
    for config in configs:
        if CONFIGS[config]["optimizer"] == "smmf":
            run_fresh("warm-up", config, WARM_UP_SHAPE, device)


Measured = Optional[dict[str, Any]]  # a training run's figures ("peak" bytes among them); None: out of memory


def deepest_within(measure: Callable[[int], Measured], budget: int, low: int, high: int
                   ) -> tuple[int, Measured, Optional[float]]:
    """The deepest depth whose run (``measure(layers)``) peaks within ``budget``, its run, and the bytes
    per layer. Peak is about linear in depth, so depths ``low`` and ``high`` give the line; the depth it
    predicts is measured and stepped back (by the measured excess, or a tenth after a run out of memory)
    while it does not fit, never below ``low``, which fits; then the gap to the shallowest depth seen to
    fail is bisected. Without a line (the deeper run failed, or peaks did not grow) the search starts
    from ``high``; when every depth measured fits, the deepest of them is the answer (more may fit).
    ``(0, None, None)`` when ``low`` layers do not fit."""
    runs: dict[int, Measured] = {}

    def run(layers: int) -> Measured:  # each depth is measured once
        if layers not in runs:
            runs[layers] = measure(layers)
        return runs[layers]

    def fits(found: Measured) -> bool:
        return found is not None and found["peak"] <= budget

    base = run(low)
    if base is None or not fits(base):
        return 0, None, None
    top = run(high)
    per_layer = (top["peak"] - base["peak"]) / (high - low) if top is not None else None
    if per_layer is not None and per_layer > 0:
        layers = max(low + int((budget - base["peak"]) // per_layer), high if fits(top) else low)
    else:
        per_layer, layers = None, high
    failed = None if fits(top) else high  # the shallowest depth seen not to fit
    found = run(layers)
    while not fits(found) and layers > low:
        failed = layers if failed is None else min(failed, layers)
        over = -(-(found["peak"] - budget) // per_layer) if found is not None and per_layer else layers // 10
        layers = max(low, layers - max(1, int(over)))
        found = run(layers)
    while failed is not None and failed - layers > 1:  # the line stepped back too far: bisect the gap
        middle = (layers + failed) // 2
        if fits(run(middle)):
            layers, found = middle, runs[middle]
        else:
            failed = middle
    return layers, found, per_layer


def largest_fitting(config: str, budget: int, device: str, width: int = 1024, heads: int = 16) -> dict[str, Any]:
    """The deepest GPT-2-shaped model (``width`` wide, batch 1×128) whose three training steps peak
    within ``budget`` bytes (:func:`deepest_within` from 4 and 24 layers; 0 layers when 4 do not fit)."""
    def measure(layers: int) -> dict[str, Any]:
        return run_fresh(f"{layers} layers", config, (layers, width, heads, 1, 128), device)

    layers, found, per_layer = deepest_within(measure, budget, 4, 24)
    return dict(config=config, budget=budget, layers=layers, params=found["params"] if found else 0,
                peak=found["peak"] if found else None, per_layer=per_layer,
                fixed=found["peak"] - layers * per_layer if found and per_layer else None)


def format_results(results: list[dict[str, Any]], fmt: str = "table") -> str:
    headers = ["model", "optimizer", "peak MiB", "/ Adam(foreach=False)", "weights MiB", "grads MiB", "state MiB",
               "rest MiB"]
    baseline = {r["model"]: r["peak"] for r in results if r["config"] == "Adam(foreach=False)"}
    rows = [[r["model"], r["config"], r["peak"] / MIB, r["peak"] / baseline[r["model"]] if r["model"] in baseline else None,
             r["weights"] / MIB, r["grads"] / MIB, r["state"] / MIB, r["rest"] / MIB] for r in results]
    return format_table(headers, rows, fmt)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Stacked bars: weights, gradients, optimizer state, the rest; one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    parts = [("weights", "#4c72b0"), ("grads", "#dd8452"), ("state", "#c44e52"), ("rest", "#8c8c8c")]
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model]
        names = ["\n".join(textwrap.wrap(r["config"].replace(",", "").replace(" (", "(").replace("(", " ("), 15, break_long_words=False))
                 for r in rows]
        bottom = [0.0] * len(rows)
        for key, color in parts:
            values = [max(r[key], 0) / 2**30 for r in rows]
            ax.bar(names, values, bottom=bottom, color=color, label=key if ax is axes[0][0] else None)
            bottom = [b + v for b, v in zip(bottom, values)]
        for x, r in enumerate(rows):
            ax.text(x, r["peak"] / 2**30, f"{r['peak'] / 2**30:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{model}: peak memory of 3 training steps")
        ax.set_ylabel("GiB")
        ax.tick_params(axis="x", labelsize=7)
    fig.legend(loc="upper center", ncol=len(parts))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    report(_child(json.loads(args.child)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
