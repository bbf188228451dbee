"""The paper's code of M (``MomentumCode.SIGN``, and its natural shape): M's sign, 1 bit an element, and the
rank-1 NNMF of |M| (Alg. 1)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from ..band import Band, store_bits_
from ..matrix import factor_sums, pack_signs, store_factors_, unpack_signs
from ..schema import COL_M, COL_V, ROW_M, ROW_V, SIGN_M, MomentumCode, StateField
from .base import V_FIELDS, BandRounds, Code, StepNumbers

__all__ = ["M_FIELDS", "SIGN", "Sign"]

# |M|'s factors in M's view (V's square one, or the natural one) and M's packed signs.
M_FIELDS = (StateField(ROW_M, lambda d: (d.m_rows,), "factor"), StateField(COL_M, lambda d: (d.m_cols,), "factor"),
            StateField(SIGN_M, lambda d: (d.bit_bytes,), "uint8", own=True, bits=True))


class Sign(Code):
    member = MomentumCode.SIGN
    magnitude_bits = 0
    fields: ClassVar[tuple[StateField, ...]] = M_FIELDS + V_FIELDS
    shard_sums = (ROW_V, COL_V, ROW_M, COL_M)

    def decode(self, state: dict[str, Any], row_m: Tensor, bits_as_matrix: Callable[[Tensor], Tensor]) -> Tensor:
        """``M̂ = S ⊙ r_M c_Mᵀ`` for the rows whose factors are ``row_m`` (every row, or a shard's band): the
        magnitude from the factors, the sign from the bits. ``bits_as_matrix`` unpacks packed bits to those rows."""
        magnitude = torch.outer(row_m, state[COL_M])
        self.magnitude_gains_(magnitude, state, bits_as_matrix)
        return torch.where(bits_as_matrix(state[SIGN_M]), magnitude, -magnitude)

    def magnitude_gains_(self, magnitude: Tensor, state: dict[str, Any],
                         bits_as_matrix: Callable[[Tensor], Tensor]) -> None:
        """What the code adds to the rank-1 magnitude it decodes (nothing: the paper's)."""

    def code_magnitude_(self, state: dict[str, Any], magnitude: Tensor) -> None:
        """|M| of the whole matrix coded into the state: its rank-1 factors."""
        store_factors_(state, ROW_M, COL_M, *factor_sums(magnitude))

    def torch_m(self, g: Tensor, state: dict[str, Any], cfg: StepNumbers) -> Tensor:
        # Decompress and update in M's own n×m view (V's, but under momentum_shape="natural"):
        # M = β1·(S ⊙ r_M c_Mᵀ) + (1 − β1)·G.
        beta1 = cfg.beta1
        assert beta1 is not None, "a code of M: beta=None gives MomentumCode.NO_M"
        m_shape = (state[ROW_M].numel(), state[COL_M].numel())
        m = self.decode(state, state[ROW_M], lambda bits: unpack_signs(bits, g.numel()).view(m_shape))
        m.mul_(beta1).add_(g.reshape(m_shape), alpha=1.0 - beta1)
        # Compress M: its signs, 1 bit each, and the rank-1 NNMF of |M|.
        state[SIGN_M].copy_(pack_signs(m >= 0))
        self.code_magnitude_(state, m.abs())
        return m.view(g.shape)

    def band_m(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band,
               denominator: Tensor) -> tuple[Band, Tensor, Tensor, Tensor]:
        """M on the band (its own view's band, padding zero), its magnitude, and the owned elements' direction."""
        beta1 = cfg.beta1
        assert beta1 is not None, "a code of M: beta=None gives MomentumCode.NO_M"
        m_band = band.in_view(state[ROW_M].numel(), state[COL_M].numel())
        m = self.decode(state, state[ROW_M][m_band.row0 : m_band.row1],
                        lambda bits: m_band.to_matrix(unpack_signs(bits, m_band.numel)))
        m.mul_(beta1).add_(m_band.to_matrix(g_flat), alpha=1.0 - beta1)
        m_band.zero_padding_(m)
        return m_band, m, m.abs(), m_band.owned(m).div(denominator)

    def band_rounds(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band, v_sums: list[Tensor],
                    denominator: Tensor) -> BandRounds:
        m_band, m, magnitude, direction = self.band_m(g_flat, state, cfg, band, denominator)
        store_bits_(state[SIGN_M], m_band.owned(m) >= 0)
        sums = yield v_sums + m_band.sums(magnitude)
        store_factors_(state, ROW_V, COL_V, sums[0], sums[1])
        store_factors_(state, ROW_M, COL_M, sums[2], sums[3])
        return direction

    def round_sizes(self, rows: int, cols: int, m_rows: int, m_cols: int, world: int) -> list[list[int]]:
        return [[rows, cols, m_rows, m_cols]]


SIGN = Sign()
