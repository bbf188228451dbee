"""The 1-bit magnitude flag on CPU (``MomentumCode.FLAG``, ``magnitude_bits=1``): F = [|M| > r cᵀ] needs the *new*
factors of |M|, which need every row's |M|, so a step takes two passes over the n×m view of V, parallel over blocks
of rows: the first sums |M| (and, without L2 decay, steps the weights and sums V), the second forms M again from the
same inputs and writes S and F against the new factors (and, with L2 decay, steps the weights). See
:func:`smmf.functional.store_magnitude_flag_`. Its state arrays come in the step schema's order: ``row_m, col_m,
sign_m, flag_m, gains_m, row_v, col_v``, then the new factors of |M| between the passes and the blocks' sums.
"""

from __future__ import annotations

import numba
import numpy as np

from .access import byte_span, load, pack_bytes, prefetch_lines, store, unpack_bytes
from .cache import KERNEL_OPTIONS, cached_njit
from .elements import flag_gain, flag_run_encode, flag_run_sums, flag_run_update, flag_run_write
from .rows import (COLUMN_TILE, PASS, PREFETCH, SCRATCH_PAD, block_rows, finish_cols, first_m_row, gather_m_rows,
                   m_rows_touched, m_run, segment)


@numba.njit(inline="always")
def scratch_layout(m_cols, m, touched):
    """Where a block's sums lie in its row of the flag's scratch: |M|'s column sums from 0, then V's column
    sums, the sums of the ``touched`` rows of M's view and the four level sums, from the three offsets
    returned, each after :data:`.rows.SCRATCH_PAD` floats; the fourth value is the row's width."""
    v_at = m_cols + SCRATCH_PAD
    rows_at = v_at + m + SCRATCH_PAD
    fits_at = rows_at + touched + SCRATCH_PAD
    return v_at, rows_at, fits_at, fits_at + 4


@numba.njit(inline="always")
def _prefetch(w, g, here, width, rows_left, m, updates, reads_w):
    """The start of a later row's segment, from element ``here`` of this one, ``rows_left`` rows from the
    block's end: the next row's when this pass updates, else (a lighter loop) the one after, whole."""
    if updates and rows_left > 1:
        prefetch_lines(g, here + m, min(width, PREFETCH))
        prefetch_lines(w, here + m, min(width, PREFETCH))
    elif not updates and rows_left > 2:
        prefetch_lines(g, here + 2 * m, width)
        if reads_w:
            prefetch_lines(w, here + 2 * m, width)


@numba.njit(inline="always", **PASS)
def _rows_pass(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, b, geo, phase, opts, sc):
    """Block ``b``'s rows of V's n×m view under the magnitude flag (one thread), in pass ``phase`` (0, 1), each
    forming this step's M from the same inputs. Either pass may *update*: the weights in place, the rows' new
    V sums into ``row_v``, V's column sums into the block's ``scratch`` (:func:`scratch_layout`); it returns
    the NaN/inf gradient elements met. The first sums |M| (columns and rows of M's view); the second
    *encodes* against the new factors of |M| in ``new_m``: the sign and flag bits, the level sums. Without L2
    decay the first updates and the second reads only the gradient and the bits; with it (M needs the weights
    before the step) the first only reads."""
    m, m_cols = geo.m, geo.m_cols
    first_row, end_row = block_rows(b, geo)
    touched = m_rows_touched(geo.rows_per_block, m, m_cols)
    v_at, rows_at, fits_at, _ = scratch_layout(m_cols, m, touched)
    acc_m, acc_v = scratch[:m_cols], scratch[v_at : v_at + m]
    msums, fits = scratch[rows_at : rows_at + touched], scratch[fits_at : fits_at + 4]
    new_row_m, new_col_m = new_m[: row_m.shape[0]], new_m[row_m.shape[0] :]
    beta1, l2, zero = sc.beta1, sc.l2, sc.beta2 - sc.beta2  # 0 in the work dtype
    high, low = gains_m[0], gains_m[1]
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
    wbuf, gbuf = np.empty(tile, dtype=np.uint32), np.empty(tile, dtype=np.uint32)
    sign_lanes, flag_lanes = np.empty(tile // 8 + 2, dtype=np.uint64), np.empty(tile // 8 + 2, dtype=np.uint64)
    sign_bits, flag_bits = sign_lanes.view(np.uint8), flag_lanes.view(np.uint8)
    bad = 0
    for c0 in range(0, m, tile):
        for i in range(first_row, end_row):
            start, width, col0, here = segment(i, c0, tile, geo)
            if width <= 0:
                continue
            _prefetch(w, g, here, width, end_row - i, m, updates, reads_w)
            gseg = load(g, here, width, gbuf)
            wseg = load(w, here, width, wbuf) if reads_w else gseg
            first, count, offset = byte_span(here, width)
            unpack_bytes(sign_m, first, count, sign_lanes)
            unpack_bytes(flag_m, first, count, flag_lanes)
            sum_v = zero
            k = start
            while k < start + width:  # runs along one row of M's view
                m_row, m_col, j0, j1 = m_run(k, start, width, m_cols)
                run = slice(offset + j0, offset + j1)
                m_span = slice(m_col, m_col + j1 - j0)
                v_run = slice(col0 + j0, col0 + j1)
                high_coef = beta1 * row_m[m_row] * high
                low_coef = beta1 * row_m[m_row] * low
                run_m, run_v, run_bad = zero, zero, 0  # what a pass does not make
                if encodes and updates:
                    run_v, run_bad = flag_run_write(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_span], new_col_m[m_span],
                        col_v[v_run], acc_v[v_run], high_coef, low_coef, new_row_m[m_row], row_v[i], fits, sc,
                        opts.zero_nonfinite)
                elif encodes:
                    flag_run_encode(gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_span], new_col_m[m_span],
                                    high_coef, low_coef, new_row_m[m_row], fits, sc, opts.zero_nonfinite)
                elif updates:
                    run_m, run_v, run_bad = flag_run_update(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_span], acc_m[m_span],
                        col_v[v_run], acc_v[v_run], high_coef, low_coef, row_v[i], sc, opts.zero_nonfinite)
                else:
                    run_m = flag_run_sums(wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_span],
                                          acc_m[m_span], high_coef, low_coef, sc, opts.zero_nonfinite)
                msums[m_row - m_row0] += run_m
                sum_v += run_v
                bad += run_bad
                k = start + j1
            if encodes:
                pack_bytes(sign_m, first, count, sign_lanes)
                pack_bytes(flag_m, first, count, flag_lanes)
            if updates:
                sums_v[i - first_row] += sum_v
                store(w, here, wseg, opts.stochastic_rounding, opts.rounding_key + start)
    if updates:
        row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", **PASS)
