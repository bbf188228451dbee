"""The block-levels code of M (``magnitude_bits=3``, :mod:`smmf.levels`) on CPU: one pass over M's rows.

M is coded by rows of the param in blocks of 128 elements, and a block's new scale is its largest new |M|,
so a block is walked twice, from L1: first every element's step (weight decay, the gradient, V from its
factors, M from its stored code, V's row and column sums) with M kept in a buffer and the block's largest |M|
found; then the codes written against the new scale. A row is walked in tiles of 8 blocks, each pass over
every block of the tile in turn. Blocks of M's rows run on threads; each keeps its own V column sums and the sums
of the V rows it touches (V's rows, in its square view, do not follow M's), added up after all have run. Each
line is the counterpart of :func:`smmf.functional._factored_update` under ``MomentumCode.LEVELS``
(tests/test_fused_kernels.py ties them).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numba
import numpy as np

from ...levels import BLOCK, NEGATIVE, SCALE_MAX, SEVENTH, TOP_LEVEL
from ...noise import DITHER_BITS
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .access import bf16_bits, hashed_i32, load, nearest_even, store
from .cache import FASTMATH, KERNEL_OPTIONS, cached_njit
from .elements import capped, count_bad, element
from .rows import finish_cols

_PASS: dict[str, Any] = dict(error_model="numpy", fastmath=FASTMATH)
# A row of M is walked in tiles of this many elements (8 blocks): every block's step first, then every block's codes,
# so that one block's chain to its codes (its largest |M|, the scale rounded to bf16, a division) overlaps the next
# blocks' steps instead of stalling the pass.
TILE = 8 * BLOCK


@numba.njit(inline="always")
def touched_v_rows(rows_per_block, cols, m):
    """At most this many rows of V's view hold elements of ``rows_per_block`` rows of M's (``cols`` each)."""
    return (rows_per_block * cols + m - 1) // m + 1


@numba.njit(inline="always")
def scale_value(bits, one):
    """A stored bf16 scale (its int16 bit pattern) in the work dtype (``one``'s)."""
    return one * np.uint32((np.uint32(bits) & np.uint32(0xFFFF)) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always")
def scale_bits(top):
    """The largest |M| of a block (finite, ≥ 0) rounded to bf16 through fp32, nearest even: its int16 bits."""
    return bf16_bits(nearest_even(np.float32(top).view(np.uint32)))


@functools.lru_cache(maxsize=None)
def level_table(dtype: Any) -> np.ndarray:
    """The numbers of the code in the work dtype, so that the kernel computes in it as the torch path does
    (numba would widen an fp32 times a Python number to fp64): ⅐, 7, 0.5 and the largest scale. Made once per
    dtype (the kernels only read it)."""
    return np.array([SEVENTH, TOP_LEVEL, 0.5, SCALE_MAX], dtype=dtype)


# Where each number lies in level_table's array.
_SEVENTH, _SEVEN, _HALF, _SCALE_MAX = 0, 1, 2, 3


@intrinsic
def dither_at(typingctx, base, offset):  # noqa: ARG001 - numba's intrinsic signature
    """:func:`smmf.noise.dither` of the element at index ``base + offset`` with the salt already in ``base``
    (salt + the index of a run's first element): a float32 in [0, 1) (exact in either work dtype), from
    :func:`~smmf.kernels.numba_cpu.access.hashed_i32`'s 32-bit lanes."""
    def codegen(context, builder, signature, args):
        x = hashed_i32(builder, args[0], args[1])
        top = builder.lshr(x, ir.Constant(ir.IntType(32), 32 - DITHER_BITS))  # < 2²⁴: exact as a float32
        return builder.fmul(builder.sitofp(top, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0 ** -DITHER_BITS))

    if not all(isinstance(t, types.Integer) and t.bitwidth >= 32 for t in (base, offset)):
        return None
    return types.float32(base, offset), codegen


@numba.njit(inline="always")
def level_of(a, inverse, offset, table):
    """The level j of |M| = ``a`` under a block's ``inverse`` = 7 / scale (scale > 0): floor(a·inverse + offset)
    ≤ 7 (``offset``: ½, or the dither in [0, 1)), 0 for NaN. Branch-free, so that the loop over a block
    vectorizes."""
    x = a * inverse + offset
    x = x if x == x else offset - offset  # NaN → level 0
    return np.uint8(min(x, table[_SEVEN]))  # in [0, 7]: truncation is the floor


def block_top(mbuf, table):
    """The largest |M| of a block (NaN counted as 0, at most the largest scale), by an integer
    maximum over the bit patterns of |M| (for non-negative floats their order is the values'; NaN's lie above
    inf's and are dropped): unlike a float maximum, which must keep NaN, the loop vectorizes. Typed by
    :func:`_overload_block_top`."""
    raise NotImplementedError("compiled only")


@overload(block_top, inline="always")
def _overload_block_top(mbuf, table):
    wide = mbuf.dtype == types.float64
    uint, float_ = (np.uint64, np.float64) if wide else (np.uint32, np.float32)
    magnitude = uint(0x7FFFFFFFFFFFFFFF) if wide else uint(0x7FFFFFFF)
    infinity = uint(0x7FF0000000000000) if wide else uint(0x7F800000)

    def top(mbuf, table):
        bits = mbuf.view(uint)
        best = uint(0)
        for j in range(bits.shape[0]):
            u = bits[j] & magnitude
            best = max(best, u if u <= infinity else uint(0))
        return min(uint(best).view(float_), table[_SCALE_MAX])

    return top


@numba.njit(inline="always")
def signed_level(code):
    """A 4-bit code's signed level ±j as a float32, exact in either work dtype (numba computes a uint8 times a
    float32, or an int32's negation, in 64-bit lanes: the loop took 1.3–4× as long per element)."""
    level = np.float32(code & np.uint8(TOP_LEVEL))
    return -level if code >= NEGATIVE else level


@numba.njit(inline="always")
def unpack_codes(codes_row, c0, width, signed_levels):
    """The 4-bit codes of columns ``c0 .. c0 + width`` (``c0`` even) as their signed levels ±j, in the work
    dtype (``signed_levels``'; a float loop over them vectorizes, one over bytes mixed with floats did not)."""
    src = codes_row[c0 >> 1 : (c0 + width + 1) >> 1]
    for q in range(src.shape[0]):
        signed_levels[2 * q] = signed_level(src[q] & np.uint8(15))
        signed_levels[2 * q + 1] = signed_level(src[q] >> np.uint8(4))


@numba.njit(inline="always")
def pack_codes(codes_row, c0, width, cbuf):
    """Inverse of :func:`unpack_codes`; a lone last code gets a zero high nibble."""
    if width & 1:
        cbuf[width] = 0
    dst = codes_row[c0 >> 1 : (c0 + width + 1) >> 1]
    for q in range(dst.shape[0]):
        dst[q] = cbuf[2 * q] | (cbuf[2 * q + 1] << np.uint8(4))


@numba.njit(**dict(_PASS, inline="always"))
def _run_step(wrun, grun, lrun, step, col_v, rv, acc_v, mrun, sc, zero_nonfinite):
    """Pass one over a run of a block that stays in one row of V's view (its row factor ``rv``, its column
    factors and sums ``col_v``/``acc_v`` from the run's first column; its stored signed levels ``lrun``, a
    level being worth ``step`` = scale·⅐): this step's M into ``mrun``, the weight stepped with it and V, V's
    capped sums into ``acc_v``. Returns its V row sum and whether every gradient element was finite. (A
    16-entry table of decoded values would save the multiply and select, but its gather stops LLVM from
    vectorizing the loop: 2.4× slower.)"""
    if sc.l2 != 0:
        return _run_step_with(wrun, grun, lrun, step, col_v, rv, acc_v, mrun, sc, zero_nonfinite, True)
    return _run_step_with(wrun, grun, lrun, step, col_v, rv, acc_v, mrun, sc, zero_nonfinite, False)


@numba.njit(**dict(_PASS, inline="always"))
def _run_step_with(wrun, grun, lrun, step, col_v, rv, acc_v, mrun, sc, zero_nonfinite, l2_decay):
    lr, beta1, rest1, eps, cap = sc.lr, sc.beta1, sc.rest1, sc.eps, sc.cap
    zero = sc.beta2 - sc.beta2
    keep_bad = not zero_nonfinite
    sum_v = zero
    any_bad = False
    for j in range(wrun.shape[0]):
        wj, gj, vj, finite = element(wrun[j], grun[j], col_v[j], rv, sc, keep_bad, zero, l2_decay)
        any_bad |= not finite
        mj = beta1 * (lrun[j] * step) + rest1 * gj
        mrun[j] = mj
        wrun[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
        vs = capped(vj, cap)
        acc_v[j] += vs
        sum_v += vs
    return sum_v, not any_bad


@numba.njit(**dict(_PASS, inline="always"))
def _block_step(wseg, gseg, lbuf, scale, table, col_v, row_v, acc_v, vsums, v_row0, start, mbuf, sc, zero_nonfinite):
    """Pass one over a block (elements ``start ..`` of the flattening; its stored codes as signed levels in
    ``lbuf``), in
    runs along rows of V's view (:func:`_run_step`); V's row sums into ``vsums`` (from V row ``v_row0``).
    Returns the block's largest |M| and whether every gradient element was finite."""
    m = col_v.shape[0]
    all_finite = True
    k = 0
    while k < wseg.shape[0]:
        i = (start + k) // m
        jv = start + k - i * m
        end = min(wseg.shape[0], k + m - jv)
        run_v, finite = _run_step(
            wseg[k:end], gseg[k:end], lbuf[k:end], scale * table[_SEVENTH], col_v[jv : jv + end - k], row_v[i],
            acc_v[jv : jv + end - k], mbuf[k:end], sc, zero_nonfinite)
        vsums[i - v_row0] += run_v
        all_finite &= finite
        k = end
    return block_top(mbuf, table), all_finite


@numba.njit(**dict(_PASS, inline="always"))
def _codes_of(cbuf, scale, table, mbuf, start, geo):
    """Pass two over a block (elements ``start ..`` of the flattening): each element's code against the
    block's new ``scale`` into ``cbuf``, its level the nearest or, under ``geo.dither``, rounded by the
    dither (a zero scale: every level 0)."""
    width = mbuf.shape[0]
    if scale > 0:
        inverse = table[_SEVEN] / scale
        if geo.dither:
            base = geo.salt + start
            for j in range(width):
                level = level_of(abs(mbuf[j]), inverse, dither_at(base, j), table)
                cbuf[j] = level | (np.uint8(NEGATIVE) if mbuf[j] < 0 else np.uint8(0))
            return
        for j in range(width):
            level = level_of(abs(mbuf[j]), inverse, table[_HALF], table)
            cbuf[j] = level | (np.uint8(NEGATIVE) if mbuf[j] < 0 else np.uint8(0))
    else:
        for j in range(width):
            cbuf[j] = np.uint8(NEGATIVE) if mbuf[j] < 0 else np.uint8(0)


@numba.njit(inline="always", **_PASS)
def _levels_step(w, g, codes, scales, table, row_v, col_v, col_acc_v, row_acc_v, bad_counts, geo, opts, sc):
    """One step under the levels code, in place: of a whole tensor, or (``opts.whole`` False) of an FSDP2
    shard's own rows of M, elements ``geo.lo ..`` of the param, leaving V's factor vectors holding this
    shard's raw row and column sums (0 for the rows it lacks) for the caller to add up across shards; M's
    code is the shard's own. ``w``, ``g``: flat, work dtype or the int16 bits of bf16; ``codes``: uint8
    (rows, ⌈cols/2⌉); ``scales``: the int16 bits of the bf16 scales (rows, ⌈cols/128⌉); ``table``:
    :func:`level_table`; ``row_v``/``col_v``: V's factors; per block of M rows: ``col_acc_v`` (blocks × m),
    ``row_acc_v`` (blocks × :func:`touched_v_rows`) and ``bad_counts``. Sums run in a fixed order for a
    given block layout (it depends on the thread count only)."""
    cols = geo.cols
    one = table[_SEVEN] / table[_SEVEN]  # 1 in the work dtype
    for b in numba.prange(bad_counts.shape[0]):
        first, end = b * geo.rows_per_block, min(geo.rows, (b + 1) * geo.rows_per_block)
        acc_v, vsums = col_acc_v[b], row_acc_v[b]
        acc_v[:] = 0
        vsums[:] = 0
        v_row0 = (geo.lo + first * cols) // geo.m
        mbuf = np.empty(TILE, dtype=col_v.dtype)
        wbuf = np.empty(TILE, dtype=np.uint32)
        gbuf = np.empty(TILE, dtype=np.uint32)
        cbuf = np.empty(TILE + 1, dtype=np.uint8)
        lbuf = np.empty(TILE + 1, dtype=col_v.dtype)
        tops = np.empty(TILE // BLOCK, dtype=col_v.dtype)
        bad = 0
        for r in range(first, end):
            for t0 in range(0, cols, TILE):
                start, tile_width = r * cols + t0, min(TILE, cols - t0)
                wseg = load(w, start, tile_width, wbuf)
                gseg = load(g, start, tile_width, gbuf)
                unpack_codes(codes[r], t0, tile_width, lbuf)
                for k0 in range(0, tile_width, BLOCK):  # each block's step and largest |M|
                    run = slice(k0, min(tile_width, k0 + BLOCK))
                    tops[k0 // BLOCK], all_finite = _block_step(
                        wseg[run], gseg[run], lbuf[run], scale_value(scales[r, (t0 + k0) // BLOCK], one), table,
                        col_v, row_v, acc_v, vsums, v_row0, geo.lo + start + k0, mbuf[run], sc, opts.zero_nonfinite)
                    if not all_finite:
                        bad += count_bad(gseg[run], sc.big)
                for k0 in range(0, tile_width, BLOCK):  # then each block's codes against its new scale
                    run = slice(k0, min(tile_width, k0 + BLOCK))
                    stored = scale_bits(tops[k0 // BLOCK])
                    scales[r, (t0 + k0) // BLOCK] = stored
                    _codes_of(cbuf[run], scale_value(stored, one), table, mbuf[run], geo.lo + start + k0, geo)
                pack_codes(codes[r], t0, tile_width, cbuf)
                store(w, start, wseg, opts.stochastic_rounding, opts.rounding_key + geo.lo + start)
        bad_counts[b] = bad
    # V's new factors from the blocks' sums (the old ones were read until here); a shard's raw sums.
    row_v[:] = 0
    for b in range(bad_counts.shape[0]):
        v_row0 = (geo.lo + b * geo.rows_per_block * cols) // geo.m
        for k in range(row_acc_v.shape[1]):
            if v_row0 + k < geo.n:
                row_v[v_row0 + k] += row_acc_v[b, k]
    finish_cols(row_v, col_v, col_acc_v, opts.whole)


# Arrays, then LevelsGeometry, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def _levels_kernel_parallel(w, g, codes, scales, table, row_v, col_v, col_acc_v, row_acc_v, bad_counts, geo, opts,
                            sc):
    _levels_step(w, g, codes, scales, table, row_v, col_v, col_acc_v, row_acc_v, bad_counts, geo, opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def _levels_kernel_serial(w, g, codes, scales, table, row_v, col_v, col_acc_v, row_acc_v, bad_counts, geo, opts, sc):
    _levels_step(w, g, codes, scales, table, row_v, col_v, col_acc_v, row_acc_v, bad_counts, geo, opts, sc)


LEVELS_KERNELS = {True: _levels_kernel_parallel, False: _levels_kernel_serial}


# ---- a piece of a param that may start and end inside blocks (a DeepSpeed ZeRO partition's): codes two per byte
# from the piece's first element, the scales of the blocks it touches. Its first and last blocks' scales are the
# largest |M| over every rank that holds a part of them, so their codes wait for the ranks' sums.


@numba.njit(inline="always")
def unpack_nibbles(codes, k, width, signed_levels):
    """:func:`unpack_codes` of the piece's elements ``k .. k + width`` (code of element k in nibble k)."""
    for j in range(width):
        q = k + j
        signed_levels[j] = signed_level((codes[q >> 1] >> np.uint8(4 * (q & 1))) & np.uint8(15))


@numba.njit(inline="always")
def pack_nibbles(codes, k, width, cbuf):
    """Inverse of :func:`unpack_nibbles`; the other nibble of a byte shared with a neighbour is kept."""
    for j in range(width):
        q = k + j
        shift = np.uint8(4 * (q & 1))
        codes[q >> 1] = np.uint8((codes[q >> 1] & ~(np.uint8(15) << shift)) | (cbuf[j] << shift))


@numba.njit(inline="always")
def piece_span(geo):
    """Blocks per row of M, and the first and last block (counted over the param, row by row) of the piece."""
    per_row = (geo.cols + BLOCK - 1) // BLOCK
    first = (geo.lo // geo.cols) * per_row + (geo.lo % geo.cols) // BLOCK
    return per_row, first, ((geo.hi - 1) // geo.cols) * per_row + ((geo.hi - 1) % geo.cols) // BLOCK


@numba.njit(inline="always")
def piece_block(b, per_row, geo):
    """Block ``b`` (counted over the param, row by row) clipped to the piece: its first element (in the param) and
    width."""
    r = b // per_row
    c0 = (b - r * per_row) * BLOCK
    start = max(r * geo.cols + c0, geo.lo)
    return start, min(r * geo.cols + min(c0 + BLOCK, geo.cols), geo.hi) - start


@numba.njit(inline="always", **_PASS)
def _levels_piece_step(w, g, codes, scales, table, row_v, col_v, acc_v, vsums, ends_m, ends_top, bad_counts, geo,
                       opts, sc):
    """One step of a piece (elements ``geo.lo .. geo.hi`` of the param) under the levels code, serial: every block
    it touches as :func:`_levels_step` steps it (the same element math), except that the first and last blocks'
    M and largest |M| go to ``ends_m`` (2 × BLOCK) and ``ends_top`` (2) for :func:`_levels_piece_ends` to code once
    ranks have added their maxima. V's factor vectors are left with the piece's raw row and column sums (``vsums``:
    the V rows it touches, from ``lo // m``; ``acc_v``: m). ``codes``: the piece's, element ``lo + k`` in nibble
    k; ``scales``: the int16 bits of the scales of the blocks it touches, from its first."""
    one = table[_SEVENTH] / table[_SEVENTH]
    per_row, first, last = piece_span(geo)
    acc_v[:] = 0
    vsums[:] = 0
    v_row0 = geo.lo // geo.m
    mbuf = np.empty(BLOCK, dtype=col_v.dtype)
    wbuf = np.empty(BLOCK, dtype=np.uint32)
    gbuf = np.empty(BLOCK, dtype=np.uint32)
    cbuf = np.empty(BLOCK + 1, dtype=np.uint8)
    lbuf = np.empty(BLOCK + 1, dtype=col_v.dtype)
    bad = 0
    for b in range(first, last + 1):
        start, width = piece_block(b, per_row, geo)
        k = start - geo.lo
        wseg = load(w, k, width, wbuf)
        gseg = load(g, k, width, gbuf)
        unpack_nibbles(codes, k, width, lbuf)
        top, all_finite = _block_step(wseg, gseg, lbuf, scale_value(scales[b - first], one), table, col_v, row_v,
                                      acc_v, vsums, v_row0, start, mbuf[:width], sc, opts.zero_nonfinite)
        if not all_finite:
            bad += count_bad(gseg, sc.big)
        if b == first or b == last:
            for end in range(2):
                if b == (first, last)[end]:
                    for j in range(width):
                        ends_m[end, j] = mbuf[j]
                    ends_top[end] = top
        else:
            stored = scale_bits(top)
            scales[b - first] = stored
            _codes_of(cbuf[:width], scale_value(stored, one), table, mbuf[:width], start, geo)
            pack_nibbles(codes, k, width, cbuf)
        store(w, k, wseg, opts.stochastic_rounding, opts.rounding_key + start)
    bad_counts[0] = bad
    row_v[:] = 0
    for k in range(vsums.shape[0]):
        row_v[v_row0 + k] = vsums[k]
    for j in range(col_v.shape[0]):
        col_v[j] = acc_v[j]


@numba.njit(inline="always", **_PASS)
def _levels_piece_ends(codes, scales, table, ends_m, tops, geo):
    """The codes and scales of the piece's first and last blocks, their scales from ``tops``: each block's
    largest |M| over every rank that holds a part of it."""
    one = table[_SEVENTH] / table[_SEVENTH]
    per_row, first, last = piece_span(geo)
    cbuf = np.empty(BLOCK + 1, dtype=np.uint8)
    for end in range(2 if last > first else 1):
        b = (first, last)[end]
        start, width = piece_block(b, per_row, geo)
        stored = scale_bits(tops[end])
        scales[b - first] = stored
        _codes_of(cbuf[:width], scale_value(stored, one), table, ends_m[end, :width], start, geo)
        pack_nibbles(codes, start - geo.lo, width, cbuf)


# Arrays, then PieceGeometry, Options, Scalars; the ends' arrays, then PieceGeometry.
@cached_njit(**KERNEL_OPTIONS)
def levels_piece_kernel(w, g, codes, scales, table, row_v, col_v, acc_v, vsums, ends_m, ends_top, bad_counts, geo,
                        opts, sc):
    _levels_piece_step(w, g, codes, scales, table, row_v, col_v, acc_v, vsums, ends_m, ends_top, bad_counts, geo,
                       opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def levels_piece_ends_kernel(codes, scales, table, ends_m, tops, geo):
    _levels_piece_ends(codes, scales, table, ends_m, tops, geo)
