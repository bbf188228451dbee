"""Layout of the per-parameter SMMF state: which tensors, of which shape and dtype.

One function, :func:`state_layout`, decides the layout from a parameter and its group's options, by the step
fields of its code of M (:data:`smmf.codes.SCHEMA`). The optimizer builds its state from it, checkpoint loading
validates against it, and the memory predictor counts it; so the three can never disagree.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, cast

import torch
from torch import Tensor

from .levels import codes_shape, levels_shape
from .matrix import packed_sign_bytes, square_matricize_shape
from .codes import BIT_FIELDS, SCHEMA, choose
from .schema import (CODES_M, COL_M, COL_V, EXP_AVG, EXP_AVG_SQ, FLAG_M, FLAG_GAINS_M, ROW_M, ROW_V, SCALES_M,
                     SIGN_M, STEP, Dims, MomentumCode, TensorSpec)
from .sharding import as_state, is_dtensor, local, shard_info

MOMENTUM_SHAPES = ("square", "natural")
# The group options that decide a state's layout (state_layout reads them; check_state_fits refuses a change).
LAYOUT_OPTIONS = ("beta", "vector_reshape", "momentum_shape", "magnitude_bits")
# The options that decide M's code, at the paper's values: what a group (or a checkpoint) without them has.
MOMENTUM_CODE_DEFAULTS: dict[str, Any] = {"momentum_shape": "square", "magnitude_bits": 0}


def momentum_option(group: Mapping[str, Any], key: str) -> Any:
    return group.get(key, MOMENTUM_CODE_DEFAULTS[key])


def real_view(tensor: Tensor) -> Tensor:
    """Complex tensors are optimized as their real view (``..., 2``)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def factor_dtype(param: Tensor) -> torch.dtype:
    """Factors and dense moments are fp64 for fp64 params and fp32 for every other float."""
    return torch.float64 if real_view(param).dtype == torch.float64 else torch.float32


def is_dense(param: Tensor, group: Mapping[str, Any]) -> bool:
    return not group["vector_reshape"] and real_view(param).dim() <= 1


def matrix_shape(param: Tensor) -> tuple[int, int]:
    """The n×m view of V (and of M under ``momentum_shape="square"``)."""
    return square_matricize_shape(real_view(param).numel())


def momentum_matrix_shape(param: Tensor, group: Mapping[str, Any]) -> tuple[int, int]:
    """The n×m view of M: square, or with ``momentum_shape="natural"`` (dim 0, the rest) for tensors of
    two or more dims (a conv weight: out_channels × the rest); 1-D tensors stay square."""
    real = real_view(param)
    if momentum_option(group, "momentum_shape") == "natural" and real.dim() >= 2 and real.numel() > 0:
        return real.shape[0], real.numel() // real.shape[0]
    return matrix_shape(param)


def momentum_code(param: Tensor, group: Mapping[str, Any]) -> MomentumCode:
    """The code of ``param``'s state under ``group``'s options."""
    return choose(is_dense(param, group), group["beta"] is not None, momentum_option(group, "magnitude_bits"))


def momentum_cols(state: Mapping[str, Any], cols: int) -> int:
    """Columns of M's own view: V's ``cols`` unless momentum_shape="natural" (or no first moment)."""
    return state[COL_M].numel() if COL_M in state else cols


def dims(param: Tensor, group: Mapping[str, Any]) -> Dims:
    """``param``'s geometry under ``group``'s options, as the schema's shape rules read it: an FSDP2 shard's
    bits are its own (padded to the largest shard), laid out per rank in the global tensor."""
    real = real_view(param)
    rows, cols = matrix_shape(param)
    info = shard_info(param)
    bit_bytes = packed_sign_bytes(rows * cols) if info is None else info.sign_bytes * (info.world if info.sharded else 1)
    return Dims(rows, cols, *momentum_matrix_shape(param, group), *levels_shape(tuple(param.shape), real.numel()),
                tuple(real.shape), bit_bytes)


