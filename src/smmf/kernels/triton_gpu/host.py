"""The host side of the Triton kernels: tensors grouped into launches, the table of each launch
built by field name, and the launches in order (:mod:`smmf.kernels.triton_gpu`'s docstring)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
import triton.language as tl
from torch import Tensor

from ...functional import StepConfig
from ...levels import levels_rows_cols
from ...state import (CODES_M, COL_M, COL_V, ROW_M, ROW_V, MomentumCode, matrix_shape, momentum_cols, real_view)
from ...codes import FACTORED_FIELDS
from ..contract import FlagPass, StepItem
from .finish import finish_kernel, flag_finish_kernel
from .levels import BLOCKS_PER_PROGRAM, LAUNCH_OPTIONS, STEP_WARPS, levels_step_kernel, v_sums_kernel
from .flag import flag_step_kernel
from .no_m import no_m_step_kernel
from .sign import sign_step_kernel
from .sums import momentum_sums_kernel
from . import table as tables  # tile shape read at each launch: benchmarks/gpu_tune.py sweeps it
from .table import META_COLUMNS, TABLE_FIELDS, layout, levels_layout


def _config_key(cfg: StepConfig, dtype: torch.dtype) -> tuple:
    """The tensors that may share a launch (the config's fields, ``StepConfig.launch_key``); its last item says
    whether ``dtype``'s weights round stochastically."""
    return cfg.launch_key(dtype)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _vector(weight: Tensor, grad: Tensor, state: dict[str, Any], m: int, lo: int, hi: int) -> bool:
    """Whether the step kernel may take the elements lo .. hi of an n×m matrix 16 bytes at a time: every
    row segment starts and ends on a multiple of 8 elements, and the weight, the gradient and the column
    factors it reads start on 16 bytes (a param viewed at an odd offset of its storage does not)."""
    vectors = [weight, grad, state[COL_V]] + ([state[COL_M]] if COL_M in state else [])
    return m % 8 == 0 and lo % 8 == 0 and hi % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in vectors)


def triton_steps_(items: Sequence[StepItem]) -> Optional[Tensor]:
    """The fused step of many tensors: ``(param, grad, state, cfg)`` each, one launch set per distinct
    (dtype, cfg, alignment, code of M) among them (under the levels code, ``magnitude_bits=3``, the kernels of
    :mod:`.levels`; each tensor's dither salt and rounding key are its own). Returns a CUDA counter of NaN/inf gradient elements (a lower
    bound; not synchronized), or None when none of the configs zeroes them.

    The host's work per tensor (grouping, the table of each launch, its copy to the GPU) is what a step
    costs on the CPU while the GPU waits, so it is done once per :func:`_signature` of the items (the
    addresses, shapes and dtypes of every tensor, which configs are equal) and kept as a plan: a later
    step with the same signature (the usual loop: the same params, state and gradient buffers) only
    launches."""
    signature = _signature(items)
    plan = _PLANS.get(signature) if signature is not None else None
    views = None
    if plan is None:
        views = [_views(param, grad) for param, grad, _, _ in items]
        plan = _make_plan(items, views)
        if signature is not None:
            if len(_PLANS) >= _PLANS_KEPT:  # the oldest goes (tolerant of another thread's step)
                _PLANS.pop(next(iter(_PLANS), ()), None)
            _PLANS[signature] = plan
    if not plan.groups:
        return None
    bad = torch.zeros(1, dtype=torch.int32, device=items[0][0].device)
    for group, indices in plan.groups:
        configs = [items[i][3] for i in indices]
        _run(group, configs[0], bad, salts=_salts(configs, group.meta.device) if group.levels else None,
             keys=_keys(group, configs))
    for weight, g, copy_of in views or ():
        if copy_of is not None:
            copy_of.copy_(weight)
    return bad if any(cfg.zero_nonfinite for _, _, _, cfg in items) else None


class _Plan(NamedTuple):
    """A step's launches: each prepared group with the indices of its items, whose configs are equal (but
    for the levels code's dither salt and the bf16 rounding key, each item's own); the first item's config is
    the launch's."""

    groups: list[tuple[_Group, list[int]]]


_PLANS: dict[tuple, _Plan] = {}  # by signature, oldest first
_PLANS_KEPT = 1024  # the step inside backward launches each param alone: a plan per param


