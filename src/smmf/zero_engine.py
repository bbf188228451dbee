"""SMMF under DeepSpeed ZeRO: the engine adapter (:mod:`smmf.engine`) for the flat buffers ZeRO puts in the groups.

Which pieces of the model's tensors a buffer holds is read from DeepSpeed once, at the buffer's first sight
(:func:`smmf.zero.find_partition`, a collective over its ranks); each piece is stepped as its tensor is on one device
(:mod:`smmf.partitions`). ZeRO-1/2 step the optimizer one group a call, with ``param_groups`` cut to that group: a
refusal in any group must leave every group as it was, so every group's options and the state of every buffer stepped
before are checked at the first call of a step, and the whole list of groups is put back when a step raises.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Iterable, Optional, cast

import torch
from torch import Tensor

from .dispatch import Route, RouteWhere, bump_versions
from .engine import Engine, EngineStep
from .optimizer import SMMF
from .options import StepConfigs
from .partitions import (Partition, check_loaded_pieces, check_pieces, cut_piece_state, init_pieces, piece_layout,
                         step_partition_)
from .checkpoint import check_smmf_group
from .codes import BIT_FIELDS
from .schema import PIECES, PLACES
from .sharding import bits_from_checkpoint, is_dtensor
from .state import STEP, check_loaded_values, state_layout
from .zero import GIVEN_GROUPS, find_partition, is_deepspeed_buffer
from .zero import stepping_to_make_state as stepping_to_make_state

__all__ = ["ZeroEngine", "engine_for", "holds_buffers", "stepping_to_make_state"]


def holds_buffers(optimizer: SMMF) -> bool:
    """Whether DeepSpeed ZeRO has put flat buffers in ``optimizer``'s groups in place of its params, read from what
    DeepSpeed attaches, without mapping their pieces (no collective)."""
    given = optimizer._given
    return "deepspeed" in sys.modules and any(not given.holds(p) and is_deepspeed_buffer(p, given.live())
                                              for group in optimizer.param_groups for p in group["params"])


def engine_for(optimizer: SMMF) -> Optional[ZeroEngine]:
    """The adapter of ``optimizer`` under DeepSpeed (imported: any tensor it was not given may be a ZeRO buffer)."""
    return ZeroEngine(optimizer) if "deepspeed" in sys.modules else None


class _BufferStep:
    """A ZeRO buffer's step: its pieces, by :func:`smmf.partitions.step_partition_`."""

    def __init__(self, engine: ZeroEngine, group: dict[str, Any], buffer: Tensor, grad: Tensor,
                 partition: Partition) -> None:
        held = engine.optimizer.state.get(buffer)
        if held:
            check_pieces(partition, group, buffer, held, f"a DeepSpeed ZeRO buffer of {buffer.numel()} elements")
        self.engine, self.group, self.buffer, self.grad, self.partition = engine, group, buffer, grad, partition
        self.before = held if held else None
        self.held = held if held else init_pieces(partition, group, buffer)
        self.counts = {id(state): state[STEP] for state in self.held[PIECES].values()}

    def run(self, configs: StepConfigs) -> Any:
        if self.held is not self.before:
            self.engine.optimizer.state[self.buffer] = self.held
        config_for = functools.partial(configs.of, self.group, dtype=self.buffer.dtype)
        nonfinite = step_partition_(self.buffer, self.grad, self.partition, self.held, self.group, config_for)
        bump_versions([self.buffer] + [t for state in self.held[PIECES].values() for t in state.values()
                                       if isinstance(t, Tensor)])
        return nonfinite

    def undo(self) -> None:
        if self.before is None:
            self.engine.optimizer.state.pop(self.buffer, None)
            return
        for state in self.before[PIECES].values():  # its pieces' counts, which its step advanced first
            state[STEP] = self.counts[id(state)]


