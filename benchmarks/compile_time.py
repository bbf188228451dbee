"""How long numba takes to compile each fused CPU kernel: what a machine's first process pays, once per
kernel and dtype, before the cache holds them (a fresh clone's test run pays all of them).

In one process with an empty cache directory of its own, each case steps a fresh param three times: its
first step compiles whatever kernels it is the first to use, and the compile time is that step's time less
the third's. Cases run from small to large, fp32 then fp64 then bf16, so each kernel is compiled by the
first case that needs it and listed there.

    python benchmarks/compile_time.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="smmf-compile-")  # before numba is imported

import torch  # noqa: E402

import smmf  # noqa: E402
from smmf.kernels.numba_cpu import host, launches  # noqa: E402

# Each code's own kernels (the host's tables, by whether they run in parallel) and the shared launches.
KERNELS = {**{f"{code.name.lower()} {'parallel' if parallel else 'serial'}": kernel
              for code, kernels in host.KERNELS.items() for parallel, kernel in kernels.items()},
           **{f"levels {'parallel' if parallel else 'serial'}": kernel for parallel, kernel in host.LEVELS_KERNELS.items()},
           "shared": launches.many_kernel, "shared blocks": launches.many_blocks_kernel,
           "shared levels": launches.many_levels_kernel, "shared flag": launches.many_flag_kernel}
SHAPES = {"300×200": (300, 200), "600×600": (600, 600)}  # below and above the parallel launches' size (the
# paper's code takes plain fp32 tensors of both into the shared launches)
CODES = {"paper": {}, "flag": dict(magnitude_bits=1), "levels": dict(magnitude_bits=3)}


def misses() -> dict[str, int]:
    return {name: sum(kernel.stats.cache_misses.values()) for name, kernel in KERNELS.items()}


def compile_seconds(shape: tuple[int, int], dtype: torch.dtype, options: dict) -> float:
    p = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
    opt = smmf.SMMF([p], backend="numba", **options)
    seconds = []
    for _ in range(3):
        p.grad = torch.randn_like(p)
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return seconds[0] - seconds[2]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | param | code | compiled | seconds |\n|---|---|---|---|---|")
    total = 0.0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for shape_name, shape in SHAPES.items():
            for code, options in CODES.items():
                before = misses()
                seconds = compile_seconds(shape, dtype, options)
                compiled = [name for name, count in misses().items() if count > before[name]]
                total += seconds
                print(f"| {str(dtype).removeprefix('torch.')} | {shape_name} | {code} | {', '.join(compiled) or '–'} "
                      f"| {seconds:.1f} |", flush=True)
    print(f"\nall of them: {total:.0f} s")


if __name__ == "__main__":
    main()
