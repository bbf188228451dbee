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
from .partitions import Partition, check_loaded_pieces, check_pieces, init_pieces, piece_layout, step_partition_
from .schema import PIECES, PLACES
from .state import STEP
from .zero import find_partition, is_deepspeed_buffer
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
