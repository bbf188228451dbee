"""The warning that a step met NaN/inf gradient elements, issued once per optimizer without waiting on a GPU."""

from __future__ import annotations

import warnings
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["NonfiniteMonitor"]


class NonfiniteMonitor:
    """Warns once when a step met NaN/inf gradient elements (``nonfinite_grads="zero"``).

    Kernels report how many elements they zeroed: a number, or a CUDA tensor that is copied to the
    host without waiting and read at a later step once it has arrived (so a CUDA warning comes a
    step late, and no step ever synchronizes for it).
    """

    def __init__(self) -> None:
        self.warned = False
        self.pending: list[tuple[Tensor, Any]] = []

    def report(self, count: Union[int, Tensor, None]) -> None:
        if self.warned or count is None:
            return
        if isinstance(count, Tensor):
            host = torch.empty(count.shape, dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            self.pending.append((host, arrived))
        elif count:
            self._warn(count)

    def host_count(self, count: Any) -> int:
        """A kernel's count as a number to add up over a step; a CUDA count is reported as it is (0 added)."""
        if isinstance(count, Tensor):
            self.report(count)
            return 0
        return count or 0

    def poll(self) -> None:
        still = []
        for host, arrived in self.pending:
            if not arrived.query():
                still.append((host, arrived))
            elif not self.warned and (count := int(host.sum())):
                self._warn(count)
        self.pending = still

    def _warn(self, count: int) -> None:
        self.warned = True
        self.pending = []
        warnings.warn(
            f"SMMF met {count} NaN/inf gradient element(s) in one step and treated them as zero gradients "
            "(nonfinite_grads='zero'; 'propagate' lets them through). Warned once per optimizer.",
            RuntimeWarning,
            stacklevel=3,
        )
