"""DDP with SMMF on CPU: torchrun --nproc-per-node 2 examples/ddp.py [--step-in-backward]"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from smmf import SMMF, step_in_backward

dist.init_process_group("gloo")  # "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
optimizer = SMMF(model.parameters(), lr=1e-3)
if "--step-in-backward" in sys.argv:  # each gradient bucket stepped when its all-reduce completes
    step_in_backward(optimizer, module=model)  # step() and zero_grad() below then do nothing
for step in range(20):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    optimizer.step()
if rank == 0:
    print(f"rank 0 after 20 steps: loss {loss.item():.4f}")
dist.barrier()  # leave together: tearing gloo down under a peer can abort at exit
dist.destroy_process_group()
