"""Where a fused CPU step's time goes: the numba kernels' launches and the host's work before, between and
after them, over one of ``smmf bench``'s shape sets (mean per step over ``--steps`` warm steps).

    python benchmarks/step_timeline.py --set resnet50 --threads 2

Each line is a stretch of the step, from one event to the next; ``X<`` and ``X>`` are the start and end of a
launch (``blocks``: the mid-sized tensors', ``many``: the small ones', ``own``: each tensor that takes a launch of
its own) or of autograd's version ``bumps`` of what the kernels wrote. ``start->checked`` is the host from
``step()`` through its checks of every param, gradient and state; ``checked->blocks<`` its work from there to the
first launch (configs, which launch each tensor takes, the launches' tables); every stretch between two launches,
and after the last, is the host's too. The kernels' figure includes numba's dispatch of each launch. Run on a quiet
machine; name the CPU.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any, Callable

import smmf.optimizer as optimizer
from smmf import SMMF
from smmf.bench.bench import SHAPE_SETS, set_threads
from smmf.bench.shapes import make_params
from smmf.kernels.numba_cpu import host


class _Checked:
    """The optimizer's NaN/inf monitor, which also marks the end of the step's checks (it is polled there)."""

    def __init__(self, monitor: Any, events: list[tuple[str, float]]) -> None:
        self.monitor, self.events = monitor, events

    def poll(self) -> None:
        self.events.append(("checked", time.perf_counter()))
        self.monitor.poll()

    def report(self, count: Any) -> None:
        self.monitor.report(count)

    def host_count(self, count: Any) -> int:
        return self.monitor.host_count(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="resnet50", choices=sorted(SHAPE_SETS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    set_threads(args.threads)
    events: list[tuple[str, float]] = []

    def timed(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*kernel_args: Any) -> Any:
            events.append((name + "<", time.perf_counter()))
            result = kernel(*kernel_args)
            events.append((name + ">", time.perf_counter()))
            return result

        return run

    # The launches a tensor takes alone: each code's kernels, and the levels code's.
    for code, kernels in host.KERNELS.items():
        host.KERNELS[code] = {parallel: timed("own", kernel) for parallel, kernel in kernels.items()}
    host.LEVELS_KERNELS = {parallel: timed("own", kernel) for parallel, kernel in host.LEVELS_KERNELS.items()}
    host.many_blocks_kernel = timed("blocks", host.many_blocks_kernel)
    for shared in ("many_kernel", "many_levels_kernel", "many_flag_kernel"):  # the small tensors' launches
        setattr(host, shared, timed("many", getattr(host, shared)))
    optimizer.mark_written = timed("bumps", optimizer.mark_written)  # autograd's version bumps, after the kernels
    opt = SMMF(make_params(SHAPE_SETS[args.set]()), backend="numba")
    opt._nonfinite = _Checked(opt._nonfinite, events)  # type: ignore[assignment]  # a stand-in with its three methods
    for _ in range(5):
        opt.step()
    stretches: dict[str, float] = collections.defaultdict(float)
    for _ in range(args.steps):
        events.clear()
        start = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        before, name_before = start, "start"
        for name, at in [*events, ("end", end)]:
            stretches[f"{name_before}->{name}"] += at - before
            before, name_before = at, name
    total = sum(stretches.values())
    kernels = sum(s for stretch, s in stretches.items() if "<->" in stretch and not stretch.startswith("bumps"))
    print(f"{args.set}, {args.threads} threads, ms per step (mean of {args.steps}):")
    for stretch, seconds in stretches.items():
        print(f"  {stretch:20s} {seconds / args.steps * 1e3:7.3f}")
    print(f"  kernels {kernels / args.steps * 1e3:.3f}, host {(total - kernels) / args.steps * 1e3:.3f}, "
          f"step {total / args.steps * 1e3:.3f}")


if __name__ == "__main__":
    main()
