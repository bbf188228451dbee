"""DTensor parameters (FSDP2 ``fully_shard``): SMMF exactly as on one device.

A parameter sharded on dim 0 owns a contiguous range ``[start, start + numel)`` of the row-major
flattening, hence a band of rows of the global n̂×m̂ matrix (its first and last rows possibly
partial). Each rank keeps the full factor vectors (``Replicate``: they are small and identical on
every rank) and the sign bits of its own elements (``Shard(0)``, padded to the same byte count on
every rank). One step sums each rank's partial row and column sums with one all-reduce, so the
factors, and therefore the update, are the single-device ones whatever the world size.

In a checkpoint the bits take a layout of their own (:func:`bits_for_checkpoint`): one row of bytes
per row of the parameter, placed ``Shard(0)`` like it, so ``torch.distributed.checkpoint`` reshards
them with the parameter and a checkpoint saved on N ranks loads on any number of ranks of an FSDP2 model
(a one-rank mesh too). An unsharded model's bits keep the flat packing in checkpoints, so DCP does not
cross between the two; a state dict of whole tensors does, either way (:func:`bits_from_checkpoint`,
:func:`rows_from_flat`, :func:`placed_like`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .matrix import pack_signs, packed_sign_bytes, unpack_signs


def is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


@dataclass(frozen=True)
class ShardInfo:
    mesh: Any
    start: int  # first element of this rank's shard in the global row-major flattening
    numel: int  # elements in this rank's shard
    sign_bytes: int  # bytes of sign bits each rank keeps (the largest shard's, rounded up)
    world: int
    sharded: bool  # False: every rank holds the whole tensor (Replicate)


# shard_info of each live DTensor by id (a tensor cannot key a WeakKeyDictionary: its == is elementwise),
# with what it was computed from: torch's local-shape computation costs about a millisecond on CPU,
# and each step asks twice per parameter.
_INFO: dict[int, tuple["weakref.ref[Tensor]", Any, ShardInfo]] = {}


def shard_info(param: Tensor) -> Optional[ShardInfo]:
    """Where this rank's piece of a DTensor parameter lies; None for a plain tensor."""
    if not is_dtensor(param):
        return None
    dtensor: Any = param  # DTensor attributes are not on torch.Tensor's type
    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    key = (tuple(param.shape), placements, id(mesh))
    known = _INFO.get(id(param))
    if known is not None and known[0]() is param and known[1] == key:
        return known[2]
    info = _shard_info(param, mesh, placements)
    ident = id(param)

    def forget(_: object) -> None:
        _INFO.pop(ident, None)

    _INFO[ident] = (weakref.ref(param, forget), key, info)
    return info


def _shard_info(param: Tensor, mesh: Any, placements: tuple[Any, ...]) -> ShardInfo:
    from torch.distributed.tensor import Replicate, Shard

    if mesh.ndim != 1 or not (placements == (Shard(0),) or placements == (Replicate(),)):
        raise RuntimeError(
            f"SMMF supports DTensor parameters on a 1-D mesh placed Shard(0) or Replicate(), got {placements} "
            f"on a {mesh.ndim}-D mesh"
        )
    world = mesh.size()
    shape = tuple(param.shape)
    if placements == (Replicate(),):
        numel = math.prod(shape)
        return ShardInfo(mesh, 0, numel, packed_sign_bytes(numel), world, sharded=False)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    inner = math.prod(shape[1:])
    largest = -(-shape[0] // world) * inner if shape else 1
    return ShardInfo(mesh, offset[0] * inner if shape else 0, math.prod(local_shape), packed_sign_bytes(largest), world, True)


def as_state(local: Tensor, info: ShardInfo, sharded: bool) -> Tensor:
    """Wrap a rank-local state tensor as a DTensor that checkpoints correctly."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if sharded and info.sharded:
        shape = torch.Size([local.shape[0] * info.world])
        return DTensor.from_local(local, info.mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))
    return DTensor.from_local(local, info.mesh, [Replicate()], run_check=False)


def placed_like(saved: Tensor, made: Tensor) -> Tensor:
    """A loaded state tensor placed as the state ``made`` for a DTensor param: a whole (plain) tensor of a
    full state dict becomes this rank's rows of a ``Shard(0)`` state, or a ``Replicate`` one; a DTensor, or
    a tensor for a plain param, is returned as it is. (Without this a full state dict's codes and dense
    moments stayed whole on every rank and were read against this rank's rows.)"""
    if is_dtensor(saved) or not is_dtensor(made):
        return saved
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placed: Any = made
    mesh, placements = placed.device_mesh, tuple(placed.placements)
    piece = saved
    if placements == (Shard(0),):
        local_shape, offset = compute_local_shape_and_global_offset(tuple(made.shape), mesh, placements)
        piece = saved[offset[0] : offset[0] + local_shape[0]]
    return DTensor.from_local(piece.to(local(made).device), mesh, placements, run_check=False,
                              shape=made.shape, stride=made.stride())


def local(t: Tensor) -> Tensor:
    """This rank's tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _rows_geometry(param: Tensor) -> tuple[int, int, int]:
    """Rows of the parameter (dim 0), elements per row, and bytes per row of packed bits."""
    rows = param.shape[0] if param.dim() else 1
    inner = param.numel() // rows if rows else 0
    return rows, inner, packed_sign_bytes(inner)


def has_rows_layout(param: Tensor) -> bool:
    """Whether ``param``'s bits go to checkpoints by rows: FSDP2 shards of a non-empty tensor."""
    info = shard_info(param)
    return info is not None and info.sharded and param.numel() > 0


def _pack_rows(bits: Tensor, row_bytes: int) -> Tensor:
    """Boolean (rows, inner) → uint8 (rows, row_bytes), each row packed from its own first byte."""
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, row_bytes * 8 - bits.shape[1]))
    return pack_signs(padded.bool()).view(bits.shape[0], row_bytes)


