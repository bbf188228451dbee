"""SMMF on DTensor parameters (FSDP2 ``fully_shard``): Alg. 1 on this rank's band of rows.

A parameter sharded on dim 0 owns a contiguous range of the row-major flattening of its n̂×m̂ matrix,
hence a band of rows (the first and last possibly partial) — of V's view and of M's own (whole rows
of it under ``momentum_shape="natural"``). :func:`sharded_step_` runs the torch path on that band —
the same lines as :func:`smmf.functional._factored_update`, with padding kept at zero — and sums the
partial row and column sums over ranks with one all-reduce (and the magnitude flag's level sums with
a second), so the factors, and therefore the update, are the single-device ones. A fused backend
(:class:`smmf.kernels.Backend`, handed in by :mod:`smmf.dispatch`) makes the same pass over the shard
in place (:func:`fused_sharded_step_`; the magnitude flag's two passes, an all-reduce after each) and
only the sums go through torch. Placement and checkpoint layout:
:mod:`smmf.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import (
    Nonfinite,
    StepConfig,
    decompress_momentum,
    factor_sums,
    flag_levels,
    magnitude_flag_fit,
    store_factors_,
    torch_step_,
)
from .kernels.contract import Backend, FlagPass
from .matrix import pack_signs, unpack_signs
from .sharding import local, shard_info
from .state import COL_M, COL_V, FLAG_M, LEVELS_M, ROW_M, ROW_V, SIGN_M, MomentumCode, matrix_shape

__all__ = ["Band", "fused_sharded_step_", "sharded_step_"]

# Sums partial row/column sums across the ranks that share a matrix.
Reducer = Callable[[list[Tensor]], list[Tensor]]


@dataclass(frozen=True)
class Band:
    """The part of the n×m matrix that a tensor holds: rows ``[row0, row1)``, of whose row-major
    flattening the tensor owns ``numel`` elements from ``first`` on (a shard's first and last rows
    may be partial)."""

    rows: int
    cols: int
    row0: int
    row1: int
    first: int
    numel: int

    @classmethod
    def of_range(cls, rows: int, cols: int, start: int, numel: int) -> "Band":
        row0 = start // cols if cols else 0
        row1 = -(-(start + numel) // cols) if numel else row0
        return cls(rows, cols, row0, row1, start - row0 * cols, numel)

    @property
    def start(self) -> int:
        """The first owned element in the row-major flattening."""
        return self.row0 * self.cols + self.first

    def in_view(self, rows: int, cols: int) -> "Band":
        """The same elements in another rows × cols view of the tensor."""
        return Band.of_range(rows, cols, self.start, self.numel)

    @property
    def padded(self) -> bool:
        return self.first != 0 or self.numel != (self.row1 - self.row0) * self.cols

    def to_matrix(self, flat: Tensor) -> Tensor:
        if not self.padded:
            return flat.view(self.row1 - self.row0, self.cols)
        out = flat.new_zeros(self.row1 - self.row0, self.cols)
        out.view(-1)[self.first : self.first + self.numel] = flat
        return out

    def owned(self, matrix: Tensor) -> Tensor:
        """The owned elements of a band matrix, flat."""
        return matrix.reshape(-1)[self.first : self.first + self.numel]

    def zero_padding_(self, matrix: Tensor) -> None:
        if self.padded:
            flat = matrix.view(-1)
            flat[: self.first] = 0
            flat[self.first + self.numel :] = 0


def sharded_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> Nonfinite:
    """The step of a DTensor parameter on the torch path: same contract as
    :func:`smmf.functional.torch_step_`."""
    return _sharded_step(param, grad, state, cfg, None)


def fused_sharded_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                        backend: Backend) -> Nonfinite:
    """The step of a DTensor parameter on a fused ``backend``: one pass over the shard, then the
    all-reduce of its row and column sums (the magnitude flag: two passes and two all-reduces)."""
    return _sharded_step(param, grad, state, cfg, backend)


def _sharded_step(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                  backend: Optional[Backend]) -> Nonfinite:
    info = shard_info(param)
    assert info is not None, "sharded_step_ takes DTensor parameters"
    local_state = {key: local(value) for key, value in state.items()}
    weight, local_grad = local(param), local(grad)
    if cfg.code is MomentumCode.DENSE or not info.sharded:  # elementwise, or every rank holds it all
        if backend is not None and cfg.code is not MomentumCode.DENSE:
            return backend.steps_([(weight, local_grad, local_state, cfg)])
        return torch_step_(weight, local_grad, local_state, cfg)
    rows, cols = matrix_shape(param)
    group = info.mesh.get_group()

    def all_reduce(sums: list[Tensor]) -> list[Tensor]:
        flat = torch.cat(sums)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return list(flat.split([s.numel() for s in sums]))

    if backend is not None and cfg.code is MomentumCode.FLAG:
        return _fused_flag_shard_step_(backend, weight, local_grad, local_state, cfg, info.start, all_reduce)
    if backend is not None:
        return _fused_shard_step_(backend, weight, local_grad, local_state, cfg, info.start, all_reduce)
    band = Band.of_range(rows, cols, info.start, info.numel)
    return torch_step_(weight, local_grad, local_state, cfg, matrix_update=partial(band_update, band=band, reduce=all_reduce))


def _fused_shard_step_(backend: Backend, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                       start: int, reduce: Reducer) -> Nonfinite:
    """The fused pass over the shard leaves its raw factor sums in the factor vectors: add
    them up across ranks, then normalize as on one device."""
    work = weight if weight.is_contiguous() else weight.contiguous()
    nonfinite = backend.shard_step_(work, grad, state, cfg, start)
    if work is not weight:
        weight.copy_(work)
    factors = [(ROW_V, COL_V)] + ([(ROW_M, COL_M)] if cfg.beta1 is not None else [])
    sums = reduce([state[key] for pair in factors for key in pair])
    for (row_key, col_key), row_sums, col_sums in zip(factors, sums[::2], sums[1::2]):
        store_factors_(state, row_key, col_key, row_sums, col_sums)
    return nonfinite


def _fused_flag_shard_step_(backend: Backend, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                            start: int, reduce: Reducer) -> Nonfinite:
    """The magnitude flag on a fused backend over a shard: its two passes
    (:meth:`smmf.kernels.Backend.flag_shard_pass_`), the shards' sums added up after each. The first
    pass's |M| sums make the new factors, which the second encodes against; the second's level sums
    make the levels; V's sums come from the pass that steps the weights
    (:meth:`smmf.kernels.Backend.updating_flag_pass`)."""
    work = weight if weight.is_contiguous() else weight.contiguous()
    new_row_m, new_col_m = torch.empty_like(state[ROW_M]), torch.empty_like(state[COL_M])
    level_sums = state[ROW_M].new_empty(4)
    v_first = backend.updating_flag_pass(cfg) == 0
    v_sums = [state[ROW_V], state[COL_V]]  # raw, after the pass that steps the weights
    found = [backend.flag_shard_pass_(work, grad, state, cfg, start, FlagPass(0, new_row_m, new_col_m, level_sums))]
    first = reduce([new_row_m, new_col_m] + (v_sums if v_first else []))
    store_factors_({ROW_M: new_row_m, COL_M: new_col_m}, ROW_M, COL_M, first[0], first[1])
    found.append(backend.flag_shard_pass_(work, grad, state, cfg, start, FlagPass(1, new_row_m, new_col_m, level_sums)))
    if work is not weight:
        weight.copy_(work)
    second = reduce([level_sums] + ([] if v_first else v_sums))
    store_factors_(state, ROW_V, COL_V, *(first[2:] if v_first else second[1:]))
    state[ROW_M].copy_(new_row_m)
    state[COL_M].copy_(new_col_m)
    state[LEVELS_M].copy_(flag_levels(second[0]))
    counted = [n for n in found if n is not None]
    return sum(counted[1:], counted[0]) if counted else None


def band_update(g_flat: Tensor, state: dict[str, Any], cfg: StepConfig, band: Band, reduce: Reducer) -> Tensor:
    """:func:`smmf.functional._factored_update` on a band: the owned elements' direction, flat.

    ``band`` is in V's (square) view; M has its own band, the same elements in M's view (its rows are
    dim 0 under ``momentum_shape="natural"``, so a ``Shard(0)`` shard holds whole rows of it)."""
    g = band.to_matrix(g_flat)
    v = torch.outer(state[ROW_V][band.row0 : band.row1], state[COL_V]).mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    band.zero_padding_(v)
    moments = [(ROW_V, COL_V, v, band)]
    m = m_band = magnitude = None
    if cfg.beta1 is not None:
        m_band = band.in_view(state[ROW_M].numel(), state[COL_M].numel())
        m = decompress_momentum(state, cfg, state[ROW_M][m_band.row0 : m_band.row1],
                                lambda bits: m_band.to_matrix(unpack_signs(bits, m_band.numel)))
        m.mul_(cfg.beta1).add_(m_band.to_matrix(g_flat), alpha=1.0 - cfg.beta1)
        m_band.zero_padding_(m)
        _store_bits_(state[SIGN_M], m_band.owned(m) >= 0)
        magnitude = m.abs()
        moments.append((ROW_M, COL_M, magnitude, m_band))
    sums: list[Tensor] = []
    for _, _, matrix, where in moments:
        row_sums, col_sums = factor_sums(matrix, numel=where.rows * where.cols)
        full_rows = matrix.new_zeros(where.rows)
        full_rows[where.row0 : where.row1] = row_sums  # other ranks' rows stay 0 until reduced
        sums += [full_rows, col_sums]
    sums = reduce(sums)
    for (row_key, col_key, _, _), row_sums, col_sums in zip(moments, sums[::2], sums[1::2]):
        store_factors_(state, row_key, col_key, row_sums, col_sums)
    denom = band.owned(v.sqrt_().add_(cfg.eps))
    if m is None or m_band is None or magnitude is None:
        return band.owned(g) / denom
    if cfg.code is MomentumCode.FLAG:  # the flag needs the new factors: its level sums take a second all-reduce
        estimate = torch.outer(state[ROW_M][m_band.row0 : m_band.row1], state[COL_M])
        above, level_sums = magnitude_flag_fit(m_band.owned(magnitude), m_band.owned(estimate), band.rows * band.cols)
        _store_bits_(state[FLAG_M], above)
        state[LEVELS_M].copy_(flag_levels(reduce([level_sums])[0]))
    return m_band.owned(m) / denom


def _store_bits_(packed: Tensor, bits: Tensor) -> None:
    """This rank's bits, packed, at the start of its (padded) byte range."""
    values = pack_signs(bits)
    packed[: values.numel()].copy_(values)
