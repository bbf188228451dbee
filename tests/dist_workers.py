"""Worker functions for the multi-process tests (2 ranks, gloo, loopback). Each worker writes its
results with torch.save so that the parent test can compare them."""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from smmf import SMMF

STEPS = 6
GLOBAL_BATCH = 8


def finish() -> None:
    """Leave together, then exit without the interpreter's teardown; every worker's last call, after
    its results are saved. A rank that tears gloo down while its peer still talks can abort at exit;
    and even after ``destroy_process_group`` the FSDP2 workers' interpreter teardown was seen to abort
    (SIGABRT, "terminate called without an active exception", no Python frame left) in about one run
    of this file in six: objects that still hold gloo work die then, as in pytorch/pytorch#179291."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


class Net(nn.Module):
    """Shapes chosen so that 2-way dim-0 shards split rows of the square-matricized matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.conv = nn.Conv2d(3, 6, 3)
        self.fc1 = nn.Linear(6 * 2 * 2 + 6, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.conv(x).flatten(1), self.embed(tokens).mean(1)], dim=1)
        return self.fc2(self.norm(torch.tanh(self.fc1(h))))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 3, 4, 4, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 11, (GLOBAL_BATCH, 3), generator=gen)
    y = torch.randn(GLOBAL_BATCH, 5, generator=gen, dtype=torch.float64)
    return x, tokens, y


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        x, tokens, y = (t.chunk(world)[rank] for t in batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x, tokens), y).backward()
        opt.step()


def optimizer(params, **options) -> SMMF:
    return SMMF(params, lr=1e-2, weight_decay=0.1, decay_rate=-0.8, **options)


def single_process_params(**options) -> list[torch.Tensor]:
    model = make_net()
    train(model, optimizer(model.parameters(), **options), range(STEPS))
    return [p.detach().clone() for p in model.parameters()]


def ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    init(rank, world, port)
    model = DistributedDataParallel(make_net())
    train(model, optimizer(model.parameters()), range(STEPS), rank, world)
    torch.save([p.detach() for p in model.module.parameters()], Path(out) / f"ddp{rank}.pt")
    finish()


def ddp_bf16_rounding_worker(rank: int, world: int, port: int, out: str, in_backward: bool, backend: str) -> None:
    """bf16 weights rounded stochastically under DDP, each rank's generator seeded apart and drawing apart
    between steps (as scripts seed per rank for data and dropout): each rank's params after STEPS steps."""
    from smmf import step_in_backward

    init(rank, world, port)
    model = nn.parallel.DistributedDataParallel(make_net().bfloat16())
    torch.manual_seed(1000 + rank)
    opt = optimizer(model.parameters(), stochastic_rounding=True, backend=backend)
    if in_backward:
        step_in_backward(opt, module=model)
    for step in range(STEPS):
        x, tokens, y = (t.chunk(world)[rank] for t in batch(step))
        nn.functional.mse_loss(model(x.bfloat16(), tokens), y.bfloat16()).backward()
        opt.step()
        opt.zero_grad()
        torch.rand(rank + 1)
    torch.save([p.detach() for p in model.module.parameters()], Path(out) / f"bf16-{rank}.pt")
    finish()


