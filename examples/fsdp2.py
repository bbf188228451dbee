"""FSDP2 (fully_shard) with SMMF and a distributed checkpoint:
torchrun --nproc-per-node 2 examples/fsdp2.py [--step-in-backward]"""

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from smmf import SMMF, step_in_backward

dist.init_process_group("gloo")  # "nccl" and device "cuda" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def smmf(model: torch.nn.Module) -> SMMF:
    optimizer = SMMF(model.parameters(), lr=1e-3)
    if "--step-in-backward" in sys.argv:  # each shard stepped, and its gradient freed, after its reduce-scatter
        step_in_backward(optimizer, module=model)  # step() and zero_grad() in train() then do nothing
    return optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> float:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        optimizer.step()  # factors are summed across ranks: the same update as on one device
    return loss.item()


model = build()
optimizer = smmf(model)
train(model, optimizer, range(10))
checkpoint = tempfile.mkdtemp() if rank == 0 else None
obj = [checkpoint]
dist.broadcast_object_list(obj)
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=obj[0])

resumed = build()
resumed_optimizer = smmf(resumed)
model_sd, optim_sd = get_state_dict(resumed, resumed_optimizer)
state = {"model": model_sd, "optim": optim_sd}
dcp.load(state, checkpoint_id=obj[0])
set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
a, b = train(model, optimizer, range(10, 20)), train(resumed, resumed_optimizer, range(10, 20))
if rank == 0:
    print(f"loss after 20 steps: uninterrupted {a:.6f}, resumed from the DCP checkpoint {b:.6f}")
dist.barrier()  # leave together: tearing gloo down under a peer can abort at exit
dist.destroy_process_group()
