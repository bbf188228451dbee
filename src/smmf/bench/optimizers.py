"""The optimizers compared, with hyperparameters from the paper's appendix tables.

``cnn`` follows the CIFAR100/ImageNet table, ``transformer`` the GPT-2 pre-training table, except
the learning rate: the tables' 1.5e-4 is for 500k iterations, and every optimizer here gets the
paper's general advice of 1e-3 (Adafactor in the CNN table uses its relative step instead). Weight
decay is Adam-style (L2) for all, as the paper ran them. Every optimizer gets the same warmup +
cosine schedule except relative-step Adafactor, which schedules itself; none is tuned further.

``finetune`` (fine-tuning a pretrained model) follows the paper's GPT-2 fine-tuning tables: weight
decay 5e-4, decay rate -0.8 for SMMF and Adafactor; the learning rate is 3e-4 instead of the tables'
2e-5, which is for the 124M-parameter GPT-2 and its many epochs.

Peers (opt-in, each an optional package, ``pip install smmf[peers]``): torchao's ``AdamW8bit`` and
``AdamW4bit`` (block-wise quantized moments), bitsandbytes' ``AdamW8bit`` and adv_optm's ``AdamW_adv``
with ``state_precision="factored"`` (a 1-bit sign and rank-1 factors, SMMF-style, with bias
correction). All four are AdamW: decoupled weight decay, with the task's weight-decay figure; the
``adamw`` row is torch's AdamW with the same arguments, their full-precision reference.
"""

from __future__ import annotations

import ast
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import RECOMMENDED, SMMF
from ..memory import OPTIMIZERS


@dataclass(frozen=True)
class OptimizerSpec:
    label: str
    build: Callable[..., torch.optim.Optimizer]
    kwargs: dict[str, Any]
    scheduled: bool = True  # False: the optimizer sets its own step size
    requires: Optional[str] = None  # the optional package it comes from (a peer), imported when built
    weights: str = "fp32"  # "bf16": the model is trained in bf16 (weights, forward and backward)


def missing_package(spec: OptimizerSpec) -> Optional[str]:
    """Why ``spec`` cannot be built here (its package is not installed or fails to import), or None."""
    if spec.requires is None:
        return None
    try:
        importlib.import_module(spec.requires)
    except Exception as err:  # a broken install (e.g. a missing native library) is as good as none
        return f"{spec.requires} is not available ({type(err).__name__}: {err}); pip install smmf[peers]"
    return None


