"""What every code's pass shares: a block of rows of V's n×m view walked in column tiles, the segments and runs
it cuts them into, and the factors finished from the blocks' sums.

What makes a pass run near the memory's speed (see ``smmf bench``): a block walks its rows in tiles of
:data:`COLUMN_TILE` columns, so the tile's column factors and sums stay in L1, and prefetches the start of the next
row's segment; each segment's bits are unpacked to 0/1 bytes and packed back eight at a time with one multiply; the
element loops (:mod:`~smmf.kernels.numba_cpu.elements`) are branch-free and vectorize.
"""

from __future__ import annotations

from typing import Any

import numba

from .cache import FASTMATH

# Rows are walked in tiles of this many columns, so that the tile's column factors and column sums
# (4 × 4 KiB in fp32) stay in L1 while the rows stream past (measured against 256 and 4096: docs/design.md).
COLUMN_TILE = 1024
# Elements of the next row's segment prefetched while this one runs (a 4096-element page of fp32 is
# a new stream for the hardware prefetcher; measured against 64 and the whole segment: docs/design.md).
PREFETCH = 256

PASS: dict[str, Any] = dict(error_model="numpy", fastmath=FASTMATH)
# Floats after each of a block's sums in a scratch that holds several end to end: laid out without a gap, |M|'s
# and V's column sums of a block sit a multiple of 4 KiB apart for many shapes, and the CPU then stalls on loads
# it cannot tell from the stores to the other ("4K aliasing"; a precaution, not measured on its own).
SCRATCH_PAD = 16


@numba.njit(inline="always")
def first_m_row(first_row, m, m_cols):
    """The first row of M's view that row ``first_row`` of V's view (m columns) touches."""
    return (first_row * m) // m_cols


@numba.njit(inline="always")
def m_rows_touched(rows, m, m_cols):
    """At most this many rows of M's view hold elements of ``rows`` consecutive rows of V's."""
    return (rows * m + m_cols - 1) // m_cols + 1


@numba.njit(inline="always")
def m_run(k, start, width, m_cols):
    """From element ``k`` of a segment (elements ``start .. start + width``), the run that stays in one row
    of M's view (``m_cols`` columns): that row, the run's first column in it, and its bounds j0 .. j1
    in the segment."""
    m_row = k // m_cols
    return m_row, k - m_row * m_cols, k - start, min(width, (m_row + 1) * m_cols - start)


@numba.njit(inline="always")
def segment(i, c0, tile, geo):
    """Row ``i``'s segment in the column tile from ``c0``: its first element, its width (≤ 0: the row holds none
    of the tile's elements lo .. hi), its first column, and where it lies in w, g and the bits (from ``lo``)."""
    start = max(i * geo.m + c0, geo.lo)
    width = min(i * geo.m + min(geo.m, c0 + tile), geo.hi) - start
    return start, width, start - i * geo.m, start - geo.lo


@numba.njit(inline="always")
def block_rows(b, geo):
    """Block ``b``'s rows of V's view: first .. end."""
    first_row = geo.row0 + b * geo.rows_per_block
    return first_row, min((geo.hi + geo.m - 1) // geo.m, first_row + geo.rows_per_block)


@numba.njit(inline="always")
def gather_m_rows(row_m, row_acc_m, geo):
    """M's row factor sums: every block's partial sums of the rows it touched, added up (other rows
    get 0)."""
    row_m[:] = 0
    for b in range(row_acc_m.shape[0]):
        first_row, end_row = block_rows(b, geo)
        lo = first_m_row(first_row, geo.m, geo.m_cols)
        hi = (end_row * geo.m - 1) // geo.m_cols + 1
        for r in range(lo, hi):
            row_m[r] += row_acc_m[b, r - lo]


@numba.njit(inline="always")
def finish_cols(rows, cols, col_acc, normalize):
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


@numba.njit(inline="always")
def finish_v(row_v, col_v, col_acc_v, geo, whole):
    """V's factors from the blocks' sums, or a piece's raw sums (``whole`` False: 0 for the rows it lacks)."""
    if not whole:  # rows of other shards: 0 in the sums to add up
        row_v[:geo.row0] = 0
        row_v[(geo.hi + geo.m - 1) // geo.m:] = 0
    finish_cols(row_v, col_v, col_acc_v, whole)
