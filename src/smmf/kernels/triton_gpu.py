"""Fused SMMF step on CUDA (Triton): the contract of the numba kernel, on GPU tiles, many tensors
per launch.

Contract (same as :func:`smmf.functional.torch_step_`): each ``param`` (fp32, bf16, fp16, or
complex with such a real view) is updated in place from its ``grad``; its state — ``row_m``/
``col_m``/``row_v``/``col_v``, the fp32 factors of the n̂×m̂ square-matricized view (M's in its own
view under ``momentum_shape="natural"``), ``sign_m``, the packed sign bits, and under
``magnitude_bits=1`` ``flag_m`` (packed like the signs) and ``levels_m`` — is rewritten in place.
``state['step']`` is already advanced. :func:`triton_steps_` takes a whole list of such tensors:
an optimizer step is a fixed number of launches whatever the number of tensors, as fused AdamW is one.

The launches, all deterministic (no floating-point atomics: a resumed run is bit-identical to an
uninterrupted one):

1. ``_step_kernel``: one program per work item, a (tensor, band of rows, column tile) triple. It
   walks its band in ``BR × BC`` tiles: reads the gradient, the weight and the sign bits once,
   rebuilds M̂ and V̂ from the factors, writes the weight and the new sign bits, and writes partial
   sums of |M| and V — per row of each tile (one slot per column tile) and per column of its band
   (one slot per band) — into an fp32 buffer of ~2/BC + 2/BAND_ROWS of the parameters' elements.
2. ``_finish_kernel``: per tensor and moment, sums the partials in a fixed order and writes the row
   factors and the column factors divided by the total (``smmf.matrix.nnmf_from_sums``).

With M in its natural shape, or with the magnitude flag, ``_momentum_sums_kernel`` sums |M| in M's
own view first (from the state before the step), so the step kernel only reads M's factors. The
flag needs the *new* factors before it can encode (F = [|M| > r cᵀ]), so for it the finish kernel
first writes them into the partial buffer, the step kernel decodes M with the old code and encodes
it against them (new sign and flag bits, and per work item the four sums of the levels' least-squares
fits), and ``_flag_finish_kernel`` copies the new factors into the state and makes the levels: five
launches.

Sign bits are laid out as :func:`smmf.matrix.pack_signs` specifies. When m̂ is a multiple of 8
every row is whole sign bytes and a tile reads and writes its own bytes. Otherwise a byte can
straddle two tiles; the kernel then ORs the new bits, 32 at a time, into a zeroed int32 scratch (OR
commutes, so this stays deterministic), which the finish kernel copies over the state: N/8 extra
bytes for those tensors only (twice that with the flag's bits).

Each tensor is described by one row of int64 in a table, a column per field (the ``T_*``
constants, :data:`TABLE_FIELDS`): the addresses of w, g, signs, row_m, col_m, row_v, col_v, then n,
m, column tiles, bands, its first work item, where its (V's) partial sums start and where its sign
scratch starts, the elements lo .. hi of the row-major flattening that w, g and the sign bits hold
(0 .. n·m, or an FSDP2 shard's range, whose first and last rows may be partial), M's own view:
columns, rows, column tiles, bands, the first work item of :func:`_momentum_sums_kernel` and where
M's partial sums start (V's view unless ``momentum_shape="natural"``), and for the flag: the
addresses of its bits and levels, where the new factors of |M| and the level sums sit in the
partial buffer, and where its bit scratch starts (0 without the flag). The
scalars of a launch (lr, β1_t, β2_t, …) are arguments, so tensors whose step configuration (or sign
alignment, or code of M) differs go to separate launches.

An FSDP2 shard (:func:`triton_shard_step_`) is one launch over its rows; the finish kernel then
leaves the raw row and column sums in the factor vectors (rows the shard lacks get 0), for the caller
to add up across ranks and normalize, as the numba kernel's shards do; with the natural shape the
momentum sums kernel runs over the shard's rows of M's view first. Under the magnitude flag a shard
takes two calls (:func:`triton_flag_shard_pass_`), for the caller to add up the shards' sums of |M|
between them: the sums kernel, then the step kernel against the new factors.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..functional import StepConfig
from ..state import (COL_M, COL_V, FLAG_M, LEVELS_M, ROW_M, ROW_V, SIGN_M, MomentumCode, matrix_shape, momentum_cols,
                     real_view)
from .contract import FlagPass, StepItem

__all__ = ["BACKEND", "triton_flag_shard_pass_", "triton_shard_step_", "triton_step_", "triton_steps_"]

# Tile shape and rows per work item. A tile of 4096 elements keeps enough bytes in flight per SM
# to be bandwidth-bound; BLOCK_COLS is a multiple of 32 (the unaligned sign path packs 32 bits at a
# time). benchmarks/gpu_tune.py sweeps alternatives.
BLOCK_ROWS, BLOCK_COLS, WARPS = 32, 128, 8
BAND_ROWS = 256
COPY_PROGRAMS = 64  # programs per tensor that copy an unaligned tensor's sign scratch back
# The tensor table: one row of int64 per tensor, a column per field (module docstring). These
# constants are the one list of fields: the kernels read ``row + T_N``, and the host fills a row by
# name (:func:`_table_row`, from :data:`TABLE_FIELDS`, which follows them).
T_W = tl.constexpr(0)
T_G = tl.constexpr(1)
T_SIGNS = tl.constexpr(2)
T_ROW_M = tl.constexpr(3)
T_COL_M = tl.constexpr(4)
T_ROW_V = tl.constexpr(5)
T_COL_V = tl.constexpr(6)
T_N = tl.constexpr(7)
T_M = tl.constexpr(8)
T_TILES = tl.constexpr(9)
T_BANDS = tl.constexpr(10)
T_FIRST_ITEM = tl.constexpr(11)
T_PARTIAL_AT = tl.constexpr(12)
T_WORDS_AT = tl.constexpr(13)
T_LO = tl.constexpr(14)
T_HI = tl.constexpr(15)
T_M_COLS = tl.constexpr(16)
T_M_ROWS = tl.constexpr(17)
T_M_TILES = tl.constexpr(18)
T_M_BANDS = tl.constexpr(19)
T_FIRST_SUMS_ITEM = tl.constexpr(20)
T_M_PARTIAL_AT = tl.constexpr(21)
T_FLAGS = tl.constexpr(22)
T_LEVELS = tl.constexpr(23)
T_NEW_M_AT = tl.constexpr(24)
T_LEVEL_SUMS_AT = tl.constexpr(25)
T_FLAG_WORDS_AT = tl.constexpr(26)
TABLE_FIELDS = tuple(name[2:].lower() for name, value in sorted(
    ((name, value) for name, value in globals().items() if name.startswith("T_")), key=lambda item: item[1].value))
META_COLUMNS = tl.constexpr(len(TABLE_FIELDS))
assert [globals()["T_" + name.upper()].value for name in TABLE_FIELDS] == list(range(len(TABLE_FIELDS)))
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # float32's largest finite value


@triton.jit
def _momentum(g, sign_bits, flag_bits, magnitude, high, low, beta1, FLAG: tl.constexpr):
    """This step's M from the stored code: β1·(±r·c, times the flag's level under ``FLAG``) + (1 − β1)·G.
    One expression for both kernels that form M, so they form the same bits."""
    if FLAG:
        magnitude = magnitude * tl.where(flag_bits != 0, high, low)
    return beta1 * (magnitude * (sign_bits.to(tl.float32) * 2.0 - 1.0)) + (1.0 - beta1) * g


@triton.jit
def _finite_or_cap(x, cap):
    """NaN → 0, above ``cap`` → ``cap`` (:func:`smmf.functional.magnitude_flag_fit`)."""
    x = tl.where(x != x, 0.0, x)
    return tl.where(x > cap, cap, x)


@triton.jit
def _or_bits(words, bits, rows, tile, m, held_lo, row_ok, BR: tl.constexpr, BC: tl.constexpr):
    """OR a tile's 0/1 ``bits`` (BR, BC/8, 8) into the int32 ``words`` that hold the bits of elements
    lo .. hi: bits of row i, columns [c, c + 32) land at bits start + [0, 32), i.e. in two words."""
    start = rows.to(tl.int64) * m + tile * BC - held_lo  # may be < 0 before lo: those bits are 0, never written
    off = (start & 31).to(tl.int32)
    lane = tl.arange(0, 32)[None, None, :] + off[:, None, None]
    shifted = tl.reshape(bits, (BR, BC // 32, 32)).to(tl.int64) << (lane & 31).to(tl.int64)
    low_word = tl.sum(tl.where(lane < 32, shifted, 0), axis=2).to(tl.int32)
    high_word = tl.sum(tl.where(lane >= 32, shifted, 0), axis=2).to(tl.int32)
    word = (start >> 5)[:, None] + tl.arange(0, BC // 32)[None, :]
    group_ok = row_ok[:, None] & (tile * BC + tl.arange(0, BC // 32)[None, :] * 32 < m)
    tl.atomic_or(words + word, low_word, mask=group_ok & (low_word != 0))
    tl.atomic_or(words + word + 1, high_word, mask=group_ok & (high_word != 0))


@triton.jit
def _work_item(meta_ptr, item_tensor_ptr, TILES: tl.constexpr, FIRST_ITEM: tl.constexpr):
    """This program's work item: its tensor (index and row of the table), and its index, band and
    column tile among that tensor's ``tiles`` (table columns TILES and FIRST_ITEM: V's view, or M's)."""
    item = tl.program_id(0)
    t = tl.load(item_tensor_ptr + item)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    tiles = tl.load(row + TILES)
    local = item - tl.load(row + FIRST_ITEM)
    return t, row, tiles, local, local // tiles, local % tiles


