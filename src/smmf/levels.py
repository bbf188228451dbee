"""The block-levels code of M (``magnitude_bits=3``, beyond the paper): its math on plain tensors.

M is seen by rows of the parameter (dim 0 × the rest; a 1-D tensor is one row), each row cut into blocks
of :data:`BLOCK` contiguous elements (the last one shorter). Per element: a sign bit and a 3-bit level
``j``; per block: a bf16 scale, the block's largest |M|. The decoded magnitude is ``j · (scale · ⅐)``, and
``j`` is the level nearest to ``|M| · (7 / scale)`` (ties up). That is 4 bits per element plus 16 per block:
4.125 bits per parameter where rows are whole blocks (a row of 9, as in a depthwise 3×3 conv, costs ~6),
against the paper's ~1 (a sign bit and factors). Each path computes the block's step ``scale · ⅐`` (⅐ rounded
to the work dtype) and its inverse ``7 / scale`` once per block, in the work dtype, so that no element pays a
division; the paths then round alike but for fused multiply-adds (the numba kernel's), which can put an element
a rounding apart in the next level now and then.

Why this code (``docs/momentum-diagnosis.md``): sign × rank-1 gives small coordinates of M their row's
and column's average, several times too large; a per-block scale with a few levels keeps each element's
own magnitude to within 1/14 of its block's largest. Blocks run along rows so that an FSDP2 shard (whole
rows) holds whole blocks; a piece of a DeepSpeed ZeRO partition may cut them, and takes its blocks' largest
|M| from the ranks that hold the rest (``encode_piece_levels``, :func:`smmf.shards.levels_piece_rounds`).

Stochastic rounding (``momentum_rounding="stochastic"``, opt-in): ``j = floor(|M| · (7 / scale) + u)`` with
``u`` uniform in [0, 1) instead of ½, so the decoded |M| is unbiased: an element below half a level is kept
with the probability its size gives, where nearest rounding sets it to 0 at every step — the EMA can then
never build a small coordinate's momentum, and at a high learning rate the code trails the dense M by 4–7%
(``docs/high-lr.md``). ``u`` is a counter-based hash of the element's index in its param and a salt
(:func:`smmf.noise.dither`), the same on every path and every rank, so a run is reproducible and resumes
exactly.

Storage: ``codes`` uint8 (rows, ⌈cols/2⌉), two 4-bit codes per byte (the even column in the low nibble),
a code being ``j | 8·[M < 0]``; ``scales`` bf16 (rows, ⌈cols/BLOCK⌉). Whatever M holds, the stored code
decodes finite: NaN codes as 0, and a scale is at most bf16's largest finite value.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .noise import dither

__all__ = ["BLOCK", "NEGATIVE", "SEVENTH", "TOP_LEVEL", "PieceBlocks", "block_span", "codes_of_elements", "codes_shape",
           "decode_levels",
           "decode_piece_levels", "encode_levels", "encode_piece_levels", "levels_rows_cols", "levels_shape",
           "packed_codes", "piece_block_maxima", "piece_blocks", "piece_codes_shape", "scales_shape"]

BLOCK = 128  # elements of a row that share a scale
TOP_LEVEL = 7  # levels j = 0 .. 7: magnitudes j/7 of the block's scale (3 bits)
NEGATIVE = 8  # the code's sign bit: set where M < 0
SCALE_MAX = float(torch.finfo(torch.bfloat16).max)  # the largest scale, so that decoding stays finite
SEVENTH = 1 / TOP_LEVEL  # a level's step is scale · SEVENTH (SEVENTH rounded to the work dtype)


def levels_shape(shape: tuple[int, ...], numel: int) -> tuple[int, int]:
    """The rows × cols view of M under this code, for a param of ``shape`` whose real view has ``numel``
    elements: dim 0 × the rest; one row for a 0-D or 1-D tensor (a complex vector too: its real view's pairs
    stay in the one row)."""
    rows = shape[0] if len(shape) >= 2 else 1
    return (rows, numel // rows) if rows else (0, 0)


def levels_rows_cols(codes: Tensor, numel: int) -> tuple[int, int]:
    """The rows × cols view of M from its stored codes (one row of codes per row of M) and the real view's
    ``numel``: what the kernels, which see only the real view, go by."""
    rows = codes.shape[0]
    return (rows, numel // rows) if rows else (0, 0)


def codes_shape(rows: int, cols: int) -> tuple[int, int]:
    return rows, (cols + 1) // 2


def scales_shape(rows: int, cols: int) -> tuple[int, int]:
    return rows, -(-cols // BLOCK)


def block_scales(m: Tensor) -> Tensor:
    """Each block's scale, as stored (bf16): its largest |M| (NaN counted as 0), at most :data:`SCALE_MAX`,
    rounded to nearest through fp32."""
    rows, cols = m.shape
    magnitude = m.abs().nan_to_num_(nan=0.0).clamp_(max=SCALE_MAX)
    padded = torch.nn.functional.pad(magnitude, (0, (-cols) % BLOCK))
    return padded.view(rows, -1, BLOCK).amax(dim=2).to(torch.float32).to(torch.bfloat16)


def per_element(per_block: Tensor, cols: int) -> Tensor:
    """A value per block, repeated over its block's elements: rows × cols."""
    return per_block.repeat_interleave(BLOCK, dim=1)[:, :cols]


def packed_codes(code: Tensor) -> Tensor:
    """4-bit codes (one a byte) two per byte along the last dim, the even one in the low nibble; the last byte's high
    nibble 0 for an odd count."""
    code = torch.nn.functional.pad(code, (0, code.shape[-1] % 2))
    return code[..., 0::2] | (code[..., 1::2] << 4)


