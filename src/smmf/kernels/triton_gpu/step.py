"""The Triton step kernels: the fused step over a work item (a band of rows × a column tile of one
tensor), and the sums of |M| in M's own view that the natural shape and the flag need first."""

from __future__ import annotations

import triton
import triton.language as tl

from .table import (
    FP32_MAX,
    T_W,
    T_G,
    T_SIGN_M,
    T_ROW_M,
    T_COL_M,
    T_N,
    T_M,
    T_TILES,
    T_FIRST_ITEM,
    T_PARTIAL_AT,
    T_WORDS_AT,
    T_LO,
    T_HI,
    T_M_COLS,
    T_M_ROWS,
    T_M_TILES,
    T_FIRST_SUMS_ITEM,
    T_M_PARTIAL_AT,
    T_FLAG_M,
    T_LEVELS_M,
    T_NEW_M_AT,
    T_LEVEL_SUMS_AT,
    T_FLAG_WORDS_AT,
)
from .tiles import (bf16_rounded, byte_geometry, factor_product, flag_fit, momentum, natural_place,
                    natural_width, pack_bits, row_sums, tensor_key, tensor_pointers, unpack_bits, v_span,
                    work_item)


@triton.jit
def store_row_sums(ptr, x, row_ok, BR: tl.constexpr):
    """A (BR, BC/8, 8) tile's row sums into ``ptr[0 .. BR)``."""
    sums = tl.sum(tl.sum(x, axis=2, keep_dims=True), axis=1, keep_dims=True)
    tl.store(ptr + tl.arange(0, BR)[:, None, None], sums, mask=row_ok[:, None, None])


@triton.jit
def tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok, SHARD: tl.constexpr, BR: tl.constexpr):
    """The rows of the tile from row ``r0``, which of them the band holds, the tile's first element (globally,
    and where w, g and the bits hold it: int64) and its elements' offsets from there (int32), and which it holds."""
    rows = r0 + tl.arange(0, BR)
    row_ok = rows < last_row
    start0 = r0 * m
    base = start0 - held_lo
    offs = tl.arange(0, BR)[:, None, None] * m32 + cols
    ok = row_ok[:, None, None] & col_ok
    if SHARD:  # the first and last rows may be partial
        ok = ok & (offs >= held_lo - start0) & (offs < held_hi - start0)
    return rows, row_ok, start0, base, offs, ok


