"""The FSDP2 optimizer step between two commits: all-reduces per step and step time on 2 and 4 CPU
ranks (gloo), GPT-2 small (124M, from its ``transformers`` config; each block sharded, then the root).

Each commit is checked out into a temporary worktree and each (commit, ranks) configuration runs in
fresh processes that import the worktree's smmf; random gradients are set on the shards, 3 untimed
steps run (numba kernels compiled or loaded), then the median of ``--steps`` timed ``opt.step()``
calls on rank 0 (the collectives keep the ranks together). Rounds alternate the commits' order.
Run on a quiet machine; name the CPU with the figures. ``--recommended`` steps with
``smmf.RECOMMENDED`` (the levels code of M) instead of the paper's code.

    python benchmarks/fsdp2_step_time.py ef6f7aa^ HEAD --ranks 2 4 --rounds 2 --steps 10
    python benchmarks/fsdp2_step_time.py ad4a85d HEAD --ranks 2 --rounds 3 --recommended
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from worktrees import checked_out


CHILD = r"""
import json, os, socket, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world, port, steps, out, recommended):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel
    import smmf
    from smmf import SMMF
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    kwargs = dict(smmf.RECOMMENDED) if recommended else dict(decay_rate=-0.8)
    opt = SMMF(model.parameters(), lr=1e-4, **kwargs)
    for _ in range(3):
        opt.step()
    real, calls = dist.all_reduce, []
    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    dist.all_reduce = counting
    opt.step()
    dist.all_reduce = real
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": statistics.median(times), "all_reduces": len(calls), "from": smmf.__file__}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)

if __name__ == "__main__":
    world, steps, out, recommended = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(world, port, steps, out, recommended), nprocs=world, join=True)
"""


def _run(tree: Path, world: int, steps: int, tmp: Path, recommended: bool) -> dict:
    script, out = tmp / "child.py", tmp / "result.json"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    subprocess.run([sys.executable, str(script), str(world), str(steps), str(out), str(int(recommended))],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert result["from"].startswith(str(tree)), f"imported {result['from']}, not the worktree's smmf"
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--recommended", action="store_true", help="step with smmf.RECOMMENDED")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, checked_out([args.before, args.after], Path(tmp)) as trees:
        for tree in trees.values():  # one rank compiles and caches the numba kernels for the others
            _run(tree, 1, 1, Path(tmp), args.recommended)
        found: dict[tuple[str, int], list[dict]] = {}
        order = list(trees.items())
        for round_ in range(1, args.rounds + 1):
            for world in args.ranks:
                for name, tree in order if round_ % 2 else order[::-1]:
                    result = _run(tree, world, args.steps, Path(tmp), args.recommended)
                    found.setdefault((name, world), []).append(result)
                    print(f"round {round_}, {world} ranks, {name}: {result['median_s'] * 1e3:.1f} ms, "
                          f"{result['all_reduces']} all-reduces per step", flush=True)
        print("| ranks | commit | all-reduces per step | step ms (median of rounds) |")
        print("|---|---|---|---|")
        for world in args.ranks:
            medians = {}
            for name in trees:
                runs = found[(name, world)]
                medians[name] = statistics.median(r["median_s"] for r in runs)
                print(f"| {world} | {name} | {runs[0]['all_reduces']} | {medians[name] * 1e3:.1f} |")
            print(f"| {world} | {args.after} / {args.before} | | {medians[args.after] / medians[args.before]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
