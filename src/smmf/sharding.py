"""DTensor parameters (FSDP2 ``fully_shard``): SMMF exactly as on one device.

A parameter sharded on dim 0 owns a contiguous range ``[start, start + numel)`` of the row-major
flattening, hence a band of rows of the global n̂×m̂ matrix (its first and last rows possibly
partial). Each rank keeps the full factor vectors (``Replicate``: they are small and identical on
every rank) and the sign bits of its own elements (``Shard(0)``, padded to the same byte count on
every rank). One step sums each rank's partial row and column sums with one all-reduce, so the
factors, and therefore the update, are the single-device ones whatever the world size.

Checkpoints go through ``torch.distributed.checkpoint`` with these placements; the sign bits are
laid out per rank, so a checkpoint resumes on the same number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .matrix import packed_sign_bytes


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


def shard_info(param: Tensor) -> Optional[ShardInfo]:
    """Where this rank's piece of a DTensor parameter lies; None for a plain tensor."""
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor import Replicate, Shard

    dtensor: Any = param  # DTensor attributes are not on torch.Tensor's type
    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
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


def local(t: Tensor) -> Tensor:
    """This rank's tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
