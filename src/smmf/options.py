"""SMMF's options, registered once: each one's name, default, check, and how checkpoints treat it.

The optimizer derives from :data:`OPTIONS` (read at each use) its group defaults (the constructor's keywords must name the same
options with the same defaults: ``tests/test_options.py``), the checks of a group (:func:`validate_group`), the keys
a checkpoint of an older version may lack (filled with the optimizer's values) and the runtime choices a checkpoint
never sets. What a step's kernels see of the options is :class:`smmf.functional.StepConfig`, made from a group by
the optimizer; a launch shared by many tensors groups them by every field of it (``StepConfig.launch_key``).
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .codes import CODES, MAGNITUDE_BITS
from .functional import StepConfig
from .kernels import check_backend
from .noise import rounding_key, step_salt
from .schedules import beta1_at, beta2_at
from .state import MOMENTUM_CODE_DEFAULTS, MOMENTUM_SHAPES, MomentumCode

__all__ = ["OPTIONS", "Option", "StepConfigs", "fill_optional", "names", "step_config", "validate_group",
           "warn_fp16_rounding"]

WEIGHT_DECAY_MODES = ("adamw", "adam")
NONFINITE_GRADS = ("zero", "propagate")
MOMENTUM_ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Option:
    """One option of a param group. ``check(group)`` raises ``ValueError`` stating the rule and the value (it may
    normalize the value in place: numpy's numbers become floats). ``optional``: a checkpoint may lack it (it was
    added after 0.1), and the optimizer's value is kept. ``from_checkpoint``: False for a runtime choice, which a
    checkpoint never sets."""

    name: str
    default: Any
    check: Callable[[dict[str, Any]], None]
    optional: bool = False
    from_checkpoint: bool = True


def _number(name: str, lo: float, hi: float, rule: str, label: Optional[str] = None, none: bool = False,
            include_hi: bool = False) -> Callable[[dict[str, Any]], None]:
    """A real number in [lo, hi) (or [lo, hi] with ``include_hi``), or None where ``none``."""

    def check(group: dict[str, Any]) -> None:
        value = group[name]
        if isinstance(value, numbers.Real) and type(value) not in (int, float, bool):  # numpy's, as torch takes them
            value = group[name] = float(value)
        if none and value is None:
            return
        if isinstance(value, Tensor) and name == "lr":
            if value.numel() != 1:
                raise ValueError(f"Tensor lr must be 1-element but has {value.numel()} elements")
            value = value.item()
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{name} should be a {'number or None' if none else 'number'} but is: {value!r}")
        if not (lo <= value <= hi if include_hi else lo <= value < hi):
            raise ValueError(f"{label or f'Invalid {name}'}: {value} ({rule})")

    return check


def _flag(name: str) -> Callable[[dict[str, Any]], None]:
    def check(group: dict[str, Any]) -> None:
        if not isinstance(group[name], bool):
            raise ValueError(f"{name} should be a bool but is: {group[name]!r}")

    return check


def _one_of(name: str, choices: tuple) -> Callable[[dict[str, Any]], None]:
    def check(group: dict[str, Any]) -> None:
        if group[name] not in choices:
            raise ValueError(f"Unknown {name}: {group[name]!r}. It needs to be one of {list(choices)}")

    return check


def _magnitude_bits(group: dict[str, Any]) -> None:
    bits = group["magnitude_bits"]
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in MAGNITUDE_BITS:  # not 3.0
        raise ValueError(f"magnitude_bits should be one of {list(MAGNITUDE_BITS)} but is: {bits!r}")


OPTIONS: tuple[Option, ...] = (
    Option("lr", 1e-3, _number("lr", 0.0, math.inf, "must be finite and >= 0", "Invalid learning rate")),
    Option("beta", 0.9, _number("beta", 0.0, 1.0, "must be None or in [0, 1)", none=True)),
    Option("eps", 1e-8, _number("eps", 0.0, math.inf, "must be finite and >= 0", "Invalid epsilon value")),
    Option("weight_decay", 0.0, _number("weight_decay", 0.0, math.inf, "must be finite and >= 0",
                                         "Invalid weight_decay value")),
    Option("decay_rate", -0.5, _number("decay_rate", -1.0, 0.0, "must be in [-1, 0]", include_hi=True)),
    Option("growth_rate", 0.999, _number("growth_rate", 0.0, 1.0, "must be None or in [0, 1]", none=True,
                                         include_hi=True)),
    Option("vector_reshape", True, _flag("vector_reshape")),
    Option("weight_decay_mode", "adamw", _one_of("weight_decay_mode", WEIGHT_DECAY_MODES)),
    Option("maximize", False, _flag("maximize"), optional=True),
    Option("stochastic_rounding", False, _flag("stochastic_rounding"), optional=True),
    Option("nonfinite_grads", "zero", _one_of("nonfinite_grads", NONFINITE_GRADS), optional=True),
    Option("momentum_shape", MOMENTUM_CODE_DEFAULTS["momentum_shape"], _one_of("momentum_shape", MOMENTUM_SHAPES),
           optional=True),
    Option("magnitude_bits", MOMENTUM_CODE_DEFAULTS["magnitude_bits"], _magnitude_bits, optional=True),
    Option("momentum_rounding", "nearest", _one_of("momentum_rounding", MOMENTUM_ROUNDINGS), optional=True),
    Option("backend", "auto", lambda group: check_backend(group["backend"]), optional=True, from_checkpoint=False),
)


def names(optional: Optional[bool] = None, from_checkpoint: Optional[bool] = None) -> tuple[str, ...]:
    """The options' names, in the registry's order; those with the given ``optional`` / ``from_checkpoint``."""
    return tuple(option.name for option in OPTIONS if optional in (None, option.optional)
                 and from_checkpoint in (None, option.from_checkpoint))


def validate_group(group: dict[str, Any]) -> None:
    """Every option of ``group`` checked, in the registry's order; each message states the rule and the value."""
    missing = [name for name in names() if name not in group]
    if missing:
        raise ValueError(f"a param group lacks SMMF's options {missing}: set them, or leave the group's keys be")
    for option in OPTIONS:
        option.check(group)


