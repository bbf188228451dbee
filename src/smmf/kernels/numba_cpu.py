"""Fused single-pass SMMF step on CPU (numba).

One pass over the n×m view of a tensor, parallel over blocks of rows: each element's gradient,
weight and sign bit are read once, M̂ and V̂ are rebuilt from the factors on the fly, the weight
and the sign bit are written in place, and the row / column sums of |M| and V (the next factors)
are accumulated as the pass goes. Nothing of size N is allocated; each block keeps two column
accumulators of length m. Blocks start on a byte boundary of the packed signs, so no two
threads write the same byte.

What makes it run near the memory's speed (see ``smmf bench``): a block walks its rows in tiles of
:data:`_COLUMN_TILE` columns, so the tile's column factors and sums stay in L1, and prefetches the
start of the next row's segment; each segment's sign
bits are unpacked to 0/1 bytes and packed back eight at a time with one multiply; the element loop
is branch-free float32 (so LLVM vectorizes it to the widest SIMD) and only flags a NaN/inf, counted
afterwards in a rare second loop.

With the magnitude flag (``magnitude_bits=1``) a step takes two passes: the flag compares |M| with the
*new* factors, which need every row first (:func:`_flag_step`).

The kernels are compiled once per machine and cached (:func:`_cached_njit`): a fresh process loads
them instead of spending seconds of LLVM and ~100 MiB of RSS on its first step.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from typing import Any, Optional, Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload
from torch import Tensor

from ..functional import StepConfig
from ..matrix import factor_sum_cap
from ..state import COL_M, COL_V, FLAG_M, LEVELS_M, ROW_M, ROW_V, SIGN_M, MomentumCode, matrix_shape, momentum_cols
from .contract import FlagPass, StepItem

__all__ = ["BACKEND", "numba_flag_shard_pass_", "numba_shard_step_", "numba_step_", "numba_steps_"]


@intrinsic
def _prefetch(typingctx, array, index):  # noqa: ARG001 - numba's intrinsic signature
    """Ask the CPU to bring ``array[index]``'s cache line into L1 (LLVM's ``llvm.prefetch``: read,
    high locality); no effect on results."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), name="llvm.prefetch.p0")
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, types.intp), codegen


