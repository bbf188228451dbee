"""The one dispatch point between the torch path and the fused kernels.

Fused kernels are optional: they are imported lazily, and ``backend="auto"`` falls back to the
torch path wherever a kernel is missing or does not cover a parameter.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch
from torch import Tensor

from ..functional import Nonfinite, StepConfig, torch_step_
from ..sharding import is_dtensor, shard_info
from ..state import EXP_AVG_SQ, momentum_code, real_view

__all__ = ["BACKENDS", "available_backends", "check_backend", "step_kernel"]

BACKENDS = ("auto", "torch", "numba", "triton")

# A kernel updates (param, grad, state, cfg) in place and reports the NaN/inf gradient elements it met.
StepKernel = Callable[[Tensor, Tensor, dict[str, Any], StepConfig], Nonfinite]


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


def _numba_covers(param: Tensor) -> bool:
    return param.device.type == "cpu" and param.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _triton_covers(param: Tensor) -> bool:
    return param.is_cuda and real_view(param).dtype in (torch.float32, torch.bfloat16, torch.float16)


def step_kernel(backend: str, param: Tensor, state: dict[str, Any]) -> StepKernel:
    """The kernel that updates ``param`` under ``backend``.

    ``auto`` takes the Triton kernel for CUDA parameters (fp32, bf16, fp16 and complex of those)
    and the numba kernel for CPU ones (fp32, fp64, bf16) where installed. The torch path takes the
    rest: dense 1-D state (``vector_reshape=False``), fp64 on CUDA, fp16 and complex on CPU. Both
    kernels take every code of M (:func:`smmf.state.momentum_code`). DTensor (FSDP2) parameters take
    the same kernels over their shard (every code; Triton: real dtypes), the rest the sharded torch
    path. A named fused backend that cannot take ``param``'s device or dtype raises ``RuntimeError``;
    dense 1-D state and complex CPU params take the torch path whatever backend is named.
    """
    if is_dtensor(param):
        from ..distributed import fused_sharded_step_, sharded_step_

        shard_info(param)  # unsupported placements fail here, before any update
        fused = (backend in ("auto", "numba") and _numba_covers(param) and _has_module("numba")) or (
            backend in ("auto", "triton") and _triton_covers(param) and not param.is_complex() and _has_module("triton"))
        if backend not in ("auto", "torch") and not fused:
            raise RuntimeError(f"backend {backend!r} cannot update this DTensor parameter ({param.dtype} on "
                               f"{param.device}, momentum code {momentum_code(state)}); use backend='auto' or 'torch'")
        return fused_sharded_step_ if fused else sharded_step_
    if backend == "torch" or EXP_AVG_SQ in state or (param.is_complex() and not param.is_cuda):
        return torch_step_
    if backend in ("auto", "numba") and _numba_covers(param) and _has_module("numba"):
        from .numba_cpu import numba_step_

        return numba_step_
    if backend in ("auto", "triton") and _triton_covers(param) and _has_module("triton"):
        from .triton_gpu import triton_step_

        return triton_step_
    if backend == "auto":
        return torch_step_
    raise RuntimeError(
        f"backend {backend!r} cannot update a {param.dtype} parameter on {param.device}; "
        "use backend='auto' to fall back to the torch path"
    )
