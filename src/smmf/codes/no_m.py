"""No first moment (``MomentumCode.NO_M``, ``beta=None``): V's rank-1 factors only; the direction is
``G / (√V + ε)``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..band import Band
from ..matrix import store_factors_
from ..schema import COL_V, ROW_V, MomentumCode
from .base import V_FIELDS, BandRounds, Code, StepNumbers

__all__ = ["NO_M"]


class NoM(Code):
    member = MomentumCode.NO_M
    fields = V_FIELDS

    def band_rounds(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band, v_sums: list[Tensor],
                    denominator: Tensor) -> BandRounds:
        direction = g_flat.div(denominator)
        sums = yield v_sums
        store_factors_(state, ROW_V, COL_V, *sums)
        return direction


NO_M = NoM()
