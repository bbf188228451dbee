"""The host's part of an SMMF step on the Triton path, measured without a GPU: CPU tensors, the Triton
launches replaced by no-ops, so what is timed is the optimizer's Python and the launches' preparation
(grouping, tables, plans) — what a GPU waits on when it runs the step faster than Python issues it.

    python benchmarks/host_time.py --sets gpt2-xl-1.3B,resnet50,gpt2-52M
    PYTHONPATH=<other checkout>/src python benchmarks/host_time.py   # another commit, for an A/B
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import smmf.optimizer as optimizer
from smmf import SMMF
from smmf.bench.bench import SHAPE_SETS
from smmf.bench.shapes import make_params
from smmf.kernels.triton_gpu import host


class _NoLaunch:
    """A Triton kernel's stand-in: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


class _TritonOnCpu:
    """The Triton backend, batched as on CUDA, for CPU tensors."""

    batched = True
    raw_writes = True
    name = "triton"
    steps_ = staticmethod(host.triton_steps_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gpt2-xl-1.3B,resnet50,gpt2-52M")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    for name in ("step_kernel", "finish_kernel", "momentum_sums_kernel", "flag_finish_kernel"):
        setattr(host, name, _NoLaunch())
    backend = _TritonOnCpu()
    optimizer.step_kernel = lambda *args: backend  # every param to the batched Triton host path
    for set_name in args.sets.split(","):
        params = make_params(SHAPE_SETS[set_name](), device="cpu", dtype=torch.float32)
        opt = SMMF(params, lr=1e-3)
        opt._nonfinite.report = lambda count: None  # its pinned buffer needs CUDA
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        print(f"{set_name}: {len(params)} tensors, host {ms:.3f} ms a step, {1e3 * ms / len(params):.1f} µs a tensor")


if __name__ == "__main__":
    main()
