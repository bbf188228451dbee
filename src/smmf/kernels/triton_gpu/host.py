"""The host side of the Triton kernels: tensors grouped into launches, the table of each launch
built by field name, and the launches in order (:mod:`smmf.kernels.triton_gpu`'s docstring)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch
import triton.language as tl
from torch import Tensor

from ...functional import StepConfig
from ...state import (COL_M, COL_V, FLAG_M, LEVELS_M, ROW_M, ROW_V, SIGN_M, MomentumCode, matrix_shape, momentum_cols,
                      real_view)
from ..contract import FlagPass, StepItem
from .finish import finish_kernel, flag_finish_kernel
from .levels import launch_levels
from .step import momentum_sums_kernel, step_kernel
from . import table as tables  # tile shape read at each launch: benchmarks/gpu_tune.py sweeps it
from .table import META_COLUMNS, TABLE_FIELDS, layout


def _config_key(cfg: StepConfig, dtype: torch.dtype) -> tuple:
    return (dtype, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.decoupled_weight_decay,
            cfg.maximize, cfg.zero_nonfinite, cfg.stochastic_rounding and dtype == torch.bfloat16)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreted() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter, which executes no inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _vector(weight: Tensor, grad: Tensor, state: dict[str, Any], m: int, lo: int, hi: int) -> bool:
    """Whether the step kernel may take the elements lo .. hi of an n×m matrix 16 bytes at a time: every
    row segment starts and ends on a multiple of 8 elements, and the weight, the gradient and the column
    factors it reads start on 16 bytes (a param viewed at an odd offset of its storage does not)."""
    vectors = [weight, grad, state[COL_V]] + ([state[COL_M]] if COL_M in state else [])
    return m % 8 == 0 and lo % 8 == 0 and hi % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in vectors)


def triton_steps_(items: Sequence[StepItem]) -> Optional[Tensor]:
    """The fused step of many tensors: ``(param, grad, state, cfg)`` each, one launch per distinct
    (dtype, cfg, alignment) among them; under the levels code (``magnitude_bits=3``), the launches of
    :func:`.levels.launch_levels` per tensor. Returns a CUDA counter of NaN/inf gradient elements (a lower
    bound; not synchronized), or None when none of the configs zeroes them."""
    launches: dict[tuple, list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]]] = {}
    levels_items = []  # the levels code: kernels of its own per tensor (.levels), not the table's
    copies_back = []
    for param, grad, state, cfg in items:
        if real_view(param).numel() == 0:
            continue
        weight = real_view(param.detach())
        if not weight.is_contiguous():  # logical row-major order: strided params go through one copy
            copy = weight.contiguous()
            copies_back.append((weight, copy))
            weight = copy
        g = real_view(grad)
        if g.dtype != weight.dtype or not g.is_contiguous():
            g = g.to(weight.dtype).contiguous()
        if cfg.code is MomentumCode.LEVELS:
            levels_items.append((weight, g, state, cfg))
            continue
        # Without a first moment there are no sign bits, and every tensor takes the aligned code.
        n, m = matrix_shape(weight)
        aligned = cfg.beta1 is None or m % 8 == 0
        natural = momentum_cols(state, m) != m
        key = (*_config_key(cfg, weight.dtype), aligned, _vector(weight, g, state, m, 0, n * m), natural,
               cfg.code is MomentumCode.FLAG)
        launches.setdefault(key, []).append((weight, g, state, cfg))
    if not launches and not levels_items:
        return None
    bad = torch.zeros(1, dtype=torch.int32, device=items[0][0].device)
    for (dtype, *_, stochastic, aligned, vector, natural, flag), tensors in launches.items():
        spans = tuple((n, m, 0, n * m, momentum_cols(state, m), flag)
                      for (n, m), state in ((matrix_shape(w), st) for w, _, st, _ in tensors))
        _launch(tensors, spans, bad, dtype=dtype, stochastic=stochastic, aligned=aligned, vector=vector,
                normalize=True, natural=natural, flag=flag)
    for weight, g, state, cfg in levels_items:
        launch_levels(weight, g, state, cfg, bad)
    for weight, copy in copies_back:
        weight.copy_(copy)
    return bad if any(cfg.zero_nonfinite for _, _, _, cfg in items) else None


def triton_shard_step_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                       start: int) -> Optional[Tensor]:
    """The fused pass over an FSDP2 shard, the contract of
    :func:`smmf.kernels.numba_cpu.numba_shard_step_`: ``weight`` (contiguous; fp32, bf16 or fp16)
    and ``grad`` hold the elements ``start ..`` of the parameter's row-major flattening, ``state``
    the rank-local state (whole factor vectors, this shard's sign bits). Updates the weight and
    sign bits; leaves this shard's raw row and column sums in the four factor vectors (0 for rows
    it lacks), for the caller to add up across shards and normalize. The paper's code and the natural
    shape (the magnitude flag: :func:`triton_flag_shard_pass_`), and the levels code's shard of whole rows
    of M (:func:`.levels.launch_levels`). Returns what :func:`triton_steps_` returns."""
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
    if cfg.code is MomentumCode.LEVELS:  # the shard's own rows of M: its own code, V's raw sums
        launch_levels(weight, grad, state, cfg, bad, start, whole=False)
    elif weight.numel():
        aligned = cfg.beta1 is None or (m % 8 == 0 and start % 8 == 0)
        m_cols = momentum_cols(state, m)
        flag = flag_pass is not None
        end = start + weight.numel()
        _launch([(weight, grad, state, cfg)], ((n, m, start, end, m_cols, flag),), bad,
                dtype=weight.dtype, stochastic=cfg.stochastic_rounding and weight.dtype == torch.bfloat16,
                aligned=aligned, vector=_vector(weight, grad, state, m, start, end), normalize=False,
                natural=m_cols != m, flag=flag, flag_pass=flag_pass)
    elif flag_pass is None or flag_pass.number == 1:  # nothing held: no sums to contribute
        for key in (ROW_V, COL_V) if flag_pass else (ROW_V, COL_V, ROW_M, COL_M):
            if key in state:
                state[key].zero_()
        if flag_pass:
            flag_pass.level_sums.zero_()
    else:
        flag_pass.new_row_m.zero_()
        flag_pass.new_col_m.zero_()
    return bad if cfg.zero_nonfinite and (flag_pass is None or flag_pass.number == 1) else None


def _launch(
    tensors: list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]],
    spans: tuple[tuple[int, int, int, int, int, bool], ...],
    bad: Tensor,
    dtype: torch.dtype,
    stochastic: bool,
    aligned: bool,
    vector: bool,
    normalize: bool,
    natural: bool,
    flag: bool,
    flag_pass: Optional[FlagPass] = None,
) -> None:
    """The launches of one group of tensors (module docstring). ``flag_pass``: one FSDP2 shard under the
    magnitude flag, one of its two passes (:func:`triton_flag_shard_pass_`)."""
    cfg = tensors[0][3]
    has_m = cfg.beta1 is not None
    device = tensors[0][0].device
    geometry, item_tensor, sums_items, partial_numel, words_numel = layout(spans, has_m, device, tables.BLOCK_COLS,
                                                                           tables.BAND_ROWS)
    table = []
    for (weight, g, state, _), geo in zip(tensors, geometry):
        row_v, col_v = state[ROW_V].data_ptr(), state[COL_V].data_ptr()
        if has_m:
            signs, row_m, col_m = state[SIGN_M].data_ptr(), state[ROW_M].data_ptr(), state[COL_M].data_ptr()
        else:
            signs, row_m, col_m = 0, row_v, col_v
        flags, levels = (state[FLAG_M].data_ptr(), state[LEVELS_M].data_ptr()) if flag else (0, 0)
        row = dict(geo, w=weight.data_ptr(), g=g.data_ptr(), signs=signs, row_m=row_m, col_m=col_m, row_v=row_v,
                   col_v=col_v, flags=flags, levels=levels)
        table += [row[field] for field in TABLE_FIELDS]
    # Pinned, then an async copy: no stream sync, and the caching host allocator keeps the buffer
    # until the copy is done.
    assert len(table) == len(tensors) * META_COLUMNS.value, "the table's rows and the kernels' META_COLUMNS disagree"
    meta = torch.tensor(table, dtype=torch.int64)
    meta = meta.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else meta
    partial = torch.empty(partial_numel, dtype=torch.float32, device=device)
    words = torch.zeros(max(words_numel, 1), dtype=torch.int32, device=device)
    blocks = dict(BR=tables.BLOCK_ROWS, BC=tables.BLOCK_COLS, BAND=tables.BAND_ROWS, num_warps=tables.WARPS)
    cap = dict(maxnreg=tables.MAX_REGISTERS) if tables.MAX_REGISTERS else {}  # the step kernel's
    finish = dict(BLOCK=256, KB=16, COPY_BLOCK=4096, FLAG=flag, num_warps=8)
    shard_pass = None if flag_pass is None else flag_pass.number
    if (natural or flag) and shard_pass != 1:  # |M|'s sums in M's own view, before the step kernel's writes
        momentum_sums_kernel[(sums_items.numel(),)](
            meta, sums_items, partial, cfg.beta1, *cfg.folded(), W_DTYPE=_TL_DTYPES[dtype],
            ZERO_BAD=cfg.zero_nonfinite, FLAG=flag, **blocks,
        )
    if flag:  # the new factors of |M| in the partial buffer: the step kernel encodes against them
        new_m, m_rows, m_cols = (geometry[0][key] for key in ("new_m_at", "m_rows", "m_cols"))  # (one tensor when a shard)
        if flag_pass is not None and shard_pass == 1:  # a shard's: the caller's, from every shard's sums
            partial[new_m : new_m + m_rows].copy_(flag_pass.new_row_m)
            partial[new_m + m_rows : new_m + m_rows + m_cols].copy_(flag_pass.new_col_m)
        else:
            finish_kernel[(len(tensors), 1)](meta, partial, words, COPIERS=1, NORMALIZE=normalize, FIRST=1,
                                              MOMENTS=1, TO_SCRATCH=True, **finish)
        if flag_pass is not None and shard_pass == 0:  # this shard's raw sums, for the caller to add up
            flag_pass.new_row_m.copy_(partial[new_m : new_m + m_rows])
            flag_pass.new_col_m.copy_(partial[new_m + m_rows : new_m + m_rows + m_cols])
            return
    step_kernel[(item_tensor.numel(),)](
        meta, item_tensor, partial, words, bad,
        cfg.lr, cfg.beta1 if has_m else 0.0, cfg.beta2, cfg.eps,
        *cfg.folded(),
        int(torch.randint(0, 2**30, ()).item()) if stochastic else 0,
        W_DTYPE=_TL_DTYPES[dtype], HAS_M=has_m, ALIGNED=aligned, VECTOR=vector and tables.VECTOR_HINTS,
        SHARD=any(lo != 0 or hi != n * m for n, m, lo, hi, *_ in spans), STAGES=tables.PIPELINE_STAGES,
        PREFETCH=tables.PREFETCH, ASM_STORES=tables.ASM_STORES and not _interpreted(),
        STOCHASTIC=stochastic, ZERO_BAD=cfg.zero_nonfinite, NATURAL=natural, FLAG=flag, **blocks, **cap,
    )
    copiers = 0 if aligned else tables.COPY_PROGRAMS
    moments = 2 if has_m and not flag else 1  # the flag's M is finished already
    finish_kernel[(len(tensors), moments + copiers)](
        meta, partial, words, COPIERS=max(copiers, 1), NORMALIZE=normalize, FIRST=0, MOMENTS=moments,
        TO_SCRATCH=False, **finish,
    )
    if flag_pass is not None:  # a shard's second pass: its work items' level sums, added in a fixed order
        items, at = geometry[0]["tiles"] * geometry[0]["bands"], geometry[0]["level_sums_at"]
        flag_pass.level_sums.copy_(partial[at : at + 4 * items].view(items, 4).sum(0))
    elif flag:
        flag_finish_kernel[(len(tensors),)](meta, partial, BLOCK=256, num_warps=4)


def triton_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> Optional[Tensor]:
    """The fused step of one tensor: same contract as :func:`smmf.functional.torch_step_`."""
    return triton_steps_([(param, grad, state, cfg)])



class _Triton:
    """The Triton backend (:class:`smmf.kernels.Backend`)."""

    name = "triton"
    steps_ = staticmethod(triton_steps_)
    shard_step_ = staticmethod(triton_shard_step_)
    flag_shard_pass_ = staticmethod(triton_flag_shard_pass_)

    @staticmethod
    def updating_flag_pass(cfg: StepConfig) -> int:
        return 1  # the first pass is the momentum sums kernel, which only reads


BACKEND = _Triton()