def bits_for_checkpoint(bits: Tensor, param: Tensor) -> Tensor:
    """A shard's packed bits (its elements from its start, padded per rank) as its rows of a
    (param rows, bytes per row) uint8 DTensor placed ``Shard(0)`` like the param: the same global
    tensor whatever the number of ranks."""
    from torch.distributed.tensor import DTensor, Shard

    info = shard_info(param)
    assert info is not None and info.sharded
    rows, inner, row_bytes = _rows_geometry(param)
    flat = unpack_signs(local(bits), info.numel).view(info.numel // inner, inner)
    return DTensor.from_local(_pack_rows(flat, row_bytes), info.mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([rows, row_bytes]), stride=(row_bytes, 1))


def rows_from_flat(packed: Tensor, param: Tensor) -> Tensor:
    """The flat packing of a whole tensor's bits (an unsharded run's checkpoint) in the layout by rows of
    :func:`bits_for_checkpoint`, as a plain tensor of all the rows (for :func:`bits_from_checkpoint`)."""
    rows, inner, row_bytes = _rows_geometry(param)
    bits = unpack_signs(local(packed).contiguous(), rows * inner).view(rows, inner)
    return _pack_rows(bits, row_bytes)


def bits_from_checkpoint(saved: Tensor, param: Tensor) -> Tensor:
    """Inverse of :func:`bits_for_checkpoint`, to the in-memory layout of ``param``'s state: this
    rank's bits for a shard (from a DTensor placed like the param, or the whole rows of a full
    state dict), the flat packing for a plain tensor. ``ValueError`` for what is not that layout."""
    rows, inner, row_bytes = _rows_geometry(param)
    if tuple(saved.shape) != (rows, row_bytes) or saved.dtype != torch.uint8:
        raise ValueError(f"packed bits by rows of a parameter of shape {tuple(param.shape)} are uint8 of shape "
                         f"{(rows, row_bytes)}, not {saved.dtype} of shape {tuple(saved.shape)}")
    info = shard_info(param)
    if info is None or not info.sharded:
        whole = pack_signs(_unpack_rows(local(saved), inner)).to(param.device if info is None else local(param).device)
        return whole if info is None else as_state(whole, info, sharded=False)
    here = local(saved) if is_dtensor(saved) else saved[info.start // inner : (info.start + info.numel) // inner]
    if here.shape[0] * inner != info.numel:
        raise ValueError(f"the packed bits hold {here.shape[0]} rows of this rank's shard, which has "
                         f"{info.numel // inner}")
    packed = pack_signs(_unpack_rows(here, inner))
    piece = packed.new_zeros(info.sign_bytes)
    piece[: packed.numel()] = packed
    return as_state(piece.to(local(param).device), info, sharded=True)


def _unpack_rows(packed_rows: Tensor, inner: int) -> Tensor:
    """uint8 (rows, row_bytes) → the flat boolean bits of its rows' first ``inner`` elements."""
    count, row_bytes = packed_rows.shape
    bits = unpack_signs(packed_rows.contiguous(), packed_rows.numel() * 8).view(count, row_bytes * 8)
    return bits[:, :inner].reshape(-1)