def _step(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, bad_counts, geo, passes, opts,
          sc):
    """One SMMF step of one n×m matrix with the magnitude flag, in place: the paper's code's step's arguments
    (:func:`.sign._step`) with the flag's bits and gains among the state's arrays, the new factors of |M|
    (``new_m``: its row factors, then its column factors) and a row of ``scratch`` per block
    (:func:`scratch_layout`).

    The whole matrix (passes 0 .. 2): two passes (:func:`_rows_pass`), the new factors of |M| made
    between them in ``new_m``, then the factors and gains stored. An FSDP2 shard's elements lo .. hi take
    one pass per call, for the caller to add up the shards' sums between them: pass 0 leaves |M|'s raw row
    and column sums in ``new_m``; pass 1 reads the new factors from it and leaves its blocks' level sums in
    their scratch; the pass that updates (0 without L2 decay, else 1) leaves V's raw sums in
    ``row_v``/``col_v`` (0 for rows the shard lacks). Neither touches ``row_m``, ``col_m`` or ``gains_m``."""
    touched = m_rows_touched(geo.rows_per_block, geo.m, geo.m_cols)
    v_at, rows_at, fits_at, _ = scratch_layout(geo.m_cols, geo.m, touched)
    col_acc_m, col_acc_v = scratch[:, : geo.m_cols], scratch[:, v_at : v_at + geo.m]
    row_acc_m, fits = scratch[:, rows_at : rows_at + touched], scratch[:, fits_at : fits_at + 4]
    new_row_m, new_col_m = new_m[: row_m.shape[0]], new_m[row_m.shape[0] :]
    whole = passes.first == 0 and passes.end == 2
    row_end = (geo.hi + geo.m - 1) // geo.m
    v_pass = 0 if sc.l2 == 0 else 1  # the pass that updates
    for phase in range(passes.first, passes.end):  # one call site: numba inlines a closure once per function
        if phase == 1 and whole:  # the new factors of |M|, from the first pass's sums
            gather_m_rows(new_row_m, row_acc_m, geo)
            finish_cols(new_row_m, new_col_m, col_acc_m, True)
        for b in numba.prange(scratch.shape[0]):
            bad = _rows_pass(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch[b], b, geo,
                             phase, opts, sc)
            if phase == v_pass:
                bad_counts[b] = bad
    if whole:
        finish_cols(row_v, col_v, col_acc_v, True)
        row_m[:] = new_row_m
        col_m[:] = new_col_m
        for level in range(2):  # high from the flagged elements' sums, low from the others'
            fit = gains_m[0] - gains_m[0]
            energy = fit
            for b in range(fits.shape[0]):
                fit += fits[b, 2 * level]
                energy += fits[b, 2 * level + 1]
            gains_m[level] = flag_gain(fit, energy)
    else:
        if passes.first == 0:  # |M|'s raw sums, into the new factors
            gather_m_rows(new_row_m, row_acc_m, geo)
            finish_cols(new_row_m, new_col_m, col_acc_m, False)
        if passes.first == v_pass:  # this pass updated: V's raw sums, 0 for other shards' rows
            row_v[:geo.row0] = 0
            row_v[row_end:] = 0
            finish_cols(row_v, col_v, col_acc_v, False)


# The weight and gradient, the state's arrays in the schema's order, the new factors of |M|, the scratch (a row
# per block: scratch_layout), the NaN/inf counts per block, then Geometry, FlagPasses, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def kernel_parallel(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, bad_counts, geo,
                    passes, opts, sc):
    _step(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, bad_counts, geo, passes, opts,
          sc)


@cached_njit(**KERNEL_OPTIONS)
def kernel_serial(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, bad_counts, geo,
                  passes, opts, sc):
    _step(w, g, row_m, col_m, sign_m, flag_m, gains_m, row_v, col_v, new_m, scratch, bad_counts, geo, passes, opts,
          sc)
