"""What the fused CPU step costs per element, and what bounds it.

1. One tensor's own numba launch (``host.own_launch``), repeated on the same tensor, at sizes from L3-resident
   (1Mi elements: 8 MiB of weight and gradient) to memory-resident (16Mi), beside an axpy over the same bytes.
2. The update's square root and division, in a loop over L1-resident fp32 arrays on one thread, beside the same
   loop with neither.

    python benchmarks/element_cost.py
    python benchmarks/element_cost.py --threads 1 --optimizer "SMMF(params, **smmf.RECOMMENDED)" --launch-only

Run on a quiet machine; name the CPU with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch

import smmf
from smmf import SMMF
from smmf.kernels.numba_cpu import host
from smmf.kernels.numba_cpu.cache import FASTMATH
from smmf.state import momentum_code

_LOOP = dict(fastmath=FASTMATH, error_model="numpy")


@numba.njit(**_LOOP)
def _with_sqrt_and_division(w, m, v, reps, lr, eps):
    for _ in range(reps):
        for j in range(w.shape[0]):
            w[j] = w[j] - lr * (m[j] / (np.sqrt(v[j]) + eps))


@numba.njit(**_LOOP)
def _without(w, m, v, reps, lr, eps):
    for _ in range(reps):
        for j in range(w.shape[0]):
            w[j] = w[j] - lr * (m[j] * (v[j] + eps))


def _median_ns_per_element(step, numel: int, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / numel * 1e9


def own_launch_by_size(optimizer: str = "SMMF(params)") -> None:
    print(f"own launch of {optimizer}, {numba.get_num_threads()} threads: "
          "elements, V's view, SMMF ns/element, axpy ns/element")
    for side in (1024, 1536, 2048, 4096):
        numel = side * side
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn_like(param)
        params = [param]
        opt = eval(optimizer, {"SMMF": SMMF, "smmf": smmf, "params": params})
        opt.step()
        group = opt.param_groups[0]
        cfg = opt._step_config(group, 2, momentum_code(param, group))
        smmf_ns = _median_ns_per_element(lambda: host.own_launch(param, param.grad, opt.state[param], cfg), numel)
        x, y = torch.randn(numel), torch.randn(numel)
        axpy = _median_ns_per_element(lambda: x.add_(y, alpha=1e-3), numel)
        print(f"{numel:>9}  {side} × {side}  {smmf_ns:.3f}  {axpy:.3f}")


def divider_in_l1(numel: int = 1024, reps: int = 20000) -> None:
    w, m, v = (np.random.rand(numel).astype(np.float32) + 1 for _ in range(3))
    lr, eps = np.float32(1e-3), np.float32(1e-8)
    print("one thread, L1-resident fp32: ns/element")
    for name, loop in (("w − lr·m/(√v + ε)", _with_sqrt_and_division), ("w − lr·m·(v + ε)", _without)):
        loop(w, m, v, 10, lr, eps)
        start = time.perf_counter()
        loop(w, m, v, reps, lr, eps)
        print(f"  {name}: {(time.perf_counter() - start) / (reps * numel) * 1e9:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="torch's and numba's thread count (default: numba's)")
    parser.add_argument("--optimizer", default="SMMF(params)", help="an expression of params (smmf imported)")
    parser.add_argument("--launch-only", action="store_true", help="skip the square-root-and-division loop")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    own_launch_by_size(args.optimizer)
    if not args.launch_only:
        divider_in_l1()
