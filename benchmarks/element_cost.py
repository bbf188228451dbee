"""What the fused CPU step costs per element, and what bounds it.

1. One tensor's own numba launch (``host.own_launch``), repeated on the same tensor, at sizes from L3-resident
   (1Mi elements: 8 MiB of weight and gradient) to memory-resident (16Mi), beside an axpy over the same bytes.
2. The update's square root and division, in a loop over L1-resident fp32 arrays on one thread, beside the same
   loop with neither.
3. The paper code's two-row element loop (``run_pair_with_momentum``) over two L1-resident rows of 1024 on one
   thread, alone and with the unpacking and packing of the rows' sign bits around it, as a block's pass runs it.

The CPU's clock takes a moment to rise under load: each part runs a second of work first, else its first
figures come out up to twice too slow.

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
from smmf.options import step_config
from smmf.kernels.numba_cpu import host
from smmf.kernels.numba_cpu.access import pack_bytes, unpack_bytes
from smmf.kernels.numba_cpu.cache import FASTMATH, KERNEL_OPTIONS
from smmf.kernels.numba_cpu.elements import run_pair_with_momentum
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
    _warm_up()
    for side in (1024, 1536, 2048, 4096):
        numel = side * side
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn_like(param)
        params = [param]
        opt = eval(optimizer, {"SMMF": SMMF, "smmf": smmf, "params": params})
        opt.step()
        group = opt.param_groups[0]
        cfg = step_config(group, 2, momentum_code(param, group))
        smmf_ns = _median_ns_per_element(lambda: host.own_launch(param, param.grad, opt.state[param], cfg), numel)
        x, y = torch.randn(numel), torch.randn(numel)
        axpy = _median_ns_per_element(lambda: x.add_(y, alpha=1e-3), numel)
        print(f"{numel:>9}  {side} × {side}  {smmf_ns:.3f}  {axpy:.3f}")


@numba.njit(**KERNEL_OPTIONS)
def _pair_loop(w0, g0, w1, g1, signs, lanes, col_m, col_v, acc_m, acc_v, sc, reps, with_bits):
    width = w0.shape[0]
    bits = lanes.view(np.uint8)
    total = 0.0
    for _ in range(reps):
        if with_bits:
            unpack_bytes(signs, 0, signs.shape[0], lanes)
        sums = run_pair_with_momentum(w0, g0, bits[:width], w1, g1, bits[width:2 * width], col_m, col_v, acc_m,
                                      acc_v, np.float32(0.5), np.float32(0.6), np.float32(0.5), np.float32(0.6), sc,
                                      True)
        if with_bits:
            pack_bytes(signs, 0, signs.shape[0], lanes)
        total += sums[0]
    return total


def _warm_up(seconds: float = 1.0) -> None:
    """Keep a core busy for ``seconds``, so that the clock has risen before the timed loops."""
    x = np.random.rand(1 << 16).astype(np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.sqrt(x, out=x)


def pair_loop_in_l1(width: int = 1024, reps: int = 20000) -> None:
    param = torch.nn.Parameter(torch.randn(width))  # only for the step's numbers
    param.grad = torch.randn_like(param)
    opt = SMMF([param])
    opt.step()
    group = opt.param_groups[0]
    sc = host.scalars(step_config(group, 2, momentum_code(param, group)), param.numel(), torch.float32)
    rng = np.random.default_rng(0)
    w0, g0, w1, g1 = (rng.standard_normal(width).astype(np.float32) for _ in range(4))
    col_m, col_v = (rng.random(width).astype(np.float32) for _ in range(2))
    acc_m, acc_v = np.zeros(width, dtype=np.float32), np.zeros(width, dtype=np.float32)
    signs = rng.integers(0, 256, 2 * width // 8).astype(np.uint8)
    lanes = np.zeros(2 * width // 8, dtype=np.uint64)
    args = (w0, g0, w1, g1, signs, lanes, col_m, col_v, acc_m, acc_v, sc)
    print("one thread, two L1-resident rows of the paper code's pair loop: ns/element")
    for with_bits in (False, True):
        _pair_loop(*args, 10, with_bits)
    _warm_up()
    for with_bits in (False, True, False, True):
        start = time.perf_counter()
        _pair_loop(*args, reps, with_bits)
        ns = (time.perf_counter() - start) / (reps * 2 * width) * 1e9
        print(f"  {'with the sign bits unpacked and packed' if with_bits else 'the loop alone':40s} {ns:.3f}")


def divider_in_l1(numel: int = 1024, reps: int = 20000) -> None:
    w, m, v = (np.random.rand(numel).astype(np.float32) + 1 for _ in range(3))
    lr, eps = np.float32(1e-3), np.float32(1e-8)
    print("one thread, L1-resident fp32: ns/element")
    _warm_up()
    for name, loop in (("w − lr·m/(√v + ε)", _with_sqrt_and_division), ("w − lr·m·(v + ε)", _without)):
        loop(w, m, v, 10, lr, eps)
        start = time.perf_counter()
        loop(w, m, v, reps, lr, eps)
        print(f"  {name}: {(time.perf_counter() - start) / (reps * numel) * 1e9:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="torch's and numba's thread count (default: numba's)")
    parser.add_argument("--optimizer", default="SMMF(params)", help="an expression of params (smmf imported)")
    parser.add_argument("--launch-only", action="store_true", help="skip the loops over L1 (parts 2 and 3)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    own_launch_by_size(args.optimizer)
    if not args.launch_only:
        divider_in_l1()
        pair_loop_in_l1()
