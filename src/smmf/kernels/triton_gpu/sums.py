"""|M|'s partial row and column sums in M's own view, from the state before the step: what the natural shape of M
(:mod:`.sign` under ``NATURAL``) and the magnitude flag (:mod:`.flag`) need before their step kernel runs."""

from __future__ import annotations

import triton
import triton.language as tl

from .table import (FP32_MAX, T_COL_M, T_FIRST_SUMS_ITEM, T_FLAG_M, T_G, T_HI, T_FLAG_GAINS_M, T_LO, T_M,
                    T_M_COLS, T_M_PARTIAL_AT, T_M_ROWS, T_M_TILES, T_N, T_ROW_M, T_SIGN_M, T_W)
from .tiles import momentum, unpack_bits, work_item


@triton.jit
def momentum_sums_kernel(meta_ptr, item_tensor_ptr, partial_ptr, beta1, gsign, shrink, l2, W_DTYPE: tl.constexpr,
                         ZERO_NONFINITE: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         BAND: tl.constexpr):
    """|M|'s partial row and column sums in M's own view (``momentum_shape="natural"``, and every
    view under the magnitude flag, whose encoding needs the new factors first), one work item per
    (band, column tile) of the rows that hold elements lo .. hi (all, or an FSDP2 shard's), from the
    state before the step: this step's M formed as the step kernel forms it, which then only reads M's
    factors. Runs first: the step kernel rewrites the weights and the sign (and flag) bits. ``FLAG``: M is
    decoded with the flag's bits and gains too."""
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
        gains_ptr = tl.load(row + T_FLAG_GAINS_M).to(tl.pointer_type(tl.float32))
        high = tl.load(gains_ptr)
        low = tl.load(gains_ptr + 1)
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
