"""Every script in ``benchmarks/`` and ``studies/`` answers ``--help``: it imports what it names (a script importing a kernel
name that a restructuring removed fails here) and parses its arguments without running its study. Scripts for
CUDA need Triton, and are skipped where it is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
NEEDS_TRITON = {"gpu_tune.py", "host_time.py", "with_geometry.py"}
MODULES = {"worktrees.py"}  # imported by the scripts, not run
SCRIPTS = sorted(f"{path.parent.name}/{path.name}" for folder in ("benchmarks", "studies")
                 for path in (ROOT / folder).glob("*.py") if path.name not in MODULES)


def test_the_named_scripts_exist_and_the_modules_import() -> None:
    assert NEEDS_TRITON <= {script.split("/")[1] for script in SCRIPTS}
    assert all((BENCHMARKS / name).exists() for name in MODULES)
    for name in MODULES:
        done = subprocess.run([sys.executable, "-c", f"import {name.removesuffix('.py')}"], capture_output=True,
                              text=True, timeout=60, cwd=BENCHMARKS)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_answers_help(script: str) -> None:
    if script.split("/")[1] in NEEDS_TRITON and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout, done.stdout[-2000:]
