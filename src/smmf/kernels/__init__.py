"""The fused kernels: which backends exist, what each covers, and how to get one.

Fused kernels are optional: a backend's module (and numba or Triton) is imported at its first use.
Each backend implements :class:`smmf.kernels.contract.Backend`; which one runs a param is decided in
:mod:`smmf.dispatch`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Optional

import torch
from torch import Tensor

from ..codes import FACTORED
from ..schema import MomentumCode
from .contract import Backend, Coverage, FlagPass, StepItem

__all__ = ["BACKENDS", "Backend", "Coverage", "FlagPass", "StepItem", "available_backends", "check_backend",
           "fused_backend", "load_backend"]

BACKENDS = ("auto", "torch", "numba", "triton")

# Each fused backend: its module (which defines ``BACKEND``) and what it covers. A backend is named
# after the package it needs.
FUSED: dict[str, tuple[str, Coverage]] = {
    "numba": ("smmf.kernels.numba_cpu", Coverage(
        "cpu", frozenset({torch.float32, torch.float64, torch.bfloat16}), complex_params=False, sharded_complex=False,
        codes=FACTORED)),
    "triton": ("smmf.kernels.triton_gpu", Coverage(
        "cuda", frozenset({torch.float32, torch.bfloat16, torch.float16}), complex_params=True, sharded_complex=False,
        codes=FACTORED)),
}


@functools.lru_cache(maxsize=None)
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def available_backends() -> list[str]:
    """Backends that can run on this machine (``auto`` and ``torch`` always can)."""
    found = ["auto", "torch"]
    if _has_module("numba"):
        found.append("numba")
    if _has_module("triton") and torch.cuda.is_available():
        found.append("triton")
    return found


def check_backend(name: str) -> None:
    """Raise ``ValueError`` for an unknown backend, ``RuntimeError`` for an unavailable one."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend: {name!r}. It needs to be one of {list(BACKENDS)}")
    if name not in available_backends():
        hint = "pip install numba" if name == "numba" else "a CUDA device and pip install triton"
        raise RuntimeError(f"backend {name!r} is not available here ({hint})")


@functools.lru_cache(maxsize=None)
def load_backend(name: str) -> Backend:
    """The fused backend ``name`` (its module imported at the first call; dispatch asks for it for
    every param at every step)."""
    backend: Backend = importlib.import_module(FUSED[name][0]).BACKEND
    return backend


def fused_backend(name: str, param: Tensor, code: MomentumCode, sharded: bool = False) -> Optional[Backend]:
    """The fused backend that takes ``param`` (a whole tensor, or with ``sharded`` an FSDP2 shard)
    under the backend ``name`` (``auto``: any installed one), or None."""
    for candidate, (_, coverage) in FUSED.items():
        if name in ("auto", candidate) and coverage.covers(param, code, sharded) and _has_module(candidate):
            return load_backend(candidate)
    return None
