"""What the step kernels of every code share (:mod:`.sign`, :mod:`.flag`, :mod:`.none`): the band a program
walks and its column tile, a tile's rows and elements, the weight, gradient and V that every code reads, this
step's V and its sums, the weight written, and the band's column sums and NaN/inf count.

A program walks its band in (BR, BC/8, 8) tiles: the last axis is one sign byte, so bits unpack and pack without
reshaping. Each iteration issues the next tile's loads into registers before it computes its own, so that no
load's latency stands between two tiles (Triton's own pipelining staged only w and g through shared memory and
left the byte loads in the loop: docs/gpu.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .table import FP32_MAX, T_COL_M, T_FIRST_ITEM, T_M_COLS, T_PARTIAL_AT, T_ROW_M, T_TILES
from .tiles import (bf16_rounded, factor_product, natural_place, natural_width, row_sums, tensor_pointers, v_span,
                    work_item)


@triton.jit
def band_of(meta_ptr, item_tensor_ptr, partial_ptr, W_DTYPE: tl.constexpr, VECTOR: tl.constexpr):
    """This program's work item: its tensor (index ``t`` and table ``row``), the tensor's column tiles, the
    item's index among the tensor's, its band and column tile; the n×m view of V and the elements lo .. hi of it
    that the arrays hold; the weight, gradient and V's factors, and where the tensor's partial sums start
    (``T_PARTIAL_AT``). ``VECTOR``: the host checked that every row segment starts and ends on 8 elements and
    that w, g and the column factors start on 16 bytes (``host._vector``); saying so lets the compiler move them
    16 bytes at a time, which halves the registers and the load instructions per element."""
    t, row, tiles, local, band, tile = work_item(meta_ptr, item_tensor_ptr, T_TILES, T_FIRST_ITEM)
    n, m, held_lo, held_hi = v_span(row)
    w_ptr, g_ptr, row_v_ptr, col_v_ptr = tensor_pointers(row, W_DTYPE)
    part = partial_ptr + tl.load(row + T_PARTIAL_AT)
    if VECTOR:
        m = tl.multiple_of(m, 8)
        held_lo = tl.multiple_of(held_lo, 8)
        held_hi = tl.multiple_of(held_hi, 8)
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        col_v_ptr = tl.multiple_of(col_v_ptr, 16)
    return t, row, tiles, local, band, tile, n, m, held_lo, held_hi, w_ptr, g_ptr, row_v_ptr, col_v_ptr, part


@triton.jit
def band_rows(band, m, held_lo, held_hi, BAND: tl.constexpr):
    """The rows first .. last of the band: of the rows that hold elements lo .. hi, BAND a band (a constexpr:
    a band height read from the table costs the loop an instruction or two and the registers that carry it)."""
    first_row = held_lo // m + band * BAND
    return first_row, tl.minimum(first_row + BAND, (held_hi + m - 1) // m)


@triton.jit
def column_tile(col_v_ptr, tile, m, BC: tl.constexpr):
    """The tile's columns as a (1, BC/8, 8) int32 block, which of them the view has, V's column factors at them,
    and m as int32."""
    m32 = m.to(tl.int32)
    cols = (tile * BC).to(tl.int32) + tl.arange(0, BC // 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    col_ok = cols < m32
    return cols, col_ok, tl.load(col_v_ptr + cols, mask=col_ok, other=0.0), m32


@triton.jit
def tile_geometry(r0, last_row, m, m32, held_lo, held_hi, cols, col_ok, SHARD: tl.constexpr, BR: tl.constexpr):
    """The rows of the tile from row ``r0``, which of them the band holds, the tile's first element (globally,
    and where w, g and the bits hold it: int64) and its elements' offsets from there (int32), and which it
    holds. ``SHARD``: some tensor holds only part of its rows (lo > 0 or hi < n·m), so each element is also
    tested against lo .. hi."""
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
def tile_inputs(w_ptr, g_ptr, row_v_ptr, base, offs, ok, rows, row_ok):
    """What every code reads for a tile: w and g as stored, and V's row factors."""
    w = tl.load(w_ptr + base + offs, mask=ok, other=0.0)
    g = tl.load(g_ptr + base + offs, mask=ok, other=0.0)
    return w, g, tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)


@triton.jit
def prepared_gradient(w_raw, g_raw, ok, any_bad, gsign, shrink, l2, ZERO_NONFINITE: tl.constexpr):
    """The decayed weight (``shrink`` = 1 − lr·wd) and G as every path prepares it (−G to maximize, NaN/inf → 0
    under ``ZERO_NONFINITE``, + l2·W under coupled decay), and ``any_bad`` with the tile's NaN/inf elements."""
    w = w_raw.to(tl.float32) * shrink
    g = g_raw.to(tl.float32) * gsign
    finite = tl.abs(g) <= FP32_MAX  # False for NaN
    any_bad = any_bad | (ok & ~finite)
    if ZERO_NONFINITE:
        g = tl.where(finite, g, 0.0)
    if l2 != 0:  # only L2 decay reads the weight: 0·W would make a NaN or infinite weight a NaN gradient
        g = g + l2 * w
    return w, g, any_bad