@triton.jit
def _step_kernel(meta_ptr, item_tensor_ptr, partial_ptr, words_ptr, bad_ptr, lr, beta1, beta2, eps, gsign, shrink, l2,
                 seed, W_DTYPE: tl.constexpr, HAS_M: tl.constexpr, ALIGNED: tl.constexpr, STOCHASTIC: tl.constexpr,
                 ZERO_BAD: tl.constexpr, NATURAL: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr,
                 BC: tl.constexpr, BAND: tl.constexpr):
    """One work item. ``meta`` is the int64 table described in the module docstring; ``partial`` is
    laid out per tensor as [V rows: tiles×n][V cols: bands×m][M rows][M cols] (:func:`_layout`);
    ``words`` is the zeroed int32 sign scratch of the unaligned tensors; n counts every row of the
    matrix, the bands only the rows that hold elements lo .. hi (``held_lo`` .. ``held_hi``).
    Scalars: ``gsign`` −1 to maximize, ``shrink`` the decoupled decay factor 1 − lr·wd, ``l2`` the
    coupled decay coefficient, ``seed`` for bf16 stochastic rounding. ``bad`` counts (a lower bound
    of) the NaN/inf gradient elements, which count as zero when ``ZERO_BAD``. What one element adds
    to a factor sum is capped (``smmf.matrix.factor_sum_cap``), so finite gradients keep the factors
    finite. A tile is held as (BR, BC/8, 8): the last axis is one sign byte, so bits unpack and pack
    without reshaping. ``ALIGNED``: every tensor's m and lo are multiples
    of 8 (each row segment is whole bytes of the sign bits). ``FLAG`` (the magnitude flag): M is
    decoded with the flag's bits and levels, and encoded against the new factors of |M| that
    :func:`_momentum_sums_kernel` and the finish kernel left in the partial buffer (``T_NEW_M_AT``, ``T_LEVEL_SUMS_AT``):
    new sign and flag bits, and each work item's four level sums. Under ``NATURAL`` or ``FLAG`` the
    sums kernel made |M|'s sums and this kernel only reads M's factors."""
    tl.static_assert(BC % 32 == 0, "a tile's columns are whole sign bytes, packed 32 bits at a time")
    BB: tl.constexpr = BC // 8
    t, row, tiles, local, band, tile = _work_item(meta_ptr, item_tensor_ptr, T_TILES, T_FIRST_ITEM)
    n = tl.load(row + T_N)
    m = tl.load(row + T_M)
    held_lo = tl.load(row + T_LO)
    held_hi = tl.load(row + T_HI)
    w_ptr = tl.load(row + T_W).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + T_G).to(tl.pointer_type(W_DTYPE))
    row_v_ptr = tl.load(row + T_ROW_V).to(tl.pointer_type(tl.float32))
    col_v_ptr = tl.load(row + T_COL_V).to(tl.pointer_type(tl.float32))
    part = partial_ptr + tl.load(row + T_PARTIAL_AT)
    m_part = partial_ptr + tl.load(row + T_M_PARTIAL_AT)
    m32 = m.to(tl.int32)
    r_idx = tl.arange(0, BR)[:, None, None]
    bit = tl.arange(0, 8)[None, None, :]
    cols = (tile * BC).to(tl.int32) + tl.arange(0, BB)[None, :, None] * 8 + bit  # (1, BB, 8)
    col_ok = cols < m32
    cv = tl.load(col_v_ptr + cols, mask=col_ok, other=0.0)
    if HAS_M:
        signs_ptr = tl.load(row + T_SIGNS).to(tl.pointer_type(tl.uint8))
        row_m_ptr = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
        col_m_ptr = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
        words = words_ptr + tl.load(row + T_WORDS_AT)
        m_cols = tl.load(row + T_M_COLS)
        if not NATURAL:
            cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
        if FLAG:
            flags_ptr = tl.load(row + T_FLAGS).to(tl.pointer_type(tl.uint8))
            levels_ptr = tl.load(row + T_LEVELS).to(tl.pointer_type(tl.float32))
            high = tl.load(levels_ptr)
            low = tl.load(levels_ptr + 1)
            new_row_m = partial_ptr + tl.load(row + T_NEW_M_AT)  # then the new column factors, from M's row count on
            new_col_m = new_row_m + tl.load(row + T_M_ROWS)
            flag_words = words_ptr + tl.load(row + T_FLAG_WORDS_AT)
            if not NATURAL:
                new_cm = tl.load(new_col_m + cols, mask=col_ok, other=0.0)
        else:
            high = 0.0
            low = 0.0
    cap = FP32_MAX / (2.0 * (n * m).to(tl.float32))
    any_bad = tl.zeros((BR, BB, 8), dtype=tl.int1)
    acc_v = tl.zeros((BR, BB, 8), dtype=tl.float32)  # column sums, reduced once after the band
    acc_m = tl.zeros((BR, BB, 8), dtype=tl.float32)
    fit_high = tl.zeros((), dtype=tl.float32)  # the flag's level sums (FLAG)
    energy_high = tl.zeros((), dtype=tl.float32)
    fit_low = tl.zeros((), dtype=tl.float32)
    energy_low = tl.zeros((), dtype=tl.float32)
    first_row = held_lo // m + band * BAND
    last_row = tl.minimum(first_row + BAND, (held_hi + m - 1) // m)
    for r0 in range(first_row, last_row, BR):
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < last_row
        # int64: the tile's first element, globally and where w, g and the sign bits hold it;
        # offsets within the tile fit in int32
        start0 = r0 * m
        base = start0 - held_lo
        offs = r_idx * m32 + cols
        ok = row_ok[:, None, None] & col_ok & (offs >= held_lo - start0) & (offs < held_hi - start0)
        w = tl.load(w_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * shrink
        g = tl.load(g_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * gsign
        finite = tl.abs(g) <= FP32_MAX  # False for NaN
        any_bad = any_bad | (ok & ~finite)
        if ZERO_BAD:
            g = tl.where(finite, g, 0.0)
        g = g + l2 * w
        rv = tl.load(row_v_ptr + rows, mask=row_ok, other=0.0)[:, None, None]
        v = beta2 * (rv * cv) + (1.0 - beta2) * (g * g)
        v = tl.where(ok, v, 0.0)
        v_capped = tl.where(v > cap, cap, v)
        tl.store(part + tile * n + rows, tl.sum(tl.sum(v_capped, axis=2), axis=1), mask=row_ok)
        acc_v += v_capped
        if HAS_M:
            if ALIGNED:  # a tile's row segment is whole bytes, one per (row, byte) of the tile
                byte_offs = base // 8 + r_idx * (m32 // 8) + (tile * BB).to(tl.int32) + tl.arange(0, BB)[None, :, None]
                byte_col = tl.arange(0, BB)[None, :, None] * 8 + (tile * BC).to(tl.int32)
                byte_elem = r_idx * m32 + byte_col  # the byte's first element, from start0
                byte_ok = (row_ok[:, None, None] & (byte_col < m32) & (byte_elem >= held_lo - start0)
                           & (byte_elem < held_hi - start0))
                bits = (tl.load(signs_ptr + byte_offs, mask=byte_ok, other=0) >> bit.to(tl.uint8)) & 1
                if FLAG:
                    flag_bits = (tl.load(flags_ptr + byte_offs, mask=byte_ok, other=0) >> bit.to(tl.uint8)) & 1
            else:
                k = base + offs
                bits = (tl.load(signs_ptr + (k >> 3), mask=ok, other=0) >> (k & 7).to(tl.uint8)) & 1
                if FLAG:
                    flag_bits = (tl.load(flags_ptr + (k >> 3), mask=ok, other=0) >> (k & 7).to(tl.uint8)) & 1
            if not FLAG:
                flag_bits = bits
            if NATURAL:  # M's own view: each element's factors by its row and column there
                k_m = start0 + offs
                magnitude = (tl.load(row_m_ptr + k_m // m_cols, mask=ok, other=0.0)
                             * tl.load(col_m_ptr + k_m % m_cols, mask=ok, other=0.0))
            else:
                magnitude = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)[:, None, None] * cm
            mm = _momentum(g, bits, flag_bits, magnitude, high, low, beta1, FLAG)
            mm = tl.where(ok, mm, 0.0)
            nonneg = ((mm >= 0) & ok).to(tl.int32)
            if ALIGNED:
                packed = tl.sum(nonneg << bit, axis=2, keep_dims=True)
                tl.store(signs_ptr + byte_offs, packed.to(tl.uint8), mask=byte_ok)
            else:
                _or_bits(words, nonneg, rows, tile, m, held_lo, row_ok, BR, BC)
            if FLAG:  # encode against the new factors: F = [|M| > R], and the least-squares sums
                if NATURAL:
                    estimate = (tl.load(new_row_m + k_m // m_cols, mask=ok, other=0.0)
                                * tl.load(new_col_m + k_m % m_cols, mask=ok, other=0.0))
                else:
                    estimate = tl.load(new_row_m + rows, mask=row_ok, other=0.0)[:, None, None] * new_cm
                a = tl.abs(mm)
                above = (a > estimate) & ok
                fit = tl.where(ok, _finite_or_cap(a * estimate, cap), 0.0)
                energy = tl.where(ok, _finite_or_cap(estimate * estimate, cap), 0.0)
                fit_high += tl.sum(tl.sum(tl.sum(tl.where(above, fit, 0.0), axis=2), axis=1), axis=0)
                energy_high += tl.sum(tl.sum(tl.sum(tl.where(above, energy, 0.0), axis=2), axis=1), axis=0)
                fit_low += tl.sum(tl.sum(tl.sum(tl.where(above, 0.0, fit), axis=2), axis=1), axis=0)
                energy_low += tl.sum(tl.sum(tl.sum(tl.where(above, 0.0, energy), axis=2), axis=1), axis=0)
                flagged = above.to(tl.int32)
                if ALIGNED:
                    tl.store(flags_ptr + byte_offs, tl.sum(flagged << bit, axis=2, keep_dims=True).to(tl.uint8),
                             mask=byte_ok)
                else:
                    _or_bits(flag_words, flagged, rows, tile, m, held_lo, row_ok, BR, BC)
            if not NATURAL and not FLAG:  # (else _momentum_sums_kernel made |M|'s sums in M's view)
                a = tl.abs(mm)
                a = tl.where(a > cap, cap, a)
                tl.store(m_part + tile * n + rows, tl.sum(tl.sum(a, axis=2), axis=1), mask=row_ok)
                acc_m += a
            u = mm / (tl.sqrt(v) + eps)
        else:
            u = g / (tl.sqrt(v) + eps)
        new_w = w - lr * u
        if W_DTYPE == tl.bfloat16:
            # Round to bf16 in the bits (the same on every Triton target): add noise below the
            # kept 16 bits (stochastic) or half an ulp to even (nearest), then truncate; NaN stays NaN.
            ubits = new_w.to(tl.uint32, bitcast=True)
            if STOCHASTIC:
                ubits += (tl.randint(seed + t, (start0 + offs).to(tl.uint32)) & 0xFFFF).to(tl.uint32)
            else:
                ubits += 0x7FFF + ((ubits >> 16) & 1)
            rounded = (ubits & 0xFFFF0000).to(tl.float32, bitcast=True)
            new_w = tl.where(new_w != new_w, new_w, rounded)
        tl.store(w_ptr + base + offs, new_w.to(W_DTYPE), mask=ok)
    tl.store(part + tiles * n + band * m + cols, tl.sum(acc_v, axis=0, keep_dims=True), mask=col_ok)
    bad = tl.sum(tl.sum(tl.sum(any_bad.to(tl.int32), axis=2), axis=1), axis=0)
    tl.atomic_add(bad_ptr, bad, mask=bad > 0)
    if HAS_M and not NATURAL and not FLAG:
        tl.store(m_part + tiles * n + band * m + cols, tl.sum(acc_m, axis=0, keep_dims=True), mask=col_ok)
    if FLAG:
        level_sums = partial_ptr + tl.load(row + T_LEVEL_SUMS_AT) + 4 * local
        tl.store(level_sums, fit_high)
        tl.store(level_sums + 1, energy_high)
        tl.store(level_sums + 2, fit_low)
        tl.store(level_sums + 3, energy_low)


@triton.jit
def _momentum_sums_kernel(meta_ptr, item_tensor_ptr, partial_ptr, beta1, gsign, shrink, l2, W_DTYPE: tl.constexpr,
                          ZERO_BAD: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                          BAND: tl.constexpr):
    """|M|'s partial row and column sums in M's own view (``momentum_shape="natural"``, and every
    view under the magnitude flag, whose encoding needs the new factors first), one work item per
    (band, column tile) of the rows that hold elements lo .. hi (all, or an FSDP2 shard's), from the
    state before the step: this step's M formed as :func:`_step_kernel` forms it, which then only
    reads M's factors. Runs first: the step kernel rewrites the weights and the sign (and flag) bits."""
    _, row, tiles, _, band, tile = _work_item(meta_ptr, item_tensor_ptr, T_M_TILES, T_FIRST_SUMS_ITEM)
    b = tl.load(row + T_M_COLS)  # M's columns
    a_rows = tl.load(row + T_M_ROWS)
    w_ptr = tl.load(row + T_W).to(tl.pointer_type(W_DTYPE))
    g_ptr = tl.load(row + T_G).to(tl.pointer_type(W_DTYPE))
    signs_ptr = tl.load(row + T_SIGNS).to(tl.pointer_type(tl.uint8))
    row_m_ptr = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
    col_m_ptr = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
    m_part = partial_ptr + tl.load(row + T_M_PARTIAL_AT)
    if FLAG:
        flags_ptr = tl.load(row + T_FLAGS).to(tl.pointer_type(tl.uint8))
        levels_ptr = tl.load(row + T_LEVELS).to(tl.pointer_type(tl.float32))
        high = tl.load(levels_ptr)
        low = tl.load(levels_ptr + 1)
    else:
        high = 0.0
        low = 0.0
    n = tl.load(row + T_N)
    held_lo = tl.load(row + T_LO)
    held_hi = tl.load(row + T_HI)
    cap = FP32_MAX / (2.0 * (n * tl.load(row + T_M)).to(tl.float32))
    b32 = b.to(tl.int32)
    cols = (tile * BC).to(tl.int32) + tl.arange(0, BC)[None, :]
    col_ok = cols < b32
    cm = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    first_row = held_lo // b + band * BAND  # the bands cover the rows that hold elements lo .. hi
    last_row = tl.minimum(first_row + BAND, (held_hi + b - 1) // b)
    for r0 in range(first_row, last_row, BR):
        rows = r0 + tl.arange(0, BR)
        row_ok = rows < last_row
        start0 = r0 * b  # the tile's first element; w, g and the bits hold elements from lo on
        base = start0 - held_lo
        offs = tl.arange(0, BR)[:, None] * b32 + cols
        ok = row_ok[:, None] & col_ok & (offs >= held_lo - start0) & (offs < held_hi - start0)
        g = tl.load(g_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * gsign
        if ZERO_BAD:
            g = tl.where(tl.abs(g) <= FP32_MAX, g, 0.0)
        if l2 != 0:  # L2 decay: M takes the weights too
            g = g + l2 * (tl.load(w_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) * shrink)
        k = base + offs
        bits = (tl.load(signs_ptr + (k >> 3), mask=ok, other=0) >> (k & 7).to(tl.uint8)) & 1
        if FLAG:
            flag_bits = (tl.load(flags_ptr + (k >> 3), mask=ok, other=0) >> (k & 7).to(tl.uint8)) & 1
        else:
            flag_bits = bits
        magnitude = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)[:, None] * cm
        mm = _momentum(g, bits, flag_bits, magnitude, high, low, beta1, FLAG)
        m_abs = tl.where(ok, tl.abs(mm), 0.0)
        m_abs = tl.where(m_abs > cap, cap, m_abs)
        tl.store(m_part + tile * a_rows + rows, tl.sum(m_abs, axis=1), mask=row_ok)
        acc += m_abs
    tl.store(m_part + tiles * a_rows + band * b + tile * BC + tl.arange(0, BC), tl.sum(acc, axis=0),
             mask=(tile * BC + tl.arange(0, BC)) < b)


@triton.jit
def _finish_kernel(meta_ptr, partial_ptr, words_ptr, BLOCK: tl.constexpr, KB: tl.constexpr,
                   COPIERS: tl.constexpr, COPY_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, FIRST: tl.constexpr,
                   MOMENTS: tl.constexpr, TO_SCRATCH: tl.constexpr, FLAG: tl.constexpr):
    """Program (t, j < MOMENTS) finishes tensor t's moment FIRST + j: 0 is V, 1 is M (in M's own
    view, ``T_M_COLS`` .. ``T_M_PARTIAL_AT``): row factor = Σ over tiles (0 for rows without elements lo ..
    hi), column factor = Σ over bands / total (0 total → divide by 1, as ``nnmf_from_sums``; not
    divided unless ``NORMALIZE``), in a fixed order, KB partials at a time; into the state, or with
    ``TO_SCRATCH`` into the partial buffer at ``T_NEW_M_AT`` (the magnitude flag's new factors, which the
    step kernel encodes against while it still decodes with the old ones). Programs (t, MOMENTS …)
    copy an unaligned tensor's sign scratch (and under ``FLAG`` its flag scratch) over its bytes."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    n = tl.load(row + T_N)
    m = tl.load(row + T_M)
    tiles = tl.load(row + T_TILES)
    bands = tl.load(row + T_BANDS)
    lo = tl.load(row + T_LO)
    hi = tl.load(row + T_HI)
    kk = tl.arange(0, KB)[:, None]
    if j < MOMENTS:
        moment = FIRST + j
        if moment == 1:  # M's view: V's unless momentum_shape="natural"
            n = tl.load(row + T_M_ROWS)
            m = tl.load(row + T_M_COLS)
            tiles = tl.load(row + T_M_TILES)
            bands = tl.load(row + T_M_BANDS)
            at = tl.load(row + T_M_PARTIAL_AT)
        else:
            at = tl.load(row + T_PARTIAL_AT)
        row0 = lo // m
        row_end = (hi + m - 1) // m
        if TO_SCRATCH:
            rows_out = partial_ptr + tl.load(row + T_NEW_M_AT)
            cols_out = rows_out + n
        else:
            rows_out = tl.load(row + T_ROW_V - (T_ROW_V - T_ROW_M) * moment).to(tl.pointer_type(tl.float32))  # row_v, or row_m
            cols_out = tl.load(row + T_COL_V - (T_COL_V - T_COL_M) * moment).to(tl.pointer_type(tl.float32))  # col_v, or col_m
        rows_part = partial_ptr + at
        cols_part = partial_ptr + at + tiles * n
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for r0 in range(0, n, BLOCK):
            idx = r0 + tl.arange(0, BLOCK)[None, :]
            s = tl.zeros((KB, BLOCK), dtype=tl.float32)
            for k0 in range(0, tiles, KB):
                held = (idx >= row0) & (idx < row_end)
                s += tl.load(rows_part + (k0 + kk) * n + idx, mask=held & (k0 + kk < tiles), other=0.0)
            row_sum = tl.sum(s, axis=0)
            tl.store(rows_out + r0 + tl.arange(0, BLOCK), row_sum, mask=r0 + tl.arange(0, BLOCK) < n)
            total += row_sum
        grand = tl.sum(total, axis=0)
        grand = tl.where(grand > 0, grand, 1.0) if NORMALIZE else 1.0
        for c0 in range(0, m, BLOCK):
            idx = c0 + tl.arange(0, BLOCK)[None, :]
            s = tl.zeros((KB, BLOCK), dtype=tl.float32)
            for b0 in range(0, bands, KB):
                s += tl.load(cols_part + (b0 + kk) * m + idx, mask=(idx < m) & (b0 + kk < bands), other=0.0)
            tl.store(cols_out + c0 + tl.arange(0, BLOCK), tl.sum(s, axis=0) / grand, mask=c0 + tl.arange(0, BLOCK) < m)
    elif (m % 8 != 0) | (lo % 8 != 0):
        nbytes = (hi - lo + 7) // 8
        _copy_bytes(tl.load(row + T_SIGNS).to(tl.pointer_type(tl.uint8)), words_ptr + tl.load(row + T_WORDS_AT), nbytes,
                    j - MOMENTS, COPIERS, COPY_BLOCK)
        if FLAG:
            _copy_bytes(tl.load(row + T_FLAGS).to(tl.pointer_type(tl.uint8)), words_ptr + tl.load(row + T_FLAG_WORDS_AT), nbytes,
                        j - MOMENTS, COPIERS, COPY_BLOCK)


@triton.jit
def _copy_bytes(dst, words, nbytes, copier, COPIERS: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """Copier ``copier`` of COPIERS: its share of the bytes of an int32 bit scratch over ``dst``."""
    scratch = words.to(tl.pointer_type(tl.uint8), bitcast=True)
    for b0 in range(copier * COPY_BLOCK, nbytes, COPIERS * COPY_BLOCK):
        idx = b0 + tl.arange(0, COPY_BLOCK)
        tl.store(dst + idx, tl.load(scratch + idx, mask=idx < nbytes), mask=idx < nbytes)


@triton.jit
def _flag_finish_kernel(meta_ptr, partial_ptr, BLOCK: tl.constexpr):
    """Program t, under the magnitude flag, after the finish kernel: tensor t's new factors of |M|
    (``T_NEW_M_AT``: in the partial buffer) into its state, and its levels h, l from the step
    kernel's per-work-item sums (``T_LEVEL_SUMS_AT``), added in a fixed order: h = Σ_F |M|·R / Σ_F R², likewise
    l over ¬F (0 where the denominator is 0; :func:`smmf.functional.flag_levels`)."""
    t = tl.program_id(0)
    row = meta_ptr + t.to(tl.int64) * META_COLUMNS
    m_cols = tl.load(row + T_M_COLS)
    factors = tl.load(row + T_M_ROWS) + m_cols  # the new row factors, then the column factors
    new = partial_ptr + tl.load(row + T_NEW_M_AT)
    row_m = tl.load(row + T_ROW_M).to(tl.pointer_type(tl.float32))
    col_m = tl.load(row + T_COL_M).to(tl.pointer_type(tl.float32))
    for i0 in range(0, factors, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        value = tl.load(new + idx, mask=idx < factors)
        tl.store(row_m + idx, value, mask=idx < factors - m_cols)
        tl.store(col_m + idx - (factors - m_cols), value, mask=(idx >= factors - m_cols) & (idx < factors))
    items = tl.load(row + T_TILES) * tl.load(row + T_BANDS)
    sums = partial_ptr + tl.load(row + T_LEVEL_SUMS_AT)
    slot = tl.arange(0, 2)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # (level, fit | energy)
    acc = tl.zeros((BLOCK, 2, 2), dtype=tl.float32)
    for i0 in range(0, items, BLOCK):
        item = i0 + tl.arange(0, BLOCK)[:, None, None]
        acc += tl.load(sums + item * 4 + slot, mask=item < items, other=0.0)
    by_level = tl.sum(acc, axis=0)
    kind = tl.arange(0, 2)[None, :]
    fit = tl.sum(tl.where(kind == 0, by_level, 0.0), axis=1)
    energy = tl.sum(tl.where(kind == 1, by_level, 0.0), axis=1)
    levels = tl.where(energy > 0, fit / tl.where(energy > 0, energy, 1.0), 0.0)
    tl.store(tl.load(row + T_LEVELS).to(tl.pointer_type(tl.float32)) + tl.arange(0, 2), levels)


@functools.lru_cache(maxsize=256)
def _layout(spans: tuple[tuple[int, int, int, int, int, bool], ...], has_m: bool,
            device: torch.device) -> tuple[list[dict[str, int]], Tensor, Tensor, int, int]:
    """Geometry of one launch, cached by its tensors' spans (n, m, lo, hi, m_cols, flag: the n×m
    matrix's elements lo .. hi, the columns of M's view, whether M carries the magnitude flag):
    each tensor's geometry columns of the table, by field name, the step kernel's and the momentum sums
    kernel's work items (tensor indices, on ``device``), and the sizes of the partial-sum buffer and
    of the bit scratch. Partial sums per tensor: [V rows: tiles×n][V cols: bands×m][M rows:
    tiles×rows of M's view][M cols: bands×m_cols], then under the flag [M's new row factors][its new
    column factors][4 level sums per step work item]."""
    geometry, counts, sums_counts = [], [], []
    first_item = first_sums_item = partial_at = words_at = 0
    for n, m, lo, hi, m_cols, flag in spans:
        tiles, bands = triton.cdiv(m, BLOCK_COLS), triton.cdiv(triton.cdiv(hi, m) - lo // m, BAND_ROWS)
        m_rows = n * m // m_cols
        sums_first = m_cols != m or flag  # |M|'s sums by _momentum_sums_kernel, in M's view
        held_m_rows = triton.cdiv(hi, m_cols) - lo // m_cols
        m_tiles, m_bands = (triton.cdiv(m_cols, BLOCK_COLS), triton.cdiv(held_m_rows, BAND_ROWS)) if sums_first else (tiles, bands)
        m_partial_at = partial_at + tiles * n + bands * m
        new_m_at = m_partial_at + ((m_tiles * m_rows + m_bands * m_cols) if has_m else 0)
        level_sums_at = new_m_at + (m_rows + m_cols if flag else 0)
        sign_words = (hi - lo) // 32 + 2 if has_m and (m % 8 or lo % 8) else 0
        geometry.append(dict(n=n, m=m, tiles=tiles, bands=bands, first_item=first_item, partial_at=partial_at,
                             words_at=words_at, lo=lo, hi=hi, m_cols=m_cols, m_rows=m_rows, m_tiles=m_tiles,
                             m_bands=m_bands, first_sums_item=first_sums_item, m_partial_at=m_partial_at,
                             new_m_at=new_m_at, level_sums_at=level_sums_at, flag_words_at=words_at + sign_words))
        counts.append(tiles * bands)
        sums_counts.append(m_tiles * m_bands if sums_first else 0)
        first_item += tiles * bands
        first_sums_item += sums_counts[-1]
        partial_at = level_sums_at + (4 * tiles * bands if flag else 0)
        words_at += sign_words * (2 if flag else 1)
    index = torch.arange(len(spans), dtype=torch.int32)
    items = torch.repeat_interleave(index, torch.tensor(counts))
    sums_items = torch.repeat_interleave(index, torch.tensor(sums_counts))
    return geometry, items.to(device), sums_items.to(device), partial_at, words_at


def _config_key(cfg: StepConfig, dtype: torch.dtype) -> tuple:
    return (dtype, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.decoupled_weight_decay,
            cfg.maximize, cfg.zero_nonfinite, cfg.stochastic_rounding and dtype == torch.bfloat16)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def triton_steps_(items: Sequence[StepItem]) -> Optional[Tensor]:
    """The fused step of many tensors: ``(param, grad, state, cfg)`` each, one launch per distinct
    (dtype, cfg, alignment) among them. Returns a CUDA counter of NaN/inf gradient elements (a lower
    bound; not synchronized), or None when none of the configs zeroes them."""
    launches: dict[tuple, list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]]] = {}
    copies_back = []
    for param, grad, state, cfg in items:
        if real_view(param).numel() == 0:
            continue
        weight = real_view(param.detach())
        if not weight.is_contiguous():  # logical row-major order: strided params go through one copy
            copy = weight.contiguous()
            copies_back.append((weight, copy))
            weight = copy
        g = real_view(grad)
        if g.dtype != weight.dtype or not g.is_contiguous():
            g = g.to(weight.dtype).contiguous()
        # Without a first moment there are no sign bits, and every tensor takes the aligned code.
        m = matrix_shape(weight)[1]
        aligned = cfg.beta1 is None or m % 8 == 0
        natural = momentum_cols(state, m) != m
        key = (*_config_key(cfg, weight.dtype), aligned, natural, cfg.code is MomentumCode.FLAG)
        launches.setdefault(key, []).append((weight, g, state, cfg))
    if not launches:
        return None
    bad = torch.zeros(1, dtype=torch.int32, device=next(iter(launches.values()))[0][0].device)
    for (dtype, *_, stochastic, aligned, natural, flag), tensors in launches.items():
        spans = tuple((n, m, 0, n * m, momentum_cols(state, m), flag)
                      for (n, m), state in ((matrix_shape(w), st) for w, _, st, _ in tensors))
        _launch(tensors, spans, bad, dtype=dtype, stochastic=stochastic, aligned=aligned, normalize=True,
                natural=natural, flag=flag)
    for weight, copy in copies_back:
        weight.copy_(copy)
    return bad if any(cfg.zero_nonfinite for _, _, _, cfg in items) else None


def triton_shard_step_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                       start: int) -> Optional[Tensor]:
    """The fused pass over an FSDP2 shard, the contract of
    :func:`smmf.kernels.numba_cpu.numba_shard_step_`: ``weight`` (contiguous; fp32, bf16 or fp16)
    and ``grad`` hold the elements ``start ..`` of the parameter's row-major flattening, ``state``
    the rank-local state (whole factor vectors, this shard's sign bits). Updates the weight and
    sign bits; leaves this shard's raw row and column sums in the four factor vectors (0 for rows
    it lacks), for the caller to add up across shards and normalize. The paper's code and the natural
    shape (the magnitude flag: :func:`triton_flag_shard_pass_`). Returns what :func:`triton_steps_`
    returns."""
    return _shard_launch(weight, grad, state, cfg, start, None)


def triton_flag_shard_pass_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                            flag_pass: FlagPass) -> Optional[Tensor]:
    """One of the magnitude flag's two passes over an FSDP2 shard (:class:`smmf.kernels.FlagPass`);
    the second always steps the weights (the first, :func:`_momentum_sums_kernel`, only reads).
    Returns what :func:`triton_steps_` returns (from pass 1; None from pass 0)."""
    return _shard_launch(weight, grad, state, cfg, start, flag_pass)


def _shard_launch(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                  flag_pass: Optional[FlagPass]) -> Optional[Tensor]:
    n, m = state[ROW_V].numel(), state[COL_V].numel()
    grad = grad.to(weight.dtype).contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=weight.device)
    if weight.numel():
        aligned = cfg.beta1 is None or (m % 8 == 0 and start % 8 == 0)
        m_cols = momentum_cols(state, m)
        flag = flag_pass is not None
        _launch([(weight, grad, state, cfg)], ((n, m, start, start + weight.numel(), m_cols, flag),), bad,
                dtype=weight.dtype, stochastic=cfg.stochastic_rounding and weight.dtype == torch.bfloat16,
                aligned=aligned, normalize=False, natural=m_cols != m, flag=flag, flag_pass=flag_pass)
    elif flag_pass is None or flag_pass.number == 1:  # nothing held: no sums to contribute
        for key in (ROW_V, COL_V) if flag_pass else (ROW_V, COL_V, ROW_M, COL_M):
            if key in state:
                state[key].zero_()
        if flag_pass:
            flag_pass.level_sums.zero_()
    else:
        flag_pass.new_row_m.zero_()
        flag_pass.new_col_m.zero_()
    return bad if cfg.zero_nonfinite and (flag_pass is None or flag_pass.number == 1) else None


def _launch(
    tensors: list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]],
    spans: tuple[tuple[int, int, int, int, int, bool], ...],
    bad: Tensor,
    dtype: torch.dtype,
    stochastic: bool,
    aligned: bool,
    normalize: bool,
    natural: bool,
    flag: bool,
    flag_pass: Optional[FlagPass] = None,
) -> None:
    """The launches of one group of tensors (module docstring). ``flag_pass``: one FSDP2 shard under the
    magnitude flag, one of its two passes (:func:`triton_flag_shard_pass_`)."""
    cfg = tensors[0][3]
    has_m = cfg.beta1 is not None
    device = tensors[0][0].device
    geometry, item_tensor, sums_items, partial_numel, words_numel = _layout(spans, has_m, device)
    table = []
    for (weight, g, state, _), geo in zip(tensors, geometry):
        row_v, col_v = state[ROW_V].data_ptr(), state[COL_V].data_ptr()
        if has_m:
            signs, row_m, col_m = state[SIGN_M].data_ptr(), state[ROW_M].data_ptr(), state[COL_M].data_ptr()
        else:
            signs, row_m, col_m = 0, row_v, col_v
        flags, levels = (state[FLAG_M].data_ptr(), state[LEVELS_M].data_ptr()) if flag else (0, 0)
        row = dict(geo, w=weight.data_ptr(), g=g.data_ptr(), signs=signs, row_m=row_m, col_m=col_m, row_v=row_v,
                   col_v=col_v, flags=flags, levels=levels)
        table += [row[field] for field in TABLE_FIELDS]
    # Pinned, then an async copy: no stream sync, and the caching host allocator keeps the buffer
    # until the copy is done.
    assert len(table) == len(tensors) * META_COLUMNS.value, "the table's rows and the kernels' META_COLUMNS disagree"
    meta = torch.tensor(table, dtype=torch.int64)
    meta = meta.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else meta
    partial = torch.empty(partial_numel, dtype=torch.float32, device=device)
    words = torch.zeros(max(words_numel, 1), dtype=torch.int32, device=device)
    blocks = dict(BR=BLOCK_ROWS, BC=BLOCK_COLS, BAND=BAND_ROWS, num_warps=WARPS)
    finish = dict(BLOCK=256, KB=16, COPY_BLOCK=4096, FLAG=flag, num_warps=8)
    shard_pass = None if flag_pass is None else flag_pass.number
    if (natural or flag) and shard_pass != 1:  # |M|'s sums in M's own view, before the step kernel's writes
        _momentum_sums_kernel[(sums_items.numel(),)](
            meta, sums_items, partial, cfg.beta1, *cfg.folded(), W_DTYPE=_TL_DTYPES[dtype],
            ZERO_BAD=cfg.zero_nonfinite, FLAG=flag, **blocks,
        )
    if flag:  # the new factors of |M| in the partial buffer: the step kernel encodes against them
        new_m, m_rows, m_cols = (geometry[0][key] for key in ("new_m_at", "m_rows", "m_cols"))  # (one tensor when a shard)
        if flag_pass is not None and shard_pass == 1:  # a shard's: the caller's, from every shard's sums
            partial[new_m : new_m + m_rows].copy_(flag_pass.new_row_m)
            partial[new_m + m_rows : new_m + m_rows + m_cols].copy_(flag_pass.new_col_m)
        else:
            _finish_kernel[(len(tensors), 1)](meta, partial, words, COPIERS=1, NORMALIZE=normalize, FIRST=1,
                                              MOMENTS=1, TO_SCRATCH=True, **finish)
        if flag_pass is not None and shard_pass == 0:  # this shard's raw sums, for the caller to add up
            flag_pass.new_row_m.copy_(partial[new_m : new_m + m_rows])
            flag_pass.new_col_m.copy_(partial[new_m + m_rows : new_m + m_rows + m_cols])
            return
    _step_kernel[(item_tensor.numel(),)](
        meta, item_tensor, partial, words, bad,
        cfg.lr, cfg.beta1 if has_m else 0.0, cfg.beta2, cfg.eps,
        *cfg.folded(),
        int(torch.randint(0, 2**30, ()).item()) if stochastic else 0,
        W_DTYPE=_TL_DTYPES[dtype], HAS_M=has_m, ALIGNED=aligned, STOCHASTIC=stochastic, ZERO_BAD=cfg.zero_nonfinite,
        NATURAL=natural, FLAG=flag, **blocks,
    )
    copiers = 0 if aligned else COPY_PROGRAMS
    moments = 2 if has_m and not flag else 1  # the flag's M is finished already
    _finish_kernel[(len(tensors), moments + copiers)](
        meta, partial, words, COPIERS=max(copiers, 1), NORMALIZE=normalize, FIRST=0, MOMENTS=moments,
        TO_SCRATCH=False, **finish,
    )
    if flag_pass is not None:  # a shard's second pass: its work items' level sums, added in a fixed order
        items, at = geometry[0]["tiles"] * geometry[0]["bands"], geometry[0]["level_sums_at"]
        flag_pass.level_sums.copy_(partial[at : at + 4 * items].view(items, 4).sum(0))
    elif flag:
        _flag_finish_kernel[(len(tensors),)](meta, partial, BLOCK=256, num_warps=4)


def triton_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> Optional[Tensor]:
    """The fused step of one tensor: same contract as :func:`smmf.functional.torch_step_`."""
    return triton_steps_([(param, grad, state, cfg)])



class _Triton:
    """The Triton backend (:class:`smmf.kernels.Backend`)."""

    name = "triton"
    steps_ = staticmethod(triton_steps_)
    shard_step_ = staticmethod(triton_shard_step_)
    flag_shard_pass_ = staticmethod(triton_flag_shard_pass_)

    @staticmethod
    def updating_flag_pass(cfg: StepConfig) -> int:
        return 1  # the first pass is the momentum sums kernel, which only reads


BACKEND = _Triton()