def state_layout(param: Tensor, group: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """The tensors SMMF keeps for ``param`` between steps (``step`` is a plain int): its code's schema fields."""
    geometry, factor = dims(param, group), factor_dtype(param)
    dtypes = {"factor": factor, "uint8": torch.uint8, "bf16": torch.bfloat16}
    return {field.key: TensorSpec(field.shape(geometry), dtypes[field.dtype])
            for field in SCHEMA[momentum_code(param, group)] if group["beta"] is not None or not field.first_moment}


def _keys_of(code: MomentumCode, beta: bool) -> frozenset[str]:
    return frozenset(field.key for field in SCHEMA[code] if beta or not field.first_moment)


# The keys of :func:`state_layout` and ``step`` for each code (and, for DENSE, with a first moment or not),
# written once: checked at every step of every param, so kept cheap.
_STATE_KEYS = {(code, beta): _keys_of(code, beta) | {STEP} for code in MomentumCode for beta in (False, True)}


def init_state(param: Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {STEP: 0}
    info = shard_info(param)
    for key, spec in state_layout(param, group).items():
        if info is None:
            state[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=param.device)
        elif key in (EXP_AVG, EXP_AVG_SQ):  # dense: elementwise, sharded like the param
            state[key] = torch.zeros_like(param, dtype=spec.dtype)
        elif key in (CODES_M, SCALES_M):  # by rows of the param: a shard's rows, or all of them (module docstring)
            state[key] = levels_state(spec, param, info)
        else:
            bits = key in BIT_FIELDS  # per element: each rank keeps its own
            piece = torch.zeros(info.sign_bytes if bits else spec.shape[0], dtype=spec.dtype, device=local(param).device)
            state[key] = as_state(piece, info, sharded=bits)
    return state


def levels_state(spec: TensorSpec, param: Tensor, info: Any) -> Tensor:
    """A zero levels-code tensor (codes or scales, by rows of the param) for a DTensor param: sharded like
    it (``Shard(0)``: each rank holds the rows of its shard, whole blocks) when the param has rows to
    shard; replicated for a sharded vector, which is one row that FSDP2 cuts anywhere (each rank then
    steps the whole row from the gathered weight and gradient: :mod:`smmf.distributed`)."""
    from torch.distributed.tensor import DTensor, Shard

    if info.sharded and param.dim() >= 2:
        rows = local(param).shape[0]
        piece = torch.zeros((rows, spec.shape[1]), dtype=spec.dtype, device=local(param).device)
        return DTensor.from_local(piece, info.mesh, [Shard(0)], run_check=False, shape=torch.Size(spec.shape),
                                  stride=(spec.shape[1], 1))
    return as_state(torch.zeros(spec.shape, dtype=spec.dtype, device=local(param).device), info, sharded=False)


def check_state_fits(param: Tensor, group: Mapping[str, Any], state: Mapping[str, Any],
                     code: Optional[MomentumCode] = None) -> None:
    """Raise ``RuntimeError`` unless the live ``state`` has the keys and shapes ``param`` needs now
    under ``group``'s options (a param whose ``.data`` was swapped for another shape would make the
    kernels read and write out of bounds; a group option changed mid-run that decides the layout —
    ``beta`` to or from None, ``vector_reshape``, ``momentum_shape``, ``magnitude_bits`` — would be
    ignored, and the optimizer could then not load its own checkpoint). ``code``: ``param``'s
    :func:`momentum_code` under ``group``, where the caller has it."""
    code = momentum_code(param, group) if code is None else code
    if not is_dtensor(param) and _fits_as_made(param, group, state, code):
        return  # every step of every param lands here: the checks below say what does not fit
    for key, value in state.items():
        if key != STEP and not isinstance(value, Tensor):
            _refuse_edited(param, key, type(value).__name__, "a tensor")
    real = real_view(param)
    need_keys = _STATE_KEYS[code, group["beta"] is not None]
    if state.keys() != need_keys:
        if STEP not in state:
            raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has SMMF state without its 'step' count: "
                               "was the optimizer's state edited? Build a new optimizer or load a checkpoint")
        if frozenset(state) in _STATE_KEYS.values():
            _refuse_layout_change()  # the state was made under another code
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has SMMF state keys {sorted(state)} where its "
                           f"options need {sorted(need_keys)}: was the optimizer's state edited? Build a new optimizer "
                           "or load a checkpoint")
    if EXP_AVG_SQ in state:
        got, need = tuple(state[EXP_AVG_SQ].shape), tuple(real.shape)
        if is_dtensor(state[EXP_AVG_SQ]) or got == need:
            return _refuse_other_tensors(param, group, state, code)
    else:
        rows, cols = matrix_shape(param)
        got, need = (state[ROW_V].shape[0], state[COL_V].shape[0]), (rows, cols)
        if got == need and CODES_M in state:  # the levels code's rows × cols
            got, need = tuple(state[CODES_M].shape), codes_shape(*levels_shape(tuple(param.shape), real.numel()))
        if got == need and ROW_M in state:  # M's own view (natural shape) must fit too
            got, need = (state[ROW_M].shape[0], state[COL_M].shape[0]), momentum_matrix_shape(param, group)
            if got != need and any(got == momentum_matrix_shape(param, {**group, "momentum_shape": shape})
                                   for shape in MOMENTUM_SHAPES):
                _refuse_layout_change()  # M was laid out under the other momentum_shape
        if got == need and all(key not in state or is_dtensor(state[key])
                               or state[key].shape[0] == packed_sign_bytes(rows * cols) for key in (SIGN_M, FLAG_M)):
            return _refuse_other_tensors(param, group, state, code)
    raise RuntimeError(
        f"a parameter of shape {tuple(param.shape)} has SMMF state made for another shape "
        f"(state {got}, this shape needs {need}): was its .data replaced? Build a new optimizer for it"
    )


