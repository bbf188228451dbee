"""The step of a DTensor parameter (FSDP2): the torch path on this rank's band of the matrix,
with one all-reduce of the partial row and column sums (see :mod:`smmf.sharding`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import Band, StepConfig, torch_step_
from ..sharding import local, shard_info
from ..state import EXP_AVG_SQ, matrix_shape


def sharded_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> int:
    info = shard_info(param)
    assert info is not None, "sharded_step_ takes DTensor parameters"
    local_state = {key: local(value) for key, value in state.items()}
    weight, local_grad = local(param), local(grad)
    if EXP_AVG_SQ in state or not info.sharded:  # elementwise, or every rank holds it all
        return torch_step_(weight, local_grad, local_state, cfg)
    rows, cols = matrix_shape(param)
    group = info.mesh.get_group()

    def all_reduce(sums: list[Tensor]) -> list[Tensor]:
        flat = torch.cat(sums)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        return list(flat.split([s.numel() for s in sums]))

    band = Band.of_range(rows, cols, info.start, info.numel)
    return torch_step_(weight, local_grad, local_state, cfg, band=band, reduce=all_reduce)
