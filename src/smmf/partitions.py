"""SMMF on flat partitions: the pieces of a model's tensors that one rank holds in a flat buffer (DeepSpeed ZeRO).

DeepSpeed's ZeRO optimizers hand their client optimizer flat buffers in place of the model's params: each holds,
end to end, this rank's pieces of the params of one group (stages 1 and 2: a contiguous range of the group's
params laid end to end, cut anywhere; stage 3: this rank's part of every param of a sub-group). SMMF steps each
piece as its whole tensor is stepped on one device:

- a piece that is a whole tensor: on its view in the buffer, by the kernels of a plain param;
- a piece of a tensor cut between ranks: by the shard passes of :mod:`smmf.shards` (a fused backend's where it
  covers the piece, else the torch path; the levels code's on the torch path, since a piece may cut its blocks),
  its weights and own bits updated alone and its factor sums added up across the ranks in **one** all-reduce for
  every cut tensor of the buffer at each round of its code (two under the magnitude flag), every rank making the
  same calls whatever it holds;
- a piece under the dense state (``vector_reshape=False``): elementwise, alone.

Which pieces a buffer holds (:class:`Partition`) is read from DeepSpeed by :mod:`smmf.zero`. The
state of each piece (the factors of its whole tensor; the bits, codes or dense moments of its own elements) is kept
under the buffer, ``optimizer.state[buffer] = {"pieces": {ordinal: state}, "places": {ordinal: (shape, start,
numel)}}``, ``ordinal`` being the tensor's place among the params the optimizer was given (its dither and rounding
noise are the ones it draws on one device); so DeepSpeed's checkpoints, which keep the client optimizer's state
dict of each rank, keep it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .codes import CODES, Code
from .dispatch import Kernel, shard_backend, step_kernel
from .functional import Nonfinite, StepConfig, torch_step_
from .schema import PIECES, PLACES
from .shards import Rounds, add_counts, fused_shard_rounds, levels_piece_rounds, run_rounds, torch_shard_rounds
from .state import (
    STEP,
    MomentumCode,
    TensorSpec,
    check_loaded_values,
    factor_dtype,
    matrix_shape,
    momentum_code,
    momentum_matrix_shape,
    state_layout,
)

__all__ = ["CutTensor", "Partition", "Piece", "PIECES", "PLACES", "check_loaded_pieces", "check_pieces",
           "cut_piece_state", "exchange", "init_pieces", "join_piece_states", "piece_layout", "step_partition_"]



@dataclass(frozen=True)
class Piece:
    """The elements ``start .. start + numel`` of the row-major flattening of a tensor of ``shape`` (the
    optimizer's ``ordinal``-th param), at ``offset`` in this rank's flat buffer."""

    ordinal: int
    shape: tuple[int, ...]
    start: int
    numel: int
    offset: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == math.prod(self.shape)

    @property
    def place(self) -> tuple[tuple[int, ...], int, int]:
        return self.shape, self.start, self.numel


@dataclass(frozen=True)
class CutTensor:
    """A tensor that two or more ranks hold pieces of: ``(start, numel)`` on each rank of the group."""

    ordinal: int
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Partition:
    """What one flat buffer holds on this rank (``pieces``, in buffer order), and every tensor of its group that
    ranks hold pieces of (``cut``, in one order on every rank): the collectives of a step are laid out by it."""

    pieces: tuple[Piece, ...]
    cut: tuple[CutTensor, ...]
    rank: int
    world: int
    process_group: Any


def exchange(pieces: Sequence[Piece], rank: int, world: int, process_group: Any) -> Partition:
    """The :class:`Partition` of this rank's ``pieces``: every rank's pieces gathered once (a collective every
    rank of ``process_group`` makes with its own), so that each knows the tensors cut between them."""
    mine = [(piece.ordinal, piece.shape, piece.start, piece.numel) for piece in pieces]
    every: list[Any] = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine, group=process_group)
    ranges: dict[int, tuple[tuple[int, ...], list[tuple[int, int]]]] = {}
    for held_by, theirs in enumerate(every):
        for ordinal, shape, start, numel in theirs:
            ranges.setdefault(ordinal, (tuple(shape), [(0, 0)] * world))[1][held_by] = (start, numel)
    cut = []
    for ordinal, (shape, where) in sorted(ranges.items()):
        covered = sorted((start, start + numel) for start, numel in where if numel)
        if [end for _, end in covered[:-1]] != [start for start, _ in covered[1:]] or covered[0][0] != 0 \
                or covered[-1][1] != math.prod(shape):
            raise RuntimeError(f"the ranks' pieces of parameter {ordinal} (shape {shape}) do not tile it: {where}")
        if len(covered) > 1:
            cut.append(CutTensor(ordinal, shape, tuple(where)))
    return Partition(tuple(pieces), tuple(cut), rank, world, process_group)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def piece_layout(piece: Piece, group: Mapping[str, Any], dtype: torch.dtype) -> dict[str, TensorSpec]:
    """The state a piece keeps (``dtype``: the buffer's): a whole tensor's, as a plain param's; a piece's, the
    whole tensor's factors and the bits, codes and dense moments of its own elements (the codes two per byte
    from its first element, the scales of the blocks it touches)."""
    meta = _meta(piece.shape, dtype)
    layout = state_layout(meta, group)
    if piece.whole:
        return layout
    return CODES[momentum_code(meta, group)].piece_layout(layout, piece.shape, piece.start, piece.numel)


def cut_piece_state(whole: Mapping[str, Any], piece: Piece, group: Mapping[str, Any],
                    dtype: torch.dtype) -> dict[str, Any]:
    """The state of ``piece`` cut from its whole tensor's state ``whole`` (a plain SMMF's, of a param of ``dtype``
    under ``group``'s options): what a rank holding the piece would have made, so that a tensor-wise checkpoint
    continues under ZeRO at any number of ranks."""
    tensors = {key: value for key, value in whole.items() if isinstance(value, Tensor)}
    if piece.whole:
        state = {key: value.clone() for key, value in tensors.items()}
    else:
        meta = _meta(piece.shape, dtype)
        state = CODES[momentum_code(meta, group)].cut(tensors, piece.shape, piece.start, piece.numel)
    return {**state, STEP: whole[STEP]}


def join_piece_states(pieces: Sequence[tuple[int, int, Mapping[str, Any]]], shape: tuple[int, ...],
                      group: Mapping[str, Any], dtype: torch.dtype, where: str, checked: bool = False) -> dict[str, Any]:
    """A tensor's whole state (as a plain SMMF keeps it) from the states of its pieces on the ranks, each
    ``(start, numel, state)``; ``ValueError`` unless they tile the tensor and were stepped alike (and, ``checked``,
    unless each piece's state is laid out as :func:`piece_layout` says and they agree on the factors)."""
    pieces = sorted(pieces, key=lambda piece: piece[0])
    ends = [0] + [start + numel for start, numel, _ in pieces]
    if [start for start, _, _ in pieces] != ends[:-1] or ends[-1] != math.prod(shape):
        raise ValueError(f"{where}: the pieces saved of this tensor of shape {shape} (elements "
                         f"{[(start, start + numel) for start, numel, _ in pieces]}) do not tile it: are the files of "
                         "some ranks missing?")
    meta = _meta(shape, dtype)
    code = CODES[momentum_code(meta, group)]
    if checked:
        for start, numel, state in pieces:
            check_loaded_values(piece_layout(Piece(0, shape, start, numel, 0), group, dtype), state, where,
                                f"the piece of elements {start} .. {start + numel}")
        _check_same_factors(pieces, code, where)
    steps = {int(state[STEP]) for _, _, state in pieces}
    if len(steps) != 1:
        raise ValueError(f"{where}: the pieces of this tensor were saved at different steps {sorted(steps)}")
    layout = state_layout(meta, group)
    if len(pieces) == 1:
        return {**{key: pieces[0][2][key] for key in layout}, STEP: steps.pop()}
    joined = code.join([(start, numel, dict(state)) for start, numel, state in pieces], shape, layout)
    return {**joined, STEP: steps.pop()}


def _check_same_factors(pieces: Sequence[tuple[int, int, Mapping[str, Any]]], code: Code, where: str) -> None:
    """The pieces of a tensor stepped across ranks hold the same factors (their sums were added up across them)."""
    shared = [field.key for field in code.fields if not field.own and field.key in pieces[0][2]]
    for start, _, state in pieces[1:]:
        for key in shared:
            if not torch.allclose(state[key].float(), pieces[0][2][key].float(), rtol=1e-5, atol=0):
                raise ValueError(f"{where}: the pieces saved of this tensor disagree on its '{key}' (the piece from "
                                 f"element {start} and the first): are they of one run?")


def init_pieces(partition: Partition, group: Mapping[str, Any], flat: Tensor) -> dict[str, Any]:
    """A buffer's state before its first step: every piece's zeros, laid out by :func:`piece_layout`."""
    states = {}
    for piece in partition.pieces:
        layout = piece_layout(piece, group, flat.dtype)
        states[piece.ordinal] = {STEP: 0, **{key: torch.zeros(spec.shape, dtype=spec.dtype, device=flat.device)
                                             for key, spec in layout.items()}}
    return {PIECES: states, PLACES: {piece.ordinal: piece.place for piece in partition.pieces}}


def check_pieces(partition: Partition, group: Mapping[str, Any], flat: Tensor, held: Mapping[str, Any],
                 where: str) -> None:
    """Raise ``RuntimeError`` unless a buffer's state ``held`` is that of this partition's pieces under
    ``group``'s options (a checkpoint of another number of ranks or layout, a layout option changed mid-run, a
    state edited or written by another optimizer: DeepSpeed's universal checkpoint loads Adam's keys there)."""
    if set(held) != {PIECES, PLACES}:
        raise RuntimeError(f"{where}: the SMMF state of a DeepSpeed ZeRO partition holds {sorted(held)}, not its "
                           f"'{PIECES}' and '{PLACES}': was it loaded from another optimizer's checkpoint or from "
                           "DeepSpeed's universal checkpoint, which cannot carry SMMF's state? Resume from a ZeRO "
                           "checkpoint of SMMF saved at this number of ranks, or, at another, from its tensor-wise "
                           "state: smmf.zero.tensorwise_state (or `smmf zero-to-plain`), then smmf.zero.load_state")
    places = {piece.ordinal: piece.place for piece in partition.pieces}
    if dict(held[PLACES]) != places:
        raise RuntimeError(f"{where}: the SMMF state of this DeepSpeed ZeRO partition is of other pieces of the "
                           "model's tensors (shape, first element, count by parameter) than this rank holds now: "
                           f"{dict(held[PLACES])} against {places}. It was saved at another number of ranks or "
                           "another ZeRO layout; resume at the layout that saved it")
    for piece in partition.pieces:
        state = held[PIECES].get(piece.ordinal)
        layout = piece_layout(piece, group, flat.dtype)
        if not isinstance(state, dict) or set(state) != set(layout) | {STEP}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise RuntimeError(f"{where}: parameter {piece.ordinal} has SMMF state {got} where its group's options "
                               f"need {sorted(set(layout) | {STEP})}: beta to or from None, vector_reshape, "
                               "momentum_shape and magnitude_bits cannot change mid-run")
        for key, spec in layout.items():
            value = state[key]
            if not isinstance(value, Tensor) or tuple(value.shape) != spec.shape or value.dtype != spec.dtype \
                    or value.device != flat.device:
                got = f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, Tensor) else \
                    type(value).__name__
                raise RuntimeError(f"{where}: parameter {piece.ordinal}'s SMMF state '{key}' is {got} where it needs "
                                   f"{spec.shape} {spec.dtype} on {flat.device}: was the state edited?")


def check_loaded_pieces(partition: Partition, group: Mapping[str, Any], flat: Tensor, saved: Any, where: str) -> None:
    """Raise ``ValueError`` unless a checkpoint's state of a buffer (``saved``) is one of this partition's pieces,
    each with the keys, shapes, dtypes and values its layout and a step allow
    (:func:`smmf.state.check_loaded_values`)."""
    if not isinstance(saved, Mapping) or set(saved) != {PIECES, PLACES}:
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"{where}: the state of a DeepSpeed ZeRO buffer holds {got}, not SMMF's '{PIECES}' and "
                         f"'{PLACES}' (is it another optimizer's checkpoint?)")
    places = {piece.ordinal: piece.place for piece in partition.pieces}
    saved_places = {ordinal: (tuple(shape), start, numel) for ordinal, (shape, start, numel) in saved[PLACES].items()}
    if saved_places != places or set(saved[PIECES]) != set(places):
        raise ValueError(f"{where}: this checkpoint holds SMMF's state of other pieces of the model's tensors (shape, "
                         f"first element, count by parameter) than this rank holds now: {saved_places} against "
                         f"{places}. It was saved at another number of ranks or another ZeRO layout (DeepSpeed "
                         "cannot reshard SMMF's state): resume at the number of ranks that saved it, or join its "
                         "pieces with smmf.zero.tensorwise_state and load that with smmf.zero.load_state")
    for piece in partition.pieces:
        check_loaded_values(piece_layout(piece, group, flat.dtype), saved[PIECES][piece.ordinal], where,
                            f"the piece of parameter {piece.ordinal} (shape {piece.shape}, elements {piece.start} .. "
                            f"{piece.start + piece.numel}) this rank holds")


