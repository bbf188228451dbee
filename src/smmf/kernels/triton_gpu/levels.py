"""The block-levels code of M (``magnitude_bits=3``, :mod:`smmf.levels`) on CUDA: two kernels per tensor,
then V's factors from their partial sums with two torch sums.

M is coded by rows of the param in blocks of 128 elements, V by the rank-1 factors of its square view:
the two views do not line up, so each kernel walks the view it needs.

1. :func:`v_sums_kernel`, one program per (column tile, band of rows) of V's square view, in the step
   kernel's tile shape (:mod:`.table`): this step's V from the old factors, and its capped sums per row
   of each tile and per column of each band, into two fp32 partial buffers. It only reads (w, g and the
   factors), so it runs first, while the weights still hold their old values (L2 decay reads them).
2. :func:`levels_step_kernel`, one program per :data:`BLOCKS_PER_PROGRAM` consecutive blocks of M (in
   row-major block order, so a 1-D param's blocks fill a program as a matrix's do), each block one row of
   its tile: decode the stored M, form this step's M and V (from the old factors) and the decayed weight,
   the block's largest |M| → its new bf16 scale, the codes against that scale (two per byte; a block is
   64 whole bytes, so no two programs share a byte), and the weight stepped with the uncompressed M and
   V, rounded to the param's dtype.

Then the host adds up the partials with ``torch.sum`` (a fixed order) and stores V's factors
(:func:`smmf.functional.store_factors_`). No floating-point atomics: a step is deterministic; the
NaN/inf count is an int32 atomic.

Each line mirrors the torch path's rounding (:func:`smmf.functional._factored_update`): torch's
``add(x, alpha=a)`` and ``addcmul`` are fused multiply-adds (on CPU's vector loops and under nvcc), so
they are ``tl.fma`` here; divisions and the square root are IEEE (``div_rn``, ``sqrt_rn``); and both
kernels are compiled without FP contraction (:data:`LAUNCH_OPTIONS`), so ``ratio·7 + 0.5`` rounds
twice, as torch's two ops do. The scales and codes then match the torch path's bit for bit wherever M
does. (The level values j/7 are exact quotients, as on CPU; torch on CUDA divides by a scalar through
its reciprocal, 1 ulp off for j = 3 and 6.)
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...functional import StepConfig, store_factors_
from ...levels import (BLOCK, DITHER_BITS, DITHER_MULTIPLIERS, NEGATIVE, SCALE_MAX, SEVENTH, TOP_LEVEL, levels_rows_cols,
                       scales_shape)
from ...matrix import factor_sum_cap
from ...state import CODES_M, COL_V, ROW_V, SCALES_M
from . import table as tables  # V's tile shape, read at each launch (as the table launches do)
from .table import FP32_MAX
from .tiles import bf16_rounded

__all__ = ["BLOCKS_PER_PROGRAM", "LAUNCH_OPTIONS", "launch_levels", "levels_step_kernel", "v_sums_kernel"]

# Blocks of M per program of the step kernel: a 16 × 128 tile, 8 elements per thread. Twice that (the table
# kernels' 4096-element tile) takes ~245 registers per thread for sm_90 (tests/triton_compile.py prints them).
BLOCKS_PER_PROGRAM, STEP_WARPS = 16, 8
# Compiled without FP contraction: the multiply-adds that torch fuses are tl.fma, the rest round as torch's ops.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)
LEVEL_BLOCK = tl.constexpr(BLOCK)
LEVEL_TOP = tl.constexpr(TOP_LEVEL)
LEVEL_NEGATIVE = tl.constexpr(NEGATIVE)
LEVEL_SCALE_MAX = tl.constexpr(SCALE_MAX)
LEVEL_SEVENTH = tl.constexpr(SEVENTH)
DITHER_MUL0, DITHER_MUL1 = tl.constexpr(DITHER_MULTIPLIERS[0]), tl.constexpr(DITHER_MULTIPLIERS[1])
DITHER_SHIFT = tl.constexpr(32 - DITHER_BITS)
DITHER_UNIT = tl.constexpr(2.0 ** -DITHER_BITS)


@triton.jit
def prepared_gradient(w, g, gsign, shrink, l2, ZERO_BAD: tl.constexpr):
    """The decayed weight, G as every path prepares it (maximize, NaN/inf → 0 under ``ZERO_BAD``, then
    + l2·W as torch's ``add(alpha=l2)``: one FMA), and whether the raw gradient was finite."""
    w = w.to(tl.float32) * shrink
    g = g.to(tl.float32) * gsign
    finite = tl.abs(g) <= FP32_MAX  # False for NaN
    if ZERO_BAD:
        g = tl.where(finite, g, 0.0)
    if l2 != 0:
        g = tl.fma(w, l2, g)
    return w, g, finite


@triton.jit
def second_moment(rv, cv, g, beta2, rest2):
    """This step's V = β2·(r c) + (1 − β2)·G², rounded as torch's ``outer(r, c).mul_(β2).addcmul_(G, G)``."""
    return tl.fma(rest2 * g, g, (rv * cv) * beta2)


@triton.jit
def v_sums_kernel(w_ptr, g_ptr, row_v_ptr, col_v_ptr, row_part_ptr, col_part_ptr, n, m, lo, hi, beta2, rest2, gsign,
                  shrink, l2, cap, ZERO_BAD: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BAND: tl.constexpr):
    """Program band · tiles + tile of the rows of V's n×m view that hold the elements ``lo .. hi`` of the
    flattening (all of it, or an FSDP2 shard's; ``w``/``g`` hold those, from ``lo``; a 1-D grid: a prime
    n·m has n / BAND bands): this step's V, each element capped at ``cap``
    (:func:`smmf.matrix.factor_sum_cap`; NaN stays NaN, as torch's clamp), summed per row of each BR × BC
    tile into ``row_part[tile, row]`` and per column over the band into ``col_part[band, col]``."""
    tiles = tl.cdiv(m, BC)
    band = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    cols = tile * BC + tl.arange(0, BC)
    col_ok = cols < m
    cv = tl.load(col_v_ptr + cols, mask=col_ok, other=0.0)[None, :]
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    first_row = lo // m + band * BAND
    last_row = tl.minimum(first_row + BAND, tl.cdiv(hi, m))
    for r0 in range(first_row, last_row, BR):
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < last_row
        offs = rows.to(tl.int64)[:, None] * m + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :] & (offs >= lo) & (offs < hi)
        w = tl.load(w_ptr + (offs - lo), mask=ok, other=0.0)
        g = tl.load(g_ptr + (offs - lo), mask=ok, other=0.0)
        _, g, _ = prepared_gradient(w, g, gsign, shrink, l2, ZERO_BAD)
        rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)[:, None]
        v = second_moment(rv, cv, g, beta2, rest2)
        v = tl.where(ok, tl.where(v > cap, cap, v), 0.0)
        tl.store(row_part_ptr + tile * n + rows, tl.sum(v, axis=1), mask=row_ok)
        acc += v
    tl.store(col_part_ptr + band * m + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def decoded_momentum(codes, scale):
    """M̂ from 4-bit codes and their block's scale: ±j·(scale·⅐) (:func:`smmf.levels.decode_levels`)."""
    magnitude = (codes & LEVEL_TOP).to(tl.float32) * (scale * LEVEL_SEVENTH)
    return tl.where(codes >= LEVEL_NEGATIVE, -magnitude, magnitude)


@triton.jit
def dither(salt, index):
    """:func:`smmf.levels.dither` of the elements at ``index`` (int64): in [0, 1), fp32. In int64 with the
    torch path's masks (a product may wrap; its low 32 bits are the same)."""
    x = (index + salt) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * DITHER_MUL0) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * DITHER_MUL1) & 0xFFFFFFFF
    x ^= x >> 16
    return (x >> DITHER_SHIFT).to(tl.float32) * DITHER_UNIT


