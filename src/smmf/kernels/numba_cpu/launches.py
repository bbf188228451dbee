"""The launches of many tensors on CPU: small fp32 tensors (one tensor per thread at a time) and mid-sized ones
(every block of rows of every tensor in one parallel loop), of the paper's code or without a first moment, each
tensor stepped by its code's pass (:mod:`.sign`, :mod:`.none`); and small fp32 tensors of the levels code and of
the magnitude flag, one tensor per thread at a time (:mod:`.levels`, :mod:`.flag`).

Per tensor t of a launch, rows of tables the host lays out: ``addresses[t]``, the data addresses of the weight, the
gradient and its code's state arrays in the schema's order (:data:`ADDRESS` for the paper's code and none, 0 for
the arrays a code lacks; :data:`LEVELS_ADDRESS`, :data:`FLAG_ADDRESS`); ``scalars[t]``, the
:class:`~.structs.Scalars`' fields in order; ``flags[t]`` and ``sizes[t]`` as each launch says. The caller keeps
every tensor alive.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...levels import BLOCK
from ...codes import SCHEMA
from ...schema import MomentumCode
from . import flag, no_m, sign
from .cache import KERNEL_OPTIONS, cached_njit
from .levels import LEVELS_KERNELS, touched_v_rows
from .rows import block_rows, finish_cols, m_rows_touched
from .structs import FlagPasses, Geometry, LevelsGeometry, Options, scalars_of

# Where each array's address is in a row of ``addresses``: the weight, the gradient, then the paper's code's state.
_W, _G = 0, 1
ADDRESS = {field.key: 2 + i for i, field in enumerate(SCHEMA[MomentumCode.SIGN])}
_ROW_M, _COL_M, _SIGN_M, _ROW_V, _COL_V = (ADDRESS[key] for key in ("row_m", "col_m", "sign_m", "row_v", "col_v"))
# The same for the levels code's launch: the weight, the gradient, then the levels code's state.
LEVELS_ADDRESS = {field.key: 2 + i for i, field in enumerate(SCHEMA[MomentumCode.LEVELS])}
_CODES_M, _SCALES_M, _LEVELS_ROW_V, _LEVELS_COL_V = (LEVELS_ADDRESS[key]
                                                     for key in ("codes_m", "scales_m", "row_v", "col_v"))
_levels_serial = LEVELS_KERNELS[False]
# And for the magnitude flag's: the weight, the gradient, then the flag's state.
FLAG_ADDRESS = {field.key: 2 + i for i, field in enumerate(SCHEMA[MomentumCode.FLAG])}
_F_ROW_M, _F_COL_M, _F_SIGN_M, _F_FLAG_M, _F_FLAG_GAINS_M, _F_ROW_V, _F_COL_V = (
    FLAG_ADDRESS[key] for key in ("row_m", "col_m", "sign_m", "flag_m", "levels_m", "row_v", "col_v"))


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
# alone (the step inside backward steps one tensor at a time) or with others, never its code's own
# serial kernel: numba's cached copy of this launch may round a sum differently from that one, and the loop
# and the step inside backward must run the same machine code.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def many_kernel(addresses, sizes, scalars, flags, bad_counts):
    """The steps of small fp32 tensors in one launch, one tensor per thread at a time; ``sizes[t]`` = (n, m,
    m_cols). Each tensor is one call of its code's serial kernel, so how many tensors share a launch changes no
    bit."""
    for t in numba.prange(addresses.shape[0]):
        n, m, m_cols = sizes[t, 0], sizes[t, 1], sizes[t, 2]
        a = addresses[t]
        w, g = _float_array(a[_W], n * m), _float_array(a[_G], n * m)
        row_v, col_v = _float_array(a[_ROW_V], n), _float_array(a[_COL_V], m)
        geo = Geometry(n, m, m_cols, 0, n, 0, n * m)
        opts = Options(False, flags[t, 1] != 0, True, 0)
        bad = np.zeros(1, dtype=np.int64)
        if flags[t, 0] != 0:
            m_rows = n * m // m_cols
            sign.kernel_serial(
                w, g, _float_array(a[_ROW_M], m_rows), _float_array(a[_COL_M], m_cols),
                numba.carray(_address(a[_SIGN_M]), (n * m + 7) // 8, np.uint8), row_v, col_v,
                np.empty((1, m_cols), dtype=np.float32), np.empty((1, m), dtype=np.float32),
                np.empty((1, m_rows_touched(n, m, m_cols)), dtype=np.float32), bad, geo, opts, scalars_of(scalars[t]))
        else:
            no_m.kernel_serial(w, g, row_v, col_v, np.empty((1, m), dtype=np.float32), bad, geo, opts,
                               scalars_of(scalars[t]))
        bad_counts[t] = bad[0]


# Cached, and like many_kernel taken by every tensor that the host's ``takes_many_levels`` accepts, alone or with
# others.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def many_levels_kernel(addresses, sizes, scalars, flags, table, bad_counts):
    """The steps of small fp32 tensors under the levels code in one launch, one tensor per thread at a time, each
    one call of the levels code's serial kernel: their own launches cost the host more than their steps (ResNet-50
    has 119 such tensors). ``addresses[t]``: :data:`LEVELS_ADDRESS`; ``sizes[t]`` = (V's n, m, M's rows, cols);
    ``flags[t]`` = (zero_nonfinite, the levels' dither, its salt at this step); ``table``:
    :func:`~.levels.level_table`."""
    for t in numba.prange(addresses.shape[0]):
        n, m, rows, cols = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3]
        a = addresses[t]
        codes = numba.carray(_address(a[_CODES_M]), (rows, (cols + 1) // 2), np.uint8)
        scales = numba.carray(_address(a[_SCALES_M]), (rows, (cols + BLOCK - 1) // BLOCK), np.int16)
        geo = LevelsGeometry(n, m, rows, cols, 0, rows, flags[t, 1] != 0, flags[t, 2])
        bad = np.zeros(1, dtype=np.int64)
        _levels_serial(_float_array(a[_W], n * m), _float_array(a[_G], n * m), codes, scales, table,
                       _float_array(a[_LEVELS_ROW_V], n), _float_array(a[_LEVELS_COL_V], m),
                       np.empty((1, m), dtype=np.float32),
                       np.empty((1, touched_v_rows(rows, cols, m)), dtype=np.float32), bad, geo,
                       Options(False, flags[t, 0] != 0, True, 0), scalars_of(scalars[t]))
        bad_counts[t] = bad[0]


# Cached, and like many_kernel taken by every tensor that the host's ``takes_many_flag`` accepts, alone or with
# others.
@cached_njit(parallel=True, **KERNEL_OPTIONS)
def many_flag_kernel(addresses, sizes, scalars, flags, bad_counts):
    """The steps of small fp32 tensors under the magnitude flag in one launch, one tensor per thread at a time,
    each one call of the flag's serial kernel (both its passes). ``addresses[t]``: :data:`FLAG_ADDRESS`;
    ``sizes[t]`` = (n, m, M's columns, rows per block, the width of its scratch row: :func:`.flag.scratch_layout`);
    ``flags[t]`` = (zero_nonfinite,)."""
    for t in numba.prange(addresses.shape[0]):
        n, m, m_cols, rows_per_block, width = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3], sizes[t, 4]
        a = addresses[t]
        m_rows = n * m // m_cols
        bits = (n * m + 7) // 8
        bad = np.zeros(1, dtype=np.int64)
        flag.kernel_serial(
            _float_array(a[_W], n * m), _float_array(a[_G], n * m), _float_array(a[_F_ROW_M], m_rows),
            _float_array(a[_F_COL_M], m_cols), numba.carray(_address(a[_F_SIGN_M]), bits, np.uint8),
            numba.carray(_address(a[_F_FLAG_M]), bits, np.uint8), _float_array(a[_F_FLAG_GAINS_M], 2),
            _float_array(a[_F_ROW_V], n), _float_array(a[_F_COL_V], m), np.empty(m_rows + m_cols, dtype=np.float32),
            np.empty((1, width), dtype=np.float32), bad, Geometry(n, m, m_cols, 0, rows_per_block, 0, n * m),
            FlagPasses(0, 2), Options(False, flags[t, 0] != 0, True, 0), scalars_of(scalars[t]))
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

    ``sizes[t]`` = (n, m, m_cols, rows_per_block, blocks, then where its blocks' sums start in ``scratch``: their
    column sums of |M| (blocks × m_cols, none without M), of V (blocks × m) and their sums of M's rows (blocks ×
    :func:`m_rows_touched`), then its first block's index in ``bad_counts``); the host lays them out. Its blocks
    are those of its own parallel launch (``host.block_layout``) and each block's pass is its code's, so the sums
    add up as they would there. Part k of the work, ``work[part_starts[k]:part_starts[k + 1]]``, each row a
    (tensor, block), runs on one thread: the host balances the parts by elements."""
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
    """Block ``b`` of tensor ``t`` of :func:`many_blocks_kernel`: its code's block pass."""
    n, m, m_cols, rows_per_block, blocks = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3], sizes[t, 4]
    a = addresses[t]
    geo = Geometry(n, m, m_cols, 0, rows_per_block, 0, n * m)
    first_row, end_row = block_rows(b, geo)
    w, g = _float_array(a[_W], n * m), _float_array(a[_G], n * m)
    row_v, col_v = _float_array(a[_ROW_V], n), _float_array(a[_COL_V], m)
    acc_v = _scratch(scratch, sizes[t, 6], blocks, m)[b]
    opts = Options(False, flags[t, 1] != 0, True, 0)
    if flags[t, 0] != 0:
        bad = sign.block_pass(
            w, g, _float_array(a[_ROW_M], n * m // m_cols), _float_array(a[_COL_M], m_cols),
            numba.carray(_address(a[_SIGN_M]), (n * m + 7) // 8, np.uint8), row_v, col_v,
            _scratch(scratch, sizes[t, 5], blocks, m_cols)[b], acc_v,
            _scratch(scratch, sizes[t, 7], blocks, m_rows_touched(rows_per_block, m, m_cols))[b],
            first_row, end_row, geo, opts, scalars_of(scalars[t]))
    else:
        bad = no_m.block_pass(w, g, row_v, col_v, acc_v, first_row, end_row, geo, opts, scalars_of(scalars[t]))
    bad_counts[sizes[t, 8] + b] = bad


@numba.njit(inline="always")
def _tensor_finish(addresses, sizes, flags, scratch, t):
    """Tensor ``t``'s factors from its blocks' sums (its code's ``finish_whole``)."""
    n, m, m_cols, rows_per_block, blocks = sizes[t, 0], sizes[t, 1], sizes[t, 2], sizes[t, 3], sizes[t, 4]
    a = addresses[t]
    row_v, col_v = _float_array(a[_ROW_V], n), _float_array(a[_COL_V], m)
    col_acc_v = _scratch(scratch, sizes[t, 6], blocks, m)
    if flags[t, 0] != 0:
        sign.finish_whole(_float_array(a[_ROW_M], n * m // m_cols), _float_array(a[_COL_M], m_cols), row_v, col_v,
                          _scratch(scratch, sizes[t, 5], blocks, m_cols), col_acc_v,
                          _scratch(scratch, sizes[t, 7], blocks, m_rows_touched(rows_per_block, m, m_cols)),
                          Geometry(n, m, m_cols, 0, rows_per_block, 0, n * m))
    else:
        _finish_v(row_v, col_v, col_acc_v)


# Compiled apart (sign.block_pass says why).
@numba.njit(**KERNEL_OPTIONS)
def _finish_v(row_v, col_v, col_acc_v):
    finish_cols(row_v, col_v, col_acc_v, True)
