"""The numba kernels' passes: a block of rows walked in column tiles, the whole step over all blocks
(in parallel or on one thread), the factors finished from the blocks' sums, and the launches of many
tensors at once. Arguments: :mod:`smmf.kernels.numba_cpu.structs`; host side:
:mod:`smmf.kernels.numba_cpu.host`.

What makes a pass run near the memory's speed (see ``smmf bench``): a block walks its rows in tiles
of :data:`COLUMN_TILE` columns, so the tile's column factors and sums stay in L1, and prefetches the
start of the next row's segment; each segment's bits are unpacked to 0/1 bytes and packed back eight
at a time with one multiply; the element loops (:mod:`~smmf.kernels.numba_cpu.elements`) are
branch-free and vectorize.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .access import byte_span, load, pack_bytes, prefetch_lines, store, unpack_bytes
from .cache import FASTMATH, KERNEL_OPTIONS, cached_njit
from .elements import (
    flag_level,
    flag_run_encode,
    flag_run_sums,
    flag_run_update,
    flag_run_write,
    run_pair_with_momentum,
    run_with_momentum,
    run_without_momentum,
)
from .structs import Geometry, Options, Scalars

# Rows are walked in tiles of this many columns, so that the tile's column factors and column sums
# (4 × 4 KiB in fp32) stay in L1 while the rows stream past (measured against 256 and 4096: docs/design.md).
COLUMN_TILE = 1024
# Elements of the next row's segment prefetched while this one runs (a 4096-element page of fp32 is
# a new stream for the hardware prefetcher; measured against 64 and the whole segment: docs/design.md).
PREFETCH = 256

_PASS: dict[str, Any] = dict(error_model="numpy", fastmath=FASTMATH)


@numba.njit(inline="always")
def first_m_row(first_row, m, m_cols):
    """The first row of M's view that row ``first_row`` of V's view (m columns) touches."""
    return (first_row * m) // m_cols


@numba.njit(inline="always")
def m_rows_touched(rows, m, m_cols):
    """At most this many rows of M's view hold elements of ``rows`` consecutive rows of V's."""
    return (rows * m + m_cols - 1) // m_cols + 1


@numba.njit(inline="always")
def _m_run(k, start, width, m_cols):
    """From element ``k`` of a segment (elements ``start .. start + width``), the run that stays in one row
    of M's view (``m_cols`` columns): that row, the run's first column in it, and its bounds j0 .. j1
    in the segment."""
    m_row = k // m_cols
    return m_row, k - m_row * m_cols, k - start, min(width, (m_row + 1) * m_cols - start)


@numba.njit(inline="always")
def _block_rows(b, geo):
    """Block ``b``'s rows of V's view: first .. end."""
    first_row = geo.row0 + b * geo.rows_per_block
    return first_row, min((geo.hi + geo.m - 1) // geo.m, first_row + geo.rows_per_block)


@numba.njit(inline="always")
def _gather_m_rows(row_m, row_acc_m, geo):
    """M's row factor sums: every block's partial sums of the rows it touched, added up (other rows
    get 0)."""
    row_m[:] = 0
    for b in range(row_acc_m.shape[0]):
        first_row, end_row = _block_rows(b, geo)
        lo = first_m_row(first_row, geo.m, geo.m_cols)
        hi = (end_row * geo.m - 1) // geo.m_cols + 1
        for r in range(lo, hi):
            row_m[r] += row_acc_m[b, r - lo]


@numba.njit(inline="always")
def _finish_cols(rows, cols, col_acc, normalize):
    """Reduce per-block column sums and normalize them by the total (a total that is not positive,
    0 or NaN, divides by 1, as :func:`smmf.matrix.nnmf_from_sums`)."""
    total = 0.0
    for i in range(rows.shape[0]):
        total += rows[i]
    scale = (1.0 / total if total > 0 else 1.0) if normalize else 1.0
    for j in range(cols.shape[0]):
        s = 0.0
        for b in range(col_acc.shape[0]):
            s += col_acc[b, j]
        cols[j] = s * scale


@numba.njit(inline="always", **_PASS)
def _rows_pass(w, g, signs, row_m, col_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc):
    """Rows ``first_row .. end_row`` of V's n×m view (one thread): the weights and sign bits in
    place, the rows' new V sums into ``row_v``, the column sums into ``acc_m``/``acc_v`` and the
    sums of the rows of M's own view that these elements touch into ``msums``, from
    :func:`first_m_row` on (all zeroed here); returns the NaN/inf gradient elements met. M's row
    factors are only read: the caller adds up ``msums`` of every block once all have run.

    Only the elements ``lo .. hi`` of the row-major flattening are there (an FSDP2 shard's, whose
    first and last rows may be partial; the whole matrix otherwise): ``w``, ``g`` and the sign bits
    start at element ``lo``.

    With M in V's view (the paper's code), two rows' segments of a tile go through one loop
    (:func:`~smmf.kernels.numba_cpu.elements.run_pair_with_momentum`) where both are whole and their
    sign bits share no byte. Which rows pair depends on the block and the shard's ends, and a paired
    row's sums may differ from an unpaired one's in the last bit (fastmath reassociates them): still a
    fixed order for a given block layout."""
    m, m_cols, lo, hi = geo.m, geo.m_cols, geo.lo, geo.hi
    # A segment's sign bits span at most tile // 8 + 2 bytes (two whole rows' in one tile: 2·tile // 8 + 2);
    # they are unpacked with their whole first and last bytes, so the neighbours' bits go back unchanged
    # (same thread, one after another).
    tile = min(m, COLUMN_TILE)
    acc_v[:] = 0
    acc_m[:] = 0
    msums[:] = 0
    m_row0 = first_m_row(first_row, m, m_cols)
    # Row sums build up over the column tiles; the old row factors are read until the end.
    sums_v = np.zeros(end_row - first_row, dtype=row_v.dtype)
    wbuf = np.empty(tile, dtype=np.uint32)
    gbuf = np.empty(tile, dtype=np.uint32)
    wbuf1 = np.empty(tile, dtype=np.uint32)
    gbuf1 = np.empty(tile, dtype=np.uint32)
    lanes = np.empty(2 * tile // 8 + 2, dtype=np.uint64)  # two whole rows' bits when m <= tile
    lanes1 = np.empty(tile // 8 + 2, dtype=np.uint64)  # the second row's, when rows span tiles
    bits = lanes.view(np.uint8)
    bits1 = lanes1.view(np.uint8)
    # With M in V's view, two rows' segments go through one loop (:func:`run_pair_with_momentum`).
    pairs = opts.has_m and m_cols == m
    bad = 0
    for c0 in range(0, m, tile):
        i = first_row
        while i < end_row:
            start = max(i * m + c0, lo)  # the segment: elements start .. start + width, columns col0 ..
            width = min(i * m + min(m, c0 + tile), hi) - start
            if width <= 0:
                i += 1
                continue
            col0 = start - i * m
            here = start - lo  # where the segment lies in w, g and the sign bits
            # The next row's segment: the same columns, whole (not cut by the end of a shard), in its own
            # bytes of sign bits or right after this one's (whole rows in one tile: one span of bits).
            together = width == m
            rows = 2 if (pairs and i + 1 < end_row and col0 == c0 and start + m + width <= hi
                         and (together or (here + width - 1) >> 3 < (here + m) >> 3)) else 1
            for ahead in range(rows, 2 * rows):  # the next rows' segments start new streams: start them early
                if i + ahead < end_row:
                    prefetch_lines(w, here + ahead * m, min(width, PREFETCH))
                    prefetch_lines(g, here + ahead * m, min(width, PREFETCH))
            wseg = load(w, here, width, wbuf)
            gseg = load(g, here, width, gbuf)
            wseg1 = wseg
            if rows == 2:
                wseg1 = load(w, here + m, width, wbuf1)
                gseg1 = load(g, here + m, width, gbuf1)
                first, count, offset = byte_span(here, 2 * width if together else width)
                unpack_bytes(signs, first, count, lanes)
                if together:
                    first1, count1, offset1, row_bits1 = first, count, offset + width, bits
                else:
                    first1, count1, offset1 = byte_span(here + m, width)
                    unpack_bytes(signs, first1, count1, lanes1)
                    row_bits1 = bits1
                run_m, run_v, run_m1, run_v1, run_bad = run_pair_with_momentum(
                    wseg, gseg, bits[offset : offset + width], wseg1, gseg1, row_bits1[offset1 : offset1 + width],
                    col_m[col0 : col0 + width], col_v[col0 : col0 + width], acc_m[col0 : col0 + width],
                    acc_v[col0 : col0 + width], row_m[i], row_v[i], row_m[i + 1], row_v[i + 1], sc, opts.zero_bad)
                pack_bytes(signs, first, count, lanes)
                if not together:
                    pack_bytes(signs, first1, count1, lanes1)
                msums[i - m_row0] += run_m
                msums[i + 1 - m_row0] += run_m1
                sums_v[i - first_row] += run_v
                sums_v[i + 1 - first_row] += run_v1
                bad += run_bad
            elif opts.has_m:
                first, count, offset = byte_span(here, width)
                unpack_bytes(signs, first, count, lanes)
                # The segment in runs along one row of M's view (one run when it is V's).
                sum_v = sc.beta2 - sc.beta2  # 0 in the work dtype
                k = start
                while k < start + width:
                    m_row, m_col, j0, j1 = _m_run(k, start, width, m_cols)
                    run_m, run_v, run_bad = run_with_momentum(
                        wseg[j0:j1], gseg[j0:j1], bits[offset + j0 : offset + j1],
                        col_m[m_col : m_col + j1 - j0], col_v[col0 + j0 : col0 + j1],
                        acc_m[m_col : m_col + j1 - j0], acc_v[col0 + j0 : col0 + j1], row_m[m_row], row_v[i],
                        sc, opts.zero_bad)
                    msums[m_row - m_row0] += run_m
                    sum_v += run_v
                    bad += run_bad
                    k = start + j1
                pack_bytes(signs, first, count, lanes)
                sums_v[i - first_row] += sum_v
            else:
                sum_v, seg_bad = run_without_momentum(
                    wseg, gseg, col_v[col0 : col0 + width], acc_v[col0 : col0 + width], row_v[i], sc, opts.zero_bad)
                sums_v[i - first_row] += sum_v
                bad += seg_bad
            for row in range(rows):  # one call of store: inlined twice, numba's SSA check warns on its branches
                store(w, here + row * m, wseg1 if row else wseg, opts.sr, opts.sr_seed + start + row * m)
            i += rows
    row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", **_PASS)
def _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc):
    """One SMMF step of one n×m matrix, in place; or of the elements ``lo .. hi`` of its row-major
    flattening that an FSDP2 shard holds (``opts.whole`` False: the four factor vectors are left
    holding this piece's raw row and column sums, 0 for the rows it lacks, for the caller to add up
    across shards).

    ``w``, ``g``: the weight and gradient, elements lo .. hi, flat: work dtype, or int16 bit patterns
    of bf16 (:func:`~smmf.kernels.numba_cpu.access.load`/``store`` convert); w is read and written,
    g only read.

    Invariants: every block starts on a byte of the sign bits (rows_per_block·m and, with more than
    one block, row0·m − lo are multiples of 8), so no two threads write one byte; sums run in a
    fixed order for a given block layout, which depends on the thread count only: runs with the same
    count are bit-identical.

    Inlined into :func:`_kernel_parallel` (blocks on threads) and :func:`_kernel_serial` (one
    thread, for small tensors: waking the pool costs more than their step). Arrays come one by one,
    never in a tuple (:mod:`~smmf.kernels.numba_cpu.structs` says why). The block pass is inlined
    too: compiled apart, LLVM fuses and reassociates its arithmetic differently, which moves the
    last bits of fp64 and bf16 results (``benchmarks/bit_identity.py`` sees it)."""
    for b in numba.prange(bad_counts.shape[0]):
        first_row, end_row = _block_rows(b, geo)
        bad_counts[b] = _rows_pass(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m[b], col_acc_v[b], row_acc_m[b],
                                   first_row, end_row, geo, opts, sc)
    row_end = (geo.hi + geo.m - 1) // geo.m
    if not opts.whole:  # rows of other shards: 0 in the sums to add up
        row_v[:geo.row0] = 0
        row_v[row_end:] = 0
    _finish_cols(row_v, col_v, col_acc_v, opts.whole)
    if opts.has_m:
        _gather_m_rows(row_m, row_acc_m, geo)
        _finish_cols(row_m, col_m, col_acc_m, opts.whole)


# The arrays of Moments and Scratch, in their order (structs.py), then Geometry, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def _kernel_parallel(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts,
                     sc):
    _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def _kernel_serial(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts,
                   sc):
    _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts, geo, opts, sc)


@numba.njit(inline="always", **_PASS)
def _flag_rows_pass(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v,
                    acc_m, acc_v, msums, fits, first_row, end_row, geo, phase, opts, sc):
    """Rows ``first_row .. end_row`` of V's n×m view under the magnitude flag (one thread), like
    :func:`_rows_pass`, in one of two passes (``phase`` 0, 1); this step's M is formed from the same
    inputs in both. Either pass may *update*: the weights in place, the rows' new V sums into
    ``row_v``, V's column sums into the block's scratch, returning the NaN/inf gradient elements met.
    The first pass sums |M| into the block's column and row sums of M's view; the second (the flag's
    ``new_row_m``/``new_col_m`` hold the new factors of |M|) *encodes*: the sign and flag bits in
    place and the flag's level sums into the block's ``fits``. Without L2 decay the first pass
    updates, and the second reads only the gradient and the bits (a third of the bytes); with it, M
    needs the weights before the step, so the first pass only reads and the second encodes and
    updates. Only the elements ``lo .. hi`` are there, as in :func:`_rows_pass`."""
    m, m_cols, lo, hi = geo.m, geo.m_cols, geo.lo, geo.hi
    beta1, l2 = sc.beta1, sc.l2
    high, low = levels[0], levels[1]
    updates = (phase == 0) == (l2 == 0)
    encodes = phase == 1
    reads_w = updates or l2 != 0
    tile = min(m, COLUMN_TILE)
    acc_m[:] = 0
    msums[:] = 0
    fits[:] = 0
    if updates:  # V's column sums are kept from the pass that made them to the end of the step
        acc_v[:] = 0
    m_row0 = first_m_row(first_row, m, m_cols)
    sums_v = np.zeros(end_row - first_row, dtype=row_v.dtype)
    wbuf = np.empty(tile, dtype=np.uint32)
    gbuf = np.empty(tile, dtype=np.uint32)
    sign_lanes = np.empty(tile // 8 + 2, dtype=np.uint64)
    flag_lanes = np.empty(tile // 8 + 2, dtype=np.uint64)
    sign_bits, flag_bits = sign_lanes.view(np.uint8), flag_lanes.view(np.uint8)
    bad = 0
    for c0 in range(0, m, tile):
        for i in range(first_row, end_row):
            start = max(i * m + c0, lo)  # the segment: elements start .. start + width, columns col0 ..
            width = min(i * m + min(m, c0 + tile), hi) - start
            if width <= 0:
                continue
            col0 = start - i * m
            here = start - lo  # where the segment lies in w, g and the bits
            if updates and i + 1 < end_row:
                prefetch_lines(g, here + m, min(width, PREFETCH))
                prefetch_lines(w, here + m, min(width, PREFETCH))
            elif not updates and i + 2 < end_row:  # a lighter loop: fetch further ahead
                prefetch_lines(g, here + 2 * m, width)
                if reads_w:
                    prefetch_lines(w, here + 2 * m, width)
            gseg = load(g, here, width, gbuf)
            wseg = load(w, here, width, wbuf) if reads_w else gseg
            first, count, offset = byte_span(here, width)
            unpack_bytes(signs, first, count, sign_lanes)
            unpack_bytes(flags, first, count, flag_lanes)
            sum_v = sc.beta2 - sc.beta2
            k = start
            while k < start + width:  # runs along one row of M's view
                m_row, m_col, j0, j1 = _m_run(k, start, width, m_cols)
                run = slice(offset + j0, offset + j1)
                m_run = slice(m_col, m_col + j1 - j0)
                v_run = slice(col0 + j0, col0 + j1)
                high_coef = beta1 * row_m[m_row] * high
                low_coef = beta1 * row_m[m_row] * low
                if encodes and updates:
                    run_v, run_bad = flag_run_write(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], new_col_m[m_run],
                        col_v[v_run], acc_v[v_run], high_coef, low_coef, new_row_m[m_row], row_v[i], fits, sc,
                        opts.zero_bad)
                    sum_v += run_v
                    bad += run_bad
                elif encodes:
                    flag_run_encode(gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], new_col_m[m_run],
                                    high_coef, low_coef, new_row_m[m_row], fits, sc, opts.zero_bad)
                elif updates:
                    run_m, run_v, run_bad = flag_run_update(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], acc_m[m_run],
                        col_v[v_run], acc_v[v_run], high_coef, low_coef, row_v[i], sc, opts.zero_bad)
                    msums[m_row - m_row0] += run_m
                    sum_v += run_v
                    bad += run_bad
                else:
                    msums[m_row - m_row0] += flag_run_sums(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], acc_m[m_run],
                        high_coef, low_coef, sc, opts.zero_bad)
                k = start + j1
            if encodes:
                pack_bytes(signs, first, count, sign_lanes)
                pack_bytes(flags, first, count, flag_lanes)
            if updates:
                sums_v[i - first_row] += sum_v
                store(w, here, wseg, opts.sr, opts.sr_seed + start)
    if updates:
        row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", **_PASS)
def _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m, col_acc_v,
               row_acc_m, fits, bad_counts, geo, passes, opts, sc):
    """One SMMF step of one n×m matrix with the magnitude flag, in place: :func:`_step`'s arguments
    and the flag's arrays (:class:`~smmf.kernels.numba_cpu.structs.FlagArrays`).

    The whole matrix (passes 0 .. 2): two passes (:func:`_flag_rows_pass`), the new factors of |M|
    made between them in ``new_row_m``/``new_col_m``, then the factors and levels stored. An FSDP2
    shard's elements lo .. hi take one pass per call, for the caller to add up the shards' sums
    between them: pass 0 leaves |M|'s raw row and column sums in ``new_row_m``/``new_col_m``; pass 1
    reads the new factors from them and leaves its blocks' level sums in ``fits``; the pass that
    updates (0 without L2 decay, else 1) leaves V's raw sums in ``row_v``/``col_v`` (0 for rows the
    shard lacks). Neither touches ``row_m``, ``col_m`` or ``levels``."""
    whole = passes.first == 0 and passes.end == 2
    row_end = (geo.hi + geo.m - 1) // geo.m
    v_pass = 0 if sc.l2 == 0 else 1  # the pass that updates
    for phase in range(passes.first, passes.end):  # one call site: numba inlines a closure once per function
        if phase == 1 and whole:  # the new factors of |M|, from the first pass's sums
            _gather_m_rows(new_row_m, row_acc_m, geo)
            _finish_cols(new_row_m, new_col_m, col_acc_m, True)
        for b in numba.prange(col_acc_v.shape[0]):
            first_row, end_row = _block_rows(b, geo)
            bad = _flag_rows_pass(
                w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m[b],
                col_acc_v[b], row_acc_m[b], fits[b], first_row, end_row, geo, phase, opts, sc)
            if phase == v_pass:
                bad_counts[b] = bad
    if whole:
        _finish_cols(row_v, col_v, col_acc_v, True)
        row_m[:] = new_row_m
        col_m[:] = new_col_m
        for level in range(2):  # high from the flagged elements' sums, low from the others'
            fit = levels[0] - levels[0]
            energy = fit
            for b in range(fits.shape[0]):
                fit += fits[b, 2 * level]
                energy += fits[b, 2 * level + 1]
            levels[level] = flag_level(fit, energy)
    else:
        if passes.first == 0:  # |M|'s raw sums, into the new factors
            _gather_m_rows(new_row_m, row_acc_m, geo)
            _finish_cols(new_row_m, new_col_m, col_acc_m, False)
        if passes.first == v_pass:  # this pass updated: V's raw sums, 0 for other shards' rows
            row_v[:geo.row0] = 0
            row_v[row_end:] = 0
            _finish_cols(row_v, col_v, col_acc_v, False)


# The arrays of Moments, FlagArrays and Scratch (flag: signs, flags, the four factors and the new
# two, levels, ...; see host.launch), then Geometry, FlagPasses, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def _flag_kernel_parallel(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m,
                          col_acc_v, row_acc_m, fits, bad_counts, geo, passes, opts, sc):
    _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m, col_acc_v,
               row_acc_m, fits, bad_counts, geo, passes, opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def _flag_kernel_serial(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m,
                        col_acc_v, row_acc_m, fits, bad_counts, geo, passes, opts, sc):
    _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m, col_acc_v,
               row_acc_m, fits, bad_counts, geo, passes, opts, sc)


@intrinsic
def _address(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
    """An integer address as a ``void*`` (for :func:`numba.carray`)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@numba.njit(inline="always")
