"""Accelerate with SMMF and its DeepSpeed plugin (ZeRO stage 1, 2 or 3): ``accelerator.save_state`` at step 3,
``load_state`` into fresh objects, and the resumed run equals the uninterrupted one.

    accelerate launch --use_deepspeed --num_processes 2 examples/accelerate_deepspeed.py [--stage 2] [--out DIR]
                      [--params PATH]

(``torchrun --nproc-per-node 2`` works the same.) SMMF is built with the model's parameters as usual; DeepSpeed's
ZeRO optimizer then hands it flat partitions, which SMMF maps back to the model's tensors (docs/distributed.md). Without
a GPU DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``, set here when CUDA is missing) over gloo. ``--params
PATH``: rank 0 writes the full parameters of both runs there.
"""

import argparse
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from smmf import SMMF

STEPS, SAVE_AT, BATCH = 6, 3, 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 10), torch.nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def accelerator_for(stage: int) -> Accelerator:
    """One Accelerator per process (a second may not take a DeepSpeed plugin). DeepSpeed clips gradients at 1.0
    unless told otherwise; the micro-batch is each of 2 ranks' share of BATCH."""
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=0.0, gradient_accumulation_steps=1)
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=BATCH // 2, train_batch_size=BATCH,
                                   zero_allow_untested_optimizer=True)
    return Accelerator(deepspeed_plugin=plugin)


def run(accelerator: Accelerator, steps: range, load: str | None = None, save: str | None = None):
    accelerator.free_memory()  # the engine of the run before: each run saves and loads its own
    torch.manual_seed(0)
    model = Net()
    optimizer = SMMF(model.parameters(), lr=1e-2, weight_decay=0.1, decay_rate=-0.8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if load is not None:
        accelerator.load_state(load)  # the engine's checkpoint: model, SMMF's state; the scheduler, the RNG states
    rank, world = accelerator.process_index, accelerator.num_processes
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 5, generator=gen)
        x, y = x.chunk(world)[rank].to(accelerator.device), y.chunk(world)[rank].to(accelerator.device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)  # DeepSpeed's backward, and its step
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if save is not None:
        accelerator.save_state(save)
    from deepspeed.utils import safe_get_full_fp32_param

    params = [safe_get_full_fp32_param(p).detach().cpu().clone() for p in model.module.parameters()]
    smmf = model.optimizer.optimizer  # the engine's ZeRO optimizer's client: SMMF
    pieces = {ordinal: tuple(state["row_v"].shape) for held in smmf.state.values()
              for ordinal, state in held["pieces"].items()}
    info = {"distributed_type": str(accelerator.distributed_type), "wrapper": type(optimizer).__name__,
            "optimizer": type(smmf).__name__, "model": type(model).__name__, "pieces": pieces,
            "steps_run": len(steps)}
    return params, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-accelerate-deepspeed-example"))
    parser.add_argument("--params")
    args = parser.parse_args()

    accelerator = accelerator_for(args.stage)
    straight, info = run(accelerator, range(STEPS))
    checkpoint = os.path.join(args.out, "step3")
    run(accelerator, range(SAVE_AT), save=checkpoint)
    resumed, resumed_info = run(accelerator, range(SAVE_AT, STEPS), load=checkpoint)
    if dist.get_rank() == 0:
        same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
        print(f"{info}; resumed from step {SAVE_AT} equals the uninterrupted run bit for bit: {same}")
        if args.params:
            torch.save({"straight": straight, "resumed": resumed, "checkpoint": sorted(os.listdir(checkpoint)),
                        "resumed_steps": resumed_info["steps_run"], **info}, args.params)
    # Leave together, then skip the interpreter's teardown: objects still holding gloo work can abort
    # the process at exit (pytorch/pytorch#179291).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
