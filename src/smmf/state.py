"""Layout of the per-parameter SMMF state: which tensors, of which shape and dtype.

One function, :func:`state_layout`, decides the layout from a parameter and its group's options.
The optimizer builds its state from it, checkpoint loading validates against it, and the memory
predictor counts it; so the three can never disagree.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor

from .matrix import packed_sign_bytes, square_matricize_shape
from .sharding import as_state, local, shard_info

# Keys of the factored state (a parameter seen as an n×m matrix).
ROW_M, COL_M, SIGN_M = "row_m", "col_m", "sign_m"
ROW_V, COL_V = "row_v", "col_v"
# Keys of the dense state (1-D parameters when ``vector_reshape=False``).
EXP_AVG, EXP_AVG_SQ = "exp_avg", "exp_avg_sq"
STEP = "step"


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def real_view(tensor: Tensor) -> Tensor:
    """Complex tensors are optimized as their real view (``..., 2``)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def factor_dtype(param: Tensor) -> torch.dtype:
    """Factors and dense moments are fp64 for fp64 params and fp32 for every other float."""
    return torch.float64 if real_view(param).dtype == torch.float64 else torch.float32


def is_dense(param: Tensor, group: Mapping[str, Any]) -> bool:
    return real_view(param).dim() <= 1 and not group["vector_reshape"]


def matrix_shape(param: Tensor) -> tuple[int, int]:
    return square_matricize_shape(real_view(param).numel())


def state_layout(param: Tensor, group: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """The tensors SMMF keeps for ``param`` between steps (``step`` is a plain int)."""
    dtype = factor_dtype(param)
    real = real_view(param)
    has_momentum = group["beta"] is not None
    if is_dense(param, group):
        dense = TensorSpec(tuple(real.shape), dtype)
        return ({EXP_AVG: dense} if has_momentum else {}) | {EXP_AVG_SQ: dense}
    rows, cols = matrix_shape(param)
    layout: dict[str, TensorSpec] = {}
    if has_momentum:
        layout[ROW_M] = TensorSpec((rows,), dtype)
        layout[COL_M] = TensorSpec((cols,), dtype)
        info = shard_info(param)
        sign_bytes = packed_sign_bytes(rows * cols) if info is None else info.sign_bytes * (info.world if info.sharded else 1)
        layout[SIGN_M] = TensorSpec((sign_bytes,), torch.uint8)
    layout[ROW_V] = TensorSpec((rows,), dtype)
    layout[COL_V] = TensorSpec((cols,), dtype)
    return layout


def init_state(param: Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {STEP: 0}
    info = shard_info(param)
    for key, spec in state_layout(param, group).items():
        if info is None:
            state[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=param.device)
        elif key in (EXP_AVG, EXP_AVG_SQ):  # dense: elementwise, sharded like the param
            state[key] = torch.zeros_like(param, dtype=spec.dtype)
        else:
            size = info.sign_bytes if key == SIGN_M else spec.shape[0]
            piece = torch.zeros(size, dtype=spec.dtype, device=local(param).device)
            state[key] = as_state(piece, info, sharded=key == SIGN_M)
    return state


def check_loaded_state(
    param: Tensor, group: Mapping[str, Any], state: Mapping[str, Any], where: str
) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the keys and shapes ``param`` needs."""
    layout = state_layout(param, group)
    expected = set(layout) | {STEP}
    if set(state) != expected:
        raise ValueError(
            f"{where}: state keys {sorted(state)} do not fit a parameter of shape "
            f"{tuple(param.shape)} with these options; expected {sorted(expected)}"
        )
    for key, spec in layout.items():
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != spec.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{where}: state '{key}' has shape {got} but a parameter of shape "
                f"{tuple(param.shape)} needs {spec.shape}"
            )
    step = state[STEP]
    step_value = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
    if not isinstance(step_value, (int, float)) or step_value < 0:
        raise ValueError(f"{where}: state 'step' should be a non-negative number but is {step!r}")