def _sharded_net(world: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_net().to(dtype)
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_bf16_rounding_worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    """One stochastically rounded step of bf16 params under FSDP2, the whole batch on every rank (each rank
    seeded apart), and the same step of the unsharded model: each param after it, from both (rank 0's)."""
    init(rank, world, port)
    torch.manual_seed(1000 + rank)
    results = {}
    for sharded in (True, False):
        model = _sharded_net(world, torch.bfloat16) if sharded else make_net().bfloat16()
        opt = optimizer(model.parameters(), stochastic_rounding=True, vector_reshape=False, backend=backend)
        x, tokens, y = batch(0)
        nn.functional.mse_loss(model(x.bfloat16(), tokens), y.bfloat16()).backward()
        opt.step()
        results[sharded] = [_full(p) for p in model.parameters()]
    if rank == 0:
        torch.save(results, Path(out) / "fsdp2-bf16.pt")
    finish()


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _collectives_in_one_step(model: nn.Module, options: dict, rank: int, world: int) -> dict[str, int]:
    """How many all-reduces and all-gathers one ``opt.step()`` makes (FSDP2's own collectives run in
    forward and backward)."""
    opt = optimizer(model.parameters(), **options)
    x, tokens, y = (t.chunk(world)[rank] for t in batch(0))
    nn.functional.mse_loss(model(x, tokens), y).backward()
    names = ("all_reduce", "all_gather", "all_gather_into_tensor")
    real = {name: getattr(dist, name) for name in names}
    calls = dict.fromkeys(names, 0)

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        opt.step()
    finally:
        for name in names:
            setattr(dist, name, real[name])
    return calls


def fsdp2_worker(rank: int, world: int, port: int, out: str, options: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from smmf.dispatch import step_kernel
    from smmf.state import momentum_code

    init(rank, world, port)
    # Uninterrupted run.
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    train(model, opt, range(STEPS), rank, world)
    straight = _full_params(model)
    # Interrupted at step 3: save through torch.distributed.checkpoint, load into fresh objects, continue.
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    train(model, opt, range(3), rank, world)
    ckpt = Path(out) / "dcp"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    whole = StateDictOptions(full_state_dict=True)  # plain tensors of the whole params, on every rank
    full = {"model": get_model_state_dict(model, options=whole), "optim": get_optimizer_state_dict(model, opt, options=whole)}
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    train(model, opt, range(3, STEPS), rank, world)
    resumed = _full_params(model)
    # The full state dict, loaded into shards without saying it is full: each rank takes its rows.
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    set_model_state_dict(model, full["model"], options=whole)
    set_optimizer_state_dict(model, opt, full["optim"])
    train(model, opt, range(3, STEPS), rank, world)
    resumed_full = _full_params(model)
    # An unsharded run's state dict (the bits' flat packing), loaded into shards.
    unsharded = make_net()
    unsharded_opt = optimizer(unsharded.parameters(), **options)
    train(unsharded, unsharded_opt, range(3))
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    set_model_state_dict(model, unsharded.state_dict(), options=whole)
    opt.load_state_dict(unsharded_opt.state_dict())
    train(model, opt, range(3, STEPS), rank, world)
    resumed_unsharded = _full_params(model)
    local_bit_bytes = [opt.state[p][key].to_local().numel() for p in model.parameters()
                       for key in ("sign_m", "flag_m") if key in opt.state[p]]
    paths = sorted({step_kernel("auto", p, momentum_code(p, opt.param_groups[0])).name for p in model.parameters()})
    collectives = _collectives_in_one_step(_sharded_net(world), options, rank, world)
    if rank == 0:
        torch.save({"straight": straight, "resumed": resumed, "resumed_full": resumed_full,
                    "resumed_unsharded": resumed_unsharded, "bit_bytes": local_bit_bytes, "paths": paths,
                    "collectives": collectives}, Path(out) / "fsdp2.pt")
    finish()


def fsdp1_flat_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    init(rank, world, port)
    messages = []
    for use_orig_params in (False, True):
        model = FullyShardedDataParallel(make_net(), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
        try:
            optimizer(model.parameters())
            messages.append(None)
        except RuntimeError as err:
            messages.append(str(err))
    if rank == 0:
        torch.save({"messages": messages}, Path(out) / "fsdp1.pt")
    finish()


def fsdp2_peak_worker(rank: int, world: int, port: int, out: str, options: dict) -> None:
    """Extra resident peak of one FSDP2 step over the shard's bytes: the fused numba pass, then the
    sharded torch path (run in a process whose large blocks are mmap-ed, so RSS follows them);
    ``options`` are SMMF's (the code of M)."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from smmf.bench.procfs import reset_peak_rss, status_kib

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    extra = {}
    for backend in ("auto", "torch"):
        model = nn.Linear(2048, 2048, bias=False)
        fully_shard(model, mesh=mesh)
        weight = next(model.parameters())
        local = torch.randn(weight.to_local().shape)
        weight.grad = DTensor.from_local(local, mesh, weight.placements, shape=weight.shape, stride=weight.stride())
        opt = SMMF(model.parameters(), backend=backend, **options)
        opt.step()  # state, and the kernel's compilation or cache load, first
        gc.collect()
        reset_peak_rss()
        before = status_kib("VmRSS") or 0
        opt.step()
        extra[backend] = ((status_kib("VmHWM") or 0) - before) * 1024 / (local.numel() * 4)
    if rank == 0:
        torch.save(extra, Path(out) / "fsdp2_peak.pt")
    finish()


def _micro_batches(step: int, rank: int, world: int, k: int):
    x, tokens, y = (t.chunk(world)[rank] for t in batch(step))
    return zip(x.chunk(k), tokens.chunk(k), y.chunk(k))


def _train_accumulating(model: nn.Module, opt: SMMF, steps: range, rank: int, world: int, k: int,
                        in_backward: bool, clip: Optional[float] = None) -> int:
    """k micro-batches per step, gradient sync on the last only: switched by the loop (the ordinary
    one) or by ``step_in_backward``'s hooks; the ordinary loop clips each gradient to ``clip``
    (``step_in_backward`` is given it). How many gradients the ordinary loop clipped."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    clipped = 0  # (also "ddp shared": another optimizer holds some of the module's params)
    for step in steps:
        for micro, (x, tokens, y) in enumerate(_micro_batches(step, rank, world, k)):
            last = micro == k - 1
            if not in_backward and not ddp:
                model.set_requires_gradient_sync(last)
            context = model.no_sync() if ddp and not in_backward and not last else nullcontext()
            with context:
                nn.functional.mse_loss(model(x, tokens), y).backward()
        if clip is not None and not in_backward:
            clipped += sum(int(nn.utils.clip_grad_norm_([p], clip) > clip) for p in model.parameters())
        opt.step()
        opt.zero_grad()
        if hasattr(opt, "partner"):  # it steps on the module's averaged gradients, whatever SMMF does
            opt.partner.step()
            opt.partner.zero_grad()
    return clipped


def _full(t):
    if not isinstance(t, torch.Tensor):
        return torch.tensor(t)  # the step count
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _accumulating_run(kind: str, world: int, options: dict, k: int, in_backward: bool, load=None):
    """A fresh model and optimizer, stepping inside backward or not, resumed from the DCP checkpoint
    ``load`` when given (loaded as users do: the hooks first, then a template state dict filled by DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from smmf import step_in_backward

    if kind.startswith("ddp"):
        net = make_net()
        if kind == "ddp ignored":  # a param DDP leaves alone: each rank steps it on its own gradient, in either loop
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["fc2.weight"])
        model = nn.parallel.DistributedDataParallel(net)
    else:
        model = _sharded_net(world)
    params = list(model.parameters())
    if kind in ("ddp shared", "ddp added"):  # the last layer: with another optimizer, or added to this one later
        head = list(model.module.fc2.parameters())
        params = [p for p in params if all(p is not q for q in head)]
    opt = optimizer(params, **{key: value for key, value in options.items() if key != "clip"})
    if kind == "ddp shared":
        opt.partner = torch.optim.SGD(head, lr=0.05)
    if in_backward:  # "fsdp2 alone": without the module, FSDP2 syncs every micro-batch
        step_in_backward(opt, k, module=None if kind == "fsdp2 alone" else model, clip_grad_norm=options.get("clip"))
    if kind == "ddp added":  # after the hooks: its params are stepped on the averaged gradients too
        opt.add_param_group({"params": head})
    if load is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _snapshot(model: nn.Module, opt: SMMF) -> dict:
    params = list(model.parameters())
    return {"params": [_full(p) for p in params],
            "state": [{key: _full(value) for key, value in opt.state.get(p, {}).items()} for p in params],
            "grads": [None if p.grad is None else _full(p.grad) for p in params]}


def step_in_backward_worker(rank: int, world: int, port: int, out: str, kind: str, options: dict, k: int) -> None:
    """The ordinary DDP / FSDP2 loop against ``step_in_backward(module=...)``: params and state after
    STEPS steps, then each one's checkpoint continued two steps by the other. ``options`` are SMMF's,
    and ``clip``: per-tensor gradient clipping."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    init(rank, world, port)
    runs, checkpoints, results = {}, {}, {}
    for in_backward in (False, True):
        model, opt = runs[in_backward] = _accumulating_run(kind, world, options, k, in_backward)
        clipped = _train_accumulating(model, opt, range(STEPS), rank, world, k, in_backward, options.get("clip"))
        results[in_backward] = _snapshot(model, opt) | {"clipped": clipped}
        checkpoints[in_backward] = Path(out) / f"dcp-{in_backward}"
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoints[in_backward])
    for in_backward in (False, True):  # each continued by itself and from the other's checkpoint
        for model, opt in (runs[in_backward],
                           _accumulating_run(kind, world, options, k, in_backward, checkpoints[not in_backward])):
            _train_accumulating(model, opt, range(STEPS, STEPS + 2), rank, world, k, in_backward, options.get("clip"))
            results.setdefault("continued", []).append(_snapshot(model, opt)["params"])
    if rank == 0:
        torch.save(results, Path(out) / "in_backward.pt")
    finish()


def _train_replicated(model: nn.Module, opt: SMMF, steps: range) -> None:
    """The whole batch on every rank: the same averaged gradient on any number of ranks."""
    for step in steps:
        x, tokens, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x, tokens), y).backward()
        opt.step()


