"""The block-levels code of M (``magnitude_bits=3``, :mod:`smmf.levels`) on CUDA: three launches for all the
tensors of a launch set, as for the paper's code, each tensor a row of the table (:func:`.table.levels_layout`:
the codes in the ``signs`` field, the scales in ``levels``, M's rows × cols and blocks per row in the fields
of M's view).

M is coded by rows of the param in blocks of 128 elements, V by the rank-1 factors of its square view:
the two views do not line up, so each kernel walks the view it needs.

1. :func:`v_sums_kernel`, one program per (tensor, band of rows, column tile) of V's square view, in the step
   kernel's tile shape (:mod:`.table`): this step's V from the old factors, and its capped sums per row
   of each tile and per column of each band, into the partial buffer where the step kernel puts V's. It only
   reads (w, g and the factors), so it runs first, while the weights still hold their old values (L2 decay
   reads them).
2. :func:`levels_step_kernel`, one program per (tensor, :data:`BLOCKS_PER_PROGRAM` consecutive blocks of
   its M) (in row-major block order, so a 1-D param's blocks fill a program as a matrix's do), each block
   one row of its tile: decode the stored M, form this step's M and V (from the old factors) and the
   decayed weight, the block's largest |M| → its new bf16 scale, the codes against that scale (two per
   byte; a block is 64 whole bytes, so no two programs share a byte), and the weight stepped with the
   uncompressed M and V, rounded to the param's dtype.
3. :func:`.finish.finish_kernel` (V only) adds up the partials in a fixed order and writes V's factors (an
   FSDP2 shard's raw sums).

No floating-point atomics: a step is deterministic; the NaN/inf count is an int32 atomic.

Each line mirrors the torch path's rounding (:func:`smmf.functional._factored_update`): torch's
``add(x, alpha=a)`` and ``addcmul`` are fused multiply-adds (on CPU's vector loops and under nvcc), so
they are ``tl.fma`` here; divisions and the square root are IEEE (``div_rn``, ``sqrt_rn``); and both
kernels are compiled without FP contraction (:data:`LAUNCH_OPTIONS`), so ``ratio·7 + 0.5`` rounds
twice, as torch's two ops do. The scales and codes then match the torch path's bit for bit wherever M
does. (The level values j/7 are exact quotients, as on CPU; torch on CUDA divides by a scalar through
its reciprocal, 1 ulp off for j = 3 and 6.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...levels import BLOCK, NEGATIVE, SCALE_MAX, SEVENTH, TOP_LEVEL
from ...noise import DITHER_BITS
from .step import write_weights
from .table import (FP32_MAX, T_CODES_M, T_FIRST_ITEM, T_FIRST_SUMS_ITEM, T_LO, T_M, T_M_COLS,
                    T_M_ROWS, T_M_TILES, T_PARTIAL_AT, T_SCALES_M, T_TILES)
from .tiles import bf16_rounded, hash_at, tensor_pointers, v_span, work_item

__all__ = ["BLOCKS_PER_PROGRAM", "LAUNCH_OPTIONS", "STEP_WARPS", "levels_step_kernel", "v_sums_kernel"]

# Blocks of M per program of the step kernel: a 16 × 128 tile, 8 elements per thread. Twice that (the table
# kernels' 4096-element tile) takes ~245 registers per thread for sm_90 (tests/triton_compile.py prints them).
BLOCKS_PER_PROGRAM, STEP_WARPS = 16, 8
# Compiled without FP contraction: the multiply-adds that torch fuses are tl.fma, the rest round as torch's ops.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)
LEVEL_BLOCK = tl.constexpr(BLOCK)
LEVEL_BLOCKS = tl.constexpr(BLOCKS_PER_PROGRAM)
LEVEL_TOP = tl.constexpr(TOP_LEVEL)
LEVEL_NEGATIVE = tl.constexpr(NEGATIVE)
LEVEL_SCALE_MAX = tl.constexpr(SCALE_MAX)
LEVEL_SEVENTH = tl.constexpr(SEVENTH)
DITHER_SHIFT = tl.constexpr(32 - DITHER_BITS)
DITHER_UNIT = tl.constexpr(2.0 ** -DITHER_BITS)


@triton.jit
def prepared_gradient(w, g, gsign, shrink, l2, ZERO_NONFINITE: tl.constexpr):
    """The decayed weight, G as every path prepares it (maximize, NaN/inf → 0 under ``ZERO_NONFINITE``, then
    + l2·W as torch's ``add(alpha=l2)``: one FMA), and whether the raw gradient was finite."""
    w = w.to(tl.float32) * shrink
    g = g.to(tl.float32) * gsign
    finite = tl.abs(g) <= FP32_MAX  # False for NaN
    if ZERO_NONFINITE:
        g = tl.where(finite, g, 0.0)
    if l2 != 0:
        g = tl.fma(w, l2, g)
    return w, g, finite


@triton.jit
def second_moment(rv, cv, g, beta2, rest2):
    """This step's V = β2·(r c) + (1 − β2)·G², rounded as torch's ``outer(r, c).mul_(β2).addcmul_(G, G)``."""
    return tl.fma(rest2 * g, g, (rv * cv) * beta2)


@triton.jit
def v_sums_kernel(meta_ptr, item_tensor_ptr, partial_ptr, beta2, rest2, gsign, shrink, l2, W_DTYPE: tl.constexpr,
                  ZERO_NONFINITE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BAND: tl.constexpr):
    """One work item (a tensor's band of rows × column tile) of V's n×m view, over the rows that hold the
    elements ``lo .. hi`` of the flattening (all of it, or an FSDP2 shard's; ``w``/``g`` hold those, from
    ``lo``): this step's V, each element capped (:func:`smmf.matrix.factor_sum_cap`; NaN stays NaN, as
    torch's clamp), summed per row of each BR × BC tile and per column over the band into the tensor's
    partial sums, laid out as the step kernel's V sums (``T_PARTIAL_AT``: [rows: tiles×n][cols: bands×m]),
    so that :func:`.finish.finish_kernel` makes the factors."""
    _t, row, tiles, _local, band, tile = work_item(meta_ptr, item_tensor_ptr, T_TILES, T_FIRST_ITEM)
    n, m, lo, hi = v_span(row)
    w_ptr, g_ptr, row_v_ptr, col_v_ptr = tensor_pointers(row, W_DTYPE)
    part = partial_ptr + tl.load(row + T_PARTIAL_AT)
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
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
        _, g, _ = prepared_gradient(w, g, gsign, shrink, l2, ZERO_NONFINITE)
        rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)[:, None]
        v = second_moment(rv, cv, g, beta2, rest2)
        v = tl.where(ok, tl.where(v > cap, cap, v), 0.0)
        tl.store(part + tile * n + rows, tl.sum(v, axis=1), mask=row_ok)
        acc += v
    tl.store(part + tiles * n + band * m + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def decoded_momentum(codes, scale):
    """M̂ from 4-bit codes and their block's scale: ±j·(scale·⅐) (:func:`smmf.levels.decode_levels`)."""
    magnitude = (codes & LEVEL_TOP).to(tl.float32) * (scale * LEVEL_SEVENTH)
    return tl.where(codes >= LEVEL_NEGATIVE, -magnitude, magnitude)


@triton.jit
def dither(salt, index):
    """:func:`smmf.noise.dither` of the elements at ``index`` (int64): in [0, 1), fp32."""
    return (hash_at(salt, index) >> DITHER_SHIFT).to(tl.float32) * DITHER_UNIT


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


@triton.jit
def levels_step_kernel(meta_ptr, item_tensor_ptr, salts_ptr, bad_ptr, keys_ptr, lr, beta1, rest1, beta2, rest2, eps,
                       gsign, shrink, l2, W_DTYPE: tl.constexpr):
    """One work item: :data:`BLOCKS_PER_PROGRAM` consecutive blocks of a tensor's M (``T_M_TILES`` blocks to
    each of its ``T_M_ROWS`` rows of ``T_M_COLS`` elements), one per row of a (blocks, 64, 2) tile whose last
    axis is the two codes of a byte (even column, low nibble). The arrays hold the param from element ``lo`` of
    its flattening (0, or an FSDP2 shard's first row): element e sits at ((lo + e) // m, (lo + e) % m) of V's
    view, whose old factors it reads, and draws its dither by lo + e with the tensor's salt (``salts[t]``; None:
    the levels round to nearest), and its bf16 rounding noise by lo + e with ``keys[t]`` (None: to nearest).
    Writes the codes, the scales and the weights; NaN/inf gradient elements count as zero and are added to
    ``bad`` (None: neither; the torch path counts them only when it zeroes them)."""
    ZERO_NONFINITE: tl.constexpr = bad_ptr is not None
    BLOCKS: tl.constexpr = LEVEL_BLOCKS
    t, row, blocks_per_row, local, _, _ = work_item(meta_ptr, item_tensor_ptr, T_M_TILES, T_FIRST_SUMS_ITEM)
    cols = tl.load(row + T_M_COLS).to(tl.int32)
    blocks = tl.load(row + T_M_ROWS).to(tl.int32) * blocks_per_row.to(tl.int32)
    m = tl.load(row + T_M)
    lo = tl.load(row + T_LO)
    w_ptr, g_ptr, row_v_ptr, col_v_ptr = tensor_pointers(row, W_DTYPE)
    codes_ptr = tl.load(row + T_CODES_M).to(tl.pointer_type(tl.uint8))
    scales_ptr = tl.load(row + T_SCALES_M).to(tl.pointer_type(tl.bfloat16))

    block = local.to(tl.int32) * BLOCKS + tl.arange(0, BLOCKS)
    block_ok = block < blocks
    row_m = (block // blocks_per_row.to(tl.int32)).to(tl.int64)[:, None]
    byte_col = (block % blocks_per_row.to(tl.int32))[:, None] * LEVEL_BLOCK + tl.arange(0, LEVEL_BLOCK // 2)[None, :] * 2
    byte = row_m * ((cols + 1) // 2) + byte_col // 2  # (BLOCKS, 64): the bytes, by their even column
    byte_ok = block_ok[:, None] & (byte_col < cols)
    half = tl.arange(0, 2)[None, None, :]
    col = byte_col[:, :, None] + half
    ok = byte_ok[:, :, None] & (col < cols)
    element = row_m[:, :, None] * cols + col

    w = tl.load(w_ptr + element, mask=ok, other=0.0)
    g = tl.load(g_ptr + element, mask=ok, other=0.0)
    w, g, finite = prepared_gradient(w, g, gsign, shrink, l2, ZERO_NONFINITE)
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
    tl.store(scales_ptr + block, scale.to(tl.bfloat16), mask=block_ok)
    if salts_ptr is not None:  # the levels rounded stochastically
        codes = encoded_momentum(mm, scale[:, None, None], dither(tl.load(salts_ptr + t), lo + element))
    else:
        codes = encoded_momentum(mm, scale[:, None, None], 0.5)
    tl.store(codes_ptr + byte, tl.sum(codes << (half * 4), axis=2).to(tl.uint8), mask=byte_ok)

    # The weight, with this step's uncompressed M and V: W − lr·M / (√V + ε), as torch's add(alpha=−lr).
    new_w = tl.fma(tl.math.div_rn(mm, tl.sqrt_rn(v) + eps), -lr, w)
    write_weights(w_ptr, 0, element, ok, new_w, keys_ptr, t, lo, W_DTYPE)  # noise by its index in the param
    if ZERO_NONFINITE:
        bad = tl.sum(tl.sum(tl.sum((ok & ~finite).to(tl.int32), axis=2), axis=1), axis=0)
        tl.atomic_add(bad_ptr, bad, mask=bad > 0)