def codes_of_elements(codes: Tensor, count: int) -> Tensor:
    """:func:`packed_codes`' inverse: one code a byte along the last dim, its first ``count``."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)[..., :count]


def encode_levels(m: Tensor, salt: Optional[int] = None, first: int = 0) -> tuple[Tensor, Tensor]:
    """``(codes, scales)`` of a rows × cols M (fp32 or fp64): each level the nearest (ties up), or with
    ``salt`` rounded stochastically by :func:`dither` (``first``: the index of M's first element in its
    param, for a shard of it)."""
    rows, cols = m.shape
    scales = block_scales(m)
    scale = scales.to(m.dtype)
    # A tensor by a tensor: IEEE division, as the kernels divide (``7 / tensor`` multiplies by a reciprocal).
    positive = torch.where(scale > 0, scale, 1.0)
    inverse = per_element(torch.where(scale > 0, torch.full_like(scale, TOP_LEVEL) / positive, 0.0), cols)
    offset = 0.5 if salt is None else dither(salt, first, rows * cols, m.dtype, m.device).view(rows, cols)
    level = (m.abs() * inverse + offset).nan_to_num_(nan=0.0).floor_().clamp_(max=TOP_LEVEL).to(torch.uint8)
    return packed_codes(level | (m < 0).to(torch.uint8) * NEGATIVE), scales


def decode_levels(codes: Tensor, scales: Tensor, cols: int, dtype: torch.dtype) -> Tensor:
    """M̂ (rows × cols in ``dtype``) from :func:`encode_levels`' output: ``±j · (scale · ⅐)``."""
    code = codes_of_elements(codes, cols)
    magnitude = (code & TOP_LEVEL).to(dtype) * per_element(scales.to(dtype) * SEVENTH, cols)
    return torch.where(code >= NEGATIVE, -magnitude, magnitude)


# ---- pieces of a param that may cut its blocks (a DeepSpeed ZeRO partition's): codes from the piece's first
# element, two per byte; the scales of the blocks it touches. Blocks are counted over the whole param, row by row
# (``row · blocks per row + block in the row``), so a contiguous piece touches a contiguous run of them.


class PieceBlocks(NamedTuple):
    """The blocks a piece of a param touches: the first and last (counted over the whole param, row by row) and,
    for each of the piece's elements, its block counted from the first."""

    first: int
    last: int
    of_element: Tensor


def block_span(shape: tuple[int, ...], numel: int, start: int, count: int) -> tuple[int, int]:
    """The first and last block that elements ``start .. start + count`` (``count`` > 0) of a param of ``shape``
    (``numel`` elements in its real view) touch, counted over the param row by row."""
    _, cols = levels_shape(shape, numel)
    per_row = -(-cols // BLOCK)

    def block(i: int) -> int:
        return (i // cols) * per_row + (i % cols) // BLOCK

    return block(start), block(start + count - 1)


def piece_blocks(shape: tuple[int, ...], numel: int, start: int, count: int, device: torch.device) -> PieceBlocks:
    """:class:`PieceBlocks` of elements ``start .. start + count`` (``count`` > 0) of a param of ``shape``."""
    _, cols = levels_shape(shape, numel)
    first, last = block_span(shape, numel, start, count)
    at = torch.arange(start, start + count, dtype=torch.int64, device=device)
    index = (at // cols) * -(-cols // BLOCK) + (at % cols) // BLOCK - first
    return PieceBlocks(first, last, index)


def piece_codes_shape(count: int) -> tuple[int]:
    return ((count + 1) // 2,)




def piece_block_maxima(m: Tensor, blocks: PieceBlocks) -> Tensor:
    """The largest |M| (NaN counted as 0, at most :data:`SCALE_MAX`) over the piece's elements of each block it
    touches, in M's dtype: a block's scale where the piece holds all of it (:func:`block_scales`)."""
    magnitude = m.abs().nan_to_num_(nan=0.0).clamp_(max=SCALE_MAX)
    maxima = m.new_zeros(blocks.last - blocks.first + 1)
    return maxima.scatter_reduce_(0, blocks.of_element, magnitude, "amax")


def encode_piece_levels(m: Tensor, maxima: Tensor, blocks: PieceBlocks, salt: Optional[int] = None,
                        first: int = 0) -> tuple[Tensor, Tensor]:
    """:func:`encode_levels` of a piece's M (flat, its elements ``first ..`` of the param), given the largest
    |M| of each block it touches over the whole param: ``(codes, scales)``, the codes two per byte from the
    piece's first element. Each element rounds as :func:`encode_levels` rounds it in the whole param."""
    scales = maxima.to(torch.float32).to(torch.bfloat16)
    scale = scales.to(m.dtype)
    positive = torch.where(scale > 0, scale, 1.0)
    inverse = torch.where(scale > 0, torch.full_like(scale, TOP_LEVEL) / positive, 0.0)[blocks.of_element]
    offset = 0.5 if salt is None else dither(salt, first, m.numel(), m.dtype, m.device)
    level = (m.abs() * inverse + offset).nan_to_num_(nan=0.0).floor_().clamp_(max=TOP_LEVEL).to(torch.uint8)
    return packed_codes(level | (m < 0).to(torch.uint8) * NEGATIVE), scales


def decode_piece_levels(codes: Tensor, scales: Tensor, blocks: PieceBlocks, dtype: torch.dtype) -> Tensor:
    """M̂ of a piece (flat, in ``dtype``) from :func:`encode_piece_levels`' output."""
    code = codes_of_elements(codes, blocks.of_element.numel())
    magnitude = (code & TOP_LEVEL).to(dtype) * (scales.to(dtype) * SEVENTH)[blocks.of_element]
    return torch.where(code >= NEGATIVE, -magnitude, magnitude)
