"""The Triton kernel matches the torch path: on CUDA when present, else under Triton's CPU
interpreter; skipped where triton is not installed (CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


PARTS = 3  # the parity battery in parts, which the suite's workers run side by side


def _parity(*args: str) -> None:
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    script = Path(__file__).with_name("triton_parity.py")
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TRITON PARITY OK" in out.stdout


@pytest.mark.parametrize("battery", ["default", pytest.param("whole", marks=pytest.mark.slow)])
@pytest.mark.parametrize("part", range(PARTS))
def test_triton_kernel_matches_torch_path(part: int, battery: str) -> None:
    """The whole parity battery on CUDA; under the CPU interpreter its quick form (every check, on fewer
    steps and smaller tensors) by default, and the whole one (over 30 minutes of a CPU core) under
    ``-m slow``."""
    import torch

    cuda = torch.cuda.is_available()
    if battery == "whole" and cuda:
        pytest.skip("on CUDA the default run's parity test runs the whole battery")
    _parity(f"--part={part}/{PARTS}", *(["--quick"] if battery == "default" and not cuda else []))


def test_every_kernel_variant_compiles_for_a_gpu() -> None:
    """The CPU interpreter does not type-check like the compiler: build every specialization for
    sm_90 with Triton's own toolchain (no GPU needed; on a GPU the parity run compiles what it uses)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU, the parity test compiles and runs the kernels")
    from triton_compile import compile_all, variants

    report = compile_all(90)
    assert len(report) == len(variants()) > 30


def test_the_16_byte_hints_are_given_only_where_they_hold() -> None:
    """The step kernel is told rows start on 8 elements and tensors on 16 bytes only when both hold:
    a wrong hint would read misaligned vectors on a GPU."""
    import torch

    from smmf.kernels.triton_gpu.host import _vector
    from smmf.state import init_state

    storage = torch.zeros(1 + 64 * 256)
    aligned, offset = storage[:-1].view(64, 256), storage[1:].view(64, 256)
    state = init_state(aligned, {"beta": 0.9, "vector_reshape": True})
    assert _vector(aligned, aligned, state, 256, 0, aligned.numel())
    assert not _vector(offset, aligned, state, 256, 0, aligned.numel())  # the weight 4 bytes off
    assert not _vector(aligned, offset, state, 256, 0, aligned.numel())  # the gradient
    assert not _vector(aligned, aligned, state, 252, 0, aligned.numel())  # rows not whole vectors
    assert not _vector(aligned, aligned, state, 256, 4, aligned.numel())  # a shard starting mid-vector
    assert not _vector(aligned, aligned, state, 256, 0, aligned.numel() - 4)  # or ending there


def test_levels_layout_refuses_what_int32_indices_cannot_reach() -> None:
    """The levels kernels index a row's elements and a tensor's blocks in int32: a row of 2^31 elements (a
    1-D param of that size is one row) is refused on the host with a clear error, not stepped out of bounds."""
    import torch

    from smmf.kernels.triton_gpu.table import levels_layout

    cpu = torch.device("cpu")
    geometry, items, step_items, partial, _ = levels_layout(((6, 8, 0, 48, 4, 12),), cpu, 128, 256, 16)
    assert geometry[0]["m_tiles"] == 1 and step_items.tolist() == [0] and partial == 6 + 8
    with pytest.raises(RuntimeError, match="int32"):
        levels_layout(((2**16, 2**16, 0, 2**32, 1, 2**32),), cpu, 128, 256, 16)