# A param's step at ``step``, of ``code``, for the optimizer's ``ordinal``-th param: the optimizer's config.
ConfigFor = Callable[[int, MomentumCode, int], StepConfig]


def round_sizes(tensor: CutTensor, group: Mapping[str, Any], dtype: torch.dtype, world: int) -> list[list[int]]:
    """The sizes of the tensors each round of a cut tensor's step adds up (:mod:`smmf.shards`), known to every
    rank, those that hold none of it too."""
    meta = _meta(tensor.shape, dtype)
    code = CODES[momentum_code(meta, group)]
    return code.round_sizes(*matrix_shape(meta), *momentum_matrix_shape(meta, group), world)


def step_partition_(flat: Tensor, grad: Tensor, partition: Partition, held: Mapping[str, Any],
                    group: Mapping[str, Any], config_for: ConfigFor) -> Nonfinite:
    """One step of every piece a buffer holds (``held``: its state, checked by :func:`check_pieces`), in place;
    returns the NaN/inf gradient elements met. Whole tensors share the launches of their kernel; the cut ones make
    one all-reduce per round of their code over ``partition.process_group``, on every rank."""
    states = held[PIECES]
    found: list[Nonfinite] = []
    whole: dict[Kernel, list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]]] = {}
    rounds: dict[int, Rounds] = {}
    cut = {tensor.ordinal: tensor for tensor in partition.cut}
    for piece in partition.pieces:
        state = states[piece.ordinal]
        state[STEP] += 1
        weight, piece_grad = flat.narrow(0, piece.offset, piece.numel), grad.narrow(0, piece.offset, piece.numel)
        code = momentum_code(_meta(piece.shape, flat.dtype), group)
        cfg = config_for(state[STEP], code, piece.ordinal)
        if piece.whole:
            weight, piece_grad = weight.view(piece.shape), piece_grad.view(piece.shape)
            whole.setdefault(step_kernel(group["backend"], weight, code), []).append((weight, piece_grad, state, cfg))
        elif CODES[code].elementwise:
            found.append(torch_step_(weight, piece_grad, state, cfg, first=piece.start))
        elif CODES[code].by_param_rows:
            rounds[piece.ordinal] = levels_piece_rounds(shard_backend(group["backend"], weight, code), weight,
                                                        piece_grad, state, cfg, piece.shape, piece.start,
                                                        cut[piece.ordinal].ranges, partition.rank)
        else:
            backend = shard_backend(group["backend"], weight, code)
            rounds[piece.ordinal] = (torch_shard_rounds(weight, piece_grad, state, cfg, piece.start) if backend is None
                                     else fused_shard_rounds(backend, weight, piece_grad, state, cfg, piece.start))
    for kernel, items in whole.items():
        found += [kernel.steps_(items)] if kernel.batched else [kernel.steps_([item]) for item in items]
    sizes = [round_sizes(tensor, group, flat.dtype, partition.world) for tensor in partition.cut]
    sums_dtype = factor_dtype(flat)

    def add_up(r: int, yielded: list[Optional[list[Tensor]]]) -> list[Optional[list[Tensor]]]:
        """Every cut tensor's sums of round ``r`` (zeros where this rank holds none of it) in one all-reduce."""
        parts: list[Tensor] = []
        for tensor_sizes, sums in zip(sizes, yielded):
            if r < len(tensor_sizes):
                if sums is None:
                    parts += [flat.new_zeros(size, dtype=sums_dtype) for size in tensor_sizes[r]]
                else:
                    assert [t.numel() for t in sums] == tensor_sizes[r], "a piece's round is not its code's"
                    parts += [t.reshape(-1) for t in sums]
        total = torch.cat(parts)
        if partition.world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=partition.process_group)
        out: list[Optional[list[Tensor]]] = []
        at = 0
        for tensor_sizes, sums in zip(sizes, yielded):
            taken = tensor_sizes[r] if r < len(tensor_sizes) else []
            pieces = list(total[at : at + sum(taken)].split(taken)) if taken else []
            at += sum(taken)
            out.append(pieces if sums is not None else None)
        return out

    count = max((len(tensor_sizes) for tensor_sizes in sizes), default=0)
    found += run_rounds([rounds.get(tensor.ordinal) for tensor in partition.cut], count, add_up)
    return add_counts(found)