def reshard_save_worker(rank: int, world: int, port: int, out: str, options: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    init(rank, world, port)
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    _train_replicated(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(out) / f"saved-on-{world}")
    finish()


def reshard_load_worker(rank: int, world: int, port: int, out: str, options: dict, saved_on: int) -> None:
    """Load the checkpoint saved on ``saved_on`` ranks on ``world``, continue three steps; on 3 ranks,
    also offer a shard's bits in the per-rank layout of another number of ranks (refused, unchanged)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    init(rank, world, port)
    model = _sharded_net(world)
    opt = optimizer(model.parameters(), **options)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=Path(out) / f"saved-on-{saved_on}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    refusal = None
    if world == 3:
        before = opt.state_dict()
        legacy = opt.state_dict()
        per_rank = torch.zeros(2 * 5, dtype=torch.uint8)  # 5 bytes on each of 2 ranks: not a layout of 3
        legacy["state"][0] = {**legacy["state"][0],
                              "sign_m": distribute_tensor(per_rank, model.embed.weight.device_mesh, [Shard(0)])}
        try:
            opt.load_state_dict(legacy)
        except ValueError as err:
            refusal = str(err)
        after = opt.state_dict()
        assert all(torch.equal(_full(after["state"][i][key]), _full(value))
                   for i, entry in before["state"].items() for key, value in entry.items())
    _train_replicated(model, opt, range(3, 6))
    result = {"params": _full_params(model), "refusal": refusal,
              "state": [{key: _full(value) for key, value in entry.items()} for _, entry in sorted(opt.state_dict()["state"].items())]}
    if rank == 0:
        torch.save(result, Path(out) / f"loaded-{saved_on}-on-{world}.pt")
    finish()


def ddp_refusals_worker(rank: int, world: int, port: int, out: str) -> None:
    """What ``step_in_backward`` refuses under DDP, each refusal leaving the optimizer as it was."""
    import pytest

    from smmf import step_in_backward

    init(rank, world, port)
    net = make_net()
    unused_found = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    opt = optimizer(net.parameters())
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        step_in_backward(opt, module=unused_found)
    from helpers import assert_nothing_installed

    assert_nothing_installed(opt)
    model = nn.parallel.DistributedDataParallel(make_net())
    opt = optimizer(model.parameters())
    step_in_backward(opt, module=model)
    stray = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # not in the module: DDP never averages it
    with pytest.raises(RuntimeError, match="not in the module given to step_in_backward"):
        opt.add_param_group({"params": [stray]})
    assert len(opt.param_groups) == 1 and stray not in opt.state
    (Path(out) / f"refused{rank}").touch()
    finish()
