"""One SMMF step on one tensor, in plain torch: the readable path, and the fallback of the kernels.

:func:`_factored_update` is Alg. 1 of the paper for one n×m matrix, line by line: decompress the
momenta from their factors and sign bits, update them with this step's gradient, compress them
again, and return the step direction built from the *uncompressed* momenta; M's lines are its code's
(:meth:`smmf.codes.Code.torch_m`, the paper's in :mod:`smmf.codes.sign`). Beyond the paper
(opt-in), M may be factorized in the tensor's natural shape and carry a 1-bit magnitude flag.
FSDP2 shards run the
same algorithm on their band of rows in :mod:`smmf.distributed`; the fused kernels in
:mod:`smmf.kernels` are tested against this file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from .codes import CODES
from .matrix import factor_sums, store_factors_
from .noise import counter_hash
from .schema import STEP_NUMBERS
from .state import COL_V, ROW_V, MomentumCode, factor_dtype, real_view

__all__ = ["StepConfig", "torch_step_", "write_back_"]

# The update of the factored state from a flat gradient: returns the flat step direction.
MatrixUpdate = Callable[[Tensor, dict[str, Any], "StepConfig"], Tensor]
# What a step reports: the NaN/inf gradient elements it met (a number, a CUDA tensor the optimizer
# reads a step later, or None when it did not count them).
Nonfinite = Union[int, Tensor, None]


@dataclass(frozen=True)
class StepConfig:
    """Scalars of one step of one parameter group; ``levels_salt`` and ``rounding_key`` are one param's own
    (:meth:`for_param`)."""

    lr: float
    beta1: Optional[float]  # β1_t of this step; None when there is no first moment
    beta2: float  # β2_t of this step
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool  # True: AdamW-style W·(1 − lr·wd); False: L2, G + wd·W
    maximize: bool
    stochastic_rounding: bool
    code: MomentumCode  # how the param's state stores M and V (smmf.state.momentum_code)
    zero_nonfinite: bool = True  # NaN/inf gradient elements count as 0 (else they propagate)
    levels_salt: Optional[int] = None  # the levels code under stochastic rounding: this step's salt (smmf.levels)
    rounding_key: Optional[int] = None  # bf16 stochastic rounding: this param's key at this step (rounding_key_for)

    def for_param(self, levels_salt: Optional[int], rounding_key: Optional[int]) -> StepConfig:
        """This config with one param's own ``levels_salt`` and ``rounding_key``: what ``dataclasses.replace``
        makes, in a fifth of its time (each param of a dithered or stochastically rounded group takes its own
        at every step, so this is paid per param)."""
        config = object.__new__(type(self))
        config.__dict__.update(self.__dict__, levels_salt=levels_salt, rounding_key=rounding_key)
        return config

    def rounds_stochastically(self, dtype: torch.dtype) -> bool:
        """Whether weights of ``dtype`` are rounded stochastically: bf16 under ``stochastic_rounding``."""
        return self.stochastic_rounding and dtype == torch.bfloat16

    def rounding_key_for(self, dtype: torch.dtype) -> Optional[int]:
        """The key of the stochastic rounding noise of weights of ``dtype``; None where they round to nearest (all
        but bf16). A bf16 step rounded stochastically must carry its own key (``smmf.noise.rounding_key`` of
        the step and the param's place): a fixed one would round each element alike at every step."""
        if not self.rounds_stochastically(dtype):
            return None
        if self.rounding_key is None:
            raise ValueError("stochastic_rounding of bf16 weights needs StepConfig.rounding_key: this param's key at "
                             "this step, smmf.noise.rounding_key(step, ordinal) (StepConfig.for_param sets it)")
        return self.rounding_key

    def numbers(self, dtype: torch.dtype) -> tuple[float, ...]:
        """The step's numbers as the fused kernels take them, but the factor sums' cap (which depends on the
        tensor's size): :data:`smmf.schema.STEP_NUMBERS`' first ten, in its order, as Python floats, for weights
        computed in ``dtype`` (β1_t and 1 − β1_t are 0 without a first moment; each 1 − β rounded once from
        float64)."""
        gsign, shrink, l2 = self.folded()
        beta1 = 0.0 if self.beta1 is None else self.beta1
        rest1 = 0.0 if self.beta1 is None else 1.0 - self.beta1
        named = dict(lr=self.lr, beta1=beta1, rest1=rest1,
                     beta2=self.beta2, rest2=1.0 - self.beta2, eps=self.eps, gsign=gsign, shrink=shrink, l2=l2,
                     big=float(torch.finfo(dtype).max))
        return tuple(named[name] for name in STEP_NUMBERS[:-1])  # a number the schema adds and this lacks raises

    def launch_key(self, dtype: torch.dtype) -> tuple:
        """What the tensors of ``dtype`` that share one launch must agree on: every field of the config but the
        ones each param has of its own (:data:`PER_PARAM_FIELDS`), with ``stochastic_rounding`` as it applies to
        ``dtype``. Made from the fields, so that a field added to the config keeps two groups that differ in it
        apart."""
        return (dtype, *(getattr(self, name) for name in _group_fields(type(self))), self.rounds_stochastically(dtype))

    def folded(self) -> tuple[float, float, float]:
        """``(gsign, shrink, l2)``: maximize and weight decay as every path applies them —
        ``W ← shrink·W`` (decoupled decay), then ``G ← gsign·G + l2·W`` (coupled, L2)."""
        decoupled = self.decoupled_weight_decay
        return (
            -1.0 if self.maximize else 1.0,
            1.0 - self.lr * self.weight_decay if decoupled else 1.0,
            0.0 if decoupled else self.weight_decay,
        )


# The fields of a StepConfig that each param of a group has of its own (StepConfig.for_param).
PER_PARAM_FIELDS = ("levels_salt", "rounding_key")


_GROUP_FIELDS: dict[type, tuple[str, ...]] = {}


def _group_fields(config_type: type) -> tuple[str, ...]:
    """The fields of a config type that are its group's, but ``stochastic_rounding`` (its dtype decides it)."""
    names = _GROUP_FIELDS.get(config_type)
    if names is None:
        names = _GROUP_FIELDS[config_type] = tuple(field.name for field in fields(config_type)
                                                   if field.name not in (*PER_PARAM_FIELDS, "stochastic_rounding"))
    return names


_ROUNDING_CHUNK = 1 << 20  # elements rounded at a time by write_back_


def torch_step_(
    param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, matrix_update: Optional[MatrixUpdate] = None,
    first: int = 0,
) -> int:
    """Update ``param`` and its ``state`` in place (``state['step']`` already advanced); return the
    number of NaN/inf gradient elements that were treated as zero (``cfg.zero_nonfinite``).

    ``matrix_update`` replaces the whole-matrix update: :mod:`smmf.distributed` passes the one of a
    shard's band of rows. ``first``: the index of ``param``'s first element in its whole parameter (an
    FSDP2 shard's), by which its elements draw their rounding noise.
    """
    weight = real_view(param)
    # Logical row-major order: channels_last and other strided params are copied once.
    work = weight.to(factor_dtype(param)).contiguous()
    g, nonfinite = prepare_grad_(grad, work, cfg)
    update = CODES[cfg.code].elementwise_direction(g, state, cfg)
    if update is None:
        update = (matrix_update or _whole_matrix_update)(g.view(-1), state, cfg)
    work.add_(update.view_as(work), alpha=-cfg.lr)
    if work is not weight:
        write_back_(weight, work, rounding_key=cfg.rounding_key_for(weight.dtype), first=first)
    return nonfinite


def prepare_grad_(grad: Tensor, work: Tensor, cfg: StepConfig) -> tuple[Tensor, int]:
    """G in ``work``'s dtype with maximize, non-finite elements and L2 decay applied (never in
    ``grad`` itself), and ``work`` shrunk in place by decoupled decay; plus the non-finite count."""
    gsign, shrink, l2 = cfg.folded()
    g = real_view(grad).to(work.dtype).contiguous()
    if gsign < 0:
        g = -g
    nonfinite = 0
    if cfg.zero_nonfinite:
        bad = g.isfinite().logical_not_()
        nonfinite = int(bad.sum())
        if nonfinite:
            g = g.masked_fill(bad, 0.0)
    if shrink != 1.0:
        work.mul_(shrink)
    if l2:
        g = g.add(work, alpha=l2)
    return g, nonfinite


def _whole_matrix_update(g: Tensor, state: dict[str, Any], cfg: StepConfig) -> Tensor:
    rows, cols = state[ROW_V].numel(), state[COL_V].numel()
    return _factored_update(g.view(rows, cols), state, cfg).view(-1)


def _factored_update(g: Tensor, state: dict[str, Any], cfg: StepConfig) -> Tensor:
    """Alg. 1 on one n×m gradient matrix ``g``; returns the direction ``M / (√V + ε)``
    (``G / (√V + ε)`` without a first moment)."""
    # Decompress and update: V = β2·(r_V c_Vᵀ) + (1 − β2)·G²;  M = β1·(S ⊙ r_M c_Mᵀ) + (1 − β1)·G.
    v = torch.outer(state[ROW_V], state[COL_V]).mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    # M decoded, updated and coded again, as its code keeps it (smmf.codes: Sign.torch_m is the paper's).
    m = CODES[cfg.code].torch_m(g, state, cfg)
    # Compress V: rank-1 NNMF.
    store_factors_(state, ROW_V, COL_V, *factor_sums(v))
    # The step uses this step's uncompressed M and V.
    denom = v.sqrt_().add_(cfg.eps)
    return g / denom if m is None else m.div_(denom)


def write_back_(dst: Tensor, src: Tensor, *, rounding_key: Optional[int], first: int = 0) -> None:
    """Write fp32 ``src`` into ``dst``; into bf16 rounded stochastically when ``rounding_key`` is given (else
    to nearest even). Element i (``first + i`` of its param) adds the top 16 bits of
    ``mix32((rounding_key + first + i) mod 2³²)`` (:func:`smmf.noise.counter_hash`) below the 16 bits bf16
    keeps, then truncates: it rounds up with the probability of the dropped fraction, with the noise every
    fused kernel draws. NaN stays NaN. By chunks, so that the hash's int64 temporaries stay small."""
    if rounding_key is not None and dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
        flat = src.reshape(-1)
        rounded = torch.empty_like(flat)
        for at in range(0, flat.numel(), _ROUNDING_CHUNK):
            part = flat[at : at + _ROUNDING_CHUNK]
            noise = (counter_hash(rounding_key, first + at, part.numel(), part.device) >> 16).to(torch.int32)
            # In int32 lanes a finite or infinite value's bits plus the noise cannot wrap; a NaN could become
            # an infinity once truncated, so NaN is kept as it is.
            bits = noise.add_(part.view(torch.int32)).bitwise_and_(-65536).view(torch.float32)
            rounded[at : at + _ROUNDING_CHUNK] = torch.where(part.isnan(), part, bits)
        src = rounded.view(src.shape)
    dst.copy_(src)
