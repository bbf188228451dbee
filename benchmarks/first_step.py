"""The first ``optimizer.step()`` of a fresh process, with the kernel cache already written: its wall
time and how much it adds to the resident memory, for the README's quick-start CNN and GPT-2 small.

Each version (this tree, and ``--commit`` taken from git for comparison) gets a cache directory of
its own; one process fills it, then ``--runs`` fresh processes are measured.

    python benchmarks/first_step.py [--runs 5] [--commit d948d04]
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

from smmf.bench.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, time
import torch
from smmf import SMMF

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

torch.manual_seed(0)
if sys.argv[1] == "cnn":  # the README's quick start
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    model(x)
    loss = torch.nn.functional.cross_entropy(model(x), y)
else:
    import transformers
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    ids = torch.randint(0, 50257, (1, 64))
    loss = model(input_ids=ids, labels=ids).loss
optimizer = SMMF(model.parameters())
loss.backward()
before = rss_mib()
start = time.perf_counter()
optimizer.step()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_mib": rss_mib() - before,
                  "tensors": sum(1 for p in model.parameters())}))
"""


def source_tree(commit: str | None, where: Path) -> Path:
    """``src`` of this tree, or of ``commit`` extracted from git into ``where``."""
    if commit is None:
        return ROOT / "src"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src/smmf"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where / "src"


def measure(src: Path, cache: Path, model: str, runs: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(cache)}
    results = []
    for _ in range(runs + 1):  # the first fills the cache
        out = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--commit", default=None, help="also measure this commit (e.g. the one before a change)")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; first step of a fresh process, kernel cache warm, median of {args.runs}")
    print("| version | model | tensors | first step s | RSS added MiB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        versions = [(args.commit, Path(tmp) / "old")] if args.commit else []
        versions.append((None, Path(tmp) / "new"))
        for commit, where in versions:
            where.mkdir()
            src = source_tree(commit, where)
            for model in ("cnn", "gpt2-small"):
                results = measure(src, where / "cache", model, args.runs)
                print(f"| {commit or 'this tree'} | {model} | {results[0]['tensors']} | "
                      f"{statistics.median(r['seconds'] for r in results):.2f} | "
                      f"{statistics.median(r['rss_mib'] for r in results):.0f} |", flush=True)


if __name__ == "__main__":
    main()
