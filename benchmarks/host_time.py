"""The host's part of an SMMF step, measured without its kernels: CPU tensors, the launches replaced by
no-ops, so what is timed is the optimizer's Python and the launches' preparation (checks, grouping, tables,
plans). On the Triton path (the default; no GPU needed) that is what a GPU waits on when it runs the step
faster than Python issues it; on the numba path (``--numba``) it is the share of a CPU step that is not the
kernels'.

    python benchmarks/host_time.py --sets gpt2-xl-1.3B,resnet50,gpt2-52M
    python benchmarks/host_time.py --recommended          # SMMF(**smmf.RECOMMENDED): the levels code's launches
    python benchmarks/host_time.py --numba --sets resnet50   # the numba path's host side
    PYTHONPATH=<other checkout>/src python benchmarks/host_time.py   # another commit, for an A/B

Besides the host's milliseconds it counts the launches of a step (on a GPU each costs the host a few
microseconds more, which CPU tensors do not show).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import smmf.optimizer as optimizer
from smmf import RECOMMENDED, SMMF
from smmf.bench.bench import SHAPE_SETS
from smmf.bench.shapes import make_params
from smmf.kernels.numba_cpu import host as numba_host
from smmf.kernels.triton_gpu import host, levels

KERNELS = ("sign_step_kernel", "flag_step_kernel", "no_m_step_kernel", "finish_kernel", "momentum_sums_kernel",
           "flag_finish_kernel", "v_sums_kernel", "levels_step_kernel")


class _NoLaunch:
    """A kernel's stand-in: ``kernel[grid](...)`` (Triton) or ``_launch(...)`` (numba) only counts the launch."""

    launches = 0

    def __getitem__(self, grid: Any) -> Any:
        return self._launch

    @classmethod
    def _launch(cls, *args: Any, **kwargs: Any) -> None:
        cls.launches += 1


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
    parser.add_argument("--recommended", action="store_true", help="SMMF(**smmf.RECOMMENDED), not the paper's code")
    parser.add_argument("--numba", action="store_true", help="the numba (CPU) path's host side, not Triton's")
    args = parser.parse_args()
    if args.numba:
        _no_numba_launches()
    else:
        _no_triton_launches()
    for set_name in args.sets.split(","):
        params = make_params(SHAPE_SETS[set_name](), device="cpu", dtype=torch.float32)
        opt = SMMF(params, lr=1e-3, backend="numba" if args.numba else "auto",
                   **(RECOMMENDED if args.recommended else {}))
        opt._nonfinite.report = lambda count: None  # its pinned buffer needs CUDA
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        times = []
        _NoLaunch.launches = 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        print(f"{set_name}: {len(params)} tensors, host {ms:.3f} ms a step, {1e3 * ms / len(params):.1f} µs a tensor, "
              f"{_NoLaunch.launches / args.repeats:.0f} {'numba' if args.numba else 'Triton'} launches a step")


def _no_numba_launches() -> None:
    """The numba kernels that the host side calls, each a counted no-op (the state is left as it was)."""
    numba_host.KERNELS = {code: {parallel: _NoLaunch._launch for parallel in kernels}
                          for code, kernels in numba_host.KERNELS.items()}
    numba_host.LEVELS_KERNELS = {parallel: _NoLaunch._launch for parallel in numba_host.LEVELS_KERNELS}
    numba_host.many_blocks_kernel = numba_host.many_kernel = _NoLaunch._launch


def _no_triton_launches() -> None:
    for module in (host, levels):  # (where each commit keeps them)
        for name in KERNELS:
            if hasattr(module, name):
                setattr(module, name, _NoLaunch())
    backend = _TritonOnCpu()
    optimizer.step_kernel = lambda *args: backend  # every param to the batched Triton host path


if __name__ == "__main__":
    main()
