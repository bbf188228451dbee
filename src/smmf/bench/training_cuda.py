"""``smmf bench --training --device cuda``: peak memory and speed of GPT-2 training steps on a GPU.

Each (model, batch, optimizer) configuration builds a GPT-2-shaped model on the GPU from its
``transformers`` config (random weights), runs :data:`WARM_STEPS` training steps under bf16 autocast,
then times :data:`TIMED_STEPS` more. Its peak is ``torch.cuda.max_memory_allocated`` over all the
steps, less what was allocated before the model was built: on CUDA every byte goes through the
caching allocator, which counts live allocations exactly, so the configurations run one after
another in one process (each freed before the next; no fresh process is needed as on CPU, whose
resident size keeps what the heap held). Tokens/s is batch × sequence × timed steps over their
seconds: what a user pays for the optimizer, the model's forward and backward included.

:func:`largest_fitting` finds the deepest model of a given width whose training step peaks within a
budget (24 GiB at GPT-2 XL's width; the card's free memory at a width of 4096, so that the depth
stays in the hundreds).
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import time
from typing import Any, Callable, Iterator, Optional, cast

import torch

from ..memory import state_bytes
from ..table import format_table
from .training_memory import build_gpt2, deepest_within

GIB = 2**30
# name: (n_layer, n_embd, n_head)
MODELS: dict[str, tuple[int, int, int]] = {"gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20)}
BATCHES: tuple[tuple[int, int], ...] = ((1, 512), (8, 512))  # (batch, sequence)
CONFIGS: dict[str, dict[str, Any]] = {
    "AdamW(fused)": dict(optimizer="adamw"),
    "SMMF": dict(optimizer="smmf"),
    "SMMF + step in backward": dict(optimizer="smmf", in_backward=True),
    "SMMF + step in backward, bf16 weights (SR)": dict(optimizer="smmf", in_backward=True, bf16=True),
}
BASELINE = "AdamW(fused)"
LARGEST = ("AdamW(fused)", "SMMF + step in backward, bf16 weights (SR)")
WARM_STEPS, TIMED_STEPS = 3, 5
CARD_WIDTH, CARD_HEADS = 4096, 32  # the shape searched within the whole card


def _optimizer(params: list[torch.nn.Parameter], config: dict[str, Any]) -> torch.optim.Optimizer:
    from .. import SMMF

    if config["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=params[0].is_cuda)
    return SMMF(params, lr=1e-4, decay_rate=-0.8, stochastic_rounding=config.get("bf16", False))


def train(shape: tuple[int, int, int], batch: int, seq: int, config_name: str,
          device: torch.device, warm: int = WARM_STEPS, timed: int = TIMED_STEPS) -> dict[str, Any]:
    """Train one configuration; its peak bytes (None off CUDA), tokens/s and the predicted parts."""
    from .. import SMMF, step_in_backward

    config = CONFIGS[config_name]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    model = build_gpt2(*shape, config.get("bf16", False), device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, config)
    handle = step_in_backward(cast(SMMF, optimizer)) if config.get("in_backward") else None
    gen = torch.Generator().manual_seed(0)
    seconds = 0.0
    for i in range(warm + timed):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warm:
            seconds += time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = max(p.numel() * p.element_size() for p in params) if handle is not None else weights
    result = dict(layers=shape[0], width=shape[1], batch=batch, seq=seq, config=config_name,
                  params=sum(p.numel() for p in params), peak=peak, tokens_per_second=batch * seq * timed / seconds,
                  weights=weights, grads=grads, state=state_bytes(optimizer))
    del handle, optimizer, params, model, loss
    _free(device)
    return result


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def runs(device: torch.device) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """Every (model, batch, configuration) of the study, as (label, run) pairs, baseline first."""
    for model, shape in MODELS.items():
        for batch, seq in BATCHES:
            for config in CONFIGS:
                yield f"{config} on {model} {batch}x{seq}", functools.partial(_run, shape, batch, seq, config, device, model)


def _run(shape: tuple[int, int, int], batch: int, seq: int, config: str, device: torch.device,
         model: str) -> dict[str, Any]:
    return dict(train(shape, batch, seq, config, device), model=model)


def run(device: torch.device, show_progress: bool = True) -> list[dict[str, Any]]:
    from .progress import progress

    # One small step first: cuBLAS makes its workspaces on the first products and keeps them, so without
    # it the first configuration's peak would count them and the others' would not.
    train((1, 64, 2), 1, 8, BASELINE, device, warm=1, timed=1)
    jobs = list(runs(device))
    found = []
    for _, job in progress(jobs, "training on CUDA", len(jobs), show_progress):
        found.append(job())
        print(json.dumps(found[-1]), file=sys.stderr, flush=True)  # kept should a later run not finish
    return found


def largest_fitting(config: str, budget: int, device: torch.device, width: int = 1600, heads: int = 25,
                    batch: int = 1, seq: int = 512) -> dict[str, Any]:
    """The deepest GPT-2-shaped model (``width`` wide, GPT-2 XL's by default) whose training steps peak
    within ``budget`` bytes (:func:`~smmf.bench.training_memory.deepest_within` from 2 and 6 layers, a
    run out of memory counting as over; 0 layers when 2 do not fit)."""
    def measure(layers: int) -> Optional[dict[str, Any]]:
        try:
            return train((layers, width, heads), batch, seq, config, device, warm=2, timed=1)
        except torch.cuda.OutOfMemoryError:
            pass
        _free(device)  # outside the handler: its traceback holds the failed run's tensors
        return None

    layers, found, per_layer = deepest_within(measure, budget, 2, 6)
    if found is None:
        return dict(config=config, budget=budget, layers=0, params=0, peak=None, per_layer=None)
    result = dict(config=config, budget=budget, layers=layers, width=width, params=found["params"],
                  peak=found["peak"], per_layer=per_layer, tokens_per_second=found["tokens_per_second"])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def format_results(results: list[dict[str, Any]], fmt: str = "table") -> str:
    headers = ["model", "batch", "optimizer", "peak GiB", f"/ {BASELINE}", "tokens/s", f"/ {BASELINE}",
               "weights GiB", "grads GiB", "state GiB"]
    key = lambda r: (r["model"], r["batch"], r["seq"])  # noqa: E731
    base = {key(r): r for r in results if r["config"] == BASELINE}
    rows = []
    for r in results:
        b = base.get(key(r))
        rows.append([r["model"], f"{r['batch']}x{r['seq']}", r["config"], r["peak"] / GIB,
                     r["peak"] / b["peak"] if b else None, r["tokens_per_second"],
                     r["tokens_per_second"] / b["tokens_per_second"] if b else None,
                     r["weights"] / GIB, r["grads"] / GIB, r["state"] / GIB])
    return format_table(headers, rows, fmt)
