"""Peak resident memory per rank of GPT-2 medium trained with FSDP2 on 2 CPU ranks (gloo):
AdamW vs SMMF vs SMMF with the step inside backward.

    python benchmarks/fsdp2_memory.py [--ranks 2] [--steps 3] [--json out.json]

Each configuration runs in fresh processes (one per rank, glibc's large blocks served by mmap so that
freed memory leaves the process); the model is built whole on each rank, sharded (each block, then
the root), and the resident high-water mark (``VmHWM``) is reset once the unsharded copy is freed,
so the figure is the training steps' own peak on that rank (Python/torch runtime included). SMMF's
numba kernels are compiled and cached by a throwaway process first, as on any machine after its
first run. Batch 1×128 per rank: weights dominate, as when fine-tuning a large model on small batches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smmf.bench.machine import cpu_model
from smmf.bench.procfs import reset_peak_rss, status_kib
from smmf.bench.training_memory import PINNED_MMAP_THRESHOLD, WARM_UP_SHAPE, build_gpt2
from smmf.sharding import local
from smmf.table import format_table

SHAPE = (24, 1024, 16, 1, 128)  # GPT-2 medium: n_layer, n_embd, n_head, batch, sequence
CONFIGS = {
    "AdamW(foreach=False)": dict(optimizer="adamw"),
    "SMMF": dict(optimizer="smmf"),
    "SMMF + step in backward": dict(optimizer="smmf", in_backward=True),
}
MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_bytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world: int, port: int, config: str, shape: tuple[int, ...], steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from smmf import SMMF, step_in_backward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    n_layer, n_embd, n_head, batch, seq = shape
    model = build_gpt2(n_layer, n_embd, n_head, False)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gc.collect()
    setup = (status_kib("VmRSS") or 0) * 1024
    reset_peak_rss()
    options = CONFIGS[config]
    params = list(model.parameters())
    if options["optimizer"] == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    else:
        optimizer = SMMF(params, lr=1e-4, decay_rate=-0.8)
        if options.get("in_backward"):
            step_in_backward(optimizer, module=model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result = dict(rank=rank, config=config, peak=(status_kib("VmHWM") or 0) * 1024, setup=setup,
                  weights=_local_bytes(params),
                  state=sum(_local_bytes(s.values()) for s in optimizer.state.values()))
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown under gloo (see tests/dist_workers.py)


def run(config: str, world: int, shape: tuple[int, ...], steps: int) -> list[dict[str, Any]]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(PINNED_MMAP_THRESHOLD)  # read by the spawned processes
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, _free_port(), config, shape, steps, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def _cpu() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    run("SMMF", args.ranks, WARM_UP_SHAPE, 1)  # compiles and caches the numba kernels
    found = {config: run(config, args.ranks, SHAPE, args.steps) for config in CONFIGS}
    base = max(r["peak"] for r in found["AdamW(foreach=False)"])
    rows = []
    for config, ranks in found.items():
        worst = max(ranks, key=lambda r: r["peak"])
        rows.append([config, worst["peak"] / MIB, worst["peak"] / base, worst["weights"] / MIB, worst["state"] / MIB,
                     worst["setup"] / MIB])
    print(f"GPT-2 medium, FSDP2 on {args.ranks} CPU ranks (gloo), batch 1x128 per rank, {args.steps} steps; "
          f"the rank with the highest peak")
    print(format_table(["optimizer", "peak MiB per rank", "/ AdamW", "weights MiB", "state MiB", "after sharding MiB"],
                       rows, "markdown"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"({_cpu()}, torch {torch.__version__}, commit {commit}; "
          f"command: python {' '.join(sys.argv)})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=found, commit=commit, argv=sys.argv), indent=1))


if __name__ == "__main__":
    main()
