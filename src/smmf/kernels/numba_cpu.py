"""Fused single-pass SMMF step on CPU (numba).

One pass over the n×m view of a tensor, parallel over blocks of rows: each element's gradient,
weight and sign bit are read once, M̂ and V̂ are rebuilt from the factors on the fly, the weight
and the sign bit are written in place, and the row / column sums of |M| and V (the next factors)
are accumulated as the pass goes. Nothing of size N is allocated; each block keeps two column
accumulators of length m. Blocks start on a byte boundary of the packed signs, so no two
threads write the same byte.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from ..functional import StepConfig
from ..matrix import factor_sum_cap
from ..state import COL_M, COL_V, ROW_M, ROW_V, SIGN_M, matrix_shape

__all__ = ["numba_step_"]


@numba.njit(inline="always")
def _load_float(src, start, length, buf):  # noqa: ARG001 - fp32/fp64 rows are used in place
    return src[start : start + length]


@numba.njit(inline="always")
def _store_float(dst, start, row, sr):  # noqa: ARG001 - the row already lives in dst
    pass


@numba.njit(inline="always")
def _load_bf16(src, start, length, buf):
    for j in range(length):
        buf[j] = (np.uint32(src[start + j]) & np.uint32(0xFFFF)) << np.uint32(16)
    return buf.view(np.float32)


@numba.njit(inline="always")
def _store_bf16(dst, start, row, sr):
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


# Reassociation lets LLVM vectorize the row/column sums; no-NaN/no-inf flags stay off so that
# non-finite values propagate exactly as on the torch path.
_FASTMATH = {"reassoc", "contract", "nsz"}


@numba.njit(inline="always")
def _unpack_row(signs, start, length, out):
    """±1 per element of ``signs`` bits ``start .. start+length``."""
    for j in range(length):
        k = start + j
        out[j] = np.float32(((signs[k >> 3] >> (k & 7)) & 1) * 2 - 1)


@numba.njit(inline="always")
def _pack_row(signs, start, length, nonneg):
    """Write ``nonneg`` (0/1 per element) into the bits ``start .. start+length`` of ``signs``."""
    end = start + length
    for byte in range(start >> 3, ((end - 1) >> 3) + 1):
        lo = max(start, byte * 8)
        hi = min(end, byte * 8 + 8)
        value = signs[byte]
        for k in range(lo, hi):
            bit = 1 << (k & 7)
            value = (value | bit) if nonneg[k - start] else (value & ~bit)
        signs[byte] = value


@numba.njit(inline="always")
def _capped(x, cap):
    """``x`` at most ``cap`` (NaN stays NaN): what one element adds to a factor sum."""
    return cap if x > cap else x


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_with_momentum(wrow, grow, msign, nonneg, col_m, col_v, acc_m, acc_v, rm, rv,
                       lr, beta1, beta2, eps, gsign, shrink, l2, zero_bad, big, cap):
    one = beta2 - beta2 + 1  # 1 in the work dtype
    zero = beta2 - beta2
    sum_m = zero
    sum_v = zero
    bad = 0
    for j in range(wrow.shape[0]):
        wj = wrow[j] * shrink
        graw = grow[j] * gsign
        finite = abs(graw) <= big  # False for NaN
        bad += 0 if finite else 1
        gj = (graw if finite or not zero_bad else zero) + l2 * wj
        vj = beta2 * (rv * col_v[j]) + (one - beta2) * (gj * gj)
        mj = beta1 * (rm * col_m[j] * msign[j]) + (one - beta1) * gj
        nonneg[j] = mj >= 0
        a = _capped(abs(mj), cap)
        vs = _capped(vj, cap)
        sum_m += a
        sum_v += vs
        acc_m[j] += a
        acc_v[j] += vs
        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
    return sum_m, sum_v, bad


@numba.njit(inline="always")
def _unpack_row_bytes(signs, first_byte, length, sign_table, out):
    """:func:`_unpack_row` for a byte-aligned row: 8 elements per table lookup."""
    for bb in range(length >> 3):
        out[bb * 8 : bb * 8 + 8] = sign_table[signs[first_byte + bb]]


@numba.njit(inline="always")
def _pack_row_bytes(signs, first_byte, length, nonneg):
    """:func:`_pack_row` for a byte-aligned row: whole bytes, no read-modify-write."""
    for bb in range(length >> 3):
        value = np.uint8(0)
        for t in range(8):
            value |= np.uint8(nonneg[bb * 8 + t]) << np.uint8(t)
        signs[first_byte + bb] = value


@numba.njit(fastmath=_FASTMATH, error_model="numpy", inline="always")
def _row_without_momentum(wrow, grow, col_v, acc_v, rv, lr, beta2, eps, gsign, shrink, l2, zero_bad, big, cap):
    one = beta2 - beta2 + 1
    zero = beta2 - beta2
    sum_v = zero
    bad = 0
    for j in range(wrow.shape[0]):
        wj = wrow[j] * shrink
        graw = grow[j] * gsign
        finite = abs(graw) <= big
        bad += 0 if finite else 1
        gj = (graw if finite or not zero_bad else zero) + l2 * wj
        vj = beta2 * (rv * col_v[j]) + (one - beta2) * (gj * gj)
        vs = _capped(vj, cap)
        sum_v += vs
        acc_v[j] += vs
        wrow[j] = wj - lr * (gj / (math.sqrt(vj) + eps))
    return sum_v, bad


def _make_kernel(load, store, parallel):
    @numba.njit(parallel=parallel, nogil=True, error_model="numpy", fastmath=_FASTMATH)
    def kernel(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v, bad_counts,
               n, m, rows_per_block, lr, beta1, has_m, beta2, eps, gsign, shrink, l2, sr, sign_table,
               zero_bad, big, cap):
        """One SMMF step of one n×m matrix, in place.

        Arrays (flat, row-major; "work" is float32, or float64 for fp64 params):
          w, g             the weight and gradient, n·m elements: work dtype, or int16 bit patterns of
                           bf16 (``load``/``store`` convert); w is read and written, g only read
          signs            uint8, ceil(n·m/8): the sign bits of M, bit k%8 of byte k//8 set when
                           element k is ≥ 0 — the layout :func:`smmf.matrix.pack_signs` specifies
          row_m, col_m     work dtype, n and m: the factors of |M| (unused without a first moment)
          row_v, col_v     work dtype, n and m: the factors of V
          col_acc_m/_v     work dtype, blocks × m: scratch for each block's column sums
          bad_counts       int64, blocks: NaN/inf gradient elements each block met
          sign_table       work dtype, 256 × 8: ±1 for each bit of each byte value
        Scalars: rows_per_block; lr; beta1, beta2 (this step's β1_t, β2_t; has_m False: no first
        moment); eps; gsign, shrink, l2 from :meth:`StepConfig.folded`; sr: stochastic rounding
        (bf16); zero_bad: NaN/inf gradient elements count as 0; big: the work dtype's largest
        finite value; cap: :func:`smmf.matrix.factor_sum_cap`.

        Invariants: every block starts on a byte of ``signs`` (rows_per_block·m is a multiple of
        8), so no two threads write one byte; sums run in a fixed order for a given block layout, which
        depends on the thread count only: runs with the same count are bit-identical.
        """
        nblocks = col_acc_v.shape[0]
        aligned = m % 8 == 0  # every row starts and ends on a byte of the packed signs
        for b in numba.prange(nblocks):
            acc_v = col_acc_v[b]
            acc_v[:] = 0
            if has_m:
                acc_m = col_acc_m[b]
                acc_m[:] = 0
            wbuf = np.empty(m, dtype=np.uint32)
            gbuf = np.empty(m, dtype=np.uint32)
            msign = np.empty(m, dtype=row_v.dtype)
            nonneg = np.empty(m, dtype=np.bool_)
            bad = 0
            for i in range(b * rows_per_block, min(n, (b + 1) * rows_per_block)):
                start = i * m
                wrow = load(w, start, m, wbuf)
                grow = load(g, start, m, gbuf)
                if has_m:
                    if aligned:
                        _unpack_row_bytes(signs, start >> 3, m, sign_table, msign)
                    else:
                        _unpack_row(signs, start, m, msign)
                    sum_m, sum_v, row_bad = _row_with_momentum(
                        wrow, grow, msign, nonneg, col_m, col_v, acc_m, acc_v, row_m[i], row_v[i],
                        lr, beta1, beta2, eps, gsign, shrink, l2, zero_bad, big, cap)
                    if aligned:
                        _pack_row_bytes(signs, start >> 3, m, nonneg)
                    else:
                        _pack_row(signs, start, m, nonneg)
                    row_m[i] = sum_m
                else:
                    sum_v, row_bad = _row_without_momentum(
                        wrow, grow, col_v, acc_v, row_v[i], lr, beta2, eps, gsign, shrink, l2, zero_bad, big, cap)
                row_v[i] = sum_v
                bad += row_bad
                store(w, start, wrow, sr)
            bad_counts[b] = bad
        _finish_cols(row_v, col_v, col_acc_v)
        if has_m:
            _finish_cols(row_m, col_m, col_acc_m)

    return kernel


@numba.njit(inline="always")
def _finish_cols(rows, cols, col_acc):
    """Reduce per-block column sums and normalize by the total (zero total → zero factors)."""
    total = 0.0
    for i in range(rows.shape[0]):
        total += rows[i]
    scale = 1.0 / total if total > 0 else 0.0
    for j in range(cols.shape[0]):
        s = 0.0
        for b in range(col_acc.shape[0]):
            s += col_acc[b, j]
        cols[j] = s * scale


# ±1 for each bit of each byte value, in both work dtypes.
_SIGN_TABLES = {
    dt: (((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1) * 2 - 1).astype(dt)
    for dt in (np.float32, np.float64)
}

# numba's workqueue threading layer (its fallback where OpenMP and TBB are missing) aborts the
# process when two threads enter parallel regions at once: parallel launches take turns. Each
# already uses every core, so with OpenMP or TBB this costs nothing.
_PARALLEL_LAUNCH = threading.Lock()

# Small tensors run on one thread: waking the thread pool costs more than their whole step.
_PARALLEL_MIN_NUMEL = 1 << 16
_KERNELS = {
    (bf16, parallel): _make_kernel(_load_bf16 if bf16 else _load_float, _store_bf16 if bf16 else _store_float, parallel)
    for bf16 in (False, True)
    for parallel in (False, True)
}


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
    rows, cols = matrix_shape(param)
    if rows == 0:
        return 0
    # The kernel walks the logical row-major order: strided tensors go through one copy.
    weight = param.detach() if param.is_contiguous() else param.detach().contiguous()
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    grad = grad.contiguous()
    rows_per_block, blocks = _block_layout(rows, cols)
    has_m = cfg.beta1 is not None
    dtype = state[ROW_V].dtype
    col_acc_m = torch.empty((blocks, cols if has_m else 0), dtype=dtype)
    col_acc_v = torch.empty((blocks, cols), dtype=dtype)
    bad_counts = np.zeros(blocks, dtype=np.int64)
    scalar = np.float64 if dtype == torch.float64 else np.float32
    parallel = rows * cols >= _PARALLEL_MIN_NUMEL
    kernel = _KERNELS[param.dtype == torch.bfloat16, parallel]
    empty = torch.empty(0, dtype=dtype)
    args = (
        _as_numpy(weight),
        _as_numpy(grad),
        state[SIGN_M].numpy() if has_m else np.empty(0, dtype=np.uint8),
        (state[ROW_M] if has_m else empty).numpy(),
        (state[COL_M] if has_m else empty).numpy(),
        state[ROW_V].numpy(),
        state[COL_V].numpy(),
        col_acc_m.numpy(),
        col_acc_v.numpy(),
        bad_counts,
        rows,
        cols,
        rows_per_block,
        scalar(cfg.lr),
        scalar(cfg.beta1 if has_m else 0.0),
        has_m,
        scalar(cfg.beta2),
        scalar(cfg.eps),
        *(scalar(x) for x in cfg.folded()),
        cfg.stochastic_rounding,
        _SIGN_TABLES[scalar],
        cfg.zero_nonfinite,
        scalar(torch.finfo(dtype).max),
        scalar(factor_sum_cap(rows * cols, dtype)),
    )
    if parallel:
        with _PARALLEL_LAUNCH:
            kernel(*args)
    else:
        kernel(*args)
    if weight.data_ptr() != param.data_ptr():
        param.detach().copy_(weight)
    return int(bad_counts.sum()) if cfg.zero_nonfinite else 0