def _float_array(address, length):
    return numba.carray(_address(address), length, np.float32)


# Cached like the others. A tensor that the host's ``takes_many`` accepts always takes this launch,
# alone (the step inside backward steps one tensor at a time) or with others, never _kernel_serial's
# own: numba's cached copy of this launch may round a sum differently from that one, and the loop
# and the step inside backward must run the same machine code.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def many_kernel(addresses, sizes, scalars, flags, bad_counts):
    """The steps of small fp32 tensors in one launch, one tensor per thread at a time.

    Per tensor t: ``addresses[t]`` = data addresses of (w, g, signs, row_m, col_m, row_v, col_v),
    ``sizes[t]`` = (n, m, m_cols), ``scalars[t]`` = :class:`Scalars`' fields in order, ``flags[t]`` =
    (has_m, zero_bad). Each tensor is one call of :func:`_kernel_serial`'s code, so how many tensors
    share a launch changes no bit. The caller keeps every tensor alive.
    """
    for t in numba.prange(addresses.shape[0]):
        n, m, m_cols = sizes[t, 0], sizes[t, 1], sizes[t, 2]
        has_m = flags[t, 0] != 0
        m_rows = n * m // m_cols if has_m else 0
        a = addresses[t]
        s = scalars[t]
        signs = numba.carray(_address(a[2]), (n * m + 7) // 8 if has_m else 0, np.uint8)
        row_m, col_m = _float_array(a[3], m_rows), _float_array(a[4], m_cols if has_m else 0)
        bad = np.zeros(1, dtype=np.int64)
        _kernel_serial(
            _float_array(a[0], n * m), _float_array(a[1], n * m), signs, row_m, col_m, _float_array(a[5], n),
            _float_array(a[6], m), np.empty((1, col_m.shape[0]), dtype=np.float32), np.empty((1, m), dtype=np.float32),
            np.empty((1, m_rows_touched(n, m, m_cols)), dtype=np.float32), bad,
            Geometry(n, m, m_cols, 0, n, 0, n * m), Options(has_m, False, flags[t, 1] != 0, True, 0),
            Scalars(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10]))
        bad_counts[t] = bad[0]


