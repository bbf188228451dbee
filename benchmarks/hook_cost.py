"""What the step inside backward costs per parameter on the host, against a plain per-parameter hook.

A backward over many small tensors (ResNet-50's 161 parameter shapes, each dimension capped at ``--cap``, so that
the kernels do almost nothing and the host's work shows; ``--cap 0``: the full shapes) is timed round-robin, in one
run, with: no hook (the backward alone); a plain hook per parameter (``p.add_(g)`` and the gradient freed, the least a
hook can do); torch's own optimizer in backward (``Adam(fused=True)`` per parameter from a post-accumulate-grad
hook, the pattern torch documents); ``smmf.step_in_backward`` on the paper's code and on ``smmf.RECOMMENDED``. Prints
each one's median backward and, over the backward alone, its cost per parameter (µs). CPU, one interleaved run:
name the CPU with the figures.

    python benchmarks/hook_cost.py [--rounds 30] [--cap 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import smmf
from smmf.bench.shapes import resnet50_shapes


def _params(cap: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(min(d, cap) for d in shape) if cap else shape for shape in resnet50_shapes()]
    return [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for shape in shapes]


class _Candidate:
    """Params of their own, the hooks of one way to step them, and one backward over them all."""

    def __init__(self, cap: int, install: Callable[[list[torch.nn.Parameter]], object]) -> None:
        self.params = _params(cap)
        self.inputs = [torch.randn_like(p) for p in self.params]
        self.handle = install(self.params)  # kept alive: the hooks belong to it

    def backward(self) -> None:
        sum((p * x).sum() for p, x in zip(self.params, self.inputs)).backward()


def _plain_hook(params: list[torch.nn.Parameter]) -> list:
    def step(p: torch.Tensor) -> None:
        p.detach().add_(p.grad, alpha=-1e-6)
        p.grad = None
    return [p.register_post_accumulate_grad_hook(step) for p in params]


def _torch_adam(params: list[torch.nn.Parameter]) -> dict:
    optimizers = {p: torch.optim.Adam([p], lr=1e-6, fused=True) for p in params}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()
    for p in params:
        p.register_post_accumulate_grad_hook(step)
    return optimizers


def _smmf(**options: object) -> Callable[[list[torch.nn.Parameter]], object]:
    return lambda params: smmf.step_in_backward(smmf.SMMF(params, lr=1e-6, **options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cap", type=int, default=4, help="cap on each dimension (0: the full shapes)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    candidates = {"backward alone": _Candidate(args.cap, lambda params: None),
                  "plain hook (p.add_(g))": _Candidate(args.cap, _plain_hook),
                  "torch Adam(fused) in backward": _Candidate(args.cap, _torch_adam),
                  "SMMF step_in_backward": _Candidate(args.cap, _smmf()),
                  "SMMF RECOMMENDED step_in_backward": _Candidate(args.cap, _smmf(**smmf.RECOMMENDED))}
    for candidate in candidates.values():  # compile and make the state, untimed
        for _ in range(3):
            candidate.backward()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, candidate in candidates.items():
            start = time.perf_counter()
            candidate.backward()
            times[name].append(time.perf_counter() - start)
    count = len(next(iter(candidates.values())).params)
    alone = statistics.median(times["backward alone"])
    print(f"{count} params (each dimension capped at {args.cap or 'none'}), {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    for name, measured in times.items():
        median = statistics.median(measured)
        extra = "" if name == "backward alone" else f", {1e6 * (median - alone) / count:.1f} µs a param over it"
        print(f"{name}: {1e3 * median:.2f} ms{extra}")


if __name__ == "__main__":
    main()
