"""The block-levels code (``MomentumCode.LEVELS``, ``magnitude_bits=3``): a sign and a 3-bit level per element of
M, a bf16 scale per block of 128 elements of a row of the param (its math on plain tensors: :mod:`smmf.levels`),
coded to nearest or, under ``momentum_rounding="stochastic"``, dithered with fresh noise at each step. Its state
is by rows of the param: an FSDP2 shard holds whole rows, and a piece that cuts its blocks takes rounds of its own
(:func:`smmf.shards.levels_piece_rounds`)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from ..band import Band
from ..levels import (block_span, codes_of_elements, codes_shape, decode_levels, encode_levels, levels_shape,
                      packed_codes, piece_codes_shape, scales_shape)
from ..matrix import store_factors_
from ..schema import CODES_M, COL_V, ROW_V, SCALES_M, MomentumCode, StateField, TensorSpec
from .base import V_FIELDS, BandRounds, Code, PieceState, StepNumbers

__all__ = ["LEVELS", "levels_update_"]


class Levels(Code):
    member = MomentumCode.LEVELS
    magnitude_bits = 3
    fields = (StateField(CODES_M, lambda d: codes_shape(d.levels_rows, d.levels_cols), "uint8", own=True),
              StateField(SCALES_M, lambda d: scales_shape(d.levels_rows, d.levels_cols), "bf16", own=True)) + V_FIELDS
    dithered = True
    by_param_rows = True

    def torch_m(self, g: Tensor, state: dict[str, Any], cfg: StepNumbers) -> Tensor:
        return levels_update_(g, state, cfg).view(g.shape)

    def band_rounds(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band, v_sums: list[Tensor],
                    denominator: Tensor) -> BandRounds:
        # The band holds whole rows of the param (an FSDP2 Shard(0) shard): its codes and scales are its own.
        direction = levels_update_(g_flat, state, cfg, band.start).div_(denominator)
        sums = yield v_sums
        store_factors_(state, ROW_V, COL_V, *sums)
        return direction

    def round_sizes(self, rows: int, cols: int, m_rows: int, m_cols: int, world: int) -> list[list[int]]:
        return [[rows, cols, 2 * world]]  # V's sums, and two block maxima per rank (levels_piece_rounds)

    def piece_layout(self, layout: dict[str, TensorSpec], shape: tuple[int, ...], start: int,
                     numel: int) -> dict[str, TensorSpec]:
        """The codes two per byte from the piece's first element, the scales of the blocks it touches."""
        first, last = block_span(shape, math.prod(shape), start, numel)
        layout[CODES_M] = TensorSpec(piece_codes_shape(numel), torch.uint8)
        layout[SCALES_M] = TensorSpec((last - first + 1,), torch.bfloat16)
        return layout

    def _cut_own(self, key: str, shape: tuple[int, ...], value: Tensor, start: int, numel: int) -> Tensor:
        if key == SCALES_M:  # the blocks the piece touches, counted over the param row by row
            first, last = block_span(shape, math.prod(shape), start, numel)
            return value.reshape(-1)[first:last + 1].clone()
        _, cols = levels_shape(shape, math.prod(shape))
        return packed_codes(codes_of_elements(value, cols).reshape(-1)[start:start + numel])

    def _join_own(self, key: str, shape: tuple[int, ...], pieces: Sequence[PieceState], spec: TensorSpec) -> Tensor:
        numel = math.prod(shape)
        if key == SCALES_M:  # a block two pieces cut has the same scale in both (the largest |M| over the ranks)
            scales = pieces[0][2][key].new_zeros(math.prod(spec.shape))
            for start, count, state in pieces:
                first, last = block_span(shape, numel, start, count)
                scales[first:last + 1] = state[key]
            return scales.view(spec.shape)
        rows, cols = levels_shape(shape, numel)
        code = torch.cat([codes_of_elements(state[key], count) for _, count, state in pieces])
        return packed_codes(code.view(rows, cols))  # each row's codes from its first element, as a whole param's


LEVELS = Levels()


def levels_update_(g: Tensor, state: dict[str, Any], cfg: StepNumbers, first: int = 0) -> Tensor:
    """M decoded by rows of the param, updated with ``g`` (the same elements, row-major; ``first``: the index of its
    first element in the param, for a shard), coded again into ``state``; returns this step's M, flat."""
    codes, scales, beta1 = state[CODES_M], state[SCALES_M], cfg.beta1
    assert beta1 is not None, "a code of M: beta=None gives MomentumCode.NO_M"
    if not g.numel():  # an FSDP2 shard without rows
        return g.reshape(-1)
    m = decode_levels(codes, scales, g.numel() // max(codes.shape[0], 1), g.dtype)
    m.mul_(beta1).add_(g.reshape(m.shape), alpha=1.0 - beta1)
    new_codes, new_scales = encode_levels(m, cfg.levels_salt, first)
    codes.copy_(new_codes)
    scales.copy_(new_scales)
    return m.view(-1)