@numba.njit(inline="always")
def _scratch(scratch, start, rows, cols):
    """``rows`` × ``cols`` of the flat ``scratch`` from ``start``."""
    return scratch[start:start + rows * cols].reshape((rows, cols))


# Cached, and like many_kernel taken by every tensor that the host's ``takes_blocks`` accepts, alone
# (the step inside backward) or with others: the loop and the step inside backward run the same code.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def many_blocks_kernel(addresses, sizes, scalars, flags, work, part_starts, scratch, bad_counts):
    """The steps of large fp32 tensors in one launch: one parallel loop over every block of rows of
    every tensor, then one over the tensors that finishes their factors. One launch instead of one
    per tensor: a launch's fork and join cost ~15 µs, and a model such as ResNet-50 has ~40 tensors
    past the small ones' launch.

    Per tensor t: ``addresses[t]``, ``scalars[t]`` and ``flags[t]`` as :func:`many_kernel`'s;
    ``sizes[t]`` = (n, m, m_cols, rows_per_block, blocks, then where its blocks' sums start in
    ``scratch``: their column sums of |M| (blocks × m_cols, none without M), of V (blocks × m) and their
    sums of M's rows (blocks × :func:`m_rows_touched`), then its first block's index in ``bad_counts``);
    the host lays them out. Its blocks are those of its own parallel launch (``host.block_layout``)
    and each block's pass is :func:`_rows_pass`, so the sums add up as they would there. Part k of the work,
    ``work[part_starts[k]:part_starts[k + 1]]``, each row a (tensor, block), runs on one thread: the
    host balances the parts by elements. The caller keeps every tensor alive."""
    for part in numba.prange(part_starts.shape[0] - 1):
        for i in range(part_starts[part], part_starts[part + 1]):
            _tensor_block(addresses, sizes, scalars, flags, scratch, bad_counts, work[i, 0], work[i, 1])
    if sizes.shape[0] == 1:  # a lone tensor (the step inside backward): no second parallel region
        _tensor_finish(addresses, sizes, flags, scratch, 0)
    else:
        for t in numba.prange(sizes.shape[0]):
            _tensor_finish(addresses, sizes, flags, scratch, t)


