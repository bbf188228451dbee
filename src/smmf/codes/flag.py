"""The 1-bit magnitude flag (``MomentumCode.FLAG``, ``magnitude_bits=1``): the paper's code plus a bit per element,
F = [|M| > r cᵀ] against the new rank-1 estimate, and two gains (high, low) fit by least squares where F is set
and where it is clear: ``M̂ = S ⊙ r cᵀ ⊙ (l + (h − l)·F)``. Fitting F needs the new factors of the whole matrix,
so a piece cut between ranks adds up its sums in two rounds."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..band import Band, store_bits_
from ..matrix import factor_sum_cap, pack_signs, store_factors_
from ..schema import COL_M, COL_V, FLAG_GAINS_M, FLAG_M, ROW_M, ROW_V, SIGN_M, MomentumCode, StateField
from .base import V_FIELDS, BandRounds, StepNumbers
from .sign import M_FIELDS, Sign

__all__ = ["FLAG", "flag_gains", "magnitude_flag_fit"]


class Flag(Sign):
    member = MomentumCode.FLAG
    magnitude_bits = 1
    fields = M_FIELDS + (StateField(FLAG_M, lambda d: (d.bit_bytes,), "uint8", own=True, bits=True),
                         StateField(FLAG_GAINS_M, lambda d: (2,), "factor")) + V_FIELDS
    flag_passes = True

    def magnitude_gains_(self, magnitude: Tensor, state: dict[str, Any],
                         bits_as_matrix: Callable[[Tensor], Tensor]) -> None:
        high, low = state[FLAG_GAINS_M].unbind()
        magnitude.mul_(torch.where(bits_as_matrix(state[FLAG_M]), high, low))

    def code_magnitude_(self, state: dict[str, Any], magnitude: Tensor) -> None:
        """The factors of |M| first, then the flag against them and its gains, from the whole matrix."""
        super().code_magnitude_(state, magnitude)
        above, sums = magnitude_flag_fit(magnitude, torch.outer(state[ROW_M], state[COL_M]))
        state[FLAG_M].copy_(pack_signs(above))
        state[FLAG_GAINS_M].copy_(flag_gains(sums))

    def band_rounds(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band, v_sums: list[Tensor],
                    denominator: Tensor) -> BandRounds:
        m_band, m, magnitude, direction = self.band_m(g_flat, state, cfg, band, denominator)
        # The new factors of |M| first, then the flag against them.
        new_row_m, new_col_m = yield m_band.sums(magnitude)
        store_factors_(state, ROW_M, COL_M, new_row_m, new_col_m)
        estimate = torch.outer(state[ROW_M][m_band.row0 : m_band.row1], state[COL_M])
        above, gain_sums = magnitude_flag_fit(m_band.owned(magnitude), m_band.owned(estimate), band.rows * band.cols)
        store_bits_(state[SIGN_M], m_band.owned(m) >= 0)
        store_bits_(state[FLAG_M], above)
        sums = yield [gain_sums] + v_sums
        state[FLAG_GAINS_M].copy_(flag_gains(sums[0]))
        store_factors_(state, ROW_V, COL_V, sums[1], sums[2])
        return direction

    def round_sizes(self, rows: int, cols: int, m_rows: int, m_cols: int, world: int) -> list[list[int]]:
        return [[m_rows, m_cols], [4, rows, cols]]


FLAG = Flag()


def magnitude_flag_fit(magnitude: Tensor, estimate: Tensor, numel: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """The flag F = [|M| > R] of ``magnitude`` against ``estimate`` R = r cᵀ (the new rank-1 estimate),
    and the sums of the least-squares fit of |M| to R where F is set and where it is clear:
    ``(Σ_F |M|·R, Σ_F R², Σ_¬F |M|·R, Σ_¬F R²)``. NaN products count 0, and each product is capped at
    :func:`smmf.matrix.factor_sum_cap` of the whole matrix (``numel`` elements, by default these), so
    the sums, and the gains, of finite gradients stay finite."""
    above = magnitude > estimate
    cap = factor_sum_cap(magnitude.numel() if numel is None else numel, estimate.dtype)
    fit = (magnitude * estimate).nan_to_num_(posinf=cap).clamp_(max=cap)
    energy = (estimate * estimate).nan_to_num_(posinf=cap).clamp_(max=cap)
    sums = [part[where].sum() for where in (above, ~above) for part in (fit, energy)]
    return above, torch.stack(sums)


def flag_gains(sums: Tensor) -> Tensor:
    """``(h, l)`` from :func:`magnitude_flag_fit`'s sums: ``h = Σ_F |M|·R / Σ_F R²``, likewise ``l``
    (0 where the set is empty or R is 0 on it)."""
    num, den = sums.view(2, 2).unbind(dim=1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