def fill_optional(group: dict[str, Any]) -> None:
    """The optional options a group (of an older checkpoint) lacks, at their defaults."""
    for option in OPTIONS:
        if option.optional:
            group.setdefault(option.name, option.default)


def step_config(group: dict[str, Any], step: int, code: MomentumCode) -> StepConfig:
    """What the kernels see of ``group``'s options at ``step`` for a param of ``code`` (without a param's own
    dither salt and rounding key: :class:`StepConfigs`)."""
    beta = group["beta"]
    return StepConfig(
        lr=float(group["lr"]),
        beta1=None if beta is None else beta1_at(beta, group["growth_rate"], step),
        beta2=beta2_at(group["decay_rate"], step),
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled_weight_decay=group["weight_decay_mode"] == "adamw",
        maximize=group["maximize"],
        stochastic_rounding=group["stochastic_rounding"],
        code=code,
        zero_nonfinite=group["nonfinite_grads"] == "zero",
        levels_salt=step_salt(step) if CODES[code].dithered and group["momentum_rounding"] == "stochastic"
        else None,
    )


class StepConfigs:
    """The configs of one step, each group's made once per step count and code."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int, MomentumCode], StepConfig] = {}

    def of(self, group: dict[str, Any], step: int, code: MomentumCode, ordinal: int, dtype: torch.dtype) -> StepConfig:
        """The config of the ``ordinal``-th param (of ``dtype``) at ``step``: its group's, with the param's own
        dither and rounding noise where it draws them."""
        key = (id(group), step, code)
        cfg = self._made.get(key) or self._made.setdefault(key, step_config(group, step, code))
        rounded = cfg.rounds_stochastically(dtype)
        if cfg.levels_salt is not None or rounded:  # each param draws its own dither and rounding noise
            cfg = cfg.for_param(None if cfg.levels_salt is None else step_salt(step, ordinal),
                                rounding_key(step, ordinal) if rounded else None)
        return cfg


def warn_fp16_rounding(group: dict[str, Any]) -> bool:
    """``stochastic_rounding`` rounds bf16 weights only: say so for a group that asks for it over fp16 weights
    (rounded to nearest); whether it was said (the optimizer says it once)."""
    if not (group["stochastic_rounding"] and any(p.dtype == torch.float16 for p in group["params"])):
        return False
    warnings.warn("SMMF's stochastic_rounding=True rounds bf16 weights only: this group's fp16 weights are "
                  "rounded to nearest. For low-precision weights stepped without an fp32 copy, use bf16 "
                  "(smmf.RECOMMENDED_BF16); for fp16, keep fp32 master weights (torch.autocast and "
                  "GradScaler, or DeepSpeed's fp16)", UserWarning, stacklevel=3)
    return True