@numba.njit(inline="always")
def _tensor_block(addresses, sizes, scalars, flags, scratch, bad_counts, t, b):
    """Block ``b`` of tensor ``t`` of :func:`many_blocks_kernel`: its :func:`_rows_pass`."""
    n, m, m_cols, rows_per_block, blocks = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3], sizes[t, 4]
    has_m = flags[t, 0] != 0
    m_width = m_cols if has_m else 0
    a = addresses[t]
    s = scalars[t]
    geo = Geometry(n, m, m_cols, 0, rows_per_block, 0, n * m)
    first_row, end_row = _block_rows(b, geo)
    bad_counts[sizes[t, 8] + b] = _block_pass(
        _float_array(a[0], n * m), _float_array(a[1], n * m),
        numba.carray(_address(a[2]), (n * m + 7) // 8 if has_m else 0, np.uint8),
        _float_array(a[3], n * m // m_cols if has_m else 0), _float_array(a[4], m_width),
        _float_array(a[5], n), _float_array(a[6], m),
        _scratch(scratch, sizes[t, 5], blocks, m_width)[b], _scratch(scratch, sizes[t, 6], blocks, m)[b],
        _scratch(scratch, sizes[t, 7], blocks, m_rows_touched(rows_per_block, m, m_cols) if has_m else 0)[b],
        first_row, end_row, geo, Options(has_m, False, flags[t, 1] != 0, True, 0),
        Scalars(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10]))


@numba.njit(inline="always")
def _tensor_finish(addresses, sizes, flags, scratch, t):
    """Tensor ``t``'s factors from its blocks' sums (:func:`_finish_whole`)."""
    n, m, m_cols, rows_per_block, blocks = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3], sizes[t, 4]
    has_m = flags[t, 0] != 0
    m_width = m_cols if has_m else 0
    a = addresses[t]
    _finish_whole(_float_array(a[3], n * m // m_cols if has_m else 0), _float_array(a[4], m_width),
                  _float_array(a[5], n), _float_array(a[6], m), _scratch(scratch, sizes[t, 5], blocks, m_width),
                  _scratch(scratch, sizes[t, 6], blocks, m),
                  _scratch(scratch, sizes[t, 7], blocks, m_rows_touched(rows_per_block, m, m_cols) if has_m else 0),
                  Geometry(n, m, m_cols, 0, rows_per_block, 0, n * m), has_m)


# The two below take the arrays made from addresses as arguments, compiled apart: numba (0.68) loses
# the slice writes (row_v's in _rows_pass) to such arrays in the function that made them.
@numba.njit(**KERNEL_OPTIONS)
def _block_pass(w, g, signs, row_m, col_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc):
    return _rows_pass(w, g, signs, row_m, col_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, geo, opts, sc)


@numba.njit(**KERNEL_OPTIONS)
def _finish_whole(row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, geo, has_m):
    """A whole matrix's factors from its blocks' sums, as :func:`_step`'s end."""
    _finish_cols(row_v, col_v, col_acc_v, True)
    if has_m:
        _gather_m_rows(row_m, row_acc_m, geo)
        _finish_cols(row_m, col_m, col_acc_m, True)


KERNELS = {True: _kernel_parallel, False: _kernel_serial}
FLAG_KERNELS = {True: _flag_kernel_parallel, False: _flag_kernel_serial}
