"""Which path updates a param: the torch path, a fused backend, or their FSDP2 (DTensor) forms.

The one place that decides it (:func:`step_kernel`). It sits above :mod:`smmf.kernels` and
:mod:`smmf.distributed`, which know nothing of each other's choice: the kernels only declare what
they cover, and the sharded step only calls the backend it is handed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .codes import CODES
from .distributed import fused_sharded_steps_, sharded_step_
from .functional import Nonfinite, StepConfig, torch_step_
from .kernels import FUSED, StepItem, fused_backend, load_backend
from .sharding import is_dtensor, shard_info
from .options import step_config
from .state import STEP, MomentumCode, init_state, momentum_code

__all__ = ["Kernel", "Route", "RouteWhere", "bump_versions", "explain", "mark_written", "route", "shard_backend",
           "step_kernel"]


@dataclass(frozen=True)
class Kernel:
    """How a param's step runs. ``steps_`` updates (param, grad, state, cfg) items in place and
    reports the NaN/inf gradient elements met; ``batched``: it takes many tensors per call (one launch
    for them), else the caller hands it one at a time; ``raw_writes``: it writes through raw pointers
    (or DTensor locals), so the caller bumps the autograd versions an in-place torch op would."""

    name: str
    steps_: Callable[[Sequence[StepItem]], Nonfinite]
    batched: bool
    raw_writes: bool
    backend: Optional[Any] = None  # the fused backend (smmf.kernels.Backend) behind it, if any


# A route's first fields: the group's index, the param's index in it, its shape, dtype and device.
RouteWhere = tuple[int, int, tuple[int, ...], torch.dtype, torch.device]


@dataclass(frozen=True)
class Route:
    """How :class:`smmf.SMMF` steps one of its params (:meth:`smmf.SMMF.routes`): the param's ``group`` and
    ``index`` in it, its shape, dtype and device, its code of M, the ``kernel`` (torch, numba, triton, their DTensor
    forms, or a DeepSpeed ZeRO partition's pieces), the ``launch`` within it, and ``why`` it goes there."""

    group: int
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    code: str
    kernel: str
    launch: str
    why: str


def _one_at_a_time(step_: Callable[[Tensor, Tensor, dict, StepConfig], Nonfinite]) -> Callable[[Sequence[StepItem]], Nonfinite]:
    def steps_(items: Sequence[StepItem]) -> Nonfinite:
        (item,) = items
        return step_(*item)

    return steps_


TORCH = Kernel("torch", _one_at_a_time(torch_step_), batched=False, raw_writes=False)
SHARDED_TORCH = Kernel("sharded torch", _one_at_a_time(sharded_step_), batched=False, raw_writes=True)


@functools.lru_cache(maxsize=None)
def _fused(name: str, sharded: bool) -> Kernel:
    backend = load_backend(name)
    if sharded:  # batched: one all-reduce for all the shards of a step
        return Kernel(f"sharded {name}", functools.partial(fused_sharded_steps_, backend=backend), batched=True,
                      raw_writes=True, backend=backend)
    return Kernel(name, backend.steps_, batched=True, raw_writes=True, backend=backend)


def _complex_goes_to_torch(param: Tensor) -> bool:
    """Complex params on a device whose fused backend does not take complex: the torch path, whatever
    backend is named (as for the dense state)."""
    return param.is_complex() and not any(
        coverage.complex_params for _, coverage in FUSED.values() if coverage.device == param.device.type)


def step_kernel(backend: str, param: Tensor, code: MomentumCode) -> Kernel:
    """The path that updates ``param`` (its state stored as ``code``) under ``backend``.

    ``auto`` takes the Triton kernel for CUDA parameters (fp32, bf16, fp16 and complex of those)
    and the numba kernel for CPU ones (fp32, fp64, bf16) where installed; the torch path the rest:
    the dense state (``vector_reshape=False``), fp64 on CUDA, fp16 and complex on CPU. DTensor
    (FSDP2) parameters take the same kernels over their shard (every code; Triton: real dtypes), the
    rest the sharded torch path. A named fused backend that cannot take ``param``'s device or dtype
    raises ``RuntimeError``; the dense state and complex CPU params take the torch path whatever
    backend is named.
    """
    return explain(backend, param, code)[0]


def explain(backend: str, param: Tensor, code: MomentumCode) -> tuple[Kernel, str]:
    """:func:`step_kernel`'s answer and why it is that path, in words (:meth:`smmf.SMMF.routes`)."""
    sharded = is_dtensor(param)
    if sharded:
        shard_info(param)  # unsupported placements fail here, before any update
    # Asked for every param at every step; the answer depends on nothing else (a refusal is not kept).
    # Keyed on the device, not its type (cheaper to hash, at every param): its index only splits entries.
    key = (backend, param.device, param.dtype, code, sharded)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = _CHOSEN.setdefault(key, _choose(backend, param, code, sharded))
    return chosen


_CHOSEN: dict[tuple[str, torch.device, torch.dtype, MomentumCode, bool], tuple[Kernel, str]] = {}


def _choose(backend: str, param: Tensor, code: MomentumCode, sharded: bool) -> tuple[Kernel, str]:
    torch_path = SHARDED_TORCH if sharded else TORCH
    if backend == "torch":
        return torch_path, "backend='torch'"
    if CODES[code].elementwise:
        return torch_path, "the dense state of a vector (vector_reshape=False) takes the torch path"
    if not sharded and _complex_goes_to_torch(param):
        return torch_path, f"no fused backend takes complex params on {param.device.type}"
    fused = fused_backend(backend, param, code, sharded)
    if fused is not None:
        return _fused(fused.name, sharded), (f"backend={backend!r}: {fused.name} takes {param.dtype} params on "
                                             f"{param.device.type}{' (DTensor shards)' if sharded else ''}")
    if backend == "auto":
        return torch_path, (f"backend='auto': no installed fused backend takes {param.dtype} params on "
                            f"{param.device.type}{' as DTensor shards' if sharded else ''}")
    if sharded:
        raise RuntimeError(f"backend {backend!r} cannot update this DTensor parameter ({param.dtype} on "
                           f"{param.device}, momentum code {code.value}); use backend='auto' or 'torch'")
    raise RuntimeError(
        f"backend {backend!r} cannot update a {param.dtype} parameter on {param.device}; "
        "use backend='auto' to fall back to the torch path"
    )


def shard_backend(backend: str, piece: Tensor, code: MomentumCode) -> Optional[Any]:
    """The fused backend whose shard passes step ``piece``, a plain tensor holding a piece of a param cut between
    ranks (a DeepSpeed ZeRO partition's), under ``backend``; None for the torch path (``torch``, and ``auto``
    where no fused backend covers it). The levels code's pieces, which may cut its blocks, take a backend that
    implements :class:`smmf.kernels.contract.LevelsPieces` (numba's), else the torch path. A named fused backend
    that cannot take the piece raises ``RuntimeError``."""
    if backend == "torch" or CODES[code].elementwise:
        return None
    fused = fused_backend(backend, piece, code, sharded=True)
    if CODES[code].by_param_rows:
        return fused if hasattr(fused, "levels_piece_pass_") else None
    if fused is None and backend != "auto":
        raise RuntimeError(f"backend {backend!r} cannot update a piece of a {piece.dtype} parameter on "
                           f"{piece.device} (momentum code {code.value}); use backend='auto' or 'torch'")
    return fused


def route(where: RouteWhere, group: dict[str, Any], param: Tensor, state: Optional[dict[str, Any]]) -> Route:
    """How ``param`` of ``group`` is stepped (``state``: its state, None before its first step, which this
    describes): :class:`Route` from ``where``, its first fields."""
    code = momentum_code(param, group)
    kernel, why = explain(group["backend"], param, code)
    launch, how = kernel.name, "one tensor at a time"
    if kernel.backend is not None and not is_dtensor(param):
        state = state or init_state(param, group)
        launch, how = kernel.backend.launch_of(param, state, step_config(group, state.get(STEP, 0) + 1, code))
    elif kernel.backend is not None:
        how = "this rank's shard, one all-reduce of the sums for every shard of the step"
    return Route(*where, code=code.value, kernel=kernel.name, launch=launch, why=f"{why}; {how}")


def mark_written(kernel: Kernel, written: list[tuple[Tensor, dict[str, Any]]]) -> None:
    """Bump the autograd version of what a fused kernel wrote through raw pointers (each param and
    its state), as an in-place torch op would (the torch path's own in-place ops do it); one call
    for them all, as this runs for every param at every step."""
    if kernel.raw_writes:
        bump_versions([t for param, state in written for t in (param, *state.values()) if isinstance(t, Tensor)])


def bump_versions(tensors: list[Tensor]) -> None:
    if _VERSION_BUMP_TAKES_MANY:
        torch.autograd.graph.increment_version(tensors)
    else:
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def _version_bump_takes_many() -> bool:
    """Whether this torch's ``increment_version`` takes a list (newer than the oldest torch supported)."""
    try:
        torch.autograd.graph.increment_version([torch.zeros(1)])
    except (TypeError, RuntimeError):
        return False
    return True


_VERSION_BUMP_TAKES_MANY = _version_bump_takes_many()
