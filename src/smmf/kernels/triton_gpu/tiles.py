"""Pieces the Triton kernels share: this step's M from the stored code, the NaN/cap guard, rounding to
bf16, packing sign bits into int32 words, a program's work item, copying the bit scratch back."""

from __future__ import annotations

import triton
import triton.language as tl

from ...noise import HASH_MULTIPLIERS
from .table import META_COLUMNS, T_COL_V, T_G, T_HI, T_LO, T_M, T_N, T_ROW_V, T_W

HASH_MUL0, HASH_MUL1 = tl.constexpr(HASH_MULTIPLIERS[0]), tl.constexpr(HASH_MULTIPLIERS[1])


@triton.jit
def momentum(g, sign_bits, flag_bits, magnitude, high, low, beta1, FLAG: tl.constexpr):
    """This step's M from the stored code: β1·(±r·c, times the flag's level under ``FLAG``) + (1 − β1)·G.
    One expression for both kernels that form M, so they form the same bits."""
    if FLAG:
        magnitude = magnitude * tl.where(flag_bits != 0, high, low)
    return beta1 * (magnitude * (sign_bits.to(tl.float32) * 2.0 - 1.0)) + (1.0 - beta1) * g


@triton.jit
def finite_or_cap(x, cap):
    """NaN → 0, above ``cap`` → ``cap`` (:func:`smmf.functional.magnitude_flag_fit`)."""
    x = tl.where(x != x, 0.0, x)
    return tl.where(x > cap, cap, x)