def _bits_flat(whole: Any, shape: tuple[int, ...], where: str) -> Any:
    """A tensor's state with its packed bits as one run keeps them (flat), from the layout by rows of the param of
    an FSDP2 run's full state dict (:func:`smmf.sharding.bits_for_checkpoint`) where they are saved so."""
    if not isinstance(whole, dict):
        return whole
    if any(is_dtensor(value) for value in whole.values()):
        raise ValueError(f"{where}: the state holds DTensors (an FSDP2 run's sharded state dict): save its full state "
                         "dict for ZeRO (get_optimizer_state_dict with StateDictOptions(full_state_dict=True))")
    shaped = torch.empty(()).expand(shape)  # the shape alone, on the CPU
    try:
        return {key: bits_from_checkpoint(value, shaped) if key in BIT_FIELDS and isinstance(value, Tensor)
                and value.dim() == 2 else value for key, value in whole.items()}
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _refusals(error: Optional[str]) -> list[tuple[int, str]]:
    """Each rank's refusal of a load (``error``: this rank's, or None), gathered over the ranks: one refusing
    stops all, before any of them changes anything."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [(0, error)] if error is not None else []
    everyone: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    return [(rank, message) for rank, message in enumerate(everyone) if message is not None]


class ZeroEngine(Engine):
    """DeepSpeed ZeRO's flat buffers in an optimizer's groups, each stepped as the pieces of the params it holds."""

    def __init__(self, optimizer: SMMF) -> None:
        self.optimizer = optimizer
        self._partitions: dict[int, tuple[weakref.ref[Tensor], Optional[Partition]]] = {}
        self._buffer_groups: dict[int, int] = {}  # a buffer's group, by its place in the whole list of groups

    def holds(self, tensor: Tensor) -> bool:
        return self._partition_of(tensor) is not None

    def _partition_of(self, buffer: Tensor) -> Optional[Partition]:
        """The pieces of the given params that ``buffer`` holds if it is a ZeRO buffer in their place, else None;
        found at its first sight (a collective over its ranks) and kept."""
        known = self._partitions.get(id(buffer))
        if known is not None and known[0]() is buffer:
            return known[1]
        given = self.optimizer._given
        partition = find_partition(buffer, given.live(), given.places())
        ident = id(buffer)
        self._partitions[ident] = (weakref.ref(buffer, lambda _: self._forget(ident)), partition)
        return partition

    def _forget(self, ident: int) -> None:
        self._partitions.pop(ident, None)
        self._buffer_groups.pop(ident, None)

    def route(self, where: RouteWhere, tensor: Tensor) -> Optional[Route]:
        if not is_deepspeed_buffer(tensor, self.optimizer._given.live()):
            return None
        return Route(*where, code="per piece", kernel="DeepSpeed ZeRO partition", launch="pieces",
                     why="a flat buffer DeepSpeed put in this group: each piece of a tensor is stepped as that tensor "
                     "(whole) or by the shard passes (cut)")

    def prepare(self, group: dict[str, Any], tensor: Tensor, grad: Tensor) -> EngineStep:
        partition = self._partition_of(tensor)
        assert partition is not None
        return _BufferStep(self, group, tensor, grad, partition)

    def before_steps(self, steps: list[EngineStep]) -> None:
        """ZeRO steps one group (or sub-group) a call: every group's options and the layouts of the buffers
        stepped before, checked before the first of them steps, so that a refusal in any group leaves every group
        as it was."""
        if not steps:
            return
        for group in self.groups(self.optimizer.param_groups):
            self.optimizer._check_options(group)
        self._note_groups(cast(_BufferStep, step).buffer for step in steps)

    def groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every param group, also while ZeRO-1/2 has cut ``param_groups`` to the one it steps; a list of other
        groups put in their place becomes the groups."""
        full = self.optimizer._all_groups
        if groups is not full:
            given = self.optimizer._given
            if len(groups) < len(full) and all(any(g is f for f in full) for g in groups) and any(
                    not given.holds(p) for g in groups for p in g["params"]):  # ZeRO's buffers, not params
                return full
            self.optimizer._all_groups = groups  # a user's or framework's own list (params it was given)
        return groups

    def after_failed_step(self) -> None:
        """ZeRO-1/2 put the whole list of groups back only after a step that succeeded."""
        if self.groups(self.optimizer.param_groups) is not self.optimizer.param_groups:
            self.optimizer.param_groups = self.optimizer._all_groups

    def _note_groups(self, buffers: Iterable[Tensor]) -> None:
        """Remember the group of each buffer (stepped, or loaded from a checkpoint), by its place: its state is
        checked by :meth:`check_layout` when another group steps."""
        place = {id(p): i for i, group in enumerate(self.groups(self.optimizer.param_groups)) for p in group["params"]}
        for buffer in buffers:
            if id(buffer) in place:
                self._buffer_groups[id(buffer)] = place[id(buffer)]

    def check_layout(self, group: dict[str, Any]) -> None:
        """The state of every buffer of ``group`` stepped before still fits its options."""
        if not self._buffer_groups:
            return
        groups = self.groups(self.optimizer.param_groups)
        for ident, index in list(self._buffer_groups.items()):
            if index < len(groups) and groups[index] is group:
                ref, partition = self._partitions[ident]
                buffer = ref()
                held = self.optimizer.state.get(buffer) if buffer is not None else None
                if buffer is not None and held and partition is not None:
                    check_pieces(partition, group, buffer, held,
                                 f"a DeepSpeed ZeRO buffer of {buffer.numel()} elements in param group {index}")

    def check_loaded(self, tensor: Tensor, options: dict[str, Any], saved: Any, where: str) -> None:
        partition = self._partition_of(tensor)
        assert partition is not None
        check_loaded_pieces(partition, options, tensor, saved, where)

    def load(self, tensor: Tensor, options: dict[str, Any], saved: Any) -> dict[str, Any]:
        """The buffer's state from a checkpoint, each piece's tensors in the dtypes of its layout (torch's loader
        would cast them to the buffer's dtype)."""
        partition = self._partition_of(tensor)
        assert partition is not None
        pieces = {}
        for piece in partition.pieces:
            saved_piece = saved[PIECES][piece.ordinal]
            pieces[piece.ordinal] = {
                **{key: saved_piece[key].to(tensor.device, spec.dtype, copy=True, memory_format=torch.contiguous_format)
                   for key, spec in piece_layout(piece, options, tensor.dtype).items()},
                STEP: int(cast(Any, saved_piece[STEP]))}
        return {PIECES: pieces, PLACES: {piece.ordinal: piece.place for piece in partition.pieces}}

    def loaded(self, tensors: list[Tensor]) -> None:
        self._note_groups(tensors)

    def saved_extras(self) -> dict[str, Any]:
        """How many params each group was given (frozen ones too): what :func:`smmf.zero.tensorwise_state` needs
        to lay out a plain SMMF's groups from the pieces, which list only the params ZeRO steps."""
        return {GIVEN_GROUPS: list(self.optimizer._given.group_sizes)} if holds_buffers(self.optimizer) else {}

    def tensorwise_to_own(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A plain SMMF's state dict of the model's params (its ids their places over the groups, as the ordinals
        of ZeRO's pieces are) as this rank's buffers' states, each piece cut from its tensor's state
        (:func:`smmf.partitions.cut_piece_state`): a run saved at any number of ranks, in one process or under
        FSDP2 continues under ZeRO. Collective: every buffer's pieces are mapped first (gathered where a buffer is
        seen first), and the ranks agree on the outcome, so that a state one rank refuses is refused by all."""
        states, saved_groups = state_dict.get("state"), state_dict.get("param_groups")
        if not (holds_buffers(self.optimizer) and isinstance(states, dict) and isinstance(saved_groups, list)):
            return state_dict
        if any(isinstance(saved, dict) and PIECES in saved for saved in states.values()):
            return state_dict  # ZeRO's own
        groups = self.groups(self.optimizer.param_groups)
        if not states and [len(saved.get("params", ())) for saved in saved_groups] == [len(g["params"]) for g in groups]:
            return state_dict
        partitions = [[self._partition_of(buffer) for buffer in group["params"]] for group in groups]
        converted, error = None, None
        try:
            converted = self._converted(state_dict, groups, partitions)
        except ValueError as err:
            error = str(err)
        refused = _refusals(error)
        if refused:
            rank, message = refused[0]
            raise ValueError(message if error is not None else f"rank {rank} refused the state dict: {message}")
        assert converted is not None
        return converted

    def _converted(self, state_dict: dict[str, Any], groups: list[dict[str, Any]],
                   partitions: list[list[Optional[Partition]]]) -> dict[str, Any]:
        states, saved_groups = state_dict["state"], state_dict["param_groups"]
        if len(saved_groups) != len(groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has "
                             f"{len(groups)}")
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            check_smmf_group(index, group, saved, self.optimizer.defaults)
        ids = [pid for saved in saved_groups for pid in saved.get("params", ())]
        given = self.optimizer._given.group_sizes
        if [len(saved.get("params", ())) for saved in saved_groups] != given:
            raise ValueError(f"the loaded state dict's groups list {[len(s.get('params', ())) for s in saved_groups]} "
                             f"parameters, and this optimizer was given {given}: a tensor-wise state continues under "
                             "ZeRO with the same parameters in the same groups")
        unknown = sorted(set(states) - set(ids), key=str)
        if unknown:
            raise ValueError(f"loaded state dict has state for parameters {unknown} that no group lists")
        by_ordinal = {ordinal: states[pid] for ordinal, pid in enumerate(ids) if pid in states}
        names = {ordinal: pid for ordinal, pid in enumerate(ids)}
        own_states: dict[int, Any] = {}
        own_groups, index = [], 0
        for group, saved, buffers in zip(groups, saved_groups, partitions):
            options = {**group, **{key: value for key, value in saved.items() if key != "params"}}
            own_groups.append({**saved, "params": list(range(index, index + len(group["params"])))})
            for buffer, partition in zip(group["params"], buffers):
                if partition is None:
                    raise ValueError("a tensor-wise SMMF state loads under DeepSpeed ZeRO into groups of ZeRO's flat "
                                     "buffers only")
                held = [piece for piece in partition.pieces if piece.ordinal in by_ordinal]
                if held and len(held) != len(partition.pieces):
                    absent = sorted(str(names[p.ordinal]) for p in partition.pieces if p.ordinal not in by_ordinal)
                    raise ValueError(f"the loaded state dict holds the state of some of the parameters this rank's "
                                     f"ZeRO buffer steps and not of parameters {absent}")
                if held:
                    own_states[index] = self._cut(partition, options, buffer.dtype, by_ordinal, names)
                index += 1
        return {**state_dict, "state": own_states, "param_groups": own_groups}

    @staticmethod
    def _cut(partition: Partition, options: dict[str, Any], dtype: torch.dtype, by_ordinal: dict[int, Any],
             names: dict[int, Any]) -> dict[str, Any]:
        pieces = {}
        for piece in partition.pieces:
            where = f"parameter {names[piece.ordinal]}"
            whole = _bits_flat(by_ordinal[piece.ordinal], piece.shape, where)
            layout = state_layout(torch.empty(piece.shape, dtype=dtype, device="meta"), options)
            check_loaded_values(layout, whole, where, f"a parameter of shape {piece.shape}")
            pieces[piece.ordinal] = cut_piece_state(whole, piece, options, dtype)
        return {PIECES: pieces, PLACES: {piece.ordinal: piece.place for piece in partition.pieces}}
