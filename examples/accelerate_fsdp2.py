"""Accelerate with SMMF and its FSDP2 plugin: ``accelerator.save_state`` at step 3, ``load_state`` into fresh
objects, and the resumed run equals the uninterrupted one.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_fsdp2.py [--out DIR] [--params PATH]
                      [--fsdp-on-cpu]

(``torchrun --nproc-per-node 2`` works the same.) On GPUs the plugin shards the model with FSDP2. On CPU, Accelerate
does not select FSDP (it keeps ``MULTI_CPU``, the plugin unused) and wraps the model in DDP instead: the example
runs either way and prints which. ``--fsdp-on-cpu`` sets Accelerate's state to FSDP after the Accelerator is made, so
that its FSDP2 code (``fully_shard``, the swap of the optimizer's parameters, DCP checkpoints) runs on CPU: a test
device, not a supported configuration. ``--params PATH``: rank 0 writes the full parameters of both runs there.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

from smmf import SMMF

STEPS, SAVE_AT, BATCH = 6, 3, 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 10), torch.nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def run(steps: range, fsdp_on_cpu: bool, load: str | None = None, save: str | None = None):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)  # one per run: its own lists
    if fsdp_on_cpu:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    torch.manual_seed(0)
    model = Net()
    optimizer = SMMF(model.parameters(), lr=1e-2, weight_decay=0.1, decay_rate=-0.8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    # Accelerate wraps the optimizer (AcceleratedOptimizer) and the scheduler (AcceleratedScheduler); with FSDP2
    # it swaps the optimizer's parameters for the sharded ones in place.
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if load is not None:
        accelerator.load_state(load)  # model, SMMF's state, the scheduler, the RNG states
    rank, world = accelerator.process_index, accelerator.num_processes
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 5, generator=gen)
        x, y = x.chunk(world)[rank].to(accelerator.device), y.chunk(world)[rank].to(accelerator.device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if save is not None:
        accelerator.save_state(save)
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for p in model.parameters()]
    info = {"distributed_type": str(accelerator.distributed_type), "wrapper": type(optimizer).__name__,
            "optimizer": type(optimizer.optimizer).__name__, "model": type(model).__name__,
            "params": sorted({type(p).__name__ for p in model.parameters()}), "lr": optimizer.param_groups[0]["lr"],
            "steps_run": len(steps)}
    return params, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-accelerate-example"))
    parser.add_argument("--params")
    parser.add_argument("--fsdp-on-cpu", action="store_true")
    args = parser.parse_args()

    straight, info = run(range(STEPS), args.fsdp_on_cpu)
    checkpoint = os.path.join(args.out, "step3")
    run(range(SAVE_AT), args.fsdp_on_cpu, save=checkpoint)
    resumed, resumed_info = run(range(SAVE_AT, STEPS), args.fsdp_on_cpu, load=checkpoint)
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