@triton.jit
def tile_loads(r0, last_row, m, m32, held_lo, held_hi, tile, cols, col_ok, w_ptr, g_ptr, row_v_ptr, signs_ptr,
               flags_ptr, row_m_ptr, col_m_ptr, cm, m_cols, inv_width, HAS_M: tl.constexpr, ALIGNED: tl.constexpr,
               SHARD: tl.constexpr, NATURAL: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """What the step reads for the tile from row ``r0``: w and g as stored, V's row factors, the sign and flag
    bits (0/1) and M's factor product r cᵀ (0 without a first moment). Rows past ``last_row`` read nothing."""
    rows, row_ok, start0, base, offs, ok = tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok, SHARD,
                                                         BR)
    w = tl.load(w_ptr + base + offs, mask=ok, other=0.0)
    g = tl.load(g_ptr + base + offs, mask=ok, other=0.0)
    rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)
    if HAS_M:
        byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
        bits = unpack_bits(signs_ptr, byte_offs, byte_ok, base + offs, ok, ALIGNED)
        flag_bits = unpack_bits(flags_ptr, byte_offs, byte_ok, base + offs, ok, ALIGNED) if FLAG else bits
        m_row, m_col = natural_place(start0, m, tile, m_cols, inv_width, BR, BC) if NATURAL else (0, 0)
        magnitude = factor_product(row_m_ptr, col_m_ptr, cm, rows, row_ok, m_row, m_col, ok, NATURAL)
    else:
        bits = tl.zeros((BR, BC // 8, 8), dtype=tl.uint8)
        flag_bits = bits
        magnitude = tl.zeros((BR, BC // 8, 8), dtype=tl.float32)
    return w, g, rv, bits, flag_bits, magnitude


@triton.jit
def step_kernel(meta_ptr, item_tensor_ptr, partial_ptr, words_ptr, bad_ptr, lr, beta1, beta2, eps, gsign, shrink, l2,
                keys_ptr, W_DTYPE: tl.constexpr, HAS_M: tl.constexpr, ALIGNED: tl.constexpr, VECTOR: tl.constexpr,
                SHARD: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr, ZERO_NONFINITE: tl.constexpr, NATURAL: tl.constexpr,
                FLAG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BAND: tl.constexpr, STAGES: tl.constexpr,
                PREFETCH: tl.constexpr = False):
    """One work item. ``meta`` is the int64 table described in the module docstring; ``partial`` is
    laid out per tensor as [V rows: tiles×n][V cols: bands×m][M rows][M cols] (:func:`~smmf.kernels.triton_gpu.table.layout`);
    ``words`` is the zeroed int32 sign scratch of the unaligned tensors; n counts every row of the
    matrix, the bands only the rows that hold elements lo .. hi (``held_lo`` .. ``held_hi``).
    Scalars: ``gsign`` −1 to maximize, ``shrink`` the decoupled decay factor 1 − lr·wd, ``l2`` the
    coupled decay coefficient; ``keys`` each tensor's key of its bf16 stochastic rounding noise
    (read under ``STOCHASTIC_ROUNDING``). ``bad`` counts (a lower bound
    of) the NaN/inf gradient elements, which count as zero when ``ZERO_NONFINITE``. What one element adds
    to a factor sum is capped (``smmf.matrix.factor_sum_cap``), so finite gradients keep the factors
    finite. A tile is held as (BR, BC/8, 8): the last axis is one sign byte, so bits unpack and pack
    without reshaping. ``ALIGNED``: every tensor's m and lo are multiples
    of 8 (each row segment is whole bytes of the sign bits). ``FLAG`` (the magnitude flag): M is
    decoded with the flag's bits and levels, and encoded against the new factors of |M| that
    :func:`momentum_sums_kernel` and the finish kernel left in the partial buffer (``T_NEW_M_AT``, ``T_LEVEL_SUMS_AT``):
    new sign and flag bits, and each work item's four level sums. Under ``NATURAL`` or ``FLAG`` the
    sums kernel made |M|'s sums and this kernel only reads M's factors. ``VECTOR``: the host checked that
    every row segment starts and ends on 8 elements and that w, g and the column factors start on 16
    bytes (``host._vector``); saying so lets the compiler move them 16 bytes at a time, which halves
    the registers and the load instructions per element. ``SHARD``: some tensor holds only part of its
    rows (lo > 0 or hi < n·m), so each element is also tested against lo .. hi. ``PREFETCH``: each
    iteration issues the next tile's loads (:func:`tile_loads`) into registers before it computes its own,
    so that no load's latency, the sign bytes' included, stands between two tiles (Triton's own pipelining,
    ``STAGES`` > 1, stages w and g through shared memory and leaves the byte loads in the loop)."""
    tl.static_assert(BC % 32 == 0, "a tile's columns are whole sign bytes, packed 32 bits at a time")
    BB: tl.constexpr = BC // 8
    t, row, tiles, local, band, tile = work_item(meta_ptr, item_tensor_ptr, T_TILES, T_FIRST_ITEM)
    n, m, held_lo, held_hi = v_span(row)
    w_ptr, g_ptr, row_v_ptr, col_v_ptr = tensor_pointers(row, W_DTYPE)
    part = partial_ptr + tl.load(row + T_PARTIAL_AT)
    m_part = partial_ptr + tl.load(row + T_M_PARTIAL_AT)
    if VECTOR:  # tell the compiler what the host checked, so that loads and stores are 16 bytes wide
        m = tl.multiple_of(m, 8)
        held_lo = tl.multiple_of(held_lo, 8)
        held_hi = tl.multiple_of(held_hi, 8)
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        col_v_ptr = tl.multiple_of(col_v_ptr, 16)
    m32 = m.to(tl.int32)
    bit = tl.arange(0, 8)[None, None, :]
    cols = (tile * BC).to(tl.int32) + tl.arange(0, BB)[None, :, None] * 8 + bit  # (1, BB, 8)
    col_ok = cols < m32
    cv = tl.load(col_v_ptr + cols, mask=col_ok, other=0.0)
    if HAS_M:
        signs_ptr = tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8))
        row_m_ptr = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
        col_m_ptr = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
        if VECTOR:
            col_m_ptr = tl.multiple_of(col_m_ptr, 16)
        words = words_ptr + tl.load(row + T_WORDS_AT)
        m_cols = tl.load(row + T_M_COLS)
        cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0) if not NATURAL else 0.0
        inv_width = 1.0 / natural_width(m_cols, BC).to(tl.float32) if NATURAL else 0.0
        if FLAG:
            flags_ptr = tl.load(row + T_FLAG_M).to(tl.pointer_type(tl.uint8))
            levels_ptr = tl.load(row + T_LEVELS_M).to(tl.pointer_type(tl.float32))
            high = tl.load(levels_ptr)
            low = tl.load(levels_ptr + 1)
            new_row_m = partial_ptr + tl.load(row + T_NEW_M_AT)  # then the new column factors, from M's row count on
            new_col_m = new_row_m + tl.load(row + T_M_ROWS)
            flag_words = words_ptr + tl.load(row + T_FLAG_WORDS_AT)
            new_cm = tl.load(new_col_m + cols, mask=col_ok, other=0.0) if not NATURAL else 0.0
        else:
            flags_ptr = signs_ptr  # unread: the flag's names exist in every variant
            high = 0.0
            low = 0.0
    else:  # unread: the names of M's state exist in every variant
        signs_ptr = tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8))
        flags_ptr = signs_ptr
        row_m_ptr = row_v_ptr
        col_m_ptr = col_v_ptr
        cm = 0.0
        m_cols = m
        inv_width = 0.0
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
    any_bad = tl.zeros((BR, BB, 8), dtype=tl.int1)
    acc_v = tl.zeros((BR, BB, 8), dtype=tl.float32)  # column sums, reduced once after the band
    acc_m = tl.zeros((BR, BB, 8), dtype=tl.float32)
    fit_high = tl.zeros((BR,), dtype=tl.float32)  # the flag's level sums by rows of the tile (FLAG)
    energy_high = tl.zeros((BR,), dtype=tl.float32)
    fit_low = tl.zeros((BR,), dtype=tl.float32)
    energy_low = tl.zeros((BR,), dtype=tl.float32)
    first_row = held_lo // m + band * BAND
    last_row = tl.minimum(first_row + BAND, (held_hi + m - 1) // m)
    if PREFETCH:  # the first tile's loads; each iteration then issues the next tile's before it computes
        next_w, next_g, next_rv, next_bits, next_flag_bits, next_magnitude = tile_loads(
            first_row, last_row, m, m32, held_lo, held_hi, tile, cols, col_ok, w_ptr, g_ptr, row_v_ptr, signs_ptr,
            flags_ptr, row_m_ptr, col_m_ptr, cm, m_cols, inv_width, HAS_M, ALIGNED, SHARD, NATURAL, FLAG, BR, BC)
    for r0 in tl.range(first_row, last_row, BR, num_stages=STAGES):
        rows, row_ok, start0, base, offs, ok = tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok,
                                                             SHARD, BR)
        loaded_w, loaded_g, loaded_rv, loaded_bits, loaded_flag_bits, loaded_magnitude = tile_loads(
            r0 + BR if PREFETCH else r0, last_row, m, m32, held_lo, held_hi, tile, cols, col_ok, w_ptr, g_ptr,
            row_v_ptr, signs_ptr, flags_ptr, row_m_ptr, col_m_ptr, cm, m_cols, inv_width, HAS_M, ALIGNED, SHARD,
            NATURAL, FLAG, BR, BC)
        if PREFETCH:  # this tile's, loaded last iteration; the next tile's are in flight
            w_raw, g_raw, rv, bits, flag_bits, magnitude = (next_w, next_g, next_rv, next_bits, next_flag_bits,
                                                            next_magnitude)
            next_w, next_g, next_rv, next_bits, next_flag_bits, next_magnitude = (
                loaded_w, loaded_g, loaded_rv, loaded_bits, loaded_flag_bits, loaded_magnitude)
        else:
            w_raw, g_raw, rv, bits, flag_bits, magnitude = (loaded_w, loaded_g, loaded_rv, loaded_bits,
                                                            loaded_flag_bits, loaded_magnitude)
        w = w_raw.to(tl.float32) * shrink
        g = g_raw.to(tl.float32) * gsign
        finite = tl.abs(g) <= FP32_MAX  # False for NaN
        any_bad = any_bad | (ok & ~finite)
        if ZERO_NONFINITE:
            g = tl.where(finite, g, 0.0)
        if l2 != 0:  # only L2 decay reads the weight: 0·W would make a NaN or infinite weight a NaN gradient
            g = g + l2 * w
        v = beta2 * (rv[:, None, None] * cv) + (1.0 - beta2) * (g * g)
        v = tl.where(ok, v, 0.0)
        v_capped = tl.where(v > cap, cap, v)
        store_row_sums(part + tile * n + r0, v_capped, row_ok, BR)
        acc_v += v_capped
        if HAS_M:
            byte_offs, byte_ok = byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD, BR, BC)
            mm = momentum(g, bits, flag_bits, magnitude, high, low, beta1, FLAG)
            mm = tl.where(ok, mm, 0.0)
            pack_bits(signs_ptr, words, ((mm >= 0) & ok).to(tl.int32), byte_offs, byte_ok, rows, tile, m, held_lo,
                      row_ok, ALIGNED, BR, BC)
            if FLAG:  # encode against the new factors: F = [|M| > R], and the least-squares sums
                m_row, m_col = natural_place(start0, m, tile, m_cols, inv_width, BR, BC) if NATURAL else (0, 0)
                estimate = factor_product(new_row_m, new_col_m, new_cm, rows, row_ok, m_row, m_col, ok, NATURAL)
                above, d_fit_high, d_energy_high, d_fit_low, d_energy_low = flag_fit(tl.abs(mm), estimate, ok, cap)
                fit_high += d_fit_high
                energy_high += d_energy_high
                fit_low += d_fit_low
                energy_low += d_energy_low
                pack_bits(flags_ptr, flag_words, above.to(tl.int32), byte_offs, byte_ok, rows, tile, m, held_lo,
                          row_ok, ALIGNED, BR, BC)
            if not NATURAL and not FLAG:  # (else momentum_sums_kernel made |M|'s sums in M's view)
                a = tl.abs(mm)
                a = tl.where(a > cap, cap, a)
                store_row_sums(m_part + tile * n + r0, a, row_ok, BR)
                acc_m += a
            u = mm / (tl.sqrt(v) + eps)
        else:
            u = g / (tl.sqrt(v) + eps)
        new_w = w - lr * u
        if W_DTYPE == tl.bfloat16:
            new_w = bf16_rounded(new_w, tensor_key(keys_ptr, t, STOCHASTIC_ROUNDING), start0 + offs, STOCHASTIC_ROUNDING)
        tl.store(w_ptr + base + offs, new_w.to(W_DTYPE), mask=ok)
    tl.store(part + tiles * n + band * m + cols, tl.sum(acc_v, axis=0, keep_dims=True), mask=col_ok)
    bad = tl.sum(row_sums(any_bad.to(tl.int32)), axis=0)
    tl.atomic_add(bad_ptr, bad, mask=bad > 0)
    if HAS_M and not NATURAL and not FLAG:
        tl.store(m_part + tiles * n + band * m + cols, tl.sum(acc_m, axis=0, keep_dims=True), mask=col_ok)
    if FLAG:
        level_sums = partial_ptr + tl.load(row + T_LEVEL_SUMS_AT) + 4 * local
        tl.store(level_sums, tl.sum(fit_high, axis=0))
        tl.store(level_sums + 1, tl.sum(energy_high, axis=0))
        tl.store(level_sums + 2, tl.sum(fit_low, axis=0))
        tl.store(level_sums + 3, tl.sum(energy_low, axis=0))


