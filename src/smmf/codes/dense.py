"""Adam's dense state (``MomentumCode.DENSE``): a vector's moments elementwise, as Adam keeps them, under
``vector_reshape=False``. Only the torch path steps it; a piece keeps its own elements' moments."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..schema import EXP_AVG, EXP_AVG_SQ, MomentumCode, StateField, TensorSpec
from .base import Code, PieceState, StepNumbers

__all__ = ["DENSE"]


class Dense(Code):
    member = MomentumCode.DENSE
    fields = (StateField(EXP_AVG, lambda d: d.shape, "factor", own=True, first_moment=True),
              StateField(EXP_AVG_SQ, lambda d: d.shape, "factor", own=True))
    elementwise = True
    shard_sums = ()

    def elementwise_direction(self, g: Tensor, state: dict[str, Any], cfg: StepNumbers) -> Tensor:
        """``M / (√V + ε)`` elementwise (``G / (√V + ε)`` without a first moment)."""
        exp_avg_sq = state[EXP_AVG_SQ]
        exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
        denom = exp_avg_sq.sqrt().add_(cfg.eps)
        if cfg.beta1 is None:
            return g / denom
        exp_avg = state[EXP_AVG]
        exp_avg.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
        return exp_avg / denom

    def round_sizes(self, rows: int, cols: int, m_rows: int, m_cols: int, world: int) -> list[list[int]]:
        return []

    def piece_layout(self, layout: dict[str, TensorSpec], shape: tuple[int, ...], start: int,
                     numel: int) -> dict[str, TensorSpec]:
        return {key: TensorSpec((numel,), spec.dtype) for key, spec in layout.items()}

    def _cut_own(self, key: str, shape: tuple[int, ...], value: Tensor, start: int, numel: int) -> Tensor:
        return value.reshape(-1)[start:start + numel].clone()

    def _join_own(self, key: str, shape: tuple[int, ...], pieces: Sequence[PieceState], spec: TensorSpec) -> Tensor:
        return torch.cat([state[key].reshape(-1) for _, _, state in pieces]).view(spec.shape)


DENSE = Dense()
