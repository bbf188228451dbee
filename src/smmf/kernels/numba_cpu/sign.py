"""The paper's code of M on CPU (``MomentumCode.SIGN``, and its natural shape): one pass over the n×m view of V,
parallel over blocks of rows. Each element's gradient, weight and sign bit are read once, M̂ and V̂ are rebuilt
from the factors on the fly, the weight and the sign bit are written in place, and the row and column sums of |M|
(in M's own view) and V (the next factors) are accumulated as the pass goes. Its state arrays come in the step
schema's order (:data:`smmf.schema.SCHEMA`): ``row_m, col_m, sign_m, row_v, col_v``.
"""

from __future__ import annotations

import numba
import numpy as np

from .access import byte_span, load, pack_bytes, prefetch_lines, store, unpack_bytes
from .cache import KERNEL_OPTIONS, cached_njit
from .elements import run_pair_with_momentum, run_with_momentum
from .rows import (COLUMN_TILE, PASS, PREFETCH, block_rows, finish_cols, finish_v, first_m_row, gather_m_rows, m_run,
                   segment)


@numba.njit(inline="always", **PASS)
def _pairs_next(i, end_row, start, width, col0, c0, here, geo):
    """Whether row ``i``'s segment (from element ``start``, ``here`` in the arrays) pairs with the next row's:
    with M in V's view (the paper's code) two rows' segments of a tile go through one loop
    (:func:`~smmf.kernels.numba_cpu.elements.run_pair_with_momentum`) where both are whole (not cut by a
    shard's ends) and their sign bits share no byte (whole rows in one tile: one span of bits). Which rows pair
    depends on the block and the shard's ends, and a paired row's sums may differ from an unpaired one's in the
    last bit (fastmath reassociates them): still a fixed order for a given block layout."""
    m = geo.m
    return (geo.m_cols == m and i + 1 < end_row and col0 == c0 and start + m + width <= geo.hi
            and (width == m or (here + width - 1) >> 3 < (here + m) >> 3))


@numba.njit(inline="always", **PASS)
def _pair(w, g, sign_m, here, width, together, m, wbuf1, gbuf1, lanes, lanes1):
    """The second row's segment of a pair (elements ``here + m ..``), loaded, and the two segments' bits unpacked:
    one span of bytes for two whole rows in one tile, else two. Returns the second segment's weights and
    gradients, the bytes and count of each span, and where each segment's bits start in its unpacked lanes."""
    wseg1 = load(w, here + m, width, wbuf1)
    gseg1 = load(g, here + m, width, gbuf1)
    first, count, offset = byte_span(here, 2 * width if together else width)
    unpack_bytes(sign_m, first, count, lanes)
    if together:
        first1, count1, offset1 = first, count, offset + width
    else:
        first1, count1, offset1 = byte_span(here + m, width)
        unpack_bytes(sign_m, first1, count1, lanes1)
    return wseg1, gseg1, first, count, offset, first1, count1, offset1