@numba.njit(inline="always")
def _prefetch_lines(array, start, length):
    """Prefetch every 64-byte line of ``array[start : start + length]``."""
    for k in range(start, start + length, 64 // array.itemsize):
        _prefetch(array, k)


def _load(src, start, length, buf):
    """``src[start : start + length]`` as float: in place for fp32/fp64, for bf16 (int16 bit patterns)
    converted into ``buf`` (uint32, at least ``length``). Typed by :func:`_overload_load`."""
    raise NotImplementedError("compiled only")


def _store(dst, start, row, sr):
    """Write a :func:`_load`ed row back: nothing for fp32/fp64 (it lives in ``dst``); bf16 rounds to
    nearest even, or stochastically with ``sr``."""
    raise NotImplementedError("compiled only")


@overload(_load, inline="always")
def _overload_load(src, start, length, buf):
    if src.dtype == types.int16:
        def load_bf16(src, start, length, buf):
            for j in range(length):
                buf[j] = (np.uint32(src[start + j]) & np.uint32(0xFFFF)) << np.uint32(16)
            return buf[:length].view(np.float32)  # a row's last tile is shorter than the buffer

        return load_bf16
    return lambda src, start, length, buf: src[start : start + length]


@overload(_store, inline="always")
def _overload_store(dst, start, row, sr):
    if dst.dtype == types.int16:
        def store_bf16(dst, start, row, sr):
            bits = row.view(np.uint32)
            for j in range(bits.shape[0]):
                u = bits[j]
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    u = u | np.uint32(0x00400000)  # NaN stays NaN: the quiet bit survives truncation
                elif sr:
                    u = u + np.uint32(np.random.randint(0, 65536))  # stochastic rounding
                else:
                    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # nearest even
                dst[start + j] = np.int16(np.int32(u >> np.uint32(16)) - (65536 if (u >> np.uint32(31)) else 0))

        return store_bf16
    return lambda dst, start, row, sr: None


# Reassociation lets LLVM vectorize the row/column sums; no-NaN/no-inf flags stay off so that
# non-finite values propagate exactly as on the torch path.
_FASTMATH = {"reassoc", "contract", "nsz"}

# Rows are walked in tiles of this many columns, so that the tile's column factors and column sums
# (4 × 4 KiB in fp32) stay in L1 while the rows stream past (256: 1.3×, 4096: 1.1× the step time of
# 1024 on a 4096×4096 tensor, one thread).
_COLUMN_TILE = 1024
# Elements of the next row's segment prefetched while this one runs (a 4096-element page of fp32 is
# a new stream for the hardware prefetcher; 256: 9–18% off the 52M set's step at 2 threads, 64 and
# the whole segment less).
_PREFETCH = 256


# Eight sign bits ↔ eight bytes of 0/1 in one uint64, branch-free and vectorizable: spreading
# copies the byte into every lane and keeps bit t in lane t (adding 0x7F then carries it to bit 7);
# gathering multiplies each lane's bit to bit 56 + t.
_SPREAD_COPIES = np.uint64(0x0101010101010101)
_SPREAD_BITS = np.uint64(0x8040201008040201)
_SPREAD_CARRY = np.uint64(0x7F7F7F7F7F7F7F7F)
_GATHER = np.uint64(0x0102040810204080)


@numba.njit(inline="always")
def _unpack_bytes(signs, first, count, lanes):
    """Bytes ``first .. first+count`` of ``signs`` → ``lanes`` (uint64 view): one 0/1 byte per bit."""
    src = signs[first : first + count]  # indexed from 0: no negative-index wraparound, so LLVM vectorizes
    for b in range(count):
        spread = (np.uint64(src[b]) * _SPREAD_COPIES) & _SPREAD_BITS
        lanes[b] = ((spread + _SPREAD_CARRY) >> np.uint64(7)) & _SPREAD_COPIES


@numba.njit(inline="always")
def _pack_bytes(signs, first, count, lanes):
    """Inverse of :func:`_unpack_bytes`: every lane byte must be 0 or 1."""
    dst = signs[first : first + count]
    for b in range(count):
        dst[b] = np.uint8((lanes[b] * _GATHER) >> np.uint64(56))


@numba.njit
def _count_bad(grow, big):
    """NaN/inf elements of a row (rare: the vectorized loop only flags that there are some)."""
    bad = 0
    for j in range(grow.shape[0]):
        bad += 0 if abs(grow[j]) <= big else 1
    return bad


@numba.njit(inline="always")
def _capped(x, cap):
    """``x`` at most ``cap`` (NaN stays NaN): what one element adds to a factor sum."""
    return cap if x > cap else x


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _element(w, g, col_v, rv, beta2, rest2, gsign, shrink, l2, keep_bad, big, zero):
    """One element's decayed weight, prepared gradient and this step's V; and whether the raw
    gradient was finite (NaN/inf become 0 unless ``keep_bad``)."""
    wj = w * shrink
    graw = g * gsign
    finite = abs(graw) <= big  # False for NaN
    gj = (graw if finite | keep_bad else zero) + l2 * wj  # bitwise: no branch in the loop
    return wj, gj, beta2 * (rv * col_v) + rest2 * (gj * gj), finite


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_with_momentum(wrow, grow, nonneg, col_m, col_v, acc_m, acc_v, rm, rv,
                       lr, beta1, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap):
    """One row segment; ``nonneg`` holds its stored sign bits as 0/1 and gets the new ones."""
    zero = beta2 - beta2
    sum_m = zero
    sum_v = zero
    any_bad = False
    keep_bad = not zero_bad
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = _element(wrow[j], grow[j], col_v[j], rv, beta2, rest2, gsign, shrink, l2, keep_bad, big, zero)
        any_bad |= not finite
        mag = rm * col_m[j]
        mj = beta1 * (mag if nonneg[j] else -mag) + rest1 * gj
        nonneg[j] = mj >= 0
        a = _capped(abs(mj), cap)
        vs = _capped(vj, cap)
        sum_m += a
        sum_v += vs
        acc_m[j] += a
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    return sum_m, sum_v, _count_bad(grow, big) if any_bad else 0


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_without_momentum(wrow, grow, col_v, acc_v, rv, lr, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap):
    zero = beta2 - beta2
    sum_v = zero
    any_bad = False
    keep_bad = not zero_bad
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = _element(wrow[j], grow[j], col_v[j], rv, beta2, rest2, gsign, shrink, l2, keep_bad, big, zero)
        any_bad |= not finite
        vs = _capped(vj, cap)
        sum_v += vs
        acc_v[j] += vs
        wrow[j] = wj - lr * (gj / (math.sqrt(vj) + eps))
    return sum_v, _count_bad(grow, big) if any_bad else 0


# The 1-bit magnitude flag (magnitude_bits=1): F = [|M| > r cᵀ] needs the *new* factors of |M|,
# which need every row's |M|: a first pass steps the weights and sums |M| and V, then a second pass
# forms M again (same arithmetic, same inputs) and writes S and F (:func:`_flag_rows_pass`). See
# :func:`smmf.functional.store_magnitude_flag_`.


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _flagged_momentum(g_term, nonneg, above, col, high_coef, low_coef):
    """This step's M from the stored code, sign · r·c · (high where flagged, else low), times β1, plus
    ``g_term`` = (1 − β1)·G: ``high_coef``/``low_coef`` = β1·r·high / β1·r·low of the run's M row."""
    mag = (high_coef if above else low_coef) * col
    return (mag if nonneg else -mag) + g_term


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_flag_sums(wrow, grow, nonneg, above, col_m, acc_m, high_coef, low_coef,
                   rest1, gsign, shrink, l2, zero_bad, big, cap):
    """First pass over a run of one M row: the capped |M| into ``acc_m`` and the returned row sum.
    ``wrow`` is only read for L2 decay (``l2 != 0``)."""
    zero = rest1 - rest1
    sum_m = zero
    keep_bad = not zero_bad
    signed_rest1 = rest1 * gsign  # gsign is ±1: (1 − β1)·gsign·G to the bit
    for j in range(grow.shape[0]):
        gj = grow[j]
        gj = gj if (abs(gj) <= big) | keep_bad else zero
        g_term = rest1 * (gj * gsign + l2 * (wrow[j] * shrink)) if l2 != 0 else signed_rest1 * gj
        a = _capped(abs(_flagged_momentum(g_term, nonneg[j], above[j], col_m[j], high_coef, low_coef)), cap)
        sum_m += a
        acc_m[j] += a
    return sum_m


@numba.njit(inline="always")
def _finite_or_cap(x, cap):
    """NaN → 0, above ``cap`` → ``cap`` (:func:`smmf.functional.magnitude_flag_fit`)."""
    return cap - cap if x != x else (cap if x > cap else x)


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _flag_fit(mj, estimate, cap, zero):
    """One element encoded against the new factors (``estimate`` = its R): sign and flag, and what it
    adds to the flag's least-squares sums Σ_F |M|·R, Σ_F R², Σ_¬F |M|·R, Σ_¬F R² (capped)."""
    a = abs(mj)
    flagged = a > estimate
    fit = _finite_or_cap(a * estimate, cap)
    energy = _finite_or_cap(estimate * estimate, cap)
    return (mj >= 0, flagged, fit if flagged else zero, energy if flagged else zero, zero if flagged else fit,
            zero if flagged else energy)


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_flag_update(wrow, grow, nonneg, above, col_m, acc_m, col_v, acc_v, high_coef, low_coef, rv,
                     lr, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap):
    """First pass without L2 decay, over a run of one M row: the weights from this step's M
    (decoded from the stored code, whose bits are only read), the capped |M| and V into
    ``acc_m``/``acc_v``; returns |M|'s and V's row sums and the NaN/inf elements met."""
    zero = beta2 - beta2
    sum_m = zero
    sum_v = zero
    any_bad = False
    keep_bad = not zero_bad
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = _element(wrow[j], grow[j], col_v[j], rv, beta2, rest2, gsign, shrink, l2, keep_bad, big, zero)
        any_bad |= not finite
        mj = _flagged_momentum(rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        a = _capped(abs(mj), cap)
        vs = _capped(vj, cap)
        sum_m += a
        sum_v += vs
        acc_m[j] += a
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    return sum_m, sum_v, _count_bad(grow, big) if any_bad else 0


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_flag_encode(grow, nonneg, above, col_m, new_col_m, high_coef, low_coef, new_rm, fits, rest1, gsign,
                     zero_bad, big, cap):
    """Second pass without L2 decay, over a run of one M row: this step's M formed again (as
    :func:`_row_flag_sums` forms it), its new sign and flag bits (0/1 in ``nonneg``/``above``) and
    the flag's least-squares sums (:func:`_flag_fit`) added into ``fits``. Reads only the gradient."""
    zero = rest1 - rest1
    fit_high = zero
    energy_high = zero
    fit_low = zero
    energy_low = zero
    keep_bad = not zero_bad
    signed_rest1 = rest1 * gsign
    for j in range(grow.shape[0]):
        gj = grow[j]
        gj = gj if (abs(gj) <= big) | keep_bad else zero
        mj = _flagged_momentum(signed_rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        nonneg[j], above[j], fh, eh, fl, el = _flag_fit(mj, new_rm * new_col_m[j], cap, zero)
        fit_high += fh
        energy_high += eh
        fit_low += fl
        energy_low += el
    fits[0] += fit_high
    fits[1] += energy_high
    fits[2] += fit_low
    fits[3] += energy_low


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_flag_write(wrow, grow, nonneg, above, col_m, new_col_m, col_v, acc_v, high_coef, low_coef, new_rm, rv, fits,
                    lr, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap):
    """Second pass with L2 decay (M needs the weights before the step), over a run of one M row:
    :func:`_row_flag_encode` and the weights and V of :func:`_row_flag_update` in one loop; returns
    V's row sum and the NaN/inf elements met."""
    zero = beta2 - beta2
    sum_v = zero
    fit_high = zero
    energy_high = zero
    fit_low = zero
    energy_low = zero
    any_bad = False
    keep_bad = not zero_bad
    for j in range(wrow.shape[0]):
        wj, gj, vj, finite = _element(wrow[j], grow[j], col_v[j], rv, beta2, rest2, gsign, shrink, l2, keep_bad, big, zero)
        any_bad |= not finite
        mj = _flagged_momentum(rest1 * gj, nonneg[j], above[j], col_m[j], high_coef, low_coef)
        nonneg[j], above[j], fh, eh, fl, el = _flag_fit(mj, new_rm * new_col_m[j], cap, zero)
        fit_high += fh
        energy_high += eh
        fit_low += fl
        energy_low += el
        vs = _capped(vj, cap)
        sum_v += vs
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    fits[0] += fit_high
    fits[1] += energy_high
    fits[2] += fit_low
    fits[3] += energy_low
    return sum_v, _count_bad(grow, big) if any_bad else 0


@numba.njit(inline="always")
def _first_m_row(first_row, m, m_cols):
    """The first row of M's view that row ``first_row`` of V's view (m columns) touches."""
    return (first_row * m) // m_cols


@numba.njit(inline="always")
def _m_rows_touched(rows, m, m_cols):
    """At most this many rows of M's view hold elements of ``rows`` consecutive rows of V's."""
    return (rows * m + m_cols - 1) // m_cols + 1


@numba.njit(inline="always")
def _gather_m_rows(row_m, row_acc_m, row0, row_end, m, m_cols, rows_per_block):
    """M's row factor sums: every block's partial sums of the rows it touched, added up (blocks of
    ``rows_per_block`` rows of V's view from ``row0`` to ``row_end``; other rows get 0)."""
    row_m[:] = 0
    for b in range(row_acc_m.shape[0]):
        first_row = row0 + b * rows_per_block
        end_row = min(row_end, first_row + rows_per_block)
        lo = _first_m_row(first_row, m, m_cols)
        hi = (end_row * m - 1) // m_cols + 1
        for r in range(lo, hi):
            row_m[r] += row_acc_m[b, r - lo]


@numba.njit(inline="always")
def _byte_span(start, width):
    """The bytes of packed bits that elements ``start .. start + width`` use: the first, how many, and
    the bit of element ``start`` in the first."""
    first = start >> 3
    return first, ((start + width - 1) >> 3) - first + 1, start & 7


@numba.njit(inline="always")
def _m_run(k, start, width, m_cols):
    """From element ``k`` of a segment (elements ``start .. start + width``), the run that stays in one row
    of M's view (``m_cols`` columns): that row, the run's first column in it, and its bounds j0 .. j1
    in the segment."""
    m_row = k // m_cols
    return m_row, k - m_row * m_cols, k - start, min(width, (m_row + 1) * m_cols - start)


@numba.njit(inline="always", error_model="numpy", fastmath=_FASTMATH)
def _rows_pass(w, g, signs, row_m, col_m, row_v, col_v, acc_m, acc_v, msums, first_row, end_row, m, m_cols,
               lo, hi, has_m, sr, zero_bad, scalars):
    """Rows ``first_row .. end_row`` of V's n×m view (one thread): the weights and sign bits in
    place, the rows' new V sums into ``row_v``, the column sums into ``acc_m``/``acc_v`` and the
    sums of the rows of M's own view (``m_cols`` columns; ``m`` unless momentum_shape="natural")
    that these elements touch into ``msums``, from :func:`_first_m_row` on (all zeroed here);
    returns the NaN/inf gradient elements met. M's row factors are only read: the caller adds
    up ``msums`` of every block once all have run. ``scalars``: :func:`_scalars`.

    Only the elements ``lo .. hi`` of the row-major flattening are there (an FSDP2 shard's, whose
    first and last rows may be partial; the whole matrix otherwise): ``w``, ``g`` and the sign bits
    start at element ``lo``."""
    lr, beta1, rest1, beta2, rest2, eps, gsign, shrink, l2, big, cap = scalars
    # A segment's sign bits span at most tile // 8 + 2 bytes; it is unpacked with its whole first
    # and last bytes, so the neighbours' bits go back unchanged (same thread, one after another).
    tile = min(m, _COLUMN_TILE)
    acc_v[:] = 0
    acc_m[:] = 0
    msums[:] = 0
    m_row0 = _first_m_row(first_row, m, m_cols)
    # Row sums build up over the column tiles; the old row factors are read until the end.
    sums_v = np.zeros(end_row - first_row, dtype=row_v.dtype)
    wbuf = np.empty(tile, dtype=np.uint32)
    gbuf = np.empty(tile, dtype=np.uint32)
    lanes = np.empty(tile // 8 + 2, dtype=np.uint64)
    bits = lanes.view(np.uint8)
    bad = 0
    for c0 in range(0, m, tile):
        for i in range(first_row, end_row):
            start = max(i * m + c0, lo)  # the segment: elements start .. start + width, columns col0 ..
            width = min(i * m + min(m, c0 + tile), hi) - start
            if width <= 0:
                continue
            col0 = start - i * m
            here = start - lo  # where the segment lies in w, g and the sign bits
            if i + 1 < end_row:  # the next row's segment starts a new stream: start it early
                _prefetch_lines(w, here + m, min(width, _PREFETCH))
                _prefetch_lines(g, here + m, min(width, _PREFETCH))
            wseg = _load(w, here, width, wbuf)
            gseg = _load(g, here, width, gbuf)
            if has_m:
                first, count, offset = _byte_span(here, width)
                _unpack_bytes(signs, first, count, lanes)
                # The segment in runs along one row of M's view (one run when it is V's).
                sum_v = beta2 - beta2  # 0 in the work dtype
                seg_bad = 0
                k = start
                while k < start + width:
                    m_row, m_col, j0, j1 = _m_run(k, start, width, m_cols)
                    run_m, run_v, run_bad = _row_with_momentum(
                        wseg[j0:j1], gseg[j0:j1], bits[offset + j0 : offset + j1],
                        col_m[m_col : m_col + j1 - j0], col_v[col0 + j0 : col0 + j1],
                        acc_m[m_col : m_col + j1 - j0], acc_v[col0 + j0 : col0 + j1], row_m[m_row], row_v[i],
                        lr, beta1, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap)
                    msums[m_row - m_row0] += run_m
                    sum_v += run_v
                    seg_bad += run_bad
                    k = start + j1
                _pack_bytes(signs, first, count, lanes)
            else:
                sum_v, seg_bad = _row_without_momentum(
                    wseg, gseg, col_v[col0 : col0 + width], acc_v[col0 : col0 + width], row_v[i],
                    lr, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap)
            sums_v[i - first_row] += sum_v
            bad += seg_bad
            _store(w, here, wseg, sr)
    row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", error_model="numpy", fastmath=_FASTMATH)
def _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts,
          n, m, m_cols, row0, rows_per_block, lo, hi, has_m, sr, zero_bad, whole, scalars):
    """One SMMF step of one n×m matrix, in place; or of the elements ``lo .. hi`` of its row-major
    flattening that an FSDP2 shard holds (``whole`` False).

    Arrays (flat, row-major; "work" is float32, or float64 for fp64 params):
      w, g             the weight and gradient, elements lo .. hi (0 .. n·m): work dtype, or int16 bit patterns of
                       bf16 (:func:`_load`/:func:`_store` convert); w is read and written, g only read
      signs            uint8, ceil((hi − lo)/8): the sign bits of M, bit k%8 of byte k//8 set when
                       element lo + k is ≥ 0 — the layout :func:`smmf.matrix.pack_signs` specifies
      row_m, col_m     work dtype: the factors of |M| in M's own view (n·m / m_cols rows, m_cols
                       columns; V's view unless momentum_shape="natural"); unused without a
                       first moment
      row_v, col_v     work dtype, n and m: the factors of V
      col_acc_m/_v     work dtype, blocks × m_cols / m: scratch for each block's column sums
      row_acc_m        work dtype, blocks × :func:`_m_rows_touched`: each block's M row sums
      bad_counts       int64, blocks: NaN/inf gradient elements each block met
    Scalars: m_cols; blocks of rows_per_block rows from row0 (lo // m); lo, hi; has_m (False: no
    first moment); sr: stochastic rounding
    (bf16); zero_bad: NaN/inf gradient elements count as 0; whole: the factors are normalized here
    (else the four factor vectors are left holding this piece's raw row and column sums, 0 for the
    rows it lacks, for the caller to add up across shards); ``scalars``, :func:`_scalars`: lr; beta1,
    beta2 (this step's β1_t, β2_t) and rest1, rest2 (1 − β1_t, 1 − β2_t, rounded once from
    float64 as on the torch path — and opaque to LLVM, which would otherwise rewrite
    β·a + (1 − β)·b as b + β·(a − b), NaN when b is inf); eps; gsign, shrink, l2 from
    :meth:`StepConfig.folded`; big: the work dtype's largest finite value; cap:
    :func:`smmf.matrix.factor_sum_cap`.

    Invariants: every block starts on a byte of ``signs`` (rows_per_block·m and, with more than one
    block, row0·m − lo are multiples of 8), so no two threads write one byte; sums run in a fixed order for a given block layout, which
    depends on the thread count only: runs with the same count are bit-identical.

    Inlined into :func:`_kernel_parallel` (blocks on threads) and :func:`_kernel_serial` (one
    thread, for small tensors: waking the pool costs more than their step).
    """
    row_end = (hi + m - 1) // m
    for b in numba.prange(col_acc_v.shape[0]):
        first_row = row0 + b * rows_per_block
        bad_counts[b] = _rows_pass(
            w, g, signs, row_m, col_m, row_v, col_v, col_acc_m[b], col_acc_v[b], row_acc_m[b],
            first_row, min(row_end, first_row + rows_per_block), m, m_cols, lo, hi, has_m, sr, zero_bad, scalars)
    if not whole:  # rows of other shards: 0 in the sums to add up
        row_v[:row0] = 0
        row_v[row_end:] = 0
    _finish_cols(row_v, col_v, col_acc_v, whole)
    if has_m:
        _gather_m_rows(row_m, row_acc_m, row0, row_end, m, m_cols, rows_per_block)
        _finish_cols(row_m, col_m, col_acc_m, whole)


def _cached_njit(**options: Any) -> Any:
    """``numba.njit`` with ``cache=True``: compiled once per machine and source version, then loaded
    in every process (in ``__pycache__`` beside this file, else numba's user-wide cache dir, or
    ``NUMBA_CACHE_DIR``). Where numba finds no writable place it compiles in every process instead;
    a cache entry that cannot be read is compiled again (:func:`_tolerate_broken_cache`)."""

    def jit(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(fn)
        _tolerate_broken_cache(dispatcher)
        return dispatcher

    return jit


_broken_cache_warned = False


def _warn_broken_cache(action: str, error: BaseException) -> None:
    global _broken_cache_warned
    if not _broken_cache_warned:
        _broken_cache_warned = True
        warnings.warn(f"smmf: numba's cache of the fused kernels could not be {action} ({type(error).__name__}: "
                      f"{error}); compiling them instead. Warned once per process.", RuntimeWarning, stacklevel=2)


def _tolerate_broken_cache(dispatcher: Any) -> None:
    """A truncated or overwritten cache file (index or data) makes numba raise at the first call of
    every later process (``UnpicklingError``, ``EOFError``, an LLVM bitcode error, ...). Here a load
    that fails warns once, drops the index so that the fresh compile writes a new entry, and
    compiles; a save that fails keeps the compiled kernel uncached."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload"):
        return
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        try:
            return load(sig, target_context)
        except Exception as error:  # noqa: BLE001 - any unreadable entry: compile instead
            _warn_broken_cache("read", error)
            with contextlib.suppress(OSError, AttributeError):
                os.remove(cache._cache_file._index_path)
            return None

    def save_overload(sig: Any, data: Any) -> None:
        try:
            save(sig, data)
        except Exception as error:  # noqa: BLE001
            _warn_broken_cache("written", error)

    cache.load_overload, cache.save_overload = load_overload, save_overload


_KERNEL_OPTIONS = dict(nogil=True, error_model="numpy", fastmath=_FASTMATH)


@_cached_njit(parallel=True, **_KERNEL_OPTIONS)
def _kernel_parallel(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts,
                     n, m, m_cols, row0, rows_per_block, lo, hi, has_m, sr, zero_bad, whole, scalars):
    _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts,
          n, m, m_cols, row0, rows_per_block, lo, hi, has_m, sr, zero_bad, whole, scalars)


@_cached_njit(**_KERNEL_OPTIONS)
def _kernel_serial(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts,
                   n, m, m_cols, row0, rows_per_block, lo, hi, has_m, sr, zero_bad, whole, scalars):
    _step(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, row_acc_m, bad_counts,
          n, m, m_cols, row0, rows_per_block, lo, hi, has_m, sr, zero_bad, whole, scalars)


@numba.njit(inline="always", error_model="numpy", fastmath=_FASTMATH)
def _flag_rows_pass(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v,
                    acc_m, acc_v, msums, fits, first_row, end_row, m, m_cols, lo, hi, phase, sr, zero_bad, scalars):
    """Rows ``first_row .. end_row`` of V's n×m view under the magnitude flag (one thread), like
    :func:`_rows_pass`, in one of two passes (``phase`` 0, 1); this step's M is formed from the same
    inputs in both. Either pass may *update*: the weights in place, the rows' new V sums into
    ``row_v``, V's column sums into ``acc_v``, returning the NaN/inf gradient elements met. The
    first pass sums |M| into ``acc_m`` (columns) and ``msums`` (rows of M's view, from
    :func:`_first_m_row` on); the second (``new_row_m``/``new_col_m`` hold the new factors of |M|)
    *encodes*: the sign and flag bits in place and the flag's level sums into ``fits``. Without L2
    decay the first pass updates, and the second reads only the gradient and the bits (a third of
    the bytes); with it, M needs the weights before the step, so the first pass only reads and the
    second encodes and updates. Only the elements ``lo .. hi`` are there, as in :func:`_rows_pass`.
    ``scalars``: :func:`_scalars`."""
    lr, beta1, rest1, beta2, rest2, eps, gsign, shrink, l2, big, cap = scalars
    high, low = levels[0], levels[1]
    updates = (phase == 0) == (l2 == 0)
    encodes = phase == 1
    reads_w = updates or l2 != 0
    tile = min(m, _COLUMN_TILE)
    acc_m[:] = 0
    msums[:] = 0
    fits[:] = 0
    if updates:  # V's column sums are kept from the pass that made them to the end of the step
        acc_v[:] = 0
    m_row0 = _first_m_row(first_row, m, m_cols)
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
                _prefetch_lines(g, here + m, min(width, _PREFETCH))
                _prefetch_lines(w, here + m, min(width, _PREFETCH))
            elif not updates and i + 2 < end_row:  # a lighter loop: fetch further ahead
                _prefetch_lines(g, here + 2 * m, width)
                if reads_w:
                    _prefetch_lines(w, here + 2 * m, width)
            gseg = _load(g, here, width, gbuf)
            wseg = _load(w, here, width, wbuf) if reads_w else gseg
            first, count, offset = _byte_span(here, width)
            _unpack_bytes(signs, first, count, sign_lanes)
            _unpack_bytes(flags, first, count, flag_lanes)
            sum_v = beta2 - beta2
            k = start
            while k < start + width:  # runs along one row of M's view
                m_row, m_col, j0, j1 = _m_run(k, start, width, m_cols)
                run = slice(offset + j0, offset + j1)
                m_run = slice(m_col, m_col + j1 - j0)
                high_coef = beta1 * row_m[m_row] * high
                low_coef = beta1 * row_m[m_row] * low
                if encodes and updates:
                    run_v, run_bad = _row_flag_write(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], new_col_m[m_run],
                        col_v[col0 + j0 : col0 + j1], acc_v[col0 + j0 : col0 + j1], high_coef, low_coef, new_row_m[m_row],
                        row_v[i], fits, lr, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap)
                    sum_v += run_v
                    bad += run_bad
                elif encodes:
                    _row_flag_encode(gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], new_col_m[m_run],
                                     high_coef, low_coef, new_row_m[m_row], fits, rest1, gsign, zero_bad, big, cap)
                elif updates:
                    run_m, run_v, run_bad = _row_flag_update(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], acc_m[m_run],
                        col_v[col0 + j0 : col0 + j1], acc_v[col0 + j0 : col0 + j1], high_coef, low_coef, row_v[i],
                        lr, rest1, beta2, rest2, eps, gsign, shrink, l2, zero_bad, big, cap)
                    msums[m_row - m_row0] += run_m
                    sum_v += run_v
                    bad += run_bad
                else:
                    msums[m_row - m_row0] += _row_flag_sums(
                        wseg[j0:j1], gseg[j0:j1], sign_bits[run], flag_bits[run], col_m[m_run], acc_m[m_run],
                        high_coef, low_coef, rest1, gsign, shrink, l2, zero_bad, big, cap)
                k = start + j1
            if encodes:
                _pack_bytes(signs, first, count, sign_lanes)
                _pack_bytes(flags, first, count, flag_lanes)
            if updates:
                sums_v[i - first_row] += sum_v
                _store(w, here, wseg, sr)
    if updates:
        row_v[first_row:end_row] = sums_v
    return bad


@numba.njit(inline="always", error_model="numpy", fastmath=_FASTMATH)
def _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v,
               col_acc_m, col_acc_v, row_acc_m, fits, bad_counts, n, m, m_cols, rows_per_block, span, sr, zero_bad,
               scalars):
    """One SMMF step of one n×m matrix with the magnitude flag, in place: :func:`_step`'s
    arguments, and ``flags`` (uint8, laid out as ``signs``), ``levels`` (work dtype, 2: high,
    low), ``new_row_m``/``new_col_m`` (the size of ``row_m``/``col_m``) and ``fits`` (work dtype,
    blocks × 4: each block's level sums). ``span`` = (row0, lo, hi, first pass, last pass + 1).

    The whole matrix (0, 0, n·m, 0, 2): two passes (:func:`_flag_rows_pass`), the new factors of
    |M| made between them in ``new_row_m``/``new_col_m``, then the factors and levels stored. An
    FSDP2 shard's elements lo .. hi take one pass per call, for the caller to add up the shards'
    sums between them: pass 0 leaves |M|'s raw row and column sums in ``new_row_m``/``new_col_m``;
    pass 1 reads the new factors from them and leaves its blocks' level sums in ``fits``; the pass
    that updates (0 without L2 decay, else 1) leaves V's raw sums in ``row_v``/``col_v`` (0 for
    rows the shard lacks). Neither touches ``row_m``, ``col_m`` or ``levels``."""
    row0, lo, hi, first_pass, end_pass = span
    whole = first_pass == 0 and end_pass == 2
    row_end = (hi + m - 1) // m
    l2 = scalars[8]
    for phase in range(first_pass, end_pass):  # one call site: numba inlines a closure once per function
        if phase == 1 and whole:  # the new factors of |M|, from the first pass's sums
            _gather_m_rows(new_row_m, row_acc_m, row0, row_end, m, m_cols, rows_per_block)
            _finish_cols(new_row_m, new_col_m, col_acc_m, True)
        for b in numba.prange(col_acc_v.shape[0]):
            first_row = row0 + b * rows_per_block
            bad = _flag_rows_pass(
                w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m[b],
                col_acc_v[b], row_acc_m[b], fits[b], first_row, min(row_end, first_row + rows_per_block), m, m_cols,
                lo, hi, phase, sr, zero_bad, scalars)
            if (phase == 0) == (l2 == 0):  # the pass that updated
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
            levels[level] = fit / energy if energy > 0 else 0
    else:
        if first_pass == 0:
            _gather_m_rows(new_row_m, row_acc_m, row0, row_end, m, m_cols, rows_per_block)
            _finish_cols(new_row_m, new_col_m, col_acc_m, False)
        if (first_pass == 0) == (l2 == 0):  # this pass updated: V's raw sums, 0 for other shards' rows
            row_v[:row0] = 0
            row_v[row_end:] = 0
            _finish_cols(row_v, col_v, col_acc_v, False)


@_cached_njit(parallel=True, **_KERNEL_OPTIONS)
def _flag_kernel_parallel(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v,
                          col_acc_m, col_acc_v, row_acc_m, fits, bad_counts, n, m, m_cols, rows_per_block, span, sr,
                          zero_bad, scalars):
    _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m, col_acc_v,
               row_acc_m, fits, bad_counts, n, m, m_cols, rows_per_block, span, sr, zero_bad, scalars)


@_cached_njit(**_KERNEL_OPTIONS)
def _flag_kernel_serial(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v,
                        col_acc_m, col_acc_v, row_acc_m, fits, bad_counts, n, m, m_cols, rows_per_block, span, sr,
                        zero_bad, scalars):
    _flag_step(w, g, signs, flags, row_m, col_m, new_row_m, new_col_m, levels, row_v, col_v, col_acc_m, col_acc_v,
               row_acc_m, fits, bad_counts, n, m, m_cols, rows_per_block, span, sr, zero_bad, scalars)


@intrinsic
def _address(typingctx, address):  # noqa: ARG001 - numba's intrinsic signature
    """An integer address as a ``void*`` (for :func:`numba.carray`)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@numba.njit(inline="always")
def _float_array(address, length):
    return numba.carray(_address(address), length, np.float32)


# Cached like the others. A tensor that :func:`_takes_many` accepts always takes this launch, alone (the
# step inside backward steps one tensor at a time) or with others, never _kernel_serial's own: numba's
# cached copy of this launch may round a sum differently from that one, and the loop and the step
# inside backward must run the same machine code.
@_cached_njit(parallel=True, **_KERNEL_OPTIONS)
def _many_kernel(addresses, sizes, scalars, flags, bad_counts):
    """The steps of small fp32 tensors in one launch, one tensor per thread at a time.

    Per tensor t: ``addresses[t]`` = data addresses of (w, g, signs, row_m, col_m, row_v, col_v),
    ``sizes[t]`` = (n, m, m_cols), ``scalars[t]`` = :func:`_scalars`, ``flags[t]`` = (has_m,
    zero_bad). Each tensor is one call of :func:`_kernel_serial`'s code, so how many tensors share a
    launch changes no bit. The caller keeps every tensor alive.
    """
    for t in numba.prange(addresses.shape[0]):
        n, m, m_cols = sizes[t, 0], sizes[t, 1], sizes[t, 2]
        has_m = flags[t, 0] != 0
        m_rows = n * m // m_cols if has_m else 0
        a = addresses[t]
        sc = scalars[t]
        signs = numba.carray(_address(a[2]), (n * m + 7) // 8 if has_m else 0, np.uint8)
        row_m, col_m = _float_array(a[3], m_rows), _float_array(a[4], m_cols if has_m else 0)
        bad = np.zeros(1, dtype=np.int64)
        _kernel_serial(
            _float_array(a[0], n * m), _float_array(a[1], n * m), signs, row_m, col_m, _float_array(a[5], n),
            _float_array(a[6], m), np.empty((1, col_m.shape[0]), dtype=np.float32), np.empty((1, m), dtype=np.float32),
            np.empty((1, _m_rows_touched(n, m, m_cols)), dtype=np.float32), bad, n, m, m_cols, 0, n, 0, n * m,
            has_m, False, flags[t, 1] != 0, True, (sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7], sc[8], sc[9], sc[10]))
        bad_counts[t] = bad[0]


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


# numba's workqueue threading layer (its fallback where OpenMP and TBB are missing) aborts the
# process when two threads enter parallel regions at once: parallel launches take turns. Each
# already uses every core, so with OpenMP or TBB this costs nothing.
_PARALLEL_LAUNCH = threading.Lock()

# Small tensors run on one thread: waking the thread pool costs more than their whole step.
_PARALLEL_MIN_NUMEL = 1 << 16
_KERNELS = {True: _kernel_parallel, False: _kernel_serial}
_FLAG_KERNELS = {True: _flag_kernel_parallel, False: _flag_kernel_serial}


def _block_layout(rows: int, cols: int) -> tuple[int, int]:
    """Rows per block (a multiple that keeps blocks byte-aligned in the sign bits) and blocks."""
    align = 8 // math.gcd(cols, 8)
    parallel = rows * cols >= _PARALLEL_MIN_NUMEL
    target_blocks = max(1, 4 * numba.get_num_threads()) if parallel else 1
    rows_per_block = max(align, -(-rows // target_blocks))
    rows_per_block = -(-rows_per_block // align) * align
    return rows_per_block, -(-rows // rows_per_block)


def _as_numpy(t: Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy()


def numba_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> int:
    """The fused step: same contract as :func:`smmf.functional.torch_step_`."""
    return numba_steps_([(param, grad, state, cfg)])


def _own_launch(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> int:
    """A tensor's step in a launch of its own (all but the small fp32 ones)."""
    rows, cols = matrix_shape(param)
    if rows == 0:
        return 0
    # The kernel walks the logical row-major order: strided tensors go through one copy.
    weight = param.detach() if param.is_contiguous() else param.detach().contiguous()
    bad = _launch(weight, grad, state, cfg, rows, cols, 0, rows * cols)
    if weight.data_ptr() != param.data_ptr():
        param.detach().copy_(weight)
    return bad


def numba_shard_step_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int) -> int:
    """The fused pass over an FSDP2 shard: ``weight`` (contiguous) and ``grad`` hold the elements
    ``start ..`` of the parameter's row-major flattening, ``state`` is the rank-local state (whole
    factor vectors, this shard's sign bits). Updates the weight and sign bits; leaves in the four
    factor vectors this shard's raw row and column sums (0 for rows it lacks), for the caller to add
    up across shards and normalize (:func:`smmf.functional.store_factors_`). Returns the NaN/inf
    gradient elements met. The paper's code and the natural shape (the magnitude flag:
    :func:`numba_flag_shard_pass_`)."""
    rows, cols = state[ROW_V].numel(), state[COL_V].numel()
    return _launch(weight, grad, state, cfg, rows, cols, start, start + weight.numel())


def numba_flag_shard_pass_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                           flag_pass: FlagPass) -> int:
    """One of the magnitude flag's two passes over an FSDP2 shard (:func:`numba_shard_step_`'s
    arguments; :class:`smmf.kernels.FlagPass`). The pass that updates the weights is
    :func:`updating_flag_pass`'s. Returns the NaN/inf gradient elements the updating pass met (0
    from the other)."""
    rows, cols = state[ROW_V].numel(), state[COL_V].numel()
    return _launch(weight, grad, state, cfg, rows, cols, start, start + weight.numel(), flag_pass)


def updating_flag_pass(cfg: StepConfig) -> int:
    """0 without L2 decay; 1 with it (M needs the weights before the step, so the first pass only reads)."""
    return 0 if cfg.folded()[2] == 0 else 1


def _launch(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, rows: int, cols: int,
            lo: int, hi: int, flag_pass: Optional[FlagPass] = None) -> int:
    """Run the kernel over the elements ``lo .. hi`` of the rows × cols matrix that ``weight``
    (contiguous) holds; the factors are normalized when that is the whole matrix. Under the
    magnitude flag a shard takes one pass per call: ``flag_pass`` (:func:`numba_flag_shard_pass_`)."""
    if grad.dtype != weight.dtype:
        grad = grad.to(weight.dtype)
    grad = grad.contiguous()
    whole = lo == 0 and hi == rows * cols
    row0, row_end = lo // cols, -(-hi // cols)
    rows_per_block, blocks = _block_layout(row_end - row0, cols)
    if (row0 * cols - lo) % 8:  # a shard starting mid-byte of a row: one block, so no two threads share a byte
        rows_per_block, blocks = row_end - row0, 1
    has_m = cfg.beta1 is not None
    dtype = state[ROW_V].dtype
    scalar = np.float64 if dtype == torch.float64 else np.float32
    m_cols = momentum_cols(state, cols)
    col_acc_m = np.empty((blocks, m_cols if has_m else 0), dtype=scalar)
    col_acc_v = np.empty((blocks, cols), dtype=scalar)
    row_acc_m = np.empty((blocks, _m_rows_touched(rows_per_block, cols, m_cols) if has_m else 0), dtype=scalar)
    bad_counts = np.zeros(blocks, dtype=np.int64)
    parallel = hi - lo >= _PARALLEL_MIN_NUMEL
    empty = np.empty(0, dtype=scalar)
    w, g = _as_numpy(weight), _as_numpy(grad)
    scalars = tuple(scalar(x) for x in _scalars(cfg, rows * cols, dtype))
    fits = None
    args: tuple[Any, ...]
    if cfg.code is MomentumCode.FLAG:
        row_m, col_m = state[ROW_M].numpy(), state[COL_M].numpy()
        kernel = _FLAG_KERNELS[parallel]
        if flag_pass is None:
            assert whole, "a shard under the magnitude flag takes numba_flag_shard_pass_"
            passes, new_row_m, new_col_m = (0, 2), np.empty_like(row_m), np.empty_like(col_m)
        else:
            passes = (flag_pass.number, flag_pass.number + 1)
            new_row_m, new_col_m = flag_pass.new_row_m.numpy(), flag_pass.new_col_m.numpy()
        fits = np.empty((blocks, 4), dtype=scalar)
        args = (w, g, state[SIGN_M].numpy(), state[FLAG_M].numpy(), row_m, col_m, new_row_m, new_col_m,
                state[LEVELS_M].numpy(), state[ROW_V].numpy(), state[COL_V].numpy(), col_acc_m, col_acc_v, row_acc_m,
                fits, bad_counts, rows, cols, m_cols, rows_per_block, (row0, lo, hi, *passes),
                cfg.stochastic_rounding, cfg.zero_nonfinite, scalars)
    else:
        kernel = _KERNELS[parallel]
        args = (w, g, state[SIGN_M].numpy() if has_m else np.empty(0, dtype=np.uint8),
                state[ROW_M].numpy() if has_m else empty, state[COL_M].numpy() if has_m else empty,
                state[ROW_V].numpy(), state[COL_V].numpy(), col_acc_m, col_acc_v, row_acc_m, bad_counts, rows, cols,
                m_cols, row0, rows_per_block, lo, hi, has_m, cfg.stochastic_rounding, cfg.zero_nonfinite, whole,
                scalars)
    if parallel:
        with _PARALLEL_LAUNCH:
            kernel(*args)
    else:
        kernel(*args)
    if flag_pass is not None and flag_pass.number == 1:
        flag_pass.level_sums.copy_(torch.from_numpy(fits.sum(axis=0)))  # type: ignore[union-attr]
    return int(bad_counts.sum()) if cfg.zero_nonfinite else 0


def _scalars(cfg: StepConfig, numel: int, dtype: torch.dtype) -> list[float]:
    """The float scalars both kernels take, in order: lr, beta1, rest1, beta2, rest2, eps, gsign,
    shrink, l2, big, cap (see :func:`_step`); ``dtype`` is the work dtype."""
    beta1 = 0.0 if cfg.beta1 is None else cfg.beta1
    rest1 = 0.0 if cfg.beta1 is None else 1.0 - cfg.beta1
    return [cfg.lr, beta1, rest1, cfg.beta2, 1.0 - cfg.beta2, cfg.eps, *cfg.folded(), float(torch.finfo(dtype).max),
            factor_sum_cap(numel, dtype)]


def _takes_many(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Small contiguous fp32 tensors: their step is mostly per-launch overhead, so they share one."""
    return (param.dtype == torch.float32 and 0 < param.numel() < _PARALLEL_MIN_NUMEL and param.is_contiguous()
            and state[ROW_V].dtype == torch.float32 and cfg.code is not MomentumCode.FLAG)


def numba_steps_(items: Sequence[StepItem]) -> int:
    """The steps of many tensors: the small fp32 ones in one launch (:func:`_many_kernel`, a lone one
    too), the rest one by one."""
    bad = 0
    rows_of_addresses, sizes, scalars, flags, alive = [], [], [], [], []
    for param, grad, state, cfg in items:
        if not _takes_many(param, state, cfg):
            bad += _own_launch(param, grad, state, cfg)
            continue
        rows, cols = matrix_shape(param)
        grad = grad.contiguous()
        alive.append(grad)
        has_m = cfg.beta1 is not None
        moment = (state[SIGN_M].data_ptr(), state[ROW_M].data_ptr(), state[COL_M].data_ptr()) if has_m else (0, 0, 0)
        rows_of_addresses.append((param.data_ptr(), grad.data_ptr(), *moment, state[ROW_V].data_ptr(),
                                  state[COL_V].data_ptr()))
        sizes.append((rows, cols, momentum_cols(state, cols)))
        scalars.append(_scalars(cfg, rows * cols, torch.float32))
        flags.append((has_m, cfg.zero_nonfinite))
    if rows_of_addresses:
        bad_counts = np.zeros(len(sizes), dtype=np.int64)
        with _PARALLEL_LAUNCH:
            _many_kernel(np.array(rows_of_addresses, dtype=np.int64), np.array(sizes, dtype=np.int64),
                         np.array(scalars, dtype=np.float32), np.array(flags, dtype=np.int64), bad_counts)
        bad += int(sum(count for count, (_, zero_bad) in zip(bad_counts.tolist(), flags) if zero_bad))
    return bad



class _Numba:
    """The numba backend (:class:`smmf.kernels.Backend`)."""

    name = "numba"
    steps_ = staticmethod(numba_steps_)
    shard_step_ = staticmethod(numba_shard_step_)
    flag_shard_pass_ = staticmethod(numba_flag_shard_pass_)
    updating_flag_pass = staticmethod(updating_flag_pass)


BACKEND = _Numba()
