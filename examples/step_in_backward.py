"""Train with the optimizer step inside backward, checkpoint, and resume.

Each parameter is updated and its gradient freed as soon as the gradient is ready, so the
gradients of the whole model never exist at once. Run: python examples/step_in_backward.py
"""

from __future__ import annotations

import io

import torch

from smmf import SMMF, step_in_backward


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 64, generator=gen)
    return x, x.roll(1, dims=1)  # learn a fixed permutation


def train(model: torch.nn.Module, optimizer: SMMF, scheduler: torch.optim.lr_scheduler.LRScheduler,
          steps: range) -> float:
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # every parameter is stepped, and its gradient freed, in here
        optimizer.step()  # steps nothing while the hooks are installed; keeps lr schedulers' bookkeeping
        scheduler.step()  # once per step, as with the ordinary loop: the next backward's steps take its lr
    return loss.item()


model = build()
optimizer = SMMF(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
step_in_backward(optimizer)
for start in range(0, 100, 25):
    print(f"step {start + 25:3d}  loss {train(model, optimizer, scheduler, range(start, start + 25)):.4f}")

checkpoint = io.BytesIO()  # an ordinary SMMF checkpoint
torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()}, checkpoint)
checkpoint.seek(0)
saved = torch.load(checkpoint, weights_only=True)

resumed = build()
resumed.load_state_dict(saved["model"])
resumed_optimizer = SMMF(resumed.parameters(), lr=3e-3)
resumed_optimizer.load_state_dict(saved["optim"])
resumed_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(resumed_optimizer, T_max=200)
resumed_scheduler.load_state_dict(saved["sched"])
step_in_backward(resumed_optimizer)
final = train(resumed, resumed_optimizer, resumed_scheduler, range(100, 125))
reference = train(model, optimizer, scheduler, range(100, 125))
print(f"resumed: loss {final:.4f}; uninterrupted: {reference:.4f}; identical: {final == reference}")
