"""No first moment on CPU (``MomentumCode.NO_M``, ``beta=None``): one pass over the n×m view of V, parallel over
blocks of rows, each element's weight stepped by G / (√V + ε) and V's row and column sums accumulated as the pass
goes. Its state arrays come in the step schema's order: ``row_v, col_v``.
"""

from __future__ import annotations

import numba
import numpy as np

from .access import load, prefetch_lines, store
from .cache import KERNEL_OPTIONS, cached_njit
from .elements import run_without_momentum
from .rows import COLUMN_TILE, PASS, PREFETCH, block_rows, finish_v, segment


@numba.njit(inline="always", **PASS)
def _rows_pass(w, g, row_v, col_v, acc_v, first_row, end_row, geo, opts, sc):
    """Rows ``first_row .. end_row`` of V's n×m view (one thread), elements ``lo .. hi``: the weights in place,
    the rows' new V sums into ``row_v`` and the column sums into ``acc_v`` (zeroed here); returns the NaN/inf
    gradient elements met."""
    m = geo.m
    tile = min(m, COLUMN_TILE)
    acc_v[:] = 0
    sums_v = np.zeros(end_row - first_row, dtype=row_v.dtype)
    wbuf = np.empty(tile, dtype=np.uint32)
    gbuf = np.empty(tile, dtype=np.uint32)
    bad = 0
    for c0 in range(0, m, tile):
        for i in range(first_row, end_row):
            start, width, col0, here = segment(i, c0, tile, geo)
            if width <= 0:
                continue
            if i + 1 < end_row:  # the next row's segment starts a new stream: start it early
                prefetch_lines(w, here + m, min(width, PREFETCH))
                prefetch_lines(g, here + m, min(width, PREFETCH))
            wseg = load(w, here, width, wbuf)
            gseg = load(g, here, width, gbuf)
            sum_v, seg_bad = run_without_momentum(wseg, gseg, col_v[col0 : col0 + width], acc_v[col0 : col0 + width],
                                                  row_v[i], sc, opts.zero_nonfinite)
            sums_v[i - first_row] += sum_v
            bad += seg_bad
            store(w, here, wseg, opts.stochastic_rounding, opts.rounding_key + start)
    row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", **PASS)
def _step(w, g, row_v, col_v, col_acc_v, bad_counts, geo, opts, sc):
    """One step without a first moment: :func:`smmf.kernels.numba_cpu.sign._step`'s contract, with V alone."""
    for b in numba.prange(bad_counts.shape[0]):
        first_row, end_row = block_rows(b, geo)
        bad_counts[b] = _rows_pass(w, g, row_v, col_v, col_acc_v[b], first_row, end_row, geo, opts, sc)
    finish_v(row_v, col_v, col_acc_v, geo, opts.whole)


# The weight and gradient, the state's arrays in the schema's order, V's column scratch and the NaN/inf counts per
# block, then Geometry, Options, Scalars.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def kernel_parallel(w, g, row_v, col_v, col_acc_v, bad_counts, geo, opts, sc):
    _step(w, g, row_v, col_v, col_acc_v, bad_counts, geo, opts, sc)


@cached_njit(**KERNEL_OPTIONS)
def kernel_serial(w, g, row_v, col_v, col_acc_v, bad_counts, geo, opts, sc):
    _step(w, g, row_v, col_v, col_acc_v, bad_counts, geo, opts, sc)


# Compiled apart from many_blocks_kernel (sign.block_pass says why).
@numba.njit(**KERNEL_OPTIONS)
def block_pass(w, g, row_v, col_v, acc_v, first_row, end_row, geo, opts, sc):
    return _rows_pass(w, g, row_v, col_v, acc_v, first_row, end_row, geo, opts, sc)
