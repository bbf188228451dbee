"""One SMMF step on one tensor, in plain torch: the readable path and the fallback of the kernels.

The step follows Alg. 1 of the paper with the decompression → compression scheme: the previous
momenta are rebuilt from their factors, updated with the current gradient, compressed again, and
the *uncompressed* momenta of this step drive the weight update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .matrix import nnmf, pack_signs, unpack_signs
from .state import (
    COL_M,
    COL_V,
    EXP_AVG,
    EXP_AVG_SQ,
    ROW_M,
    ROW_V,
    SIGN_M,
    factor_dtype,
    matrix_shape,
    real_view,
)

__all__ = ["StepConfig", "torch_step_", "write_back_"]


@dataclass(frozen=True)
class StepConfig:
    """Scalars of one step of one parameter group."""

    lr: float
    beta1: Optional[float]  # β1_t of this step; None when there is no first moment
    beta2: float  # β2_t of this step
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool  # True: AdamW-style W·(1 − lr·wd); False: L2, G + wd·W
    maximize: bool
    stochastic_rounding: bool


def torch_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> None:
    """Update ``param`` and its ``state`` in place (``state['step']`` already advanced)."""
    work_dtype = factor_dtype(param)
    weight = real_view(param)
    # Logical row-major order: channels_last and other strided params are copied once.
    work = weight.to(work_dtype).contiguous()
    g = real_view(grad).to(work_dtype).contiguous()
    if cfg.maximize:
        g = -g
    if cfg.weight_decay != 0.0:
        if cfg.decoupled_weight_decay:
            work.mul_(1.0 - cfg.lr * cfg.weight_decay)
        else:
            g = g.add(work, alpha=cfg.weight_decay)  # out of place: never touch p.grad
    if EXP_AVG_SQ in state:
        update = _dense_update(g, state, cfg)
    else:
        update = _factored_update(g.view(matrix_shape(param)), state, cfg)
    work.add_(update.view_as(work), alpha=-cfg.lr)
    if work is not weight:
        write_back_(weight, work, cfg.stochastic_rounding)


def _dense_update(g: Tensor, state: dict[str, Any], cfg: StepConfig) -> Tensor:
    exp_avg_sq = state[EXP_AVG_SQ]
    exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    denom = exp_avg_sq.sqrt().add_(cfg.eps)
    if cfg.beta1 is None:
        return g / denom
    exp_avg = state[EXP_AVG]
    exp_avg.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
    return exp_avg / denom


def _factored_update(g: Tensor, state: dict[str, Any], cfg: StepConfig) -> Tensor:
    # Second moment: decompress, update, compress; keep this step's V for the update.
    v = torch.outer(state[ROW_V], state[COL_V])
    v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    _store_factors(state, ROW_V, COL_V, v)
    denom = v.sqrt_().add_(cfg.eps)
    if cfg.beta1 is None:
        return g / denom
    # First moment: |M| from its factors, the sign from the 1-bit matrix.
    magnitude = torch.outer(state[ROW_M], state[COL_M])
    nonnegative = unpack_signs(state[SIGN_M], g.numel()).view(g.shape)
    m = torch.where(nonnegative, magnitude, -magnitude)
    m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
    state[SIGN_M].copy_(pack_signs(m >= 0))
    _store_factors(state, ROW_M, COL_M, m.abs())
    return m.div_(denom)


def _store_factors(state: dict[str, Any], row_key: str, col_key: str, matrix: Tensor) -> None:
    rows, cols = nnmf(matrix)
    state[row_key].copy_(rows)
    state[col_key].copy_(cols)


def write_back_(dst: Tensor, src: Tensor, stochastic_rounding: bool) -> None:
    """Write fp32 ``src`` into ``dst``; bf16 ``dst`` may use stochastic rounding."""
    if stochastic_rounding and dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
        bits = src.view(torch.int32)
        noise = torch.randint_like(bits, 0, 1 << 16)
        # Adding uniform noise below the kept 16 bits, then truncating, rounds up with
        # probability equal to the dropped fraction; the truncated value is exact in bf16.
        src = bits.add(noise).bitwise_and_(-65536).view(torch.float32)
    dst.copy_(src)