@triton.jit
def momentum_sums_kernel(meta_ptr, item_tensor_ptr, partial_ptr, beta1, gsign, shrink, l2, W_DTYPE: tl.constexpr,
                         ZERO_NONFINITE: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         BAND: tl.constexpr):
    """|M|'s partial row and column sums in M's own view (``momentum_shape="natural"``, and every
    view under the magnitude flag, whose encoding needs the new factors first), one work item per
    (band, column tile) of the rows that hold elements lo .. hi (all, or an FSDP2 shard's), from the
    state before the step: this step's M formed as :func:`step_kernel` forms it, which then only
    reads M's factors. Runs first: the step kernel rewrites the weights and the sign (and flag) bits."""
    _, row, tiles, _, band, tile = work_item(meta_ptr, item_tensor_ptr, T_M_TILES, T_FIRST_SUMS_ITEM)
    b = tl.load(row + T_M_COLS)  # M's columns
    a_rows = tl.load(row + T_M_ROWS)
    w_ptr = tl.load(row + T_W).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + T_G).to(tl.pointer_type(W_DTYPE))
    signs_ptr = tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8))
    row_m_ptr = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
    col_m_ptr = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
    m_part = partial_ptr + tl.load(row + T_M_PARTIAL_AT)
    if FLAG:
        flags_ptr = tl.load(row + T_FLAG_M).to(tl.pointer_type(tl.uint8))
        levels_ptr = tl.load(row + T_LEVELS_M).to(tl.pointer_type(tl.float32))
        high = tl.load(levels_ptr)
        low = tl.load(levels_ptr + 1)
    else:
        high = 0.0
        low = 0.0
    n = tl.load(row + T_N)
    held_lo = tl.load(row + T_LO)
    held_hi = tl.load(row + T_HI)
    cap = FP32_MAX / (2.0 * (n * tl.load(row + T_M)).to(tl.float32))
    b32 = b.to(tl.int32)
    cols = (tile * BC).to(tl.int32) + tl.arange(0, BC)[None, :]
    col_ok = cols < b32
    cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    first_row = held_lo // b + band * BAND  # the bands cover the rows that hold elements lo .. hi
    last_row = tl.minimum(first_row + BAND, (held_hi + b - 1) // b)
    for r0 in range(first_row, last_row, BR):
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < last_row
        start0 = r0 * b  # the tile's first element; w, g and the bits hold elements from lo on
        base = start0 - held_lo
        offs = tl.arange(0, BR)[:, None] * b32 + cols
        ok = row_ok[:, None] & col_ok & (offs >= held_lo - start0) & (offs < held_hi - start0)
        g = tl.load(g_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * gsign
        if ZERO_NONFINITE:
            g = tl.where(tl.abs(g) <= FP32_MAX, g, 0.0)
        if l2 != 0:  # L2 decay: M takes the weights too
            g = g + l2 * (tl.load(w_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * shrink)
        bits = unpack_bits(signs_ptr, 0, False, base + offs, ok, ALIGNED=False)  # M's rows: not whole bytes
        flag_bits = unpack_bits(flags_ptr, 0, False, base + offs, ok, ALIGNED=False) if FLAG else bits
        magnitude = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)[:, None] * cm
        mm = momentum(g, bits, flag_bits, magnitude, high, low, beta1, FLAG)
        m_abs = tl.where(ok, tl.abs(mm), 0.0)
        m_abs = tl.where(m_abs > cap, cap, m_abs)
        tl.store(m_part + tile * a_rows + rows, tl.sum(m_abs, axis=1), mask=row_ok)
        acc += m_abs
    tl.store(m_part + tiles * a_rows + band * b + tile * BC + tl.arange(0, BC), tl.sum(acc, axis=0),
             mask=(tile * BC + tl.arange(0, BC)) < b)