@triton.jit
def encoded_momentum(m, scale, offset):
    """The 4-bit codes of M against its block's new ``scale``: j = floor(|M|·(7/scale) + offset), at most 7
    (``offset``: ½, or the dither in [0, 1)); 0 for NaN or a zero scale; with the sign bit where M < 0
    (:func:`smmf.levels.encode_levels`)."""
    positive = scale > 0
    inverse = tl.where(positive, tl.math.div_rn(7.0, tl.where(positive, scale, 1.0)), 0.0)
    x = tl.abs(m) * inverse + offset
    x = tl.where(x != x, 0.0, x)
    # floor(min(x, 7)) == min(floor(x), 7), and x ≥ 0: the truncating cast is the floor.
    level = tl.minimum(x, 7.0).to(tl.int32)
    return level | tl.where(m < 0, LEVEL_NEGATIVE, 0)


@triton.jit(do_not_specialize=["salt"])  # a new value each step: one compile, not one per value class
def levels_step_kernel(w_ptr, g_ptr, codes_ptr, scales_ptr, row_v_ptr, col_v_ptr, bad_ptr, cols, m, lo,
                       blocks_per_row, blocks, lr, beta1, rest1, beta2, rest2, eps, gsign, shrink, l2, seed, salt,
                       ZERO_BAD: tl.constexpr, STOCHASTIC: tl.constexpr, DITHER: tl.constexpr, BLOCKS: tl.constexpr):
    """BLOCKS consecutive blocks of M (of ``blocks``; ``blocks_per_row`` per row of ``cols`` elements),
    one per row of a (BLOCKS, 64, 2) tile whose last axis is the two codes of a byte (even column, low
    nibble). The arrays hold the param from element ``lo`` of its flattening (0, or an FSDP2 shard's first
    row): element e sits at ((lo + e) // m, (lo + e) % m) of V's view, whose old factors it reads, and
    draws its dither by lo + e. Writes the codes, the scales and the weights; adds the NaN/inf gradient
    elements to ``bad`` under ``ZERO_BAD`` (the torch path counts them only then)."""
    block = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    block_ok = block < blocks
    row = (block // blocks_per_row).to(tl.int64)[:, None]
    byte_col = (block % blocks_per_row)[:, None] * LEVEL_BLOCK + tl.arange(0, LEVEL_BLOCK // 2)[None, :] * 2
    byte = row * ((cols + 1) // 2) + byte_col // 2  # (BLOCKS, 64): the bytes, by their even column
    byte_ok = block_ok[:, None] & (byte_col < cols)
    half = tl.arange(0, 2)[None, None, :]
    col = byte_col[:, :, None] + half
    ok = byte_ok[:, :, None] & (col < cols)
    element = row[:, :, None] * cols + col

    w = tl.load(w_ptr + element, mask=ok, other=0.0)
    g = tl.load(g_ptr + element, mask=ok, other=0.0)
    w, g, finite = prepared_gradient(w, g, gsign, shrink, l2, ZERO_BAD)
    v_row = (lo + element) // m
    v = second_moment(tl.load(row_v_ptr + v_row, mask=ok, other=0.0),
                      tl.load(col_v_ptr + (lo + element - v_row * m), mask=ok, other=0.0), g, beta2, rest2)

    old_scale = tl.load(scales_ptr + block, mask=block_ok, other=0.0).to(tl.float32)[:, None, None]
    old_codes = (tl.load(codes_ptr + byte, mask=byte_ok, other=0)[:, :, None] >> (half * 4).to(tl.uint8)) & 15
    mm = tl.where(ok, tl.fma(g, rest1, decoded_momentum(old_codes, old_scale) * beta1), 0.0)

    # The block's scale: its largest |M| (NaN as 0, at most bf16's largest), rounded to bf16 (nearest).
    a = tl.abs(mm)
    top = tl.max(tl.max(tl.minimum(tl.where(a != a, 0.0, a), LEVEL_SCALE_MAX), axis=2), axis=1)
    scale = bf16_rounded(top, 0, 0, False)
    tl.store(scales_ptr + block, scale.to(scales_ptr.dtype.element_ty), mask=block_ok)
    if DITHER:  # the levels rounded stochastically
        codes = encoded_momentum(mm, scale[:, None, None], dither(salt, lo + element))
    else:
        codes = encoded_momentum(mm, scale[:, None, None], 0.5)
    tl.store(codes_ptr + byte, tl.sum(codes << (half * 4), axis=2).to(tl.uint8), mask=byte_ok)

    # The weight, with this step's uncompressed M and V: W − lr·M / (√V + ε), as torch's add(alpha=−lr).
    new_w = tl.fma(tl.math.div_rn(mm, tl.sqrt_rn(v) + eps), -lr, w)
    if w_ptr.dtype.element_ty == tl.bfloat16:
        new_w = bf16_rounded(new_w, seed, element, STOCHASTIC)
    tl.store(w_ptr + element, new_w.to(w_ptr.dtype.element_ty), mask=ok)
    if ZERO_BAD:
        bad = tl.sum(tl.sum(tl.sum((ok & ~finite).to(tl.int32), axis=2), axis=1), axis=0)
        tl.atomic_add(bad_ptr, bad, mask=bad > 0)


def launch_levels(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, bad: Tensor, lo: int = 0,
                  whole: bool = True) -> None:
    """One tensor's step under the levels code, in place: ``weight`` the param's real view, contiguous
    (fp32, bf16 or fp16), ``grad`` contiguous in its dtype; M's rows are ``weight``'s
    (:func:`smmf.levels.levels_rows_cols`). Or an FSDP2 shard's (``whole`` False): its own rows of M, from
    element ``lo`` of the param, leaving this shard's raw V sums in the factor vectors (0 for the rows it
    lacks) for the caller to add up across shards. Adds the NaN/inf gradient elements met to the int32
    counter ``bad`` when ``cfg.zero_nonfinite``. No host sync."""
    m = state[COL_V].numel()
    rows, cols = levels_rows_cols(state[CODES_M], weight.numel())
    blocks_per_row = scales_shape(rows, cols)[1]
    gsign, shrink, l2 = cfg.folded()
    row_part, col_part = _v_sums(weight, grad, state, cfg, lo)
    stochastic = cfg.stochastic_rounding and weight.dtype == torch.bfloat16
    blocks = rows * blocks_per_row
    assert cfg.beta1 is not None, "the levels code is a code of M: beta=None gives MomentumCode.NONE"
    if blocks:
        levels_step_kernel[(triton.cdiv(blocks, BLOCKS_PER_PROGRAM),)](
            weight, grad, state[CODES_M], state[SCALES_M], state[ROW_V], state[COL_V], bad, cols, m, lo,
            blocks_per_row, blocks, cfg.lr, cfg.beta1, 1.0 - cfg.beta1, cfg.beta2, 1.0 - cfg.beta2, cfg.eps, gsign,
            shrink, l2, int(torch.randint(0, 2**30, ()).item()) if stochastic else 0, cfg.levels_salt or 0,
            ZERO_BAD=cfg.zero_nonfinite, STOCHASTIC=stochastic, DITHER=cfg.levels_salt is not None,
            BLOCKS=BLOCKS_PER_PROGRAM, num_warps=STEP_WARPS,
            **LAUNCH_OPTIONS,
        )
    # The old factors were read until here.
    row_sums, col_sums = row_part.sum(dim=0), col_part.sum(dim=0)
    if whole:
        store_factors_(state, ROW_V, COL_V, row_sums, col_sums)
    else:
        state[ROW_V].copy_(row_sums)
        state[COL_V].copy_(col_sums)


def _v_sums(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
            lo: int) -> tuple[Tensor, Tensor]:
    """:func:`v_sums_kernel` over the rows of V's n×m view that hold ``weight``'s elements (from ``lo``):
    the partial row sums (one per column tile; 0 for other rows) and column sums (one per band of rows),
    for the caller to add up after the step kernel."""
    n, m = state[ROW_V].numel(), state[COL_V].numel()
    hi = lo + weight.numel()
    tiles, bands = triton.cdiv(m, tables.BLOCK_COLS), triton.cdiv(-(-hi // m) - lo // m, tables.BAND_ROWS)
    whole = lo == 0 and hi == n * m
    row_part = (torch.empty if whole else torch.zeros)((tiles, n), dtype=torch.float32, device=weight.device)
    col_part = torch.zeros((max(bands, 1), m), dtype=torch.float32, device=weight.device)
    gsign, shrink, l2 = cfg.folded()
    if bands:
        v_sums_kernel[(tiles * bands,)](
            weight, grad, state[ROW_V], state[COL_V], row_part, col_part, n, m, lo, hi, cfg.beta2, 1.0 - cfg.beta2,
            gsign, shrink, l2, factor_sum_cap(n * m, torch.float32), ZERO_BAD=cfg.zero_nonfinite,
            BR=tables.BLOCK_ROWS, BC=tables.BLOCK_COLS, BAND=tables.BAND_ROWS, num_warps=tables.WARPS,
            **LAUNCH_OPTIONS,
        )
    return row_part, col_part
