"""The Triton finish kernels: the factors from the step kernel's partial sums, in a fixed order, and
under the magnitude flag its new factors and gains into the state."""

from __future__ import annotations

import triton
import triton.language as tl

from .table import (
    META_COLUMNS,
    T_SIGN_M,
    T_ROW_M,
    T_COL_M,
    T_ROW_V,
    T_COL_V,
    T_N,
    T_M,
    T_TILES,
    T_BANDS,
    T_PARTIAL_AT,
    T_WORDS_AT,
    T_LO,
    T_HI,
    T_M_COLS,
    T_M_ROWS,
    T_M_TILES,
    T_M_BANDS,
    T_M_PARTIAL_AT,
    T_FLAG_M,
    T_FLAG_GAINS_M,
    T_NEW_M_AT,
    T_GAIN_SUMS_AT,
    T_FLAG_WORDS_AT,
)
from .tiles import copy_bytes


@triton.jit
def finish_kernel(meta_ptr, partial_ptr, words_ptr, BLOCK: tl.constexpr, KB: tl.constexpr,
                  COPIERS: tl.constexpr, COPY_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, FIRST: tl.constexpr,
                  MOMENTS: tl.constexpr, TO_SCRATCH: tl.constexpr, FLAG: tl.constexpr):
    """Program (t, j < MOMENTS) finishes tensor t's moment FIRST + j: 0 is V, 1 is M (in M's own
    view, ``T_M_COLS`` .. ``T_M_PARTIAL_AT``): row factor = Σ over tiles (0 for rows without elements lo ..
    hi), column factor = Σ over bands / total (0 total → divide by 1, as ``nnmf_from_sums``; not
    divided unless ``NORMALIZE``), in a fixed order, KB partials at a time; into the state, or with
    ``TO_SCRATCH`` into the partial buffer at ``T_NEW_M_AT`` (the magnitude flag's new factors, which the
    step kernel encodes against while it still decodes with the old ones). Programs (t, MOMENTS …)
    copy an unaligned tensor's sign scratch (and under ``FLAG`` its flag scratch) over its bytes.
    Divisions here are IEEE (``div_rn``): a total near the float32 maximum is a legal factor sum (each
    element's share is capped, not the total), and the GPU's fast division returns 0 for divisors
    above 2^126."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    n = tl.load(row + T_N)
    m = tl.load(row + T_M)
    tiles = tl.load(row + T_TILES)
    bands = tl.load(row + T_BANDS)
    lo = tl.load(row + T_LO)
    hi = tl.load(row + T_HI)
    kk = tl.arange(0, KB)[:, None]
    if j < MOMENTS:
        moment = FIRST + j
        if moment == 1:  # M's view: V's unless momentum_shape="natural"
            n = tl.load(row + T_M_ROWS)
            m = tl.load(row + T_M_COLS)
            tiles = tl.load(row + T_M_TILES)
            bands = tl.load(row + T_M_BANDS)
            at = tl.load(row + T_M_PARTIAL_AT)
        else:
            at = tl.load(row + T_PARTIAL_AT)
        row0 = lo // m
        row_end = (hi + m - 1) // m
        if TO_SCRATCH:
            rows_out = partial_ptr + tl.load(row + T_NEW_M_AT)
            cols_out = rows_out + n
        else:
            rows_out = tl.load(row + T_ROW_V - (T_ROW_V - T_ROW_M) * moment).to(tl.pointer_type(tl.float32))  # row_v, or row_m
            cols_out = tl.load(row + T_COL_V - (T_COL_V - T_COL_M) * moment).to(tl.pointer_type(tl.float32))  # col_v, or col_m
        rows_part = partial_ptr + at
        cols_part = partial_ptr + at + tiles * n
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for r0 in range(0, n, BLOCK):
            idx = r0 + tl.arange(0, BLOCK)[None, :]
            s = tl.zeros((KB, BLOCK), dtype=tl.float32)
            for k0 in range(0, tiles, KB):
                held = (idx >= row0) & (idx < row_end)
                s += tl.load(rows_part + (k0 + kk) * n + idx, mask=held & (k0 + kk < tiles), other=0.0)
            row_sum = tl.sum(s, axis=0)
            tl.store(rows_out + r0 + tl.arange(0, BLOCK), row_sum, mask=r0 + tl.arange(0, BLOCK) < n)
            total += row_sum
        grand = tl.sum(total, axis=0)
        grand = tl.where(grand > 0, grand, 1.0) if NORMALIZE else 1.0
        for c0 in range(0, m, BLOCK):
            idx = c0 + tl.arange(0, BLOCK)[None, :]
            s = tl.zeros((KB, BLOCK), dtype=tl.float32)
            for b0 in range(0, bands, KB):
                s += tl.load(cols_part + (b0 + kk) * m + idx, mask=(idx < m) & (b0 + kk < bands), other=0.0)
            tl.store(cols_out + c0 + tl.arange(0, BLOCK), tl.math.div_rn(tl.sum(s, axis=0), grand),
                     mask=c0 + tl.arange(0, BLOCK) < m)
    elif (m % 8 != 0) | (lo % 8 != 0):
        nbytes = (hi - lo + 7) // 8
        copy_bytes(tl.load(row + T_SIGN_M).to(tl.pointer_type(tl.uint8)), words_ptr + tl.load(row + T_WORDS_AT), nbytes,
                    j - MOMENTS, COPIERS, COPY_BLOCK)
        if FLAG:
            copy_bytes(tl.load(row + T_FLAG_M).to(tl.pointer_type(tl.uint8)), words_ptr + tl.load(row + T_FLAG_WORDS_AT), nbytes,
                        j - MOMENTS, COPIERS, COPY_BLOCK)


@triton.jit
def flag_finish_kernel(meta_ptr, partial_ptr, BLOCK: tl.constexpr):
    """Program t, under the magnitude flag, after the finish kernel: tensor t's new factors of |M|
    (``T_NEW_M_AT``: in the partial buffer) into its state, and its gains h, l from the step
    kernel's per-work-item sums (``T_GAIN_SUMS_AT``), added in a fixed order: h = Σ_F |M|·R / Σ_F R², likewise
    l over ¬F (0 where the denominator is 0; :func:`smmf.functional.flag_gains`)."""
    t = tl.program_id(0)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    m_cols = tl.load(row + T_M_COLS)
    factors = tl.load(row + T_M_ROWS) + m_cols  # the new row factors, then the column factors
    new = partial_ptr + tl.load(row + T_NEW_M_AT)
    row_m = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
    col_m = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
    for i0 in range(0, factors, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        value = tl.load(new + idx, mask=idx < factors)
        tl.store(row_m + idx, value, mask=idx < factors - m_cols)
        tl.store(col_m + idx - (factors - m_cols), value, mask=(idx >= factors - m_cols) & (idx < factors))
    items = tl.load(row + T_TILES) * tl.load(row + T_BANDS)
    sums = partial_ptr + tl.load(row + T_GAIN_SUMS_AT)
    slot = tl.arange(0, 2)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # (level, fit | energy)
    acc = tl.zeros((BLOCK, 2, 2), dtype=tl.float32)
    for i0 in range(0, items, BLOCK):
        item = i0 + tl.arange(0, BLOCK)[:, None, None]
        acc += tl.load(sums + item * 4 + slot, mask=item < items, other=0.0)
    by_level = tl.sum(acc, axis=0)
    kind = tl.arange(0, 2)[None, :]
    fit = tl.sum(tl.where(kind == 0, by_level, 0.0), axis=1)
    energy = tl.sum(tl.where(kind == 1, by_level, 0.0), axis=1)
    levels = tl.where(energy > 0, tl.math.div_rn(fit, tl.where(energy > 0, energy, 1.0)), 0.0)
    tl.store(tl.load(row + T_FLAG_GAINS_M).to(tl.pointer_type(tl.float32)) + tl.arange(0, 2), levels)
