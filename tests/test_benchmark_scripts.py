"""Every script in ``benchmarks/`` and ``studies/`` answers ``--help``: it imports what it names (a script importing a kernel
name that a restructuring removed fails here) and parses its arguments without running its study. Scripts for
CUDA need Triton, and are skipped where it is not installed."""

from __future__ import annotations

import ast
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


def _defines(module: Path, name: str) -> bool:
    """Whether ``name`` is a submodule of the package at ``module`` or bound at its top level."""
    if module.name == "__init__.py" and ((module.parent / f"{name}.py").exists() or (module.parent / name).is_dir()):
        return True
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                   for a in node.names):
            return True
        targets = [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else getattr(node, "targets", [])
        if any(name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets):
            return True
        if isinstance(node, (ast.If, ast.Try)) and name in {getattr(n, "id", None) or getattr(n, "asname", None)
                                                            or getattr(n, "name", None) for n in ast.walk(node)}:
            return True  # bound under a condition (an optional dependency, or for type checkers beside a lazy import)
    return False


UNCHECKED = ("benchmarks", "studies", "tests", "examples")  # where no import runs without the optional packages


@pytest.mark.parametrize("folder", UNCHECKED)
def test_every_smmf_name_a_script_imports_exists(folder: str) -> None:
    """Statically, so that the scripts and test helpers CI cannot import (they need Triton or a GPU) still fail
    here when a restructuring renames what they import from smmf."""
    missing = []
    for script in sorted((ROOT / folder).glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "smmf"):
                continue
            base = ROOT / "src" / Path(*node.module.split("."))
            module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if not module.exists():
                missing.append(f"{script.name}: {node.module}")
                continue
            missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names
                        if a.name != "*" and not _defines(module, a.name)]
    assert not missing, missing