def _refuse_other_tensors(param: Tensor, group: Mapping[str, Any], state: Mapping[str, Any],
                         code: MomentumCode) -> None:
    """After the checks above found the param's shape and options fitting: a plain param's state tensor
    whose shape or dtype is still not the one :func:`init_state` made (edited in place, e.g. its
    ``.data`` replaced: the kernels write through its address) is refused too; a DTensor param's
    state passes."""
    if is_dtensor(param):
        return
    misfit = _misfit(state, _live_layout(param, group, code))
    if misfit is not None:
        key, shape, dtype = misfit
        tensor = state[key]
        cast = tuple(tensor.shape) == tuple(shape) and tensor.dtype != dtype
        _refuse_edited(param, key, f"shape {tuple(tensor.shape)} ({tensor.dtype})", f"{tuple(shape)} ({dtype})",
                       f"was the parameter cast to {param.dtype} (model.double(), .half(), .to(dtype)) after its "
                       "state was made, or the state edited?" if cast else None)


def _refuse_edited(param: Tensor, key: str, got: str, need: str, question: Optional[str] = None) -> None:
    raise RuntimeError(
        f"a parameter of shape {tuple(param.shape)} has SMMF state '{key}' of {got} where it needs {need}: "
        + (question or "was the optimizer's state edited?") + " Build a new optimizer or load a checkpoint"
    )


# The shape and dtype of each state tensor of a plain (not DTensor) param, by what decides them
# (:func:`state_layout`).
_LIVE_LAYOUTS: dict[tuple[Any, ...], tuple[tuple[str, torch.Size, torch.dtype], ...]] = {}


def _fits_as_made(param: Tensor, group: Mapping[str, Any], state: Mapping[str, Any], code: MomentumCode) -> bool:
    """Whether a plain ``param``'s ``state`` has ``step`` and exactly the tensors, of the shapes and
    dtypes, that :func:`init_state` makes for it now (``code``: its :func:`momentum_code` under ``group``)."""
    layout = _live_layout(param, group, code)
    return len(state) == len(layout) + 1 and STEP in state and _misfit(state, layout) is None


def _misfit(state: Mapping[str, Any],
            layout: tuple[tuple[str, torch.Size, torch.dtype], ...]) -> Optional[tuple[str, torch.Size, torch.dtype]]:
    """The first entry of ``layout`` whose tensor ``state`` lacks or holds with another shape or dtype."""
    for entry in layout:
        key, shape, dtype = entry
        tensor = state.get(key)
        if not isinstance(tensor, Tensor) or tensor.shape != shape or tensor.dtype != dtype:
            return entry
    return None


def _live_layout(param: Tensor, group: Mapping[str, Any],
                 code: MomentumCode) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    """:func:`state_layout` for a plain ``param`` whose state is of ``code``, as (key, shape, dtype), made
    once per shape, dtype and option that decides it."""
    key = (param.shape, param.dtype, code, group["beta"] is not None, momentum_option(group, "momentum_shape"))
    layout = _LIVE_LAYOUTS.get(key)
    if layout is None:
        if momentum_code(param, group) is not code:  # the layout below is the group's code's: never file it wrongly
            raise ValueError(f"code {code} is not the momentum code of this param under its group")
        if len(_LIVE_LAYOUTS) >= 4096:  # a process that makes model after model
            _LIVE_LAYOUTS.clear()
        layout = _LIVE_LAYOUTS[key] = tuple((name, torch.Size(spec.shape), spec.dtype)
                                            for name, spec in state_layout(param, group).items())
    return layout


