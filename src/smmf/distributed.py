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

from dataclasses import dataclass
from functools import partial
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import Nonfinite, StepConfig, _whole_matrix_update, torch_step_
from .kernels.contract import Backend, StepItem
from .sharding import ShardInfo, local, shard_info
from .band import Band
from .codes import CODES
from .shards import Reducer, Rounds, add_counts, band_update, fused_shard_rounds, run_rounds
from .state import ROW_V, matrix_shape

__all__ = ["fused_sharded_steps_", "sharded_step_"]


def sharded_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> Nonfinite:
    """The step of a DTensor parameter on the torch path: same contract as
    :func:`smmf.functional.torch_step_`."""
    local_state = {key: local(value) for key, value in state.items()}
    return _local_step_(param, _info(param), local(param), local(grad), local_state, cfg)


def _local_step_(param: Tensor, info: ShardInfo, weight: Tensor, local_grad: Tensor, local_state: dict[str, Any],
                 cfg: StepConfig) -> Nonfinite:
    """:func:`sharded_step_` on the local tensors of ``param`` (whose ``info`` is given)."""
    code = CODES[cfg.code]
    if code.elementwise or not info.sharded:  # every rank holds it all
        return torch_step_(weight, local_grad, local_state, cfg, first=info.start)
    group = info.mesh.get_group()
    if code.by_param_rows and param.dim() < 2:  # one row, cut anywhere: step it whole
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
        code = CODES[cfg.code]
        if code.elementwise:  # the torch path
            found.append(torch_step_(weight, local_grad, local_state, cfg, first=info.start))
        elif code.by_param_rows and info.sharded and param.dim() < 2:  # a vector: stepped whole
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
    return add_counts(found)


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

    def rounds(self, backend: Backend) -> Rounds:
        return fused_shard_rounds(backend, self.weight, self.grad, self.state, self.cfg, self.start)


def _shard_steps(backend: Backend, shards: Sequence[_Shard]) -> list[Nonfinite]:
    """The fused passes over the shards (:func:`smmf.shards.fused_shard_rounds`), each round's sums of all of
    them added up in one call of the reducer per key: one all-reduce per process group and dtype for each
    round (the magnitude flag's two rounds: two; the second only for its shards). The same calls in the same
    order on every rank: the params come in the same order everywhere."""

    def add_up(_: int, yielded: list[Optional[list[Tensor]]]) -> list[Optional[list[Tensor]]]:
        by_key: dict[Hashable, list[int]] = {}
        for i, sums in enumerate(yielded):
            if sums is not None:
                by_key.setdefault(shards[i].key, []).append(i)
        out: list[Optional[list[Tensor]]] = [None] * len(yielded)
        for indices in by_key.values():
            summed = shards[indices[0]].reduce([t for i in indices for t in yielded[i] or ()])
            at = 0
            for i in indices:
                count = len(yielded[i] or ())
                out[i], at = summed[at : at + count], at + count
        return out

    count = 2 if any(CODES[shard.cfg.code].flag_passes for shard in shards) else 1
    return run_rounds([shard.rounds(backend) for shard in shards], count if shards else 0, add_up)


def _fused_flag_shard_step_(backend: Backend, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                            start: int, reduce: Reducer) -> Nonfinite:
    """One shard under the magnitude flag, its sums added up by ``reduce`` (tests stand threads in
    for ranks)."""
    return add_counts(_shard_steps(backend, [_Shard(weight, grad, state, cfg, start, "shard", reduce)]))