def _signature(items: Sequence[StepItem]) -> Optional[tuple]:
    """What decides a step's plan: every param's and gradient's address, shape and dtype, every state
    tensor's name, address and size, which items' configs are equal (a plan launches a group with one
    item's config) and what of them it bakes in (stochastic rounding, a first moment, the code of M, whether
    the levels are dithered: each item's salt and rounding key are read at every step), and
    the tile geometry. None when some param or gradient needs a copy first (strided, or a
    gradient of another dtype): that step is planned for itself alone."""
    classes: dict[tuple[int, torch.dtype], tuple] = {}
    values: dict[tuple, int] = {}
    entries = []
    for param, grad, state, cfg in items:
        if not (param.is_contiguous() and grad.is_contiguous()) or grad.dtype != param.dtype:
            return None
        kind = classes.get((id(cfg), param.dtype))
        if kind is None:
            # Equal configs by the key the plan groups by (the real view's dtype: a complex param and a
            # real one share a launch), with what the plan bakes in taken as values.
            key = _config_key(cfg, real_view(param).dtype)
            kind = classes[(id(cfg), param.dtype)] = (values.setdefault(key, len(values)), key[-1],
                                                      cfg.beta1 is None, cfg.code, cfg.levels_salt is None)
        entries.append((kind, param.data_ptr(), param.shape, param.dtype, grad.data_ptr(),
                        *[(name, t.data_ptr(), t.numel()) for name, t in state.items() if isinstance(t, Tensor)]))
    return (tables.BLOCK_COLS, tables.BAND_ROWS, *entries)


