"""Memory per rank of GPT-2 trained under DeepSpeed ZeRO-2 on 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``), with
``torch.optim.AdamW`` as DeepSpeed's client optimizer against SMMF and ``smmf.RECOMMENDED``: how much of SMMF's
saving survives what DeepSpeed keeps anyway (its fp32 master partition, its gradient partition).

    python benchmarks/deepspeed_memory.py [--model small|medium] [--precision bf16|fp32] [--ranks 2] [--steps 3]
                                          [--json out.json]

Each configuration runs in fresh processes (one per rank, glibc's large blocks served by mmap so that freed memory
leaves the process). Per rank: the resident high-water mark (``VmHWM``) from just before ``deepspeed.initialize``
(the model already built whole: ZeRO-2 keeps every rank's weights whole) to the end of the steps; the optimizer's
state (every tensor of the client optimizer's state, this rank's); DeepSpeed's fp32 master partition (the buffers it
hands the client optimizer) and its gradient partition (their gradients, as the last step left them); the model's
weights. Batch 1×128 per rank. SMMF's numba kernels are compiled and cached by a throwaway process first, as on any
machine after its first run.
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
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from smmf.bench.machine import cpu_model
from smmf.bench.procfs import reset_peak_rss, status_kib
from smmf.bench.training_memory import PINNED_MMAP_THRESHOLD, WARM_UP_SHAPE, build_gpt2
from smmf.table import format_table

SHAPES = {"small": (12, 768, 12, 1, 128), "medium": (24, 1024, 16, 1, 128)}  # n_layer, n_embd, n_head, batch, seq
CONFIGS = ("AdamW", "SMMF", "SMMF RECOMMENDED")
MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(state: Any) -> int:
    """Every tensor of an optimizer's state (SMMF's under a buffer: each piece's), the step counts aside."""
    if isinstance(state, dict):
        return sum(_state_bytes(value) for key, value in state.items() if key != "step")
    return _bytes([state])


def _rank(rank: int, world: int, port: int, config: str, shape: tuple[int, ...], bf16: bool, steps: int,
          out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    import smmf

    with redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    n_layer, n_embd, n_head, batch, seq = shape
    model = build_gpt2(n_layer, n_embd, n_head, bf16)
    weights = _bytes(model.parameters())
    params = list(model.parameters())
    if config == "AdamW":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    else:
        options = smmf.RECOMMENDED if "RECOMMENDED" in config else dict(decay_rate=-0.8)
        optimizer = smmf.SMMF(params, lr=1e-4, **options)
    ds_config = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
    gc.collect()
    setup = (status_kib("VmRSS") or 0) * 1024
    reset_peak_rss()
    with redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    buffers = [p for group in optimizer.param_groups for p in group["params"]]
    result = dict(rank=rank, config=config, peak=(status_kib("VmHWM") or 0) * 1024, setup=setup, weights=weights,
                  state=sum(_state_bytes(state) for state in optimizer.state.values()), master=_bytes(buffers),
                  numel=sum(p.numel() for p in params))
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown under gloo (see tests/dist_workers.py)


def run(config: str, world: int, shape: tuple[int, ...], bf16: bool, steps: int) -> list[dict[str, Any]]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(PINNED_MMAP_THRESHOLD)  # read by the spawned processes
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, _free_port(), config, shape, bf16, steps, out), nprocs=world,
                           join=True, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    bf16 = args.precision == "bf16"
    for config in CONFIGS[1:]:  # compiles and caches each code's numba kernels
        run(config, args.ranks, WARM_UP_SHAPE, bf16, 1)
    found = {config: run(config, args.ranks, SHAPES[args.model], bf16, args.steps) for config in CONFIGS}
    numel = found["AdamW"][0]["numel"]
    base = max(r["peak"] for r in found["AdamW"])
    rows = []
    for config, ranks in found.items():
        worst = max(ranks, key=lambda r: r["peak"])
        rows.append([config, worst["peak"] / MIB, worst["peak"] / base, worst["state"] / MIB,
                     8 * worst["state"] / numel * args.ranks / 8, worst["master"] / MIB, worst["weights"] / MIB,
                     (base - worst["peak"]) / MIB])
    print(f"GPT-2 {args.model} ({numel / 1e6:.0f}M parameters), DeepSpeed ZeRO-2 on {args.ranks} CPU ranks (gloo), "
          f"{args.precision} weights, batch 1x128 per rank, {args.steps} steps; the rank with the highest peak")
    print(format_table(["client optimizer", "peak MiB per rank", "/ AdamW", "state MiB per rank",
                        "state bytes/param (all ranks)", "fp32 master partition MiB", "weights MiB",
                        "saved MiB per rank"], rows, "markdown"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"({cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, deepspeed "
          f"{__import__('deepspeed').__version__}, commit {commit}; command: python {' '.join(sys.argv)})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=found, commit=commit, argv=sys.argv), indent=1))


if __name__ == "__main__":
    main()
