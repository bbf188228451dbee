"""The step kernel of the paper's code of M (``MomentumCode.SIGN``) on CUDA: M's sign bits and the rank-1
factors of |M|, in V's square view or in M's natural shape."""

from __future__ import annotations

import triton
import triton.language as tl

from .step import (band_of, band_rows, band_sums, bit_scratch, capped_magnitude, column_tile, m_estimate, m_factors,
                   prepared_gradient, second_moment, tile_geometry, tile_inputs, write_weights)
from .table import FP32_MAX, T_M_PARTIAL_AT, T_SIGN_M, T_WORDS_AT
from .tiles import byte_geometry, momentum, pack_bits, unpack_bits


@triton.jit
def sign_step_kernel(meta_ptr, item_tensor_ptr, partial_ptr, words_ptr, bad_ptr, keys_ptr, lr, beta1, beta2, eps,
                     gsign, shrink, l2, W_DTYPE: tl.constexpr, VECTOR: tl.constexpr, SHARD: tl.constexpr,
                     NATURAL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BAND: tl.constexpr):
    """One work item (a band of rows × a column tile of one tensor) of the paper's code: reads w, g and the
    sign bits once, rebuilds M̂ and V̂ from the factors, writes the weight and the new sign bits, and the
    partial sums of V and (in V's view) of |M|, per row of each tile and per column of the band, into the
    tensor's slots of ``partial`` (:func:`~smmf.kernels.triton_gpu.table.layout`). Under ``NATURAL`` the sums
    kernel (:mod:`.sums`) made |M|'s sums in M's own view first, and this kernel only reads M's factors.

    ``words``: the zeroed int32 scratch of the bits of tensors whose rows are not whole sign bytes (None: every
    tensor's are, and a tile writes its own bytes). ``bad``: where the NaN/inf gradient elements are counted,
    which count as zero (None: neither). ``keys``: each tensor's key of its bf16 stochastic rounding noise
    (None: to nearest). Scalars: ``gsign`` −1 to maximize, ``shrink`` the decoupled decay factor 1 − lr·wd,
    ``l2`` the coupled decay coefficient. What one element adds to a factor sum is capped
    (``smmf.matrix.factor_sum_cap``), so finite gradients keep the factors finite."""
    ALIGNED: tl.constexpr = words_ptr is None
    t, row, tiles, local, band, tile, n, m, held_lo, held_hi, w_ptr, g_ptr, row_v_ptr, col_v_ptr, part = band_of(
        meta_ptr, item_tensor_ptr, partial_ptr, W_DTYPE, VECTOR)
    cols, col_ok, cv, m32 = column_tile(col_v_ptr, tile, m, BC)
    signs_ptr = tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8))
    row_m_ptr, col_m_ptr, m_cols, cm, inv_width = m_factors(row, cols, col_ok, VECTOR, NATURAL, BC)
    words = words_ptr  # None: every row is whole sign bytes, and a tile writes its own
    if not ALIGNED:
        words = bit_scratch(row, T_WORDS_AT, words_ptr)
    m_part = partial_ptr + tl.load(row + T_M_PARTIAL_AT)
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
    any_bad = tl.zeros((BR, BC // 8, 8), dtype=tl.int1)
    acc_v = tl.zeros((BR, BC // 8, 8), dtype=tl.float32)  # column sums, reduced once after the band
    acc_m = tl.zeros((BR, BC // 8, 8), dtype=tl.float32)
    first_row, last_row = band_rows(band, m, held_lo, held_hi, BAND)
    rows, row_ok, start0, base, offs, ok = tile_geometry(first_row, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                         SHARD, BR)
    next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base, offs, ok, rows, row_ok)
    byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
    next_bits = unpack_bits(signs_ptr, byte_offs, byte_ok, base + offs, ok, ALIGNED)
    next_magnitude = m_estimate(row_m_ptr, col_m_ptr, cm, rows, row_ok, ok, start0, m, tile, m_cols, inv_width,
                                NATURAL, BR, BC)
    for r0 in tl.range(first_row, last_row, BR, num_stages=1):
        rows, row_ok, start0, base, offs, ok = tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                             SHARD, BR)
        # The next tile's loads, issued before this tile is computed (past the band's end they read nothing).
        rows1, row_ok1, start1, base1, offs1, ok1 = tile_geometry(r0 + BR, last_row, m, m32, held_lo, held_hi, cols,
                                                                  col_ok, SHARD, BR)
        w_raw, g_raw, rv, bits, magnitude = next_w, next_g, next_rv, next_bits, next_magnitude
        next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base1, offs1, ok1, rows1, row_ok1)
        byte_offs1, byte_ok1 = byte_geometry(base1, start1, held_lo, held_hi, m32, tile, row_ok1, SHARD, BR, BC)
        next_bits = unpack_bits(signs_ptr, byte_offs1, byte_ok1, base1 + offs1, ok1, ALIGNED)
        next_magnitude = m_estimate(row_m_ptr, col_m_ptr, cm, rows1, row_ok1, ok1, start1, m, tile, m_cols,
                                    inv_width, NATURAL, BR, BC)
        w, g, any_bad = prepared_gradient(w_raw, g_raw, ok, any_bad, gsign, shrink, l2, bad_ptr is not None)
        v, v_capped = second_moment(g, rv, cv, ok, cap, beta2, part + tile * n + r0, row_ok, BR)
        acc_v += v_capped
        byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
        mm = tl.where(ok, momentum(g, bits, bits, magnitude, 0.0, 0.0, beta1, False), 0.0)
        pack_bits(signs_ptr, words, ((mm >= 0) & ok).to(tl.int32), byte_offs, byte_ok, rows, tile, m, held_lo,
                  row_ok, ALIGNED, BR, BC)
        if not NATURAL:
            acc_m += capped_magnitude(mm, cap, m_part + tile * n + r0, row_ok, BR)
        write_weights(w_ptr, base, offs, ok, w - lr * (mm / (tl.sqrt(v) + eps)), keys_ptr, t, start0, W_DTYPE)
    band_sums(part, acc_v, any_bad, bad_ptr, tiles, n, m, band, cols, col_ok)
    if not NATURAL:
        tl.store(m_part + tiles * n + band * m + cols, tl.sum(acc_m, axis=0, keep_dims=True), mask=col_ok)
