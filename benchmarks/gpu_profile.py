"""Where an SMMF step's time goes on a GPU, per shape set: the host's time to issue the step (the
optimizer's Python and the launches, no synchronization) against the step's time to the GPU's end,
beside fused AdamW's, and the step's CUDA kernels by their total time (``torch.profiler``).

    python benchmarks/gpu_profile.py --sets resnet50,gpt2-xl-1.3B
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from smmf import SMMF
from smmf.bench.bench import SHAPE_SETS
from smmf.bench.shapes import make_params


def issue_and_finish_ms(step, repeats: int) -> tuple[float, float]:
    """Median ms to issue one step (the host returns) and to finish it (the GPU is done)."""
    issued, finished = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        issued.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        finished.append(time.perf_counter() - start)
    return 1e3 * statistics.median(issued), 1e3 * statistics.median(finished)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="resnet50,gpt2-xl-1.3B")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for set_name in args.sets.split(","):
        params = make_params(SHAPE_SETS[set_name](), device="cuda", dtype=torch.float32)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        smmf = SMMF(params, lr=1e-6, backend="triton")
        adamw = torch.optim.AdamW(params, lr=1e-6, fused=True)
        for _ in range(3):
            smmf.step()
            adamw.step()
        print(f"\n== {set_name}: {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.1f}M params")
        for name, opt in (("SMMF (triton)", smmf), ("AdamW (fused)", adamw)):
            issued, finished = issue_and_finish_ms(opt.step, args.repeats)
            print(f"{name}: issued in {issued:.3f} ms, finished in {finished:.3f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                smmf.step()
            torch.cuda.synchronize()
        print("SMMF, 3 steps:")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
        del smmf, adamw, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