def _pyopt(name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        import pytorch_optimizer

        return getattr(pytorch_optimizer, name)(params, **kwargs)

    return build


def _bf16(build: Callable[..., torch.optim.Optimizer], master: bool = False,
          stochastic: bool = False) -> Callable[..., torch.optim.Optimizer]:
    """``build`` on fp32 copies of bf16 weights (:class:`~smmf.bench.bf16_weights.BF16Weights`)."""
    def wrapped(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        from .bf16_weights import BF16Weights

        return BF16Weights(params, build, master=master, stochastic_rounding=stochastic, **kwargs)

    return wrapped


def _peer(module: str, name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return getattr(importlib.import_module(module), name)(params, **kwargs)

    return build


KINDS = ("cnn", "transformer", "finetune")


def optimizer_specs(kind: str) -> dict[str, OptimizerSpec]:
    if kind not in KINDS:
        raise ValueError(f"Unknown task kind: {kind!r}. It needs to be one of {list(KINDS)}")
    cnn = kind == "cnn"
    finetune = kind == "finetune"
    wd = 5e-4 if cnn or finetune else 1e-2
    lr = 3e-4 if finetune else 1e-3
    adafactor = dict(betas=(0.9, 0.999), decay_rate=-0.8, clip_threshold=1.0, eps1=1e-30, eps2=1e-3,
                     weight_decay=wd, weight_decouple=False, momentum_dtype=torch.float32)
    if cnn:
        adafactor |= dict(lr=None, relative_step=True, scale_parameter=True)
    else:
        adafactor |= dict(lr=lr, relative_step=False, scale_parameter=False)
    smmf = dict(lr=lr, beta=0.9, eps=1e-8, weight_decay=wd, weight_decay_mode="adam",
                decay_rate=-0.8 if finetune else -0.5, growth_rate=0.999)
    adamw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    recommended = smmf | dict(RECOMMENDED) | dict(weight_decay_mode="adamw")
    return {
        "adam": OptimizerSpec("Adam", torch.optim.Adam, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)),
        "adafactor": OptimizerSpec("Adafactor", _pyopt("AdaFactor"), adafactor, scheduled=not cnn),
        "sm3": OptimizerSpec("SM3", _pyopt("SM3"), dict(lr=lr, momentum=0.9, eps=1e-30)),  # SM3 has no weight decay
        "came": OptimizerSpec("CAME", _pyopt("CAME"), dict(lr=lr, betas=(0.9, 0.999, 0.9999), eps1=1e-30, eps2=1e-16,
                                                             clip_threshold=1.0, weight_decay=wd, weight_decouple=False)),
        "smmf": OptimizerSpec("SMMF", SMMF, smmf),
        # Beyond the paper (opt-in options of SMMF): M in the tensor's natural shape, then + the magnitude flag.
        "smmf-natural": OptimizerSpec("SMMF natural", SMMF, smmf | dict(momentum_shape="natural")),
        "smmf-natural-flag": OptimizerSpec("SMMF natural+flag", SMMF,
                                           smmf | dict(momentum_shape="natural", magnitude_bits=1)),
        # smmf.RECOMMENDED with SMMF's default decoupled weight decay (the figure AdamW gets).
        "smmf-recommended": OptimizerSpec("SMMF recommended", SMMF, recommended),
        "adafactor-torch": OptimizerSpec("Adafactor (torch, no β1)", torch.optim.Adafactor,
                                         dict(lr=1e-2, beta2_decay=-0.8, weight_decay=wd)),
        "adamw": OptimizerSpec("AdamW (torch, fused)", torch.optim.AdamW, adamw | dict(fused=True)),
        # bf16 weights (the bf16 study, docs/training.md): SMMF steps them itself, rounding to nearest or
        # stochastically; AdamW steps fp32 copies, made from them at every step (its moments stay fp32) or kept
        # between steps (an fp32 master copy: mixed precision as usually done).
        **{f"{RECOMMENDED_SMMF}-bf16{tail}": OptimizerSpec(f"SMMF recommended, bf16 weights{label}", SMMF, recommended
                                                           | dict(stochastic_rounding=bool(tail)), weights="bf16")
           for tail, label in (("", ""), ("-sr", ", stochastic rounding"))},
        "adamw-bf16": OptimizerSpec("AdamW, bf16 weights", _bf16(torch.optim.AdamW), adamw | dict(fused=True),
                                    weights="bf16"),
        "adamw-bf16-sr": OptimizerSpec("AdamW, bf16 weights, stochastic rounding",
                                       _bf16(torch.optim.AdamW, stochastic=True), adamw | dict(fused=True),
                                       weights="bf16"),
        "adamw-bf16-master": OptimizerSpec("AdamW, bf16 weights, fp32 master copy",
                                           _bf16(torch.optim.AdamW, master=True), adamw | dict(fused=True),
                                           weights="bf16"),
        **{name: OptimizerSpec(label, _peer(module, cls), adamw | extra, requires=module.partition(".")[0])
           for name, (label, module, cls, extra) in PEERS.items()},
    }


# name: (label, module, class, arguments beyond AdamW's)
PEERS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "torchao-adamw8bit": ("AdamW8bit (torchao)", "torchao.optim", "AdamW8bit", {}),
    "torchao-adamw4bit": ("AdamW4bit (torchao)", "torchao.optim", "AdamW4bit", {}),
    "bnb-adamw8bit": ("AdamW8bit (bitsandbytes)", "bitsandbytes.optim", "AdamW8bit", {}),
    "adv-adamw-factored": ("AdamW_adv factored (adv_optm)", "adv_optm", "AdamW_adv", dict(state_precision="factored")),
}

PAPER_SMMF = "smmf"
RECOMMENDED_SMMF = "smmf-recommended"
# The paper's five, AdamW and the option we recommend (smmf.RECOMMENDED), so that the default run shows each SMMF
# beside its like-for-like baseline. SMMF's other codes of M are opt-in like "adafactor-torch" and the peers.
DEFAULT_OPTIMIZERS = (*OPTIMIZERS, "adamw", RECOMMENDED_SMMF)
# Each SMMF row's like-for-like baseline: the one with its weight decay (the paper's SMMF and its other codes of M
# add L2 decay to the gradient, as Adam; the recommended option decouples it, as AdamW).
LIKE_FOR_LIKE = {PAPER_SMMF: "adam", "smmf-natural": "adam", "smmf-natural-flag": "adam", RECOMMENDED_SMMF: "adamw"}


def _top_level_commas(text: str) -> list[str]:
    """``text`` split at the commas outside brackets: ``betas=(0.9,0.99),lr=1`` is two pairs."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def parse_opt_args(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["smmf:lr=3e-3,decay_rate=-0.8", "adam:betas=(0.9,0.99)"]`` → ``{"smmf": {"lr": 0.003, "decay_rate":
    -0.8}, "adam": {"betas": (0.9, 0.99)}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not rest:
            raise ValueError(f"--opt-args expects NAME:key=value[,key=value], got {item!r}")
        for pair in _top_level_commas(rest):
            key, eq, value = pair.partition("=")
            if not eq:
                raise ValueError(f"--opt-args expects key=value, got {pair!r} in {item!r}")
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            out.setdefault(name, {})[key.strip()] = parsed
    return out


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """The learning-rate factor of every compared optimizer at a step: linear warmup over ``warmup`` steps, then a
    cosine to 0 at ``steps``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor
