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
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from ..functional import StepConfig
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
        if sr:
            u = u + np.uint32(np.random.randint(0, 65536))  # stochastic rounding
        else:
            u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # nearest even
        dst[start + j] = np.int16(np.int32(u >> np.uint32(16)) - (65536 if (u >> np.uint32(31)) else 0))


def _make_kernel(load, store):
    @numba.njit(parallel=True, fastmath=False, nogil=True)
    def kernel(w, g, signs, row_m, col_m, row_v, col_v, col_acc_m, col_acc_v,
               n, m, rows_per_block, lr, beta1, has_m, beta2, eps, wd, decoupled, maximize, sr):
        nblocks = col_acc_v.shape[0]
        shrink = 1.0 - lr * wd if decoupled else 1.0
        l2 = 0.0 if decoupled else wd
        for b in numba.prange(nblocks):
            first_row = b * rows_per_block
            last_row = min(n, first_row + rows_per_block)
            acc_m = col_acc_m[b]
            acc_v = col_acc_v[b]
            acc_m[:] = 0.0
            acc_v[:] = 0.0
            wbuf = np.empty(m, dtype=np.uint32)
            gbuf = np.empty(m, dtype=np.uint32)
            old_byte = 0
            new_byte = 0
            block_end = last_row * m
            for i in range(first_row, last_row):
                start = i * m
                wrow = load(w, start, m, wbuf)
                grow = load(g, start, m, gbuf)
                rm = row_m[i] if has_m else 0.0
                rv = row_v[i]
                sum_m = 0.0
                sum_v = 0.0
                for j in range(m):
                    gj = -grow[j] if maximize else grow[j]
                    wj = wrow[j] * shrink
                    gj = gj + l2 * wj
                    vj = beta2 * (rv * col_v[j]) + (1.0 - beta2) * gj * gj
                    sum_v += vj
                    acc_v[j] += vj
                    if has_m:
                        k = start + j
                        bit = k & 7
                        if bit == 0:
                            old_byte = signs[k >> 3]
                            new_byte = 0
                        mhat = rm * col_m[j]
                        if not (old_byte >> bit) & 1:
                            mhat = -mhat
                        mj = beta1 * mhat + (1.0 - beta1) * gj
                        if mj >= 0:
                            new_byte |= 1 << bit
                        if bit == 7 or k == block_end - 1:
                            signs[k >> 3] = new_byte
                        a = abs(mj)
                        sum_m += a
                        acc_m[j] += a
                        wrow[j] = wj - lr * (mj / (math.sqrt(vj) + eps))
                    else:
                        wrow[j] = wj - lr * (gj / (math.sqrt(vj) + eps))
                store(w, start, wrow, sr)
                if has_m:
                    row_m[i] = sum_m
                row_v[i] = sum_v
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


_FLOAT_KERNEL = _make_kernel(_load_float, _store_float)
_BF16_KERNEL = _make_kernel(_load_bf16, _store_bf16)


def _block_layout(rows: int, cols: int) -> tuple[int, int]:
    """Rows per block (a multiple that keeps blocks byte-aligned in the sign bits) and blocks."""
    align = 8 // math.gcd(cols, 8)
    target_blocks = max(1, 4 * numba.get_num_threads())
    rows_per_block = max(align, -(-rows // target_blocks))
    rows_per_block = -(-rows_per_block // align) * align
    return rows_per_block, -(-rows // rows_per_block)


def _as_numpy(t: Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy()


def numba_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> None:
    """The fused step: same contract as :func:`smmf.functional.torch_step_`."""
    rows, cols = matrix_shape(param)
    if rows == 0:
        return
    # The kernel walks the logical row-major order: strided tensors go through one copy.
    weight = param.detach() if param.is_contiguous() else param.detach().contiguous()
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    grad = grad.contiguous()
    rows_per_block, blocks = _block_layout(rows, cols)
    has_m = cfg.beta1 is not None
    dtype = state[ROW_V].dtype
    col_acc_m = torch.empty((blocks, cols if has_m else 0), dtype=torch.float64)
    col_acc_v = torch.empty((blocks, cols), dtype=torch.float64)
    kernel = _BF16_KERNEL if param.dtype == torch.bfloat16 else _FLOAT_KERNEL
    empty = torch.empty(0, dtype=dtype)
    kernel(
        _as_numpy(weight),
        _as_numpy(grad),
        state[SIGN_M].numpy() if has_m else np.empty(0, dtype=np.uint8),
        (state[ROW_M] if has_m else empty).numpy(),
        (state[COL_M] if has_m else empty).numpy(),
        state[ROW_V].numpy(),
        state[COL_V].numpy(),
        col_acc_m.numpy(),
        col_acc_v.numpy(),
        rows,
        cols,
        rows_per_block,
        cfg.lr,
        cfg.beta1 if has_m else 0.0,
        has_m,
        cfg.beta2,
        cfg.eps,
        cfg.weight_decay,
        cfg.decoupled_weight_decay,
        cfg.maximize,
        cfg.stochastic_rounding,
    )
    if weight.data_ptr() != param.data_ptr():
        param.detach().copy_(weight)