@triton.jit
def store_row_sums(ptr, x, row_ok, BR: tl.constexpr):
    """A (BR, BC/8, 8) tile's row sums into ``ptr[0 .. BR)``."""
    sums = tl.sum(tl.sum(x, axis=2, keep_dims=True), axis=1, keep_dims=True)
    tl.store(ptr + tl.arange(0, BR)[:, None, None], sums, mask=row_ok[:, None, None])


@triton.jit
def second_moment(g, rv, cv, ok, cap, beta2, row_sums_ptr, row_ok, BR: tl.constexpr):
    """This step's V from the old factors, and its elements capped (:func:`smmf.matrix.factor_sum_cap`), whose
    row sums go to ``row_sums_ptr`` (the tile's slot of the partial sums)."""
    v = beta2 * (rv[:, None, None] * cv) + (1.0 - beta2) * (g * g)
    v = tl.where(ok, v, 0.0)
    v_capped = tl.where(v > cap, cap, v)
    store_row_sums(row_sums_ptr, v_capped, row_ok, BR)
    return v, v_capped


@triton.jit
def capped_magnitude(mm, cap, row_sums_ptr, row_ok, BR: tl.constexpr):
    """|M| capped, whose row sums go to ``row_sums_ptr``: the paper's code's sums of |M| in V's view."""
    a = tl.abs(mm)
    a = tl.where(a > cap, cap, a)
    store_row_sums(row_sums_ptr, a, row_ok, BR)
    return a


@triton.jit
def write_weights(w_ptr, base, offs, ok, new_w, keys_ptr, t, start0, W_DTYPE: tl.constexpr):
    """The stepped weights, rounded to the param's dtype: to bf16 stochastically with the tensor's key
    (``keys[t]``, the host's ``StepConfig.rounding_key``; ``keys_ptr`` None: to nearest)."""
    if W_DTYPE == tl.bfloat16:
        if keys_ptr is not None:
            new_w = bf16_rounded(new_w, tl.load(keys_ptr + t), start0 + offs, True)
        else:
            new_w = bf16_rounded(new_w, 0, start0 + offs, False)
    tl.store(w_ptr + base + offs, new_w.to(W_DTYPE), mask=ok)


@triton.jit
def band_sums(part, acc, any_bad, bad_ptr, tiles, n, m, band, cols, col_ok):
    """The band's column sums of V (``acc``) into its slot of the tensor's partial sums (``part``), and its
    NaN/inf gradient elements added to ``bad`` (``bad_ptr`` None: not counted)."""
    tl.store(part + tiles * n + band * m + cols, tl.sum(acc, axis=0, keep_dims=True), mask=col_ok)
    if bad_ptr is not None:
        bad = tl.sum(row_sums(any_bad.to(tl.int32)), axis=0)
        tl.atomic_add(bad_ptr, bad, mask=bad > 0)


@triton.jit
def bit_scratch(row, WORDS_FIELD: tl.constexpr, words_ptr):
    """Where a tensor's int32 bit scratch starts (``words_ptr`` from the table's ``WORDS_FIELD`` on), for
    tensors whose rows are not whole bytes (``words_ptr`` not None)."""
    return words_ptr + tl.load(row + WORDS_FIELD)


@triton.jit
def m_factors(row, cols, col_ok, VECTOR: tl.constexpr, NATURAL: tl.constexpr, BC: tl.constexpr):
    """M's factors for a column tile: its row and column factors, the columns of M's view, and M's column
    factors at the tile's columns (M in V's view) or, under ``NATURAL``, 1 / :func:`natural_width` (each
    element's place in M's view is computed)."""
    row_m_ptr = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
    col_m_ptr = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
    if VECTOR:
        col_m_ptr = tl.multiple_of(col_m_ptr, 16)
    m_cols = tl.load(row + T_M_COLS)
    cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0) if not NATURAL else 0.0
    inv_width = 1.0 / natural_width(m_cols, BC).to(tl.float32) if NATURAL else 0.0
    return row_m_ptr, col_m_ptr, m_cols, cm, inv_width


@triton.jit
def m_estimate(row_ptr, col_ptr, cm, rows, row_ok, ok, start0, m, tile, m_cols, inv_width, NATURAL: tl.constexpr,
               BR: tl.constexpr, BC: tl.constexpr):
    """r cᵀ of a pair of M's factors at each element of a tile (:func:`m_factors`)."""
    m_row, m_col = natural_place(start0, m, tile, m_cols, inv_width, BR, BC) if NATURAL else (0, 0)
    return factor_product(row_ptr, col_ptr, cm, rows, row_ok, m_row, m_col, ok, NATURAL)
