"""The library's modules form layers, and imports only run down them (or within one): the kernels
know nothing of who dispatches to them, and the sharded step calls the backend it is handed."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "smmf"

# Lowest first. A module imports (anywhere in its body) only from its own layer or lower ones.
LAYERS = [
    {"matrix", "noise", "levels", "schedules", "table", "schema", "band"},
    {"codes"},
    {"sharding"},
    {"state"},
    {"functional"},
    {"kernels", "kernels.contract", "kernels.numba_cpu", "kernels.triton_gpu"},
    {"options"},
    {"shards", "distributed"},
    {"dispatch"},
    {"engine", "params", "nonfinite", "checkpoint"},
    {"optimizer"},
    # The engines, above the optimizer: they adapt it through smmf.engine, which imports them only when used.
    {"partitions", "zero", "zero_engine", "backward", "backward_ranks"},
    {"memory", "integrations", "__init__"},
    {"cli", "bench"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _rank(module: str) -> int:
    """A module's layer, or its package's (``from .. import __version__`` names the package's ``__init__``)."""
    while module not in RANK:
        if not module:
            return RANK["__init__"]
        module = module.rpartition(".")[0]
    return RANK[module]


def _imports(path: Path) -> set[str]:
    package = _module_name(path).split(".")
    if path.name != "__init__.py" or package == ["__init__"]:
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {target} if node.module else {".".join(base + [alias.name]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smmf."):
            found.add(node.module.removeprefix("smmf."))  # type: ignore[union-attr]
    return {name for name in found if name}


def test_every_module_has_a_layer() -> None:
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        assert name.split(".")[0] in RANK or name in RANK, f"{name} is in no layer"


def test_imports_only_run_down_the_layers() -> None:
    upward = [(_module_name(path), target) for path in SRC.rglob("*.py") for target in _imports(path)
              if _rank(target) > _rank(_module_name(path))]
    assert not upward, f"imports from a higher layer: {upward}"


def test_no_import_circle() -> None:
    """No module imports, even for type checking, one that imports it back through any chain: each reads on its
    own, bottom-up."""
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}

    def known(target: str) -> str:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    graph = {name: {known(t) for t in _imports(path)} - {"", name} for name, path in modules.items()}
    for start in graph:  # a depth-first walk from each module: coming back to it is a circle
        stack, seen = list(graph[start]), set()
        while stack:
            name = stack.pop()
            assert name != start, f"{start} imports itself back through its imports"
            if name not in seen:
                seen.add(name)
                stack.extend(graph[name])


def test_the_sharded_step_does_not_pick_kernels() -> None:
    """distributed.py calls the backend contract only: no kernel module, no device test."""
    source = (SRC / "distributed.py").read_text()
    assert "numba_cpu" not in source and "triton_gpu" not in source and "is_cuda" not in source
    assert not {"kernels.numba_cpu", "kernels.triton_gpu", "dispatch"} & _imports(SRC / "distributed.py")


def test_import_smmf_loads_no_engine_code() -> None:
    """``import smmf``, a step and ``routes()`` load neither DeepSpeed ZeRO's partitions nor the step inside backward:
    the optimizer imports them when it meets a ZeRO buffer, and ``smmf.step_in_backward`` when it is first asked
    for."""
    import subprocess
    import sys

    probe = ("import sys, torch, smmf; p = torch.nn.Parameter(torch.ones(4, 4)); p.grad = torch.ones(4, 4); "
             "smmf.SMMF([p], backend='torch').step(); smmf.SMMF([p]).routes(); "
             "print(sorted(m for m in sys.modules if m.startswith('smmf.'))); "
             "smmf.step_in_backward; print('smmf.backward' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, asked = done.stdout.splitlines()
    for engine in ("smmf.partitions", "smmf.zero", "smmf.zero_engine", "smmf.backward", "smmf.backward_ranks"):
        assert f"'{engine}'" not in loaded, loaded
    assert asked == "True"