def _refuse_layout_change() -> None:
    raise RuntimeError(
        "a parameter's SMMF state was made under other group options than it has now: beta to or from None, "
        "vector_reshape, momentum_shape and magnitude_bits decide the state's layout and cannot change mid-run. "
        "Set them back, or build a new optimizer (or, if the parameter's .data was replaced by another shape, "
        "a new optimizer for it)"
    )


def _refuse_impossible_values(value: Tensor, dtype: torch.dtype, key: str, where: str) -> None:
    """What a step can leave in a state tensor (``value`` as it will be kept, in ``dtype``): factors, levels and
    scales finite and non-negative (their sums are capped); the dense second moment non-negative, infinite where a
    huge finite gradient squared to inf, as Adam's; the dense first moment of any sign. NaN only where
    ``nonfinite_grads="propagate"`` let a NaN gradient in, a run that had diverged. Checked when a checkpoint loads,
    on this rank's piece of a DTensor with the counts summed over its mesh, so that every rank refuses alike: a NaN
    factor would make every weight NaN."""
    piece = local(value).to(dtype)
    none = torch.zeros((), dtype=torch.int64, device=piece.device)
    dense = key in (EXP_AVG, EXP_AVG_SQ)
    counts = torch.stack([piece.isnan().sum(), none if dense else piece.isinf().sum(),
                          none if key == EXP_AVG else (piece < 0).sum()])
    if is_dtensor(value):
        torch.distributed.all_reduce(counts, group=cast(Any, value).device_mesh.get_group())
    nan, inf, negative = (int(c) for c in counts.tolist())
    if nan or inf:
        raise ValueError(f"{where}: state '{key}' holds {nan + inf} {'NaN' if dense else 'NaN or infinite'} "
                         f"value(s); a step leaves it {'without NaN' if dense else 'finite'} unless "
                         "nonfinite_grads='propagate' let a NaN gradient in (was the run that saved it diverged, or "
                         "the checkpoint damaged?)")
    if negative:
        raise ValueError(f"{where}: state '{key}' holds {negative} negative value(s); a step leaves it non-negative "
                         "(is the checkpoint damaged?)")


def check_loaded_state(
    param: Tensor, group: Mapping[str, Any], state: Mapping[str, Any], where: str
) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the keys, shapes and dtypes ``param`` needs, values a
    step can leave (:func:`_refuse_impossible_values`) and a finite, non-negative, whole ``step``."""
    check_loaded_values(state_layout(param, group), state, where, f"a parameter of shape {tuple(param.shape)}")


def check_loaded_values(layout: Mapping[str, TensorSpec], state: Mapping[str, Any], where: str, what: str) -> None:
    """:func:`check_loaded_state` against a ``layout`` (``what``: whose, for the messages)."""
    expected = set(layout) | {STEP}
    if not isinstance(state, Mapping) or set(state) != expected:
        keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{where}: state keys {keys} do not fit {what} with these options; expected "
                         f"{sorted(expected)}")
    for key, spec in layout.items():
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != spec.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{where}: state '{key}' has shape {got} but {what} needs {spec.shape}")
        if spec.dtype == torch.uint8 and value.dtype != torch.uint8:
            raise ValueError(f"{where}: state '{key}' holds packed bits and must be uint8, not {value.dtype}")
        if spec.dtype != torch.uint8 and not value.is_floating_point():
            raise ValueError(f"{where}: state '{key}' must be a floating-point tensor, not {value.dtype}")
        if spec.dtype != torch.uint8:
            _refuse_impossible_values(value, spec.dtype, key, where)
    step = state[STEP]
    step_value = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
    if (
        isinstance(step_value, bool)
        or not isinstance(step_value, (int, float))
        or not math.isfinite(step_value)
        or step_value < 0
        or step_value != int(step_value)
    ):
        raise ValueError(f"{where}: state 'step' should be a finite, non-negative whole number but is {step!r}")
