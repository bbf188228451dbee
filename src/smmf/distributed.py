"""SMMF on DTensor parameters (FSDP2 ``fully_shard``): Alg. 1 on this rank's band of rows.

A parameter sharded on dim 0 owns a contiguous range of the row-major flattening of its n̂×m̂ matrix,
hence a band of rows (the first and last possibly partial) — of V's view and of M's own (whole rows
of it under ``momentum_shape="natural"``). :func:`sharded_step_` runs the torch path on that band —
the same lines as :func:`smmf.functional._factored_update`, with padding kept at zero — and sums the
partial row and column sums over ranks with one all-reduce (and the magnitude flag's level sums with
a second), so the factors, and therefore the update, are the single-device ones. A fused backend
(:class:`smmf.kernels.Backend`, handed in by :mod:`smmf.dispatch`) makes the same pass over each shard
in place and only the sums go through torch: for all the parameters of a step at once
(:func:`fused_sharded_steps_`), one all-reduce per process group (the magnitude flag's two passes:
two). The levels code (``magnitude_bits=3``) codes M by rows of the param, so a shard of a param with
two or more dims codes its own rows and only V's sums cross ranks (on a fused backend, in the step's one
all-reduce); a vector is one row that FSDP2 cuts anywhere (inside a block, inside a code byte), so its
code is replicated and each rank steps the whole vector, keeping its own elements (on a fused backend:
every vector of the step from one all-gather of their weights and gradients, in the backend's launch for
whole tensors). Placement and checkpoint layout: :mod:`smmf.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import (
    Nonfinite,
    StepConfig,
    decompress_momentum,
    factor_sums,
    _whole_matrix_update,
    flag_levels,
    levels_update_,
    magnitude_flag_fit,
    store_factors_,
    torch_step_,
)
from .kernels.contract import Backend, FlagPass, StepItem
from .matrix import pack_signs, unpack_signs
from .sharding import ShardInfo, local, shard_info
from .state import COL_M, COL_V, FLAG_M, LEVELS_M, ROW_M, ROW_V, SIGN_M, MomentumCode, matrix_shape

__all__ = ["Band", "fused_sharded_steps_", "sharded_step_"]

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
    local_state = {key: local(value) for key, value in state.items()}
    return _local_step_(param, _info(param), local(param), local(grad), local_state, cfg)


def _local_step_(param: Tensor, info: ShardInfo, weight: Tensor, local_grad: Tensor, local_state: dict[str, Any],
                 cfg: StepConfig) -> Nonfinite:
    """:func:`sharded_step_` on the local tensors of ``param`` (whose ``info`` is given)."""
    if cfg.code is MomentumCode.DENSE or not info.sharded:  # elementwise, or every rank holds it all
        return torch_step_(weight, local_grad, local_state, cfg, first=info.start)
    group = info.mesh.get_group()
    if cfg.code is MomentumCode.LEVELS and param.dim() < 2:  # one row, cut anywhere: step it whole
        gather = partial(_gather_vector, total=param.numel(), world=info.world, group=group)
        own = slice(info.start, info.start + info.numel)
        return torch_step_(weight, local_grad, local_state, cfg, first=info.start,
                           matrix_update=lambda g, st, c: _whole_matrix_update(gather(g), st, c)[own])
    rows, cols = matrix_shape(param)
    band = Band.of_range(rows, cols, info.start, info.numel)
    return torch_step_(weight, local_grad, local_state, cfg, first=info.start,
                       matrix_update=partial(band_update, band=band, reduce=_all_reduce_on(group)))


def _gather_vector(local_part: Tensor, total: int, world: int, group: Any) -> Tensor:
    """The whole of a vector sharded in FSDP2's chunks (``ceil(total / world)`` elements a rank, the last
    ones shorter or empty), on every rank."""
    return _gather_vectors([(local_part, total)], world, group)[0]


def _gather_vectors(parts: Sequence[tuple[Tensor, int]], world: int, group: Any) -> list[Tensor]:
    """:func:`_gather_vector` of each (local part, total) in **one** all-gather: their bytes side by side,
    each chunk's slot padded to 8 bytes so that every dtype's view of it is aligned."""
    chunk_bytes = [-(-total // world) * part.element_size() for part, total in parts]
    slots = [-(-nbytes // 8) * 8 for nbytes in chunk_bytes]
    mine = torch.zeros(sum(slots), dtype=torch.uint8, device=parts[0][0].device)
    at = 0
    for (part, _), slot in zip(parts, slots):
        raw = part.detach().contiguous().view(-1).view(torch.uint8)
        mine[at : at + raw.numel()] = raw
        at += slot
    pieces = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(pieces, mine, group=group)
    every = torch.stack(pieces)  # (world, bytes): rank r's chunks in row r
    wholes, at = [], 0
    for (part, total), nbytes, slot in zip(parts, chunk_bytes, slots):
        wholes.append(every[:, at : at + nbytes].contiguous().view(part.dtype).view(-1)[:total])
        at += slot
    return wholes


def fused_sharded_steps_(items: Sequence[StepItem], backend: Backend) -> Nonfinite:
    """The steps of DTensor parameters on a fused ``backend``: one pass over each shard, then the row
    and column sums of all of them added up across ranks in **one** all-reduce per process group and
    dtype (the magnitude flag's two passes: two); the levels code's vectors take one all-gather per
    process group and are stepped whole (their NaN/inf elements counted on every rank, not only on the
    one that holds them). Each parameter ends as :func:`sharded_step_` leaves it."""
    found: list[Nonfinite] = []
    whole: list[StepItem] = []
    vectors: list[_Vector] = []
    shards: list[_Shard] = []
    for param, grad, state, cfg in items:
        info = _info(param)
        local_state = {key: local(value) for key, value in state.items()}
        weight, local_grad = local(param), local(grad)
        if cfg.code is MomentumCode.DENSE:  # elementwise: the torch path
            found.append(torch_step_(weight, local_grad, local_state, cfg, first=info.start))
        elif cfg.code is MomentumCode.LEVELS and info.sharded and param.dim() < 2:  # a vector: stepped whole
            vectors.append(_Vector(info, param.numel(), (weight, local_grad, local_state, cfg)))
        elif not info.sharded:  # every rank holds it all
            whole.append((weight, local_grad, local_state, cfg))
        else:
            group = info.mesh.get_group()
            dtype = local_state[ROW_V].dtype
            shards.append(_Shard(weight, local_grad, local_state, cfg, info.start, (id(group), dtype),
                                 _all_reduce_on(group)))
    gathered = _whole_vectors(vectors)
    if whole or gathered:
        found.append(backend.steps_(whole + gathered))
    for vector, (whole_weight, *_) in zip(vectors, gathered):
        own = vector.info.start
        vector.item[0].copy_(whole_weight[own : own + vector.info.numel])
    found += _shard_steps(backend, shards)
    return _total(found)


class _Vector(NamedTuple):
    """A sharded vector of the levels code: its placement, its length and its rank-local step item."""

    info: ShardInfo
    total: int
    item: StepItem


def _whole_vectors(vectors: Sequence[_Vector]) -> list[StepItem]:
    """Each sharded vector's step item with its whole weight and gradient (its state is replicated): one
    all-gather per process group for all of them."""
    by_group: dict[int, list[int]] = {}
    for i, vector in enumerate(vectors):
        by_group.setdefault(id(vector.info.mesh.get_group()), []).append(i)
    out: dict[int, StepItem] = {}
    for indices in by_group.values():
        info = vectors[indices[0]].info
        parts = [(tensor, vectors[i].total) for i in indices for tensor in vectors[i].item[:2]]
        wholes = _gather_vectors(parts, info.world, info.mesh.get_group())
        for i, weight, grad in zip(indices, wholes[::2], wholes[1::2]):
            _, _, state, cfg = vectors[i].item
            out[i] = (weight, grad, state, cfg)
    return [out[i] for i in range(len(vectors))]


def _info(param: Tensor) -> ShardInfo:
    info = shard_info(param)
    assert info is not None, "the sharded steps take DTensor parameters"
    return info


def _all_reduce_on(group: Any) -> Reducer:
    def all_reduce(sums: list[Tensor]) -> list[Tensor]:
        flat = torch.cat(sums)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return list(flat.split([s.numel() for s in sums]))

    return all_reduce


def _total(found: Sequence[Nonfinite]) -> Nonfinite:
    counted = [n for n in found if n is not None]
    return sum(counted[1:], counted[0]) if counted else None


@dataclass
class _Shard:
    """One parameter's shard in a step of many: its local tensors, and how its sums are added up
    (``reduce``; shards with the same ``key`` share one call of it)."""

    weight: Tensor
    grad: Tensor
    state: dict[str, Any]
    cfg: StepConfig
    start: int
    key: Hashable
    reduce: Reducer
    work: Tensor = field(init=False)
    flag: Optional[FlagPass] = None

    def __post_init__(self) -> None:
        self.work = self.weight if self.weight.is_contiguous() else self.weight.contiguous()

    def write_back(self) -> None:
        if self.work is not self.weight:
            self.weight.copy_(self.work)


def _reduce_together(rounds: Sequence[tuple[_Shard, list[Tensor]]]) -> list[list[Tensor]]:
    """Each shard's tensors summed across ranks, one call of the reducer per key for all of them (the
    same calls in the same order on every rank: the params come in the same order everywhere)."""
    by_key: dict[Hashable, list[int]] = {}
    for i, (shard, _) in enumerate(rounds):
        by_key.setdefault(shard.key, []).append(i)
    out: list[list[Tensor]] = [[] for _ in rounds]
    for indices in by_key.values():
        summed = rounds[indices[0]][0].reduce([t for i in indices for t in rounds[i][1]])
        at = 0
        for i in indices:
            out[i], at = summed[at : at + len(rounds[i][1])], at + len(rounds[i][1])
    return out


def _shard_steps(backend: Backend, shards: Sequence[_Shard]) -> list[Nonfinite]:
    """The fused passes over the shards, and the all-reduces of their sums, shared by all of them.

    Without the flag, a shard's one pass leaves its raw factor sums in the factor vectors: added up
    across ranks, they are normalized as on one device. Under the magnitude flag
    (:meth:`smmf.kernels.Backend.flag_shard_pass_`), the first pass's |M| sums make the new factors,
    which the second pass encodes against; the second's level sums make the levels; V's sums come
    from the pass that steps the weights (:meth:`smmf.kernels.Backend.updating_flag_pass`). So the
    first all-reduce takes every shard's sums, the second only the flagged shards'."""
    found: list[Nonfinite] = []
    first: list[tuple[_Shard, list[Tensor]]] = []
    for shard in shards:
        state, cfg = shard.state, shard.cfg
        if cfg.code is MomentumCode.FLAG:
            shard.flag = FlagPass(0, torch.empty_like(state[ROW_M]), torch.empty_like(state[COL_M]),
                                  state[ROW_M].new_empty(4))
            found.append(backend.flag_shard_pass_(shard.work, shard.grad, state, cfg, shard.start, shard.flag))
            v_first = backend.updating_flag_pass(cfg) == 0
            first.append((shard, [shard.flag.new_row_m, shard.flag.new_col_m]
                          + ([state[ROW_V], state[COL_V]] if v_first else [])))
        else:
            found.append(backend.shard_step_(shard.work, shard.grad, state, cfg, shard.start))
            shard.write_back()
            keys = [ROW_V, COL_V] + ([ROW_M, COL_M] if cfg.code is MomentumCode.SIGN else [])
            first.append((shard, [state[key] for key in keys]))
    second: list[tuple[_Shard, list[Tensor]]] = []
    for (shard, _), sums in zip(first, _reduce_together(first)):
        state, flag = shard.state, shard.flag
        if flag is None:
            for row_key, col_key, row_sums, col_sums in zip((ROW_V, ROW_M), (COL_V, COL_M), sums[::2], sums[1::2]):
                store_factors_(state, row_key, col_key, row_sums, col_sums)
            continue
        store_factors_({ROW_M: flag.new_row_m, COL_M: flag.new_col_m}, ROW_M, COL_M, sums[0], sums[1])
        if len(sums) > 2:  # V's sums came from the first pass
            store_factors_(state, ROW_V, COL_V, sums[2], sums[3])
        shard.flag = flag._replace(number=1)
        found.append(backend.flag_shard_pass_(shard.work, shard.grad, state, shard.cfg, shard.start, shard.flag))
        shard.write_back()
        second.append((shard, [flag.level_sums] + ([] if len(sums) > 2 else [state[ROW_V], state[COL_V]])))
    for (shard, _), sums in zip(second, _reduce_together(second)):
        state, flag = shard.state, shard.flag
        assert flag is not None
        if len(sums) > 1:  # V's sums came from the second pass
            store_factors_(state, ROW_V, COL_V, sums[1], sums[2])
        state[ROW_M].copy_(flag.new_row_m)
        state[COL_M].copy_(flag.new_col_m)
        state[LEVELS_M].copy_(flag_levels(sums[0]))
    return found


def _fused_flag_shard_step_(backend: Backend, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                            start: int, reduce: Reducer) -> Nonfinite:
    """One shard under the magnitude flag, its sums added up by ``reduce`` (tests stand threads in
    for ranks)."""
    return _total(_shard_steps(backend, [_Shard(weight, grad, state, cfg, start, "shard", reduce)]))


def band_update(g_flat: Tensor, state: dict[str, Any], cfg: StepConfig, band: Band, reduce: Reducer) -> Tensor:
    """:func:`smmf.functional._factored_update` on a band: the owned elements' direction, flat.

    ``band`` is in V's (square) view; M has its own band, the same elements in M's view (its rows are
    dim 0 under ``momentum_shape="natural"``, so a ``Shard(0)`` shard holds whole rows of it)."""
    g = band.to_matrix(g_flat)
    v = torch.outer(state[ROW_V][band.row0 : band.row1], state[COL_V]).mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    band.zero_padding_(v)
    moments = [(ROW_V, COL_V, v, band)]
    m = m_band = magnitude = None
    if cfg.code is MomentumCode.LEVELS:  # by rows of the param: this shard's rows are whole rows, its own
        m = levels_update_(g_flat, state, cfg, band.start)
    elif cfg.beta1 is not None:
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
    if cfg.code is MomentumCode.LEVELS:
        assert m is not None
        return m / denom
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