@numba.njit(inline="always", **PASS)
def _rows_pass(w, g, row_m, col_m, sign_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc):
    """Rows ``first_row .. end_row`` of V's n×m view (one thread): the weights and sign bits in place, the
    rows' new V sums into ``row_v``, the column sums into ``acc_m``/``acc_v`` and the sums of the rows of M's
    own view that these elements touch into ``msums``, from :func:`first_m_row` on (all zeroed here); returns
    the NaN/inf gradient elements met. M's row factors are only read: the caller adds up ``msums`` of every
    block once all have run. Only the elements ``lo .. hi`` of the row-major flattening are there (an FSDP2
    shard's, whose first and last rows may be partial): ``w``, ``g`` and the sign bits start at element ``lo``."""
    m, m_cols = geo.m, geo.m_cols
    # A segment's sign bits span at most tile // 8 + 2 bytes (two whole rows' in one tile: 2·tile // 8 + 2),
    # unpacked with their whole first and last bytes: the neighbours' bits go back unchanged (same thread).
    tile = min(m, COLUMN_TILE)
    acc_v[:] = 0
    acc_m[:] = 0
    msums[:] = 0
    m_row0 = first_m_row(first_row, m, m_cols)
    sums_v = np.zeros(end_row - first_row, dtype=row_v.dtype)  # V's row sums over the tiles (row_v read till then)
    wbuf, gbuf = np.empty(tile, dtype=np.uint32), np.empty(tile, dtype=np.uint32)
    wbuf1, gbuf1 = np.empty(tile, dtype=np.uint32), np.empty(tile, dtype=np.uint32)  # a pair's second row's
    lanes = np.empty(2 * tile // 8 + 2, dtype=np.uint64)  # two whole rows' bits when m <= tile
    lanes1 = np.empty(tile // 8 + 2, dtype=np.uint64)  # the second row's, when rows span tiles
    bits, bits1 = lanes.view(np.uint8), lanes1.view(np.uint8)
    bad = 0
    for c0 in range(0, m, tile):
        i = first_row
        while i < end_row:
            start, width, col0, here = segment(i, c0, tile, geo)
            if width <= 0:
                i += 1
                continue
            together = width == m
            rows = 2 if _pairs_next(i, end_row, start, width, col0, c0, here, geo) else 1
            for ahead in range(rows, 2 * rows):  # the next rows' segments start new streams: start them early
                if i + ahead < end_row:
                    prefetch_lines(w, here + ahead * m, min(width, PREFETCH))
                    prefetch_lines(g, here + ahead * m, min(width, PREFETCH))
            wseg = load(w, here, width, wbuf)
            gseg = load(g, here, width, gbuf)
            wseg1 = wseg
            if rows == 2:
                wseg1, gseg1, first, count, offset, first1, count1, offset1 = _pair(
                    w, g, sign_m, here, width, together, m, wbuf1, gbuf1, lanes, lanes1)
                row_bits1 = bits if together else bits1
                run_m, run_v, run_m1, run_v1, run_bad = run_pair_with_momentum(
                    wseg, gseg, bits[offset : offset + width], wseg1, gseg1, row_bits1[offset1 : offset1 + width],
                    col_m[col0 : col0 + width], col_v[col0 : col0 + width], acc_m[col0 : col0 + width],
                    acc_v[col0 : col0 + width], row_m[i], row_v[i], row_m[i + 1], row_v[i + 1], sc,
                    opts.zero_nonfinite)
                pack_bytes(sign_m, first, count, lanes)
                if not together:
                    pack_bytes(sign_m, first1, count1, lanes1)
                msums[i - m_row0] += run_m
                msums[i + 1 - m_row0] += run_m1
                sums_v[i - first_row] += run_v
                sums_v[i + 1 - first_row] += run_v1
                bad += run_bad
            else:
                first, count, offset = byte_span(here, width)
                unpack_bytes(sign_m, first, count, lanes)
                # The segment in runs along one row of M's view (one run when it is V's).
                sum_v = sc.beta2 - sc.beta2  # 0 in the work dtype
                k = start
                while k < start + width:
                    m_row, m_col, j0, j1 = m_run(k, start, width, m_cols)
                    run_m, run_v, run_bad = run_with_momentum(
                        wseg[j0:j1], gseg[j0:j1], bits[offset + j0 : offset + j1],
                        col_m[m_col : m_col + j1 - j0], col_v[col0 + j0 : col0 + j1],
                        acc_m[m_col : m_col + j1 - j0], acc_v[col0 + j0 : col0 + j1], row_m[m_row], row_v[i],
                        sc, opts.zero_nonfinite)
                    msums[m_row - m_row0] += run_m
                    sum_v += run_v
                    bad += run_bad
                    k = start + j1
                pack_bytes(sign_m, first, count, lanes)
                sums_v[i - first_row] += sum_v
            for row in range(rows):  # one call of store: inlined twice, numba's SSA check warns on its branches
                store(w, here + row * m, wseg1 if row else wseg, opts.stochastic_rounding,
                      opts.rounding_key + start + row * m)
            i += rows
    row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", **PASS)
def _step(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc):
    """One step of one n×m matrix under the paper's code, in place; or of the elements ``lo .. hi`` of its
    row-major flattening that a shard holds (``opts.whole`` False: the four factor vectors are left holding this
    piece's raw row and column sums, 0 for the rows it lacks, for the caller to add up across shards).

    ``w``, ``g``: the weight and gradient, elements lo .. hi, flat: work dtype, or int16 bit patterns
    of bf16 (:func:`~smmf.kernels.numba_cpu.access.load`/``store`` convert); w is read and written,
    g only read.

    Invariants: every block starts on a byte of the sign bits (rows_per_block·m and, with more than
    one block, row0·m − lo are multiples of 8), so no two threads write one byte; sums run in a
    fixed order for a given block layout, which depends on the thread count only: runs with the same
    count are bit-identical.

    Inlined into :func:`kernel_parallel` (blocks on threads) and :func:`kernel_serial` (one thread, for small
    tensors: waking the pool costs more than their step). Arrays come one by one, never in a tuple
    (:mod:`~smmf.kernels.numba_cpu.structs` says why). The block pass is inlined too: compiled apart, LLVM fuses
    and reassociates its arithmetic differently, which moves the last bits of fp64 and bf16 results
    (``benchmarks/bit_identity.py`` sees it)."""
    for b in numba.prange(bad_counts.shape[0]):
        first_row, end_row = block_rows(b, geo)
        bad_counts[b] = _rows_pass(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m[b], col_acc_v[b],
                                   row_acc_m[b], first_row, end_row, geo, opts, sc)
    finish_v(row_v, col_v, col_acc_v, geo, opts.whole)
    gather_m_rows(row_m, row_acc_m, geo)
    finish_cols(row_m, col_m, col_acc_m, opts.whole)


# The weight and gradient, the state's arrays in the schema's order, the scratch (structs.Scratch), then
# Geometry, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def kernel_parallel(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts,
                    sc):
    _step(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def kernel_serial(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts,
                  sc):
    _step(w, g, row_m, col_m, sign_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc)


# Compiled apart from many_blocks_kernel, which calls it with arrays made from addresses: numba (0.68) loses the
# slice writes (row_v's in _rows_pass) to such arrays in the function that made them.
@numba.njit(**KERNEL_OPTIONS)
def block_pass(w, g, row_m, col_m, sign_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc):
    return _rows_pass(w, g, row_m, col_m, sign_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc)


@numba.njit(**KERNEL_OPTIONS)
def finish_whole(row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, geo):
    """A whole matrix's factors from its blocks' sums, as :func:`_step`'s end."""
    finish_cols(row_v, col_v, col_acc_v, True)
    gather_m_rows(row_m, row_acc_m, geo)
    finish_cols(row_m, col_m, col_acc_m, True)
