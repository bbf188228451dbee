"""Optimizer-state memory: measured from an optimizer, and predicted from parameter shapes.

``state_bytes`` counts the tensors an optimizer keeps between steps. ``predict_state_bytes``
computes the same figure from shapes alone for SMMF, Adam/AdamW, Adafactor, SM3 and CAME (the
last three as pytorch_optimizer implements them, with a first moment as the paper ran them), so
the state of a 7B model can be known without allocating it. Step counters are not counted: they
are scalars, and torch keeps them on the CPU.

``allocator_block`` rounds every tensor up to a multiple of that many bytes, as PyTorch's CUDA
caching allocator does (512 B); the paper's figures were measured that way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from .options import OPTIONS, validate_group
from .sharding import local as local_shard
from .state import state_layout
from .table import format_table

__all__ = ["OPTIMIZERS", "state_bytes", "predict_state_tensors", "predict_state_bytes", "report", "MemoryReport"]

OPTIMIZERS = ("adam", "adafactor", "sm3", "came", "smmf")
CUDA_ALLOCATOR_BLOCK = 512

Shape = tuple[int, ...]
ShapesLike = Union[torch.nn.Module, Iterable[Tensor], Iterable[Shape]]



def _smmf_group(smmf_options: dict[str, object]) -> dict[str, object]:
    """SMMF's defaults (:data:`smmf.options.OPTIONS`) updated with ``smmf_options``, checked as the constructor
    checks them."""
    defaults = {option.name: option.default for option in OPTIONS}
    unknown = sorted(set(smmf_options) - set(defaults))
    if unknown:
        raise ValueError(f"SMMF has no option {', '.join(map(repr, unknown))}; its options are {sorted(defaults)}")
    group = {**defaults, **smmf_options}
    validate_group(group)
    return group


def _round_up(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block if block > 1 else nbytes


def state_bytes(optimizer: torch.optim.Optimizer, allocator_block: int = 1) -> int:
    """Bytes held by ``optimizer``'s state tensors (this rank's shards for DTensors)."""
    total = 0
    states = list(optimizer.state.values())
    while states:
        for key, value in states.pop().items():
            if isinstance(value, dict):  # a DeepSpeed ZeRO buffer's: the state of each piece it holds
                states.append(value)
            elif key != "step" and isinstance(value, Tensor):
                local = local_shard(value)  # DTensor: this rank's shard
                total += _round_up(local.numel() * local.element_size(), allocator_block)
    return total


def predict_state_tensors(shape: Shape, optimizer: str, itemsize: int = 4, **smmf_options: object) -> list[int]:
    """Bytes of each state tensor that ``optimizer`` keeps for one real parameter of ``shape`` whose elements
    take ``itemsize`` bytes (2: bf16/fp16, 4: fp32, 8: fp64)."""
    if optimizer == "smmf" and itemsize not in _DTYPES:
        raise ValueError(f"SMMF's itemsize must be one of {sorted(_DTYPES)} (bytes of a real element), got {itemsize}")
    return _tensor_bytes(shape, optimizer, itemsize, _DTYPES.get(itemsize, torch.float32), **smmf_options)


def _tensor_bytes(shape: Shape, optimizer: str, itemsize: int, dtype: torch.dtype, **smmf_options: object) -> list[int]:
    """:func:`predict_state_tensors` for elements of ``itemsize`` bytes, SMMF's for params of ``dtype``."""
    numel = math.prod(shape)
    dense = numel * itemsize
    if smmf_options and optimizer != "smmf":
        raise ValueError(f"{', '.join(map(repr, sorted(smmf_options)))} are options of SMMF, not of {optimizer!r}")
    if optimizer in ("adam", "adamw"):
        return [dense, dense]
    if optimizer in ("adafactor", "came"):
        if len(shape) >= 2:
            rows = math.prod(shape[:-1]) * 4
            cols = math.prod(shape[:-2]) * shape[-1] * 4
            second = [rows, cols] * (2 if optimizer == "came" else 1)  # CAME: also the residual
        else:
            second = [numel * 4]
        rms = [4] if optimizer == "came" else []  # CAME keeps RMS as a 0-d tensor
        return [dense, *second, *rms]
    if optimizer == "sm3":
        covers = [n * itemsize for n in shape] if shape else [itemsize]
        return [dense, *covers]
    if optimizer == "smmf":
        param = torch.empty(shape, device="meta", dtype=dtype)
        layout = state_layout(param, _smmf_group(smmf_options))
        return [math.prod(spec.shape) * spec.dtype.itemsize for spec in layout.values()]
    raise ValueError(f"Unknown optimizer: {optimizer!r}. It needs to be one of {list(OPTIMIZERS)}")


_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _trainable_shapes(params: ShapesLike) -> list[tuple[Shape, torch.dtype]]:
    """(shape, dtype) of each trainable param (fp32 for a shape): SMMF lays a complex param's state out
    from its own shape and its real view's elements."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    out = []
    for p in params:
        if isinstance(p, Tensor):
            if p.requires_grad or not isinstance(p, torch.nn.Parameter):
                out.append((tuple(p.shape), p.dtype))
        else:
            out.append((tuple(p), torch.float32))
    return out


def predict_state_bytes(params: ShapesLike, optimizer: str, allocator_block: int = 1, **smmf_options: object) -> int:
    """Predicted optimizer state of ``params`` (a module, tensors or shapes; fp32 for shapes)."""
    return _predict(_trainable_shapes(params), optimizer, allocator_block, **smmf_options)


def _predict(shapes: list[tuple[Shape, torch.dtype]], optimizer: str, allocator_block: int,
             **smmf_options: object) -> int:
    return sum(
        _round_up(nbytes, allocator_block)
        for shape, dtype in shapes
        for nbytes in _tensor_bytes(shape, optimizer, dtype.itemsize, dtype, **smmf_options)
    )


@dataclass(frozen=True)
class MemoryReport:
    """Per-optimizer state of one model: exact bytes and bytes as the CUDA allocator holds them."""

    params: int
    exact: dict[str, int]
    allocated: dict[str, int]

    def table(self, fmt: str = "table") -> str:
        adam = self.exact.get("adam")
        rows = [
            [name, self.exact[name] / 2**20, self.allocated[name] / 2**20, adam / self.exact[name] if adam else None]
            for name in self.exact
        ]
        return format_table(["optimizer", "state MiB", "as allocated MiB", "Adam / this"], rows, fmt)

    def __str__(self) -> str:
        return f"{self.params:,} trainable parameters\n" + self.table()


def report(model_or_params: ShapesLike, optimizers: Sequence[str] = OPTIMIZERS, allocator_block: Optional[int] = None) -> MemoryReport:
    """Optimizer state of a model for each optimizer, predicted from shapes (nothing allocated)."""
    shapes = _trainable_shapes(model_or_params)
    block = CUDA_ALLOCATOR_BLOCK if allocator_block is None else allocator_block
    return MemoryReport(
        params=sum(math.prod(s) for s, _ in shapes),
        exact={o: _predict(shapes, o, 1) for o in optimizers},
        allocated={o: _predict(shapes, o, block) for o in optimizers},
    )
