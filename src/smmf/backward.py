"""The optimizer step inside backward: each parameter is updated, and its gradient freed, as soon
as its gradient is ready — so at most a few gradients exist at once instead of all of them.

With SMMF's tiny state, training memory is then about weights + activations. The optimizer object
stays an ordinary one: ``param_groups`` (and so ``torch.optim.lr_scheduler``), ``state_dict`` and
``load_state_dict`` work and checkpoints are interchangeable with the ordinary loop; ``step()`` and
``zero_grad()`` find no gradient left and do nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .optimizer import SMMF

__all__ = ["step_in_backward", "StepInBackward"]


class StepInBackward:
    """The hooks :func:`step_in_backward` registered; :meth:`remove` restores the ordinary loop."""

    def __init__(self, optimizer: SMMF, accumulation_steps: int) -> None:
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self._accumulated: dict[Tensor, int] = {}
        self._handles = [
            param.register_post_accumulate_grad_hook(self._make_hook(group))
            for group in optimizer.param_groups
            for param in group["params"]
            if param.requires_grad
        ]

    def _make_hook(self, group: dict[str, Any]):
        def hook(param: Tensor) -> None:
            # Fires once per backward for each param, after all its uses have been summed in.
            count = self._accumulated.get(param, 0) + 1
            if count < self.accumulation_steps:
                self._accumulated[param] = count
                return
            self._accumulated[param] = 0
            self.optimizer.step_params([(group, param)])
            param.grad = None

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def step_in_backward(optimizer: SMMF, accumulation_steps: int = 1) -> StepInBackward:
    """Run ``optimizer``'s step for each parameter inside backward, and free its gradient.

    ``accumulation_steps=k`` accumulates k backward passes (micro-batches) and steps on the k-th;
    the gradients then live from the first to the k-th, as in ordinary accumulation. What cannot
    work, and fails or is refused: global-norm gradient clipping (the norm is not known until
    every gradient exists; clip inside your loss, or per parameter with a hook of your own
    registered first); ``torch.amp.GradScaler`` (the step would run on scaled gradients before the
    scaler could check them; ``scaler.step`` then fails with its "No inf checks were recorded"
    error); DDP or any multi-process gradient reduction (the step would see this rank's gradient
    before the all-reduce: refused while a process group of more than one rank exists).
    """
    if not isinstance(optimizer, SMMF):
        raise TypeError(f"step_in_backward takes an smmf.SMMF optimizer, not {type(optimizer).__name__}")
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps should be an int >= 1 but is: {accumulation_steps!r}")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise RuntimeError(
            "step_in_backward cannot run under DDP or another multi-rank gradient reduction: each param's step "
            "would see this rank's gradient before the all-reduce. Use the ordinary optimizer.step()."
        )
    return StepInBackward(optimizer, accumulation_steps)
