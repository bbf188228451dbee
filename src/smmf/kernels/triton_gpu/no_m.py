"""The step kernel without a first moment (``MomentumCode.NO_M``, ``beta=None``) on CUDA: V's factors only,
W −= lr·G / (√V + ε)."""

from __future__ import annotations

import triton
import triton.language as tl

from .step import (band_of, band_rows, band_sums, column_tile, prepared_gradient, second_moment, tile_geometry,
                   tile_inputs, write_weights)
from .table import FP32_MAX


@triton.jit
def no_m_step_kernel(meta_ptr, item_tensor_ptr, partial_ptr, bad_ptr, keys_ptr, lr, beta2, eps, gsign, shrink, l2,
                     W_DTYPE: tl.constexpr, VECTOR: tl.constexpr, SHARD: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, BAND: tl.constexpr):
    """One work item (a band of rows × a column tile of one tensor) without a first moment: reads w and g once,
    rebuilds V̂ from its factors, writes the weight and V's partial sums, as :func:`.sign.sign_step_kernel`
    (whose arguments these are)."""
    t, row, tiles, local, band, tile, n, m, held_lo, held_hi, w_ptr, g_ptr, row_v_ptr, col_v_ptr, part = band_of(
        meta_ptr, item_tensor_ptr, partial_ptr, W_DTYPE, VECTOR)
    cols, col_ok, cv, m32 = column_tile(col_v_ptr, tile, m, BC)
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
    any_bad = tl.zeros((BR, BC // 8, 8), dtype=tl.int1)
    acc_v = tl.zeros((BR, BC // 8, 8), dtype=tl.float32)  # column sums, reduced once after the band
    first_row, last_row = band_rows(band, m, held_lo, held_hi, BAND)
    rows, row_ok, start0, base, offs, ok = tile_geometry(first_row, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                         SHARD, BR)
    next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base, offs, ok, rows, row_ok)
    for r0 in tl.range(first_row, last_row, BR, num_stages=1):
        rows, row_ok, start0, base, offs, ok = tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                             SHARD, BR)
        # The next tile's loads, issued before this tile is computed (past the band's end they read nothing).
        rows1, row_ok1, start1, base1, offs1, ok1 = tile_geometry(r0 + BR, last_row, m, m32, held_lo, held_hi, cols,
                                                                  col_ok, SHARD, BR)
        w_raw, g_raw, rv = next_w, next_g, next_rv
        next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base1, offs1, ok1, rows1, row_ok1)
        w, g, any_bad = prepared_gradient(w_raw, g_raw, ok, any_bad, gsign, shrink, l2, bad_ptr is not None)
        v, v_capped = second_moment(g, rv, cv, ok, cap, beta2, part + tile * n + r0, row_ok, BR)
        acc_v += v_capped
        write_weights(w_ptr, base, offs, ok, w - lr * (g / (tl.sqrt(v) + eps)), keys_ptr, t, start0, W_DTYPE)
    band_sums(part, acc_v, any_bad, bad_ptr, tiles, n, m, band, cols, col_ok)
