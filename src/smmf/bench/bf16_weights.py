"""bf16 weights trained by an optimizer that keeps fp32 numbers: the baselines of the bf16 study.

:class:`BF16Weights` wraps an optimizer built on fp32 copies of a model's bf16 weights: each step hands it the
bf16 gradients as fp32, steps the copies, and writes them back into the bf16 weights, rounded to nearest or
stochastically (with SMMF's rounding noise, :func:`smmf.noise.rounding_key`). With ``master`` the copies are kept
between steps (an fp32 master copy, mixed precision as usually done); without, they are made from the bf16 weights
at every step, so that only the weights' rounding differs from the optimizer's fp32 run (its moments stay fp32).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from ..functional import write_back_
from ..noise import rounding_key


class BF16Weights(torch.optim.Optimizer):
    """``build(fp32 copies, **kwargs)``'s optimizer stepping bf16 ``params`` (see the module docstring). Its
    ``param_groups`` are the inner optimizer's (a scheduler sets their ``lr``); its ``state`` holds the inner
    state and, with ``master``, each weight's fp32 copy."""

    def __init__(self, params: Iterable[Tensor], build: Callable[..., torch.optim.Optimizer], master: bool = False,
                 stochastic_rounding: bool = False, **kwargs: Any) -> None:
        self.weights = list(params)
        if any(p.dtype != torch.bfloat16 for p in self.weights):
            raise ValueError("BF16Weights steps bf16 parameters")
        self.copies = [p.detach().float().clone() for p in self.weights]
        self.inner = build(self.copies, **kwargs)
        self.master, self.stochastic_rounding, self.steps = master, stochastic_rounding, 0
        super().__init__(self.copies, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self._publish_state()

    def _publish_state(self) -> None:
        self.state = {weight: {**self.inner.state.get(copy, {}), **({"master": copy} if self.master else {})}
                      for weight, copy in zip(self.weights, self.copies)}  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for weight, copy in zip(self.weights, self.copies):
            if not self.master:
                copy.copy_(weight)
            copy.grad = None if weight.grad is None else weight.grad.float()
        self.inner.step()
        self.steps += 1
        for place, (weight, copy) in enumerate(zip(self.weights, self.copies)):
            key = rounding_key(self.steps, place) if self.stochastic_rounding else None
            write_back_(weight, copy, rounding_key=key)
            copy.grad = None
        self._publish_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for weight in self.weights:
            weight.grad = None