@triton.jit
def hash32(x):
    """:func:`smmf.noise.mix32` (two multiply-xorshift rounds) of uint32 ``x``: its products wrap mod 2³²,
    as the torch path's masks make them. A few instructions, where Philox (``tl.randint``) takes ten rounds."""
    x ^= x >> 16
    x *= tl.full((), HASH_MUL0, tl.uint32)
    x ^= x >> 15
    x *= tl.full((), HASH_MUL1, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def hash_at(base, index):
    """:func:`hash32` of (``base`` + ``index``) mod 2³², the numba kernel's ``hash32_at``."""
    return hash32((base + index).to(tl.uint32))


@triton.jit
def tensor_key(keys_ptr, t, STOCHASTIC_ROUNDING: tl.constexpr):
    """Tensor ``t``'s key for :func:`bf16_rounded` at this step, ``keys[t]`` (the host's
    ``StepConfig.rounding_key``); nothing is read, and 0 returned, without ``STOCHASTIC_ROUNDING``."""
    if STOCHASTIC_ROUNDING:
        return tl.load(keys_ptr + t)
    else:
        return 0


@triton.jit
def bf16_rounded(x, key, offsets, STOCHASTIC_ROUNDING: tl.constexpr):
    """fp32 ``x`` rounded to bf16 in the bits, so that every Triton target (and the interpreter) rounds
    alike: add noise below the kept 16 bits (``STOCHASTIC_ROUNDING``: the top 16 bits of :func:`hash32` of the
    tensor's ``key`` + the element's index in the whole tensor, the formula of every path) or half an ulp
    to even (nearest), then truncate; NaN stays NaN. Returns fp32 values that bf16 holds exactly."""
    ubits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC_ROUNDING:
        ubits += hash_at(key, offsets) >> 16
    else:
        ubits += 0x7FFF + ((ubits >> 16) & 1)
    rounded = (ubits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def or_bits(words, bits, rows, tile, m, held_lo, row_ok, BR: tl.constexpr, BC: tl.constexpr):
    """OR a tile's 0/1 ``bits`` (BR, BC/8, 8) into the int32 ``words`` that hold the bits of elements
    lo .. hi: bits of row i, columns [c, c + 32) land at bits start + [0, 32), i.e. in two words."""
    start = rows.to(tl.int64) * m + tile * BC - held_lo  # may be < 0 before lo: those bits are 0, never written
    off = (start & 31).to(tl.int32)
    lane = tl.arange(0, 32)[None, None, :] + off[:, None, None]
    shifted = tl.reshape(bits, (BR, BC // 32, 32)).to(tl.int64) << (lane & 31).to(tl.int64)
    low_word = tl.sum(tl.where(lane < 32, shifted, 0), axis=2).to(tl.int32)
    high_word = tl.sum(tl.where(lane >= 32, shifted, 0), axis=2).to(tl.int32)
    word = (start >> 5)[:, None] + tl.arange(0, BC // 32)[None, :]
    group_ok = row_ok[:, None] & (tile * BC + tl.arange(0, BC // 32)[None, :] * 32 < m)
    tl.atomic_or(words + word, low_word, mask=group_ok & (low_word != 0))
    tl.atomic_or(words + word + 1, high_word, mask=group_ok & (high_word != 0))


@triton.jit
def work_item(meta_ptr, item_tensor_ptr, TILES: tl.constexpr, FIRST_ITEM: tl.constexpr):
    """This program's work item: its tensor (index and row of the table), and its index, band and
    column tile among that tensor's ``tiles`` (table columns TILES and FIRST_ITEM: V's view, or M's)."""
    item = tl.program_id(0)
    t = tl.load(item_tensor_ptr + item)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    tiles = tl.load(row + TILES)
    local = item - tl.load(row + FIRST_ITEM)
    return t, row, tiles, local, local // tiles, local % tiles


@triton.jit
def v_span(row):
    """A table row's n×m view of V and the elements lo .. hi of it that the weight and gradient hold."""
    return tl.load(row + T_N), tl.load(row + T_M), tl.load(row + T_LO), tl.load(row + T_HI)


@triton.jit
def tensor_pointers(row, W_DTYPE: tl.constexpr):
    """A table row's weight and gradient (of the launch's dtype) and V's row and column factors (fp32)."""
    return (tl.load(row + T_W).to(tl.pointer_type(W_DTYPE)), tl.load(row + T_G).to(tl.pointer_type(W_DTYPE)),
            tl.load(row + T_ROW_V).to(tl.pointer_type(tl.float32)), tl.load(row + T_COL_V).to(tl.pointer_type(tl.float32)))


@triton.jit
def copy_bytes(dst, words, nbytes, copier, COPIERS: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """Copier ``copier`` of COPIERS: its share of the bytes of an int32 bit scratch over ``dst``."""
    scratch = words.to(tl.pointer_type(tl.uint8), bitcast=True)
    for b0 in range(copier * COPY_BLOCK, nbytes, COPIERS * COPY_BLOCK):
        idx = b0 + tl.arange(0, COPY_BLOCK)
        tl.store(dst + idx, tl.load(scratch + idx, mask=idx < nbytes), mask=idx < nbytes)


@triton.jit
def row_sums(x):
    """A (BR, BC/8, 8) tile's sums per row."""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def byte_geometry(base, start0, held_lo, held_hi, m32, tile, row_ok, SHARD: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr):
    """Where a (BR, BC/8, 8) tile's sign bytes lie when its rows are whole bytes (ALIGNED): one per (row,
    byte) of the tile, from the element ``base`` of the bits held; and which of them it holds."""
    BB: tl.constexpr = BC // 8
    r_idx = tl.arange(0, BR)[:, None, None]
    byte_offs = (base >> 3) + r_idx * (m32 // 8) + (tile * BB).to(tl.int32) + tl.arange(0, BB)[None, :, None]
    byte_col = tl.arange(0, BB)[None, :, None] * 8 + (tile * BC).to(tl.int32)
    byte_ok = row_ok[:, None, None] & (byte_col < m32)
    if SHARD:
        byte_elem = r_idx * m32 + byte_col  # the byte's first element, from start0
        byte_ok = byte_ok & (byte_elem >= held_lo - start0) & (byte_elem < held_hi - start0)
    return byte_offs, byte_ok


@triton.jit
def unpack_bits(ptr, byte_offs, byte_ok, k, ok, ALIGNED: tl.constexpr):
    """A tile's packed bits (signs or flags) as 0/1, by whole bytes (``ALIGNED``) or bit by bit at the
    held elements ``k``."""
    if ALIGNED:
        bits = (tl.load(ptr + byte_offs, mask=byte_ok, other=0) >> tl.arange(0, 8)[None, None, :].to(tl.uint8)) & 1
    else:
        bits = (tl.load(ptr + (k >> 3), mask=ok, other=0) >> (k & 7).to(tl.uint8)) & 1
    return bits


@triton.jit
def pack_bits(ptr, words, values, byte_offs, byte_ok, rows, tile, m, held_lo, row_ok, ALIGNED: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr):
    """Store a tile's 0/1 int32 ``values`` as packed bits: whole bytes (``ALIGNED``), or ORed into the
    int32 scratch ``words`` (:func:`or_bits`) that the finish kernel copies back."""
    if ALIGNED:
        bit = tl.arange(0, 8)[None, None, :]
        tl.store(ptr + byte_offs, tl.sum(values << bit, axis=2, keep_dims=True).to(tl.uint8), mask=byte_ok)
    else:
        or_bits(words, values, rows, tile, m, held_lo, row_ok, BR, BC)


@triton.jit
def natural_place(start0, m, tile, m_cols, inv_width, BR: tl.constexpr, BC: tl.constexpr):
    """Each element's row and column in M's own view, ``m_cols`` wide, for a (BR, BC/8, 8) tile whose row i
    starts at element ``start0 + i·m + tile·BC`` of the tensor; ``inv_width`` is
    1 / :func:`natural_width`. One 64-bit division per tile row (one per element is a call of ~80 machine
    instructions). A tile row's elements up to the end of M's row hold it; the rest, fewer than BC, lie
    in the following rows, placed by a float division that is exact for such small integers."""
    BB: tl.constexpr = BC // 8
    first = start0 + tl.arange(0, BR).to(tl.int64) * m + tile * BC
    row0 = first // m_cols
    col0 = first - row0 * m_cols  # < m_cols
    to_next = tl.minimum(m_cols - col0, BC).to(tl.int32)[:, None, None]  # the row's elements before M's next row
    local = tl.arange(0, BB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # (1, BB, 8), < BC
    past = local - to_next  # ≥ 0: this many elements into the rows after row0, < BC
    # past // width: (past + ½) / width is a quotient plus at least ½ / width ≥ 1/(4·BC) from the next integer
    rows_on = tl.floor((past.to(tl.float32) + 0.5) * inv_width).to(tl.int32)
    wrap = past >= 0
    m_row = row0[:, None, None] + tl.where(wrap, rows_on + 1, 0).to(tl.int64)
    m_col = tl.where(wrap, (past - rows_on * natural_width(m_cols, BC)).to(tl.int64), col0[:, None, None] + local)
    return m_row, m_col


@triton.jit
def natural_width(m_cols, BC: tl.constexpr):
    """M's row width as :func:`natural_place` divides by it: the width, or 2·BC for rows wider than that (more
    than any ``past``, so the quotient stays 0 and the remainder ``past``)."""
    return tl.minimum(m_cols, 2 * BC).to(tl.int32)


@triton.jit
def factor_product(row_ptr, col_ptr, col_values, rows, row_ok, m_row, m_col, ok, NATURAL: tl.constexpr):
    """r cᵀ at each element of a tile: by the tile's rows and its loaded column factors, or under ``NATURAL``
    by each element's row and column in M's own view (:func:`natural_place`)."""
    if NATURAL:
        product = tl.load(row_ptr + m_row, mask=ok, other=0.0) * tl.load(col_ptr + m_col, mask=ok, other=0.0)
    else:
        product = tl.load(row_ptr + rows, mask=row_ok, other=0.0)[:, None, None] * col_values
    return product


@triton.jit
def flag_fit(a, estimate, ok, cap):
    """The magnitude flag's encoding of |M| = ``a`` against the new estimate R: the flag F = [a > R], and
    the four least-squares sums Σ_F a·R, Σ_F R², Σ_¬F a·R, Σ_¬F R² of each row of the tile (each element's
    share capped). By rows: a row's sum stays within its warp, where the tile's would cross warps through
    shared memory on every tile."""
    above = (a > estimate) & ok
    fit = tl.where(ok, finite_or_cap(a * estimate, cap), 0.0)
    energy = tl.where(ok, finite_or_cap(estimate * estimate, cap), 0.0)
    return (above, row_sums(tl.where(above, fit, 0.0)), row_sums(tl.where(above, energy, 0.0)),
            row_sums(tl.where(above, 0.0, fit)), row_sums(tl.where(above, 0.0, energy)))
