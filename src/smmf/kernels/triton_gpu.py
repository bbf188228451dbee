"""Fused SMMF step on CUDA (Triton): the contract of the numba kernel, on GPU tiles.

Each program owns a band of rows and walks it in column tiles: it reads the gradient, the weight
and the packed sign bytes once, rebuilds M̂ and V̂ from the factors, writes the weight and the new
sign bytes in place, keeps its rows' sums of |M| and V in registers, and adds its column sums to
two m-long accumulators. The column factors are normalized afterwards (two vector ops).

Covers fp32/bf16/fp16 parameters whose matrix width m̂ is a multiple of 8 (each row is then whole
sign bytes); anything else (and ``stochastic_rounding``) takes the torch path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..functional import StepConfig, torch_step_
from ..matrix import nnmf_from_sums
from ..state import COL_M, COL_V, ROW_M, ROW_V, SIGN_M, matrix_shape

__all__ = ["triton_step_", "covers"]

_BLOCK_ROWS = 16
_BLOCK_COLS = 128


@triton.jit
def _smmf_kernel(w_ptr, g_ptr, signs_ptr, row_m_ptr, col_m_ptr, row_v_ptr, col_v_ptr, acc_m_ptr, acc_v_ptr,
                 n, m, lr, beta1, beta2, eps, gsign, shrink, l2,
                 HAS_M: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n
    rows64 = rows.to(tl.int64)
    rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)
    if HAS_M:
        rm = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)
    else:
        rm = tl.zeros((BR,), dtype=tl.float32)
    sum_v = tl.zeros((BR,), dtype=tl.float32)
    sum_m = tl.zeros((BR,), dtype=tl.float32)
    shifts = tl.arange(0, 8).to(tl.uint8)
    for c0 in range(0, m, BC):
        cols = c0 + tl.arange(0, BC)
        col_ok = cols < m
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows64[:, None] * m + cols[None, :]
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * shrink
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32) * gsign + l2 * w
        cv = tl.load(col_v_ptr + cols, mask=col_ok, other=0.0)
        v = beta2 * (rv[:, None] * cv[None, :]) + (1.0 - beta2) * (g * g)
        v = tl.where(ok, v, 0.0)
        sum_v += tl.sum(v, axis=1)
        tl.atomic_add(acc_v_ptr + cols, tl.sum(v, axis=0), mask=col_ok)
        if HAS_M:
            byte_cols = c0 // 8 + tl.arange(0, BC // 8)
            byte_offs = rows64[:, None] * (m // 8) + byte_cols[None, :]
            byte_ok = row_ok[:, None] & (byte_cols < m // 8)[None, :]
            old = tl.load(signs_ptr + byte_offs, mask=byte_ok, other=0)
            bits = (old[:, :, None] >> shifts[None, None, :]) & 1
            sign = tl.reshape(bits, (BR, BC)).to(tl.float32) * 2.0 - 1.0
            cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
            mm = beta1 * (rm[:, None] * cm[None, :] * sign) + (1.0 - beta1) * g
            mm = tl.where(ok, mm, 0.0)
            nonneg = tl.reshape((mm >= 0).to(tl.uint8), (BR, BC // 8, 8))
            packed = tl.sum((nonneg << shifts[None, None, :]).to(tl.int32), axis=2)
            tl.store(signs_ptr + byte_offs, packed.to(tl.uint8), mask=byte_ok)
            a = tl.abs(mm)
            sum_m += tl.sum(a, axis=1)
            tl.atomic_add(acc_m_ptr + cols, tl.sum(a, axis=0), mask=col_ok)
            u = mm / (tl.sqrt(v) + eps)
        else:
            u = g / (tl.sqrt(v) + eps)
        tl.store(w_ptr + offs, (w - lr * u).to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(row_v_ptr + rows, sum_v, mask=row_ok)
    if HAS_M:
        tl.store(row_m_ptr + rows, sum_m, mask=row_ok)


def covers(param: Tensor, cfg: StepConfig) -> bool:
    _, cols = matrix_shape(param)
    return (
        param.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and cols % 8 == 0
        and cols > 0
        and param.is_contiguous()
        and not (cfg.stochastic_rounding and param.dtype == torch.bfloat16)
    )


def triton_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> None:
    """The fused step: same contract as :func:`smmf.functional.torch_step_`."""
    if not covers(param, cfg):
        torch_step_(param, grad, state, cfg)
        return
    rows, cols = matrix_shape(param)
    has_m = cfg.beta1 is not None
    weight = param.detach()
    grad = grad.to(param.dtype).contiguous()
    acc_v = torch.zeros(cols, dtype=torch.float32, device=param.device)
    acc_m = torch.zeros(cols if has_m else 1, dtype=torch.float32, device=param.device)
    dummy = acc_m  # never read when HAS_M is false
    decoupled = cfg.decoupled_weight_decay
    _smmf_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
        weight, grad,
        state[SIGN_M] if has_m else dummy,
        state[ROW_M] if has_m else dummy,
        state[COL_M] if has_m else dummy,
        state[ROW_V], state[COL_V], acc_m, acc_v,
        rows, cols, cfg.lr, cfg.beta1 if has_m else 0.0, cfg.beta2, cfg.eps,
        -1.0 if cfg.maximize else 1.0,
        1.0 - cfg.lr * cfg.weight_decay if decoupled else 1.0,
        0.0 if decoupled else cfg.weight_decay,
        HAS_M=has_m, BR=_BLOCK_ROWS, BC=_BLOCK_COLS,
    )
    for row_key, col_key, acc in ((ROW_V, COL_V, acc_v), (ROW_M, COL_M, acc_m)):
        if row_key == ROW_M and not has_m:
            continue
        _, normalized = nnmf_from_sums(state[row_key], acc)
        state[col_key].copy_(normalized)