def _views(param: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The weight and gradient the kernels walk (real, contiguous, one dtype), and the param's real view
    when the weight is a copy of it, to be copied back after the step."""
    weight = real_view(param.detach())
    copy_of = None
    if not weight.is_contiguous():  # logical row-major order: strided params go through one copy
        weight, copy_of = weight.contiguous(), weight
    g = real_view(grad)
    if g.dtype != weight.dtype or not g.is_contiguous():
        g = g.to(weight.dtype).contiguous()
    return weight, g, copy_of


def _make_plan(items: Sequence[StepItem], views: list[tuple[Tensor, Tensor, Optional[Tensor]]]) -> _Plan:
    launches: dict[tuple, list[int]] = {}
    levels: dict[tuple, list[int]] = {}  # the levels code: kernels of its own (.levels), dithered or not
    for index, ((weight, g, _), (_, _, state, cfg)) in enumerate(zip(views, items)):
        if weight.numel() == 0:
            continue
        if cfg.code is MomentumCode.LEVELS:
            levels.setdefault((*_config_key(cfg, weight.dtype), cfg.levels_salt is not None), []).append(index)
            continue
        # Without a first moment there are no sign bits, and every tensor takes the aligned code.
        n, m = matrix_shape(weight)
        aligned = cfg.beta1 is None or m % 8 == 0
        natural = momentum_cols(state, m) != m
        key = (*_config_key(cfg, weight.dtype), aligned, _vector(weight, g, state, m, 0, n * m), natural,
               cfg.code is MomentumCode.FLAG)
        launches.setdefault(key, []).append(index)
    groups = []
    for (dtype, *_, stochastic, aligned, vector, natural, flag), indices in launches.items():
        tensors = [(views[i][0], views[i][1], items[i][2]) for i in indices]
        spans = tuple((n, m, 0, n * m, momentum_cols(state, m), flag)
                      for (n, m), state in ((matrix_shape(w), st) for w, _, st in tensors))
        group = _prepare(tensors, spans, has_m=items[indices[0]][3].beta1 is not None, dtype=dtype,
                         stochastic=stochastic, aligned=aligned, vector=vector, normalize=True, natural=natural,
                         flag=flag)
        groups.append((group, indices))
    for (dtype, *_, stochastic, _), indices in levels.items():
        tensors = [(views[i][0], views[i][1], items[i][2]) for i in indices]
        groups.append((_prepare_levels(tensors, [0] * len(tensors), dtype, stochastic, normalize=True), indices))
    return _Plan(groups)


def triton_shard_step_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                       start: int) -> Optional[Tensor]:
    """The fused pass over an FSDP2 shard, the contract of
    :func:`smmf.kernels.numba_cpu.numba_shard_step_`: ``weight`` (contiguous; fp32, bf16 or fp16)
    and ``grad`` hold the elements ``start ..`` of the parameter's row-major flattening, ``state``
    the rank-local state (whole factor vectors, this shard's sign bits). Updates the weight and
    sign bits; leaves this shard's raw row and column sums in the four factor vectors (0 for rows
    it lacks), for the caller to add up across shards and normalize. The paper's code and the natural
    shape (the magnitude flag: :func:`triton_flag_shard_pass_`), and the levels code's shard of whole rows
    of M (:mod:`.levels`). Returns what :func:`triton_steps_` returns."""
    return _shard_launch(weight, grad, state, cfg, start, None)


def triton_flag_shard_pass_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                            flag_pass: FlagPass) -> Optional[Tensor]:
    """One of the magnitude flag's two passes over an FSDP2 shard (:class:`smmf.kernels.FlagPass`);
    the second always steps the weights (the first, :func:`~smmf.kernels.triton_gpu.step.momentum_sums_kernel`, only reads).
    Returns what :func:`triton_steps_` returns (from pass 1; None from pass 0)."""
    return _shard_launch(weight, grad, state, cfg, start, flag_pass)


def _shard_launch(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                  flag_pass: Optional[FlagPass]) -> Optional[Tensor]:
    n, m = state[ROW_V].numel(), state[COL_V].numel()
    grad = grad.to(weight.dtype).contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=weight.device)
    if cfg.code is MomentumCode.LEVELS and weight.numel():  # the shard's own rows of M: its own code, V's raw sums
        group = _prepare_levels([(weight, grad, state)], [start], weight.dtype,
                                cfg.rounds_stochastically(weight.dtype), normalize=False)
        _run(group, cfg, bad, salts=_salts([cfg], weight.device), keys=_keys(group, [cfg]))
    elif weight.numel():
        aligned = cfg.beta1 is None or (m % 8 == 0 and start % 8 == 0)
        m_cols = momentum_cols(state, m)
        flag = flag_pass is not None
        end = start + weight.numel()
        group = _prepare([(weight, grad, state)], ((n, m, start, end, m_cols, flag),), has_m=cfg.beta1 is not None,
                         dtype=weight.dtype, stochastic=cfg.rounds_stochastically(weight.dtype),
                         aligned=aligned, vector=_vector(weight, grad, state, m, start, end), normalize=False,
                         natural=m_cols != m, flag=flag)
        pass_0 = flag_pass is not None and flag_pass.number == 0  # it only reads: no weights to round
        _run(group, cfg, bad, flag_pass, keys=None if pass_0 else _keys(group, [cfg]))
    elif flag_pass is None or flag_pass.number == 1:  # nothing held: no sums to contribute
        for key in (ROW_V, COL_V) if flag_pass else (ROW_V, COL_V, ROW_M, COL_M):
            if key in state:
                state[key].zero_()
        if flag_pass:
            flag_pass.gain_sums.zero_()
    else:
        flag_pass.new_row_m.zero_()
        flag_pass.new_col_m.zero_()
    return bad if cfg.zero_nonfinite and (flag_pass is None or flag_pass.number == 1) else None


class _Group(NamedTuple):
    """One launch set's tensors, prepared: their table on the device, its layout, and the kernels'
    specialization."""

    meta: Tensor
    geometry: list[dict[str, int]]
    item_tensor: Tensor
    sums_items: Tensor
    partial_numel: int
    words_numel: int
    tensors: int  # how many
    has_m: bool
    dtype: torch.dtype
    stochastic: bool
    aligned: bool
    vector: bool
    normalize: bool
    natural: bool
    flag: bool
    shard: bool
    stream: Optional[torch.cuda.Stream]  # the CUDA stream its table was copied on (None on CPU)
    levels: bool = False  # the block-levels code's launches (.levels): item_tensor V's sums, sums_items M's blocks


def _prepare(tensors: list[tuple[Tensor, Tensor, dict[str, Any]]],
             spans: tuple[tuple[int, int, int, int, int, bool], ...],
             has_m: bool, dtype: torch.dtype, stochastic: bool, aligned: bool, vector: bool, normalize: bool,
             natural: bool, flag: bool) -> _Group:
    """The table of one group of (weight, gradient, state) and where it lies on the device (module
    docstring)."""
    device = tensors[0][0].device
    geometry, item_tensor, sums_items, partial_numel, words_numel = layout(spans, has_m, device, tables.BLOCK_COLS,
                                                                           tables.BAND_ROWS)
    table = [column for (weight, g, state), geo in zip(tensors, geometry) for column in _table_row(weight, g, state, geo)]
    return _Group(_on_device(table, len(tensors), device), geometry, item_tensor, sums_items, partial_numel,
                  words_numel, len(tensors), has_m, dtype, stochastic, aligned, vector, normalize, natural, flag,
                  shard=any(lo != 0 or hi != n * m for n, m, lo, hi, *_ in spans), stream=_stream(device))


def _prepare_levels(tensors: list[tuple[Tensor, Tensor, dict[str, Any]]], starts: list[int], dtype: torch.dtype,
                    stochastic: bool, normalize: bool) -> _Group:
    """The table of one group under the block-levels code (:func:`.table.levels_layout`): each weight holds
    the elements from ``starts[i]`` of its param (0, or an FSDP2 shard's first row), and its codes and scales are in
    the table's ``codes_m`` and ``scales_m`` columns."""
    device = tensors[0][0].device
    spans = tuple((*_v_shape(state), lo, lo + weight.numel(), *levels_rows_cols(state[CODES_M], weight.numel()))
                  for (weight, _, state), lo in zip(tensors, starts))
    geometry, v_items, step_items, partial_numel, _ = levels_layout(spans, device, tables.BLOCK_COLS, tables.BAND_ROWS,
                                                                    BLOCKS_PER_PROGRAM)
    table = [column for (weight, g, state), geo in zip(tensors, geometry) for column in _table_row(weight, g, state, geo)]
    return _Group(_on_device(table, len(tensors), device), geometry, v_items, step_items, partial_numel, 0,
                  len(tensors), True, dtype, stochastic, aligned=True, vector=False, normalize=normalize, natural=False,
                  flag=False, shard=any(lo != 0 or hi != n * m for n, m, lo, hi, *_ in spans), stream=_stream(device),
                  levels=True)


def _table_row(weight: Tensor, g: Tensor, state: dict[str, Any], geometry: dict[str, int]) -> list[int]:
    """A tensor's row of the table: the addresses of its weight, gradient and state's tensors (by the schema's
    keys; 0 for the fields its code lacks), then its geometry."""
    row = dict(geometry, w=weight.data_ptr(), g=g.data_ptr(),
               **{key: state[key].data_ptr() if key in state else 0 for key in FACTORED_FIELDS})
    return [row[field] for field in TABLE_FIELDS]


def _v_shape(state: dict[str, Any]) -> tuple[int, int]:
    """V's n×m view, from its factors (a shard's weight holds only part of it)."""
    return state[ROW_V].numel(), state[COL_V].numel()


def _on_device(table: list[int], tensors: int, device: torch.device) -> Tensor:
    """The table's int64 rows on ``device`` (:func:`_to_device`)."""
    assert len(table) == tensors * META_COLUMNS.value, "the table's rows and the kernels' META_COLUMNS disagree"
    return _to_device(torch.tensor(table, dtype=torch.int64), device)


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device``: on CUDA pinned, then an async copy (no stream sync; the caching host
    allocator keeps the buffer until the copy is done)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _salts(configs: list[StepConfig], device: torch.device) -> Optional[Tensor]:
    """The levels' dither salt of each item of a launch, on ``device`` (one small copy a step: a salt changes
    every step), or None when the levels are rounded to nearest."""
    if configs[0].levels_salt is None:
        return None
    return _to_device(torch.tensor([cfg.levels_salt for cfg in configs], dtype=torch.int64), device)


def _keys(group: _Group, configs: list[StepConfig]) -> Optional[Tensor]:
    """Each item's key of its bf16 rounding noise at this step, on the group's device (one small copy a step:
    a key changes every step), or None when the group rounds to nearest."""
    if not group.stochastic:
        return None
    keys = [cfg.rounding_key_for(group.dtype) for cfg in configs]
    return _to_device(torch.tensor(keys, dtype=torch.int64), group.meta.device)


def _run(group: _Group, cfg: StepConfig, bad: Tensor, flag_pass: Optional[FlagPass] = None,
         salts: Optional[Tensor] = None, keys: Optional[Tensor] = None) -> None:
    """The launches of one prepared group (module docstring), with ``cfg``'s scalars. ``flag_pass``: one
    FSDP2 shard under the magnitude flag, one of its two passes (:func:`triton_flag_shard_pass_`). ``salts``:
    under the levels code, each tensor's dither salt (None: nearest levels); ``keys``: each tensor's key of its
    bf16 rounding noise (None: nearest)."""
    meta, geometry, flag, normalize = group.meta, group.geometry, group.flag, group.normalize
    device = meta.device
    if group.stream is not None and torch.cuda.current_stream(device) != group.stream:
        # A kept plan on another stream than it was made on: its table's copy must be done before the
        # launches read it, and the allocator must not reuse the table's memory before they are done.
        current = torch.cuda.current_stream(device)
        current.wait_stream(group.stream)
        for tensor in (meta, group.item_tensor, group.sums_items):
            tensor.record_stream(current)
    partial = torch.empty(group.partial_numel, dtype=torch.float32, device=device)
    if group.levels:
        return _run_levels(group, cfg, bad, partial, salts, keys)
    words = torch.zeros(max(group.words_numel, 1), dtype=torch.int32, device=device)
    blocks = dict(BR=tables.BLOCK_ROWS, BC=tables.BLOCK_COLS, BAND=tables.BAND_ROWS, num_warps=tables.WARPS)
    finish = dict(BLOCK=256, KB=16, COPY_BLOCK=4096, FLAG=flag, num_warps=8)
    shard_pass = None if flag_pass is None else flag_pass.number
    if (group.natural or flag) and shard_pass != 1:  # |M|'s sums in M's own view, before the step kernel's writes
        momentum_sums_kernel[(group.sums_items.numel(),)](
            meta, group.sums_items, partial, cfg.beta1, *cfg.folded(), W_DTYPE=_TL_DTYPES[group.dtype],
            ZERO_NONFINITE=cfg.zero_nonfinite, FLAG=flag, **blocks,
        )
    if flag:  # the new factors of |M| in the partial buffer: the step kernel encodes against them
        new_m, m_rows, m_cols = (geometry[0][key] for key in ("new_m_at", "m_rows", "m_cols"))  # (one tensor when a shard)
        if flag_pass is not None and shard_pass == 1:  # a shard's: the caller's, from every shard's sums
            partial[new_m : new_m + m_rows].copy_(flag_pass.new_row_m)
            partial[new_m + m_rows : new_m + m_rows + m_cols].copy_(flag_pass.new_col_m)
        else:
            finish_kernel[(group.tensors, 1)](meta, partial, words, COPIERS=1, NORMALIZE=normalize, FIRST=1,
                                             MOMENTS=1, TO_SCRATCH=True, **finish)
        if flag_pass is not None and shard_pass == 0:  # this shard's raw sums, for the caller to add up
            flag_pass.new_row_m.copy_(partial[new_m : new_m + m_rows])
            flag_pass.new_col_m.copy_(partial[new_m + m_rows : new_m + m_rows + m_cols])
            return
    _step_launch(group, cfg, partial, None if group.aligned else words, bad if cfg.zero_nonfinite else None, keys,
                 blocks)
    copiers = 0 if group.aligned else tables.COPY_PROGRAMS
    moments = 2 if group.has_m and not flag else 1  # the flag's M is finished already
    finish_kernel[(group.tensors, moments + copiers)](
        meta, partial, words, COPIERS=max(copiers, 1), NORMALIZE=normalize, FIRST=0, MOMENTS=moments,
        TO_SCRATCH=False, **finish,
    )
    if flag_pass is not None:  # a shard's second pass: its work items' level sums, added in a fixed order
        items, at = geometry[0]["tiles"] * geometry[0]["bands"], geometry[0]["gain_sums_at"]
        flag_pass.gain_sums.copy_(partial[at : at + 4 * items].view(items, 4).sum(0))
    elif flag:
        flag_finish_kernel[(group.tensors,)](meta, partial, BLOCK=256, num_warps=4)


def _step_launch(group: _Group, cfg: StepConfig, partial: Tensor, words: Optional[Tensor], bad: Optional[Tensor],
                 keys: Optional[Tensor], blocks: dict[str, int]) -> None:
    """The step kernel of the group's code of M (:mod:`.sign`, :mod:`.flag`, :mod:`.none`). ``words``: the bit
    scratch (None: every row is whole sign bytes); ``bad``: the NaN/inf counter (None: they are not zeroed);
    ``keys``: the bf16 rounding keys (None: to nearest)."""
    grid = (group.item_tensor.numel(),)
    options = dict(W_DTYPE=_TL_DTYPES[group.dtype], VECTOR=group.vector and tables.VECTOR_HINTS, SHARD=group.shard,
                   **blocks, **(dict(maxnreg=tables.MAX_REGISTERS) if tables.MAX_REGISTERS else {}))
    head = (group.meta, group.item_tensor, partial)
    if not group.has_m:
        no_m_step_kernel[grid](*head, bad, keys, cfg.lr, cfg.beta2, cfg.eps, *cfg.folded(), **options)
    else:
        kernel = flag_step_kernel if group.flag else sign_step_kernel
        kernel[grid](*head, words, bad, keys, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, *cfg.folded(),
                     NATURAL=group.natural, **options)


def _run_levels(group: _Group, cfg: StepConfig, bad: Tensor, partial: Tensor, salts: Optional[Tensor],
                keys: Optional[Tensor]) -> None:
    """The block-levels code's launches (:mod:`.levels`): V's partial sums from the old factors, then the
    step over M's blocks (which still reads them), then the finish kernel's V factors (raw sums for a
    shard)."""
    gsign, shrink, l2 = cfg.folded()
    assert cfg.beta1 is not None, "the levels code is a code of M: beta=None gives MomentumCode.NO_M"
    dtype = _TL_DTYPES[group.dtype]
    v_sums_kernel[(group.item_tensor.numel(),)](
        group.meta, group.item_tensor, partial, cfg.beta2, 1.0 - cfg.beta2, gsign, shrink, l2, W_DTYPE=dtype,
        ZERO_NONFINITE=cfg.zero_nonfinite, BR=tables.BLOCK_ROWS, BC=tables.BLOCK_COLS, BAND=tables.BAND_ROWS,
        num_warps=tables.WARPS, **LAUNCH_OPTIONS,
    )
    levels_step_kernel[(group.sums_items.numel(),)](
        group.meta, group.sums_items, salts, bad if cfg.zero_nonfinite else None, keys, cfg.lr, cfg.beta1,
        1.0 - cfg.beta1, cfg.beta2, 1.0 - cfg.beta2, cfg.eps, gsign, shrink, l2, W_DTYPE=dtype, num_warps=STEP_WARPS,
        **LAUNCH_OPTIONS,
    )
    finish_kernel[(group.tensors, 1)](group.meta, partial, bad, COPIERS=1, NORMALIZE=group.normalize, FIRST=0,
                                      MOMENTS=1, TO_SCRATCH=False, BLOCK=256, KB=16, COPY_BLOCK=4096, FLAG=False,
                                      num_warps=8)


def triton_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> Optional[Tensor]:
    """The fused step of one tensor: same contract as :func:`smmf.functional.torch_step_`."""
    return triton_steps_([(param, grad, state, cfg)])



class _Triton:
    """The Triton backend (:class:`smmf.kernels.Backend`)."""

    name = "triton"
    steps_ = staticmethod(triton_steps_)

    @staticmethod
    def launch_of(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> tuple[str, str]:
        """The launches that step a whole tensor (:func:`triton_steps_`), and why."""
        if cfg.code is MomentumCode.LEVELS:
            return "levels launches", ("the levels code: V's sums, then a step over 16 blocks of M per program, "
                                       "shared by the tensors of its dtype and configuration")
        _, m = matrix_shape(real_view(param))
        natural = momentum_cols(state, m) != m
        launches = 5 if cfg.code is MomentumCode.FLAG else 3 if natural else 2
        return f"{launches} grouped launches", (f"{cfg.code.value} code{', natural shape' if natural else ''}: "
                                                f"{launches} launches shared by the tensors of its dtype, "
                                                "configuration and sign alignment")
    shard_step_ = staticmethod(triton_shard_step_)
    flag_shard_pass_ = staticmethod(triton_flag_shard_pass_)

    @staticmethod
    def updating_flag_pass(cfg: StepConfig) -> int:
        return 1  # the first pass is the momentum sums kernel, which only reads


BACKEND = _Triton()
