"""Optimizer-state bytes as they are held in memory, the same way for every optimizer.

A quantized state can be a tensor subclass whose outer tensor only looks like an fp32 tensor of the
parameter's shape (torchao's ``OptimState8bit`` and ``OptimState4bit``: uint8 ``codes``, fp32 block
``scale`` and a 256-entry ``qmap``); ``numel() * element_size()`` of that wrapper counts bytes that
do not exist. Here every subclass is opened through ``__tensor_flatten__`` (recursively; a DTensor
opens to its local shard) down to plain tensors, and each distinct storage is counted once, at its
``nbytes``: a lookup table shared by all parameters (bitsandbytes' ``qmap1``) is one table. For plain,
unshared state tensors this equals ``numel() * element_size()``. Step counters are not counted.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import Tensor


def plain_tensors(tensor: Tensor) -> Iterator[Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or a subclass's inner tensors, recursively."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (Tensor, torch.nn.Parameter):
        yield tensor
        return
    names, _ = flatten()
    for name in names:
        yield from plain_tensors(getattr(tensor, name))


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tensor subclasses opened to their inner tensors)."""
    total = 0
    seen: set[tuple[str, int]] = set()
    for tensor in tensors:
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            pointer = storage.data_ptr()
            if pointer:  # zero-size and meta storages have no address, and are not shared
                key = (str(plain.device), pointer)
                if key in seen:
                    continue
                seen.add(key)
            total += storage.nbytes()
    return total


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every tensor ``optimizer`` keeps between steps, step counters left out."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, Tensor):
                yield value


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s state as it is held in memory (see the module docstring)."""
    return storage_bytes(state_tensors(optimizer))
