"""The step kernel of the 1-bit magnitude flag (``MomentumCode.FLAG``, ``magnitude_bits=1``) on CUDA: M decoded
with the old sign and flag bits and gains, and encoded against the new factors of |M| that the sums kernel
(:mod:`.sums`) and the finish kernel left in the partial buffer."""

from __future__ import annotations

import triton
import triton.language as tl

from .step import (band_of, band_rows, band_sums, bit_scratch, column_tile, m_estimate, m_factors, prepared_gradient,
                   second_moment, tile_geometry, tile_inputs, write_weights)
from .table import (FP32_MAX, T_FLAG_M, T_FLAG_WORDS_AT, T_GAIN_SUMS_AT, T_FLAG_GAINS_M, T_M_ROWS, T_NEW_M_AT,
                    T_SIGN_M, T_WORDS_AT)
from .tiles import byte_geometry, flag_fit, momentum, pack_bits, unpack_bits


@triton.jit
def flag_step_kernel(meta_ptr, item_tensor_ptr, partial_ptr, words_ptr, bad_ptr, keys_ptr, lr, beta1, beta2, eps,
                     gsign, shrink, l2, W_DTYPE: tl.constexpr, VECTOR: tl.constexpr, SHARD: tl.constexpr,
                     NATURAL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BAND: tl.constexpr):
    """One work item (a band of rows × a column tile of one tensor) under the magnitude flag, with the
    arguments of :func:`.sign.sign_step_kernel`: M decoded with the old sign and flag bits and gains, and
    encoded against the new factors of |M| in the partial buffer (``T_NEW_M_AT``): new sign and flag bits
    (F = [|M| > r cᵀ]), and the item's four least-squares sums of the levels (``T_GAIN_SUMS_AT``). The sums
    kernel made |M|'s sums, so only V's are made here."""
    ALIGNED: tl.constexpr = words_ptr is None
    t, row, tiles, local, band, tile, n, m, held_lo, held_hi, w_ptr, g_ptr, row_v_ptr, col_v_ptr, part = band_of(
        meta_ptr, item_tensor_ptr, partial_ptr, W_DTYPE, VECTOR)
    cols, col_ok, cv, m32 = column_tile(col_v_ptr, tile, m, BC)
    signs_ptr = tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8))
    row_m_ptr, col_m_ptr, m_cols, cm, inv_width = m_factors(row, cols, col_ok, VECTOR, NATURAL, BC)
    words, flag_words = words_ptr, words_ptr  # None: every row is whole bytes, and a tile writes its own
    if not ALIGNED:
        words = bit_scratch(row, T_WORDS_AT, words_ptr)
    flags_ptr = tl.load(row + T_FLAG_M).to(tl.pointer_type(tl.uint8))
    gains_ptr = tl.load(row + T_FLAG_GAINS_M).to(tl.pointer_type(tl.float32))
    high, low = tl.load(gains_ptr), tl.load(gains_ptr + 1)
    new_row_m = partial_ptr + tl.load(row + T_NEW_M_AT)  # then the new column factors, from M's row count on
    new_col_m = new_row_m + tl.load(row + T_M_ROWS)
    if not ALIGNED:
        flag_words = bit_scratch(row, T_FLAG_WORDS_AT, words_ptr)
    new_cm = tl.load(new_col_m + cols, mask=col_ok, other=0.0) if not NATURAL else 0.0
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
    any_bad = tl.zeros((BR, BC // 8, 8), dtype=tl.int1)
    acc_v = tl.zeros((BR, BC // 8, 8), dtype=tl.float32)  # column sums, reduced once after the band
    fit_high = tl.zeros((BR,), dtype=tl.float32)  # the level sums, by rows of the tile (:func:`flag_fit`)
    energy_high = tl.zeros((BR,), dtype=tl.float32)
    fit_low = tl.zeros((BR,), dtype=tl.float32)
    energy_low = tl.zeros((BR,), dtype=tl.float32)
    first_row, last_row = band_rows(band, m, held_lo, held_hi, BAND)
    rows, row_ok, start0, base, offs, ok = tile_geometry(first_row, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                         SHARD, BR)
    next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base, offs, ok, rows, row_ok)
    byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
    next_bits = unpack_bits(signs_ptr, byte_offs, byte_ok, base + offs, ok, ALIGNED)
    next_flag_bits = unpack_bits(flags_ptr, byte_offs, byte_ok, base + offs, ok, ALIGNED)
    next_magnitude = m_estimate(row_m_ptr, col_m_ptr, cm, rows, row_ok, ok, start0, m, tile, m_cols, inv_width,
                                NATURAL, BR, BC)
    for r0 in tl.range(first_row, last_row, BR, num_stages=1):
        rows, row_ok, start0, base, offs, ok = tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                             SHARD, BR)
        # The next tile's loads, issued before this tile is computed (past the band's end they read nothing).
        rows1, row_ok1, start1, base1, offs1, ok1 = tile_geometry(r0 + BR, last_row, m, m32, held_lo, held_hi, cols,
                                                                  col_ok, SHARD, BR)
        w_raw, g_raw, rv, bits, flag_bits, magnitude = (next_w, next_g, next_rv, next_bits, next_flag_bits,
                                                        next_magnitude)
        next_w, next_g, next_rv = tile_inputs(w_ptr, g_ptr, row_v_ptr, base1, offs1, ok1, rows1, row_ok1)
        byte_offs1, byte_ok1 = byte_geometry(base1, start1, held_lo, held_hi, m32, tile, row_ok1, SHARD, BR, BC)
        next_bits = unpack_bits(signs_ptr, byte_offs1, byte_ok1, base1 + offs1, ok1, ALIGNED)
        next_flag_bits = unpack_bits(flags_ptr, byte_offs1, byte_ok1, base1 + offs1, ok1, ALIGNED)
        next_magnitude = m_estimate(row_m_ptr, col_m_ptr, cm, rows1, row_ok1, ok1, start1, m, tile, m_cols,
                                    inv_width, NATURAL, BR, BC)
        w, g, any_bad = prepared_gradient(w_raw, g_raw, ok, any_bad, gsign, shrink, l2, bad_ptr is not None)
        v, v_capped = second_moment(g, rv, cv, ok, cap, beta2, part + tile * n + r0, row_ok, BR)
        acc_v += v_capped
        byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
        mm = tl.where(ok, momentum(g, bits, flag_bits, magnitude, high, low, beta1, True), 0.0)
        pack_bits(signs_ptr, words, ((mm >= 0) & ok).to(tl.int32), byte_offs, byte_ok, rows, tile, m, held_lo,
                  row_ok, ALIGNED, BR, BC)
        estimate = m_estimate(new_row_m, new_col_m, new_cm, rows, row_ok, ok, start0, m, tile, m_cols, inv_width,
                              NATURAL, BR, BC)
        above, d_fit_high, d_energy_high, d_fit_low, d_energy_low = flag_fit(tl.abs(mm), estimate, ok, cap)
        fit_high += d_fit_high
        energy_high += d_energy_high
        fit_low += d_fit_low
        energy_low += d_energy_low
        pack_bits(flags_ptr, flag_words, above.to(tl.int32), byte_offs, byte_ok, rows, tile, m, held_lo, row_ok,
                  ALIGNED, BR, BC)
        write_weights(w_ptr, base, offs, ok, w - lr * (mm / (tl.sqrt(v) + eps)), keys_ptr, t, start0, W_DTYPE)
    band_sums(part, acc_v, any_bad, bad_ptr, tiles, n, m, band, cols, col_ok)
    item_sums = partial_ptr + tl.load(row + T_GAIN_SUMS_AT) + 4 * local
    tl.store(item_sums, tl.sum(fit_high, axis=0))
    tl.store(item_sums + 1, tl.sum(energy_high, axis=0))
    tl.store(item_sums + 2, tl.sum(fit_low, axis=0))
    tl.store(item_sums + 3, tl.sum(energy_low, axis=0))
