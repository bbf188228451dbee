"""Fused SMMF step on CUDA (Triton): the contract of the numba kernel, on GPU tiles.

Contract (same as :func:`smmf.functional.torch_step_`): ``param`` (fp32, bf16, fp16, or complex
with such a real view) is updated in place from ``grad``; its state — ``row_m``/``col_m``/``row_v``/
``col_v`` fp32 factors of the n̂×m̂ square-matricized view and ``sign_m``, the packed sign bits laid
out as :func:`smmf.matrix.pack_signs` specifies — is rewritten in place. ``state['step']`` is
already advanced. Nothing of the parameter's size is allocated but the sign scratch below.

Two launches per tensor, both deterministic (no floating-point atomics, so a resumed run is
bit-identical to an uninterrupted one):

1. ``_step_kernel``, grid (bands, column tiles). A program walks its band of rows in tiles of
   ``BR × BC``: it reads the gradient, the weight and the sign bits once, rebuilds M̂ and V̂ from the
   factors, writes the weight and the new sign bits, and writes its partial sums of |M| and V —
   per row of each tile (one slot per column tile) and per column of its band (one slot per band)
   — into a small fp32 buffer (~2/BC + 2·bands/n̂ of the parameter's fp32 bytes).
2. ``_finish_kernel``, one program per moment: sums the partials in a fixed order, writes the row
   factors and the column factors normalized by the total (``smmf.matrix.nnmf_from_sums``).

Sign bits: when m̂ is a multiple of 8 every row is whole sign bytes and a tile reads and writes its
own bytes. Otherwise a byte can straddle two tiles; the kernel then ORs the new bits, 32 at a time,
into a zeroed int32 scratch (atomic OR is order-independent, so still deterministic) that is
copied over the state afterwards: N/8 extra bytes for those tensors only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..functional import StepConfig
from ..state import COL_M, COL_V, ROW_M, ROW_V, SIGN_M, matrix_shape, real_view

__all__ = ["triton_step_"]


@triton.jit
def _step_kernel(w_ptr, g_ptr, signs_ptr, words_ptr, row_m_ptr, col_m_ptr, row_v_ptr, col_v_ptr, part_ptr,
                 n, m, band_rows, lr, beta1, beta2, eps, gsign, shrink, l2, seed,
                 HAS_M: tl.constexpr, ALIGNED: tl.constexpr, STOCHASTIC: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr):
    """Arguments: ``w``/``g`` the weight and gradient (n·m elements, row-major, param dtype);
    ``signs`` uint8 packed sign bits; ``words`` a zeroed int32 scratch for the new bits (used when
    not ``ALIGNED``); the four fp32 factor vectors (read only here); ``part`` the fp32 partial sums,
    laid out [V rows: tiles×n][M rows: tiles×n][V cols: bands×m][M cols: bands×m]. Scalars:
    ``gsign`` −1 to maximize, ``shrink`` the decoupled decay factor 1 − lr·wd, ``l2`` the coupled
    decay coefficient, ``seed`` for stochastic rounding. ``BC`` is a multiple of 32."""
    band = tl.program_id(0)
    tile = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    cols = tile * BC + tl.arange(0, BC)
    col_ok = cols < m
    cv = tl.load(col_v_ptr + cols, mask=col_ok, other=0.0)
    if HAS_M:
        cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
    col_sum_v = tl.zeros((BC,), dtype=tl.float32)
    col_sum_m = tl.zeros((BC,), dtype=tl.float32)
    row_part_v = part_ptr + tile * n
    row_part_m = part_ptr + (n_tiles + tile) * n
    first_row = band * band_rows
    last_row = tl.minimum(first_row + band_rows, n)
    for r0 in range(first_row, last_row, BR):
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < last_row
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * m + cols[None, :]
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * shrink
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32) * gsign + l2 * w
        rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)
        v = beta2 * (rv[:, None] * cv[None, :]) + (1.0 - beta2) * (g * g)
        v = tl.where(ok, v, 0.0)
        tl.store(row_part_v + rows, tl.sum(v, axis=1), mask=row_ok)
        col_sum_v += tl.sum(v, axis=0)
        if HAS_M:
            if ALIGNED:  # a tile's row segment is whole bytes: read and write them in place
                byte_cols = tile * (BC // 8) + tl.arange(0, BC // 8)
                byte_offs = rows.to(tl.int64)[:, None] * (m // 8) + byte_cols[None, :]
                byte_ok = row_ok[:, None] & (byte_cols < m // 8)[None, :]
                old = tl.load(signs_ptr + byte_offs, mask=byte_ok, other=0)
                shifts8 = tl.arange(0, 8).to(tl.uint8)
                bits = tl.reshape((old[:, :, None] >> shifts8[None, None, :]) & 1, (BR, BC))
            else:
                bits = (tl.load(signs_ptr + (offs >> 3), mask=ok, other=0) >> (offs & 7).to(tl.uint8)) & 1
            rm = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)
            sign = bits.to(tl.float32) * 2.0 - 1.0
            mm = beta1 * (rm[:, None] * cm[None, :] * sign) + (1.0 - beta1) * g
            mm = tl.where(ok, mm, 0.0)
            nonneg = (mm >= 0) & ok
            if ALIGNED:
                byte_bits = tl.reshape(nonneg.to(tl.int32), (BR, BC // 8, 8)) << shifts8.to(tl.int32)[None, None, :]
                tl.store(signs_ptr + byte_offs, tl.sum(byte_bits, axis=2).to(tl.uint8), mask=byte_ok)
            else:
                # Bits of row i, columns [c, c + 32) land at global bits base + [0, 32), i.e. in two
                # int32 words: OR each word's share in (atomic OR commutes: deterministic).
                base = rows.to(tl.int64) * m + tile * BC
                off = (base & 31).to(tl.int32)
                t = tl.arange(0, 32)
                lane = t[None, None, :] + off[:, None, None]
                shifted = tl.reshape(nonneg.to(tl.int64), (BR, BC // 32, 32)) << (lane & 31).to(tl.int64)
                lo = tl.sum(tl.where(lane < 32, shifted, 0), axis=2).to(tl.int32)
                hi = tl.sum(tl.where(lane >= 32, shifted, 0), axis=2).to(tl.int32)
                word = (base >> 5)[:, None] + tl.arange(0, BC // 32)[None, :]
                group_ok = row_ok[:, None] & (tile * BC + tl.arange(0, BC // 32)[None, :] * 32 < m)
                tl.atomic_or(words_ptr + word, lo, mask=group_ok & (lo != 0))
                tl.atomic_or(words_ptr + word + 1, hi, mask=group_ok & (hi != 0))
            a = tl.abs(mm)
            tl.store(row_part_m + rows, tl.sum(a, axis=1), mask=row_ok)
            col_sum_m += tl.sum(a, axis=0)
            u = mm / (tl.sqrt(v) + eps)
        else:
            u = g / (tl.sqrt(v) + eps)
        new_w = w - lr * u
        if w_ptr.dtype.element_ty == tl.bfloat16:
            # Round to bf16 in the bits (the same on every Triton target): add noise below the
            # kept 16 bits (stochastic) or half an ulp to even (nearest), then truncate; NaN stays NaN.
            bits = new_w.to(tl.uint32, bitcast=True)
            if STOCHASTIC:
                bits += (tl.randint(seed, offs.to(tl.uint32)) & 0xFFFF).to(tl.uint32)
            else:
                bits += 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
            new_w = tl.where(new_w != new_w, new_w, rounded)
        tl.store(w_ptr + offs, new_w.to(w_ptr.dtype.element_ty), mask=ok)
    col_part = part_ptr + 2 * n_tiles * n + band * m
    tl.store(col_part + cols, col_sum_v, mask=col_ok)
    if HAS_M:
        tl.store(col_part + tl.num_programs(0) * m + cols, col_sum_m, mask=col_ok)


@triton.jit
def _finish_kernel(part_ptr, row_v_ptr, col_v_ptr, row_m_ptr, col_m_ptr, n, m, n_tiles, n_bands,
                   BLOCK: tl.constexpr):
    """Program 0 finishes V, program 1 M: row factor = Σ over tiles, column factor = Σ over bands
    / total (0 total → divide by 1, as ``nnmf_from_sums``). Fixed summation order."""
    moment = tl.program_id(0)
    rows_part = part_ptr + moment * n_tiles * n
    cols_part = part_ptr + 2 * n_tiles * n + moment * n_bands * m
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(0, n, BLOCK):
        idx = r0 + tl.arange(0, BLOCK)
        ok = idx < n
        s = tl.zeros((BLOCK,), dtype=tl.float32)
        for t in range(n_tiles):
            s += tl.load(rows_part + t * n + idx, mask=ok, other=0.0)
        if moment == 0:
            tl.store(row_v_ptr + idx, s, mask=ok)
        else:
            tl.store(row_m_ptr + idx, s, mask=ok)
        total += s
    grand = tl.sum(total, axis=0)
    grand = tl.where(grand > 0, grand, 1.0)
    for c0 in range(0, m, BLOCK):
        idx = c0 + tl.arange(0, BLOCK)
        ok = idx < m
        s = tl.zeros((BLOCK,), dtype=tl.float32)
        for b in range(n_bands):
            s += tl.load(cols_part + b * m + idx, mask=ok, other=0.0)
        if moment == 0:
            tl.store(col_v_ptr + idx, s / grand, mask=ok)
        else:
            tl.store(col_m_ptr + idx, s / grand, mask=ok)


@dataclass(frozen=True)
class _Plan:
    """Launch geometry of one n×m matrix."""

    block_rows: int
    block_cols: int
    warps: int
    band_rows: int
    bands: int
    tiles: int
    partial_numel: int  # fp32 elements of the partial-sum buffer


# (block_rows, block_cols, warps) by matrix width; the battery (benchmarks/gpu_battery.sh) sweeps
# alternatives. Tiles of 4096 elements keep enough bytes in flight per SM to be bandwidth-bound.
TILE_TABLE = {32: (128, 32, 4), 64: (64, 64, 4), 128: (32, 128, 8)}
# Programs per SM to aim for, and the fewest rows per band (bounds the column partials to
# 2·bands·m ≤ 2n·m/MIN_BAND_ROWS floats, ~2% of the parameter's fp32 bytes).
PROGRAMS_PER_SM = 4
MIN_BAND_ROWS = 96


@functools.lru_cache(maxsize=4096)
def _plan(n: int, m: int, sms: int) -> _Plan:
    width = min(max(triton.next_power_of_2(m), 32), 128)
    block_rows, block_cols, warps = TILE_TABLE[width]
    tiles = triton.cdiv(m, block_cols)
    max_bands = max(1, min(triton.cdiv(n, block_rows), n // MIN_BAND_ROWS))
    bands = max(1, min(max_bands, triton.cdiv(PROGRAMS_PER_SM * sms, tiles)))
    band_rows = triton.cdiv(triton.cdiv(n, bands), block_rows) * block_rows
    bands = triton.cdiv(n, band_rows)
    return _Plan(block_rows, block_cols, warps, band_rows, bands, tiles, 2 * tiles * n + 2 * bands * m)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> None:
    """The fused step: same contract as :func:`smmf.functional.torch_step_`."""
    rows, cols = matrix_shape(param)
    if rows == 0:
        return
    weight = real_view(param.detach())
    if not weight.is_contiguous():  # logical row-major order: strided params go through one copy
        weight = weight.contiguous()
    g = real_view(grad)
    if g.dtype != weight.dtype:
        g = g.to(weight.dtype)
    g = g.contiguous()
    device = weight.device
    plan = _plan(rows, cols, _sm_count(device))
    has_m = cfg.beta1 is not None
    aligned = cols % 8 == 0
    partial = torch.empty(plan.partial_numel, dtype=torch.float32, device=device)
    words = partial if aligned or not has_m else torch.zeros(rows * cols // 32 + 2, dtype=torch.int32, device=device)
    decoupled = cfg.decoupled_weight_decay
    stochastic = cfg.stochastic_rounding and weight.dtype == torch.bfloat16
    row_v, col_v = state[ROW_V], state[COL_V]
    row_m, col_m, signs = (state[ROW_M], state[COL_M], state[SIGN_M]) if has_m else (row_v, col_v, words)
    _step_kernel[(plan.bands, plan.tiles)](
        weight, g, signs, words, row_m, col_m, row_v, col_v, partial,
        rows, cols, plan.band_rows, cfg.lr, cfg.beta1 if has_m else 0.0, cfg.beta2, cfg.eps,
        -1.0 if cfg.maximize else 1.0,
        1.0 - cfg.lr * cfg.weight_decay if decoupled else 1.0,
        0.0 if decoupled else cfg.weight_decay,
        int(torch.randint(0, 2**31 - 1, ()).item()) if stochastic else 0,
        HAS_M=has_m, ALIGNED=aligned, STOCHASTIC=stochastic,
        BR=plan.block_rows, BC=plan.block_cols, num_warps=plan.warps,
    )
    _finish_kernel[(2 if has_m else 1,)](
        partial, row_v, col_v, row_m, col_m, rows, cols, plan.tiles, plan.bands, BLOCK=1024, num_warps=4,
    )
    if has_m and not aligned:
        signs.copy_(words.view(torch.uint8)[: signs.numel()])
    if weight.data_ptr() != real_view(param.detach()).data_ptr():
        real_view(param.detach()).copy_(weight)
