"""The host side of the numba kernels: torch tensors to the kernels' named arguments, block layout,
and which launch a tensor takes."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Optional, Sequence

import numba
import numpy as np
import torch
from torch import Tensor

from ...functional import StepConfig
from ...matrix import factor_sum_cap, square_matricize_shape
from ...levels import BLOCK, levels_rows_cols, levels_shape
from ...state import (CODES_M, COL_M, COL_V, ROW_M, ROW_V, SCALES_M, MomentumCode, matrix_shape, momentum_cols, real_view)
from ...codes import SCHEMA
from ..contract import FlagPass, LevelsEnds, StepItem
from . import flag, no_m, sign
from .launches import (ADDRESS, FLAG_ADDRESS, LEVELS_ADDRESS, many_blocks_kernel, many_flag_kernel, many_kernel,
                       many_levels_kernel)
from .levels import LEVELS_KERNELS, level_table, levels_piece_ends_kernel, levels_piece_kernel, touched_v_rows
from .rows import SCRATCH_PAD, m_rows_touched
from .structs import FlagPasses, Geometry, LevelsGeometry, Options, PieceGeometry, Scalars

# Each code's kernels over a tensor (or a shard of one; the levels code's: LEVELS_KERNELS), by whether they run in
# parallel. Each takes the weight, the gradient and its state's arrays in the schema's order (smmf.schema.SCHEMA).
KERNELS = {MomentumCode.SIGN: {True: sign.kernel_parallel, False: sign.kernel_serial},
           MomentumCode.NO_M: {True: no_m.kernel_parallel, False: no_m.kernel_serial},
           MomentumCode.FLAG: {True: flag.kernel_parallel, False: flag.kernel_serial}}

# numba's workqueue threading layer (its fallback where OpenMP and TBB are missing) aborts the
# process when two threads enter parallel regions at once: parallel launches take turns. Each
# already uses every core, so with OpenMP or TBB this costs nothing.
PARALLEL_LAUNCH = threading.Lock()

# Small tensors run on one thread: waking the thread pool costs more than their whole step.
PARALLEL_MIN_NUMEL = 1 << 16


_POOL_STARTED = False


def follow_torch_threads() -> int:
    """Set numba's thread count to torch's (``torch.set_num_threads``, ``OMP_NUM_THREADS``; at most numba's
    pool, ``NUMBA_NUM_THREADS``), read at every step, so that one setting governs the whole training step: a
    torchrun rank with ``OMP_NUM_THREADS=1`` steps on one thread, not on every core. Starting numba's OpenMP
    pool (its first parallel call) sets the OpenMP runtime's count, which torch shares, to the pool's size (the
    core count by default): the caller's is put back. Returns the count."""
    global _POOL_STARTED
    threads = torch.get_num_threads()
    if not _POOL_STARTED:
        with PARALLEL_LAUNCH:
            numba.get_num_threads()  # starts the pool
            torch.set_num_threads(threads)
            _POOL_STARTED = True
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:  # numba's count is per calling thread
        numba.set_num_threads(threads)
    return threads


def block_layout(rows: int, cols: int) -> tuple[int, int]:
    """Rows per block (a multiple that keeps blocks byte-aligned in the sign bits) and blocks, at the
    thread count of now."""
    return _block_layout(rows, cols, numba.get_num_threads())


def _block_layout(rows: int, cols: int, threads: int) -> tuple[int, int]:
    parallel = rows * cols >= PARALLEL_MIN_NUMEL
    return _blocks_of(rows, cols, max(1, 4 * threads) if parallel else 1)


@functools.lru_cache(maxsize=4096)  # asked per tensor at every step
def _blocks_of(rows: int, cols: int, target_blocks: int) -> tuple[int, int]:
    align = 8 // math.gcd(cols, 8)
    rows_per_block = max(align, -(-rows // target_blocks))
    rows_per_block = -(-rows_per_block // align) * align
    return rows_per_block, -(-rows // rows_per_block)


def _as_numpy(t: Tensor) -> np.ndarray:
    """``t`` (contiguous) flat, bf16 as its int16 bit patterns (numpy has no bf16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1)  # numpy's reshape: half the cost of torch's here, paid per launch


def scalars(cfg: StepConfig, numel: int, dtype: torch.dtype) -> Scalars:
    """The step's :class:`Scalars` in the work dtype ``dtype`` (np.float32, or np.float64 for fp64)."""
    return Scalars._make((*_group_scalars(_group_of(cfg), dtype), _work_scalar(dtype)(factor_sum_cap(numel, dtype))))


def _group_of(cfg: StepConfig) -> StepConfig:
    """``cfg`` without the levels' salt and the rounding key, which each param of a group has its own of: the key
    of the group's numbers."""
    return cfg if cfg.levels_salt is None and cfg.rounding_key is None else cfg.for_param(None, None)


def _work_scalar(dtype: torch.dtype) -> type:
    return np.float64 if dtype == torch.float64 else np.float32


@functools.lru_cache(maxsize=64)
def _group_numbers(cfg: StepConfig, dtype: torch.dtype) -> tuple[float, ...]:
    """:meth:`StepConfig.numbers`: the same for every tensor of a group at a step, so made once (per launch
    they cost as much as the rest of the host side)."""
    return cfg.numbers(dtype)


def options(cfg: StepConfig, dtype: torch.dtype, whole: bool, rounds: bool = True) -> Options:
    """The step's :class:`Options` for weights of ``dtype``; ``rounds``: this call writes the weights (a flag
    shard's other pass only reads them)."""
    return Options(stochastic_rounding=cfg.stochastic_rounding, zero_nonfinite=cfg.zero_nonfinite, whole=whole,
                   rounding_key=(cfg.rounding_key_for(dtype) or 0) if rounds else 0)


@functools.lru_cache(maxsize=64)
def _group_scalars(cfg: StepConfig, dtype: torch.dtype) -> tuple[Any, ...]:
    """:func:`_group_numbers` in the work dtype."""
    return tuple(map(_work_scalar(dtype), _group_numbers(cfg, dtype)))


def updating_flag_pass(cfg: StepConfig) -> int:
    """0 without L2 decay; 1 with it (M needs the weights before the step, so the first pass only reads)."""
    return 0 if cfg.folded()[2] == 0 else 1


def launch(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, rows: int, cols: int,
           lo: int, hi: int, flag_pass: Optional[FlagPass] = None) -> int:
    """Run the kernel over the elements ``lo .. hi`` of the rows × cols matrix that ``weight``
    (contiguous) holds; the factors are normalized when that is the whole matrix. Under the
    magnitude flag a shard takes one pass per call (``flag_pass``)."""
    if grad.dtype != weight.dtype:
        grad = grad.to(weight.dtype)
    grad = grad.contiguous()
    whole = lo == 0 and hi == rows * cols
    row0, row_end = lo // cols, -(-hi // cols)
    rows_per_block, blocks = block_layout(row_end - row0, cols)
    if (row0 * cols - lo) % 8:  # a shard starting mid-byte of a row: one block, so no two threads share a byte
        rows_per_block, blocks = row_end - row0, 1
    dtype = state[ROW_V].dtype
    scalar = _work_scalar(dtype)
    m_cols = momentum_cols(state, cols)
    geo = Geometry(n=rows, m=cols, m_cols=m_cols, row0=row0, rows_per_block=rows_per_block, lo=lo, hi=hi)
    writes = flag_pass is None or flag_pass.number == updating_flag_pass(cfg)  # a flag shard's other pass reads
    opts = options(cfg, weight.dtype, whole, rounds=writes)
    parallel = hi - lo >= PARALLEL_MIN_NUMEL
    state_arrays = tuple(state[field.key].numpy() for field in SCHEMA[cfg.code])
    touched = _m_rows_touched(rows_per_block, cols, m_cols)
    bad_counts = np.zeros(blocks, dtype=np.int64)
    args: tuple[Any, ...]
    if cfg.code is MomentumCode.NO_M:
        args = (np.empty((blocks, cols), dtype=scalar), bad_counts, geo, opts)
    elif cfg.code is MomentumCode.SIGN:  # |M|'s and V's column sums and M's row sums, per block
        args = (np.empty((blocks, m_cols), dtype=scalar), np.empty((blocks, cols), dtype=scalar),
                np.empty((blocks, touched), dtype=scalar), bad_counts, geo, opts)
    else:
        m_rows = state[ROW_M].numel()
        new_m = np.empty(m_rows + m_cols, dtype=scalar)  # the new factors of |M|: rows, then columns
        if flag_pass is None:
            assert whole, "a shard under the magnitude flag takes numba_flag_shard_pass_"
            passes = FlagPasses(0, 2)
        else:
            passes = FlagPasses(flag_pass.number, flag_pass.number + 1)
            if flag_pass.number == 1:  # the caller's new factors, from every shard's sums
                new_m[:m_rows], new_m[m_rows:] = flag_pass.new_row_m.numpy(), flag_pass.new_col_m.numpy()
        *_, fits_at, width = _flag_scratch_layout(m_cols, cols, touched)
        scratch: np.ndarray = np.empty((blocks, width), dtype=scalar)
        args = (new_m, scratch, bad_counts, geo, passes, opts)
    kernel = KERNELS[cfg.code][parallel]
    with PARALLEL_LAUNCH if parallel else contextlib.nullcontext():
        kernel(_as_numpy(weight), _as_numpy(grad), *state_arrays, *args, scalars(cfg, rows * cols, dtype))
    if cfg.code is MomentumCode.FLAG and flag_pass is not None:
        if flag_pass.number == 0:  # this shard's raw sums of |M|, for the caller to add up
            flag_pass.new_row_m.copy_(torch.from_numpy(new_m[:m_rows]))
            flag_pass.new_col_m.copy_(torch.from_numpy(new_m[m_rows:]))
        else:
            flag_pass.gain_sums.copy_(torch.from_numpy(scratch[:, fits_at : fits_at + 4].sum(axis=0)))
    return sum(bad_counts.tolist()) if cfg.zero_nonfinite else 0


def launch_levels(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, lo: int = 0,
                  whole: bool = True) -> int:
    """The step of a tensor (``weight`` contiguous) under the levels code (``magnitude_bits=3``): a whole
    one, or an FSDP2 shard's own rows of M, elements ``lo ..`` of the param, leaving V's raw sums
    (``whole`` False)."""
    grad = grad.to(weight.dtype).contiguous()
    n, m = state[ROW_V].numel(), state[COL_V].numel()
    numel = real_view(weight).numel()
    rows, cols = levels_rows_cols(state[CODES_M], numel)
    parallel = numel >= PARALLEL_MIN_NUMEL
    rows_per_block = max(1, -(-rows // (4 * numba.get_num_threads()))) if parallel else max(rows, 1)
    blocks = -(-rows // rows_per_block)
    dtype = state[ROW_V].dtype
    scalar = _work_scalar(dtype)
    geo = LevelsGeometry(n=n, m=m, rows=rows, cols=cols, lo=lo, rows_per_block=rows_per_block,
                         dither=cfg.levels_salt is not None, salt=cfg.levels_salt or 0)
    opts = options(cfg, weight.dtype, whole)
    sc = scalars(cfg, n * m, dtype)
    bad_counts = np.zeros(blocks, dtype=np.int64)
    args = (_as_numpy(weight), _as_numpy(grad), state[CODES_M].numpy(), state[SCALES_M].view(torch.int16).numpy(),
            level_table(scalar), state[ROW_V].numpy(), state[COL_V].numpy(), np.empty((blocks, m), dtype=scalar),
            np.empty((blocks, touched_v_rows(rows_per_block, cols, m)), dtype=scalar), bad_counts, geo, opts, sc)
    if parallel:
        with PARALLEL_LAUNCH:
            LEVELS_KERNELS[True](*args)
    else:
        LEVELS_KERNELS[False](*args)
    return sum(bad_counts.tolist()) if cfg.zero_nonfinite else 0


def _piece_geometry(state: dict[str, Any], cfg: StepConfig, shape: tuple[int, ...], start: int,
                    numel: int) -> PieceGeometry:
    _, cols = levels_shape(shape, math.prod(shape))
    return PieceGeometry(n=state[ROW_V].numel(), m=state[COL_V].numel(), cols=cols, lo=start, hi=start + numel,
                         dither=cfg.levels_salt is not None, salt=cfg.levels_salt or 0)


def levels_piece_pass(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, shape: tuple[int, ...],
                      start: int) -> tuple[int, LevelsEnds]:
    """The levels code's step of a piece (``weight`` contiguous: elements ``start ..`` of a param of ``shape``)
    that may cut its blocks (:meth:`smmf.kernels.contract.LevelsPieces.levels_piece_pass_`)."""
    grad = grad.to(weight.dtype).contiguous()
    geo = _piece_geometry(state, cfg, shape, start, weight.numel())
    dtype = state[ROW_V].dtype
    scalar = _work_scalar(dtype)
    ends = LevelsEnds(torch.zeros(2, BLOCK, dtype=dtype), torch.zeros(2, dtype=dtype))
    bad = np.zeros(1, dtype=np.int64)
    opts = options(cfg, weight.dtype, False)
    v_rows = (geo.hi - 1) // geo.m - geo.lo // geo.m + 1
    levels_piece_kernel(_as_numpy(weight), _as_numpy(grad), state[CODES_M].numpy(),
                        state[SCALES_M].view(torch.int16).numpy(), level_table(scalar), state[ROW_V].numpy(),
                        state[COL_V].numpy(), np.empty(geo.m, dtype=scalar), np.empty(v_rows, dtype=scalar),
                        ends.m.numpy(), ends.tops.numpy(), bad, geo, opts, scalars(cfg, geo.n * geo.m, dtype))
    return (int(bad[0]) if cfg.zero_nonfinite else 0), ends


def levels_piece_ends(state: dict[str, Any], cfg: StepConfig, shape: tuple[int, ...], start: int, numel: int,
                      ends: LevelsEnds, tops: Tensor) -> None:
    """The codes of a piece's first and last blocks (:meth:`smmf.kernels.contract.LevelsPieces.levels_piece_ends_`)."""
    geo = _piece_geometry(state, cfg, shape, start, numel)
    levels_piece_ends_kernel(state[CODES_M].numpy(), state[SCALES_M].view(torch.int16).numpy(),
                             level_table(_work_scalar(state[ROW_V].dtype)), ends.m.numpy(),
                             tops.to(state[ROW_V].dtype).contiguous().numpy(), geo)


def own_launch(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> int:
    """A tensor's step in a launch of its own (those the shared launches do not take: bf16, fp64, strided, and
    the larger ones of the magnitude flag and the levels code)."""
    rows, cols = matrix_shape(param)
    if rows == 0:
        return 0
    # The kernel walks the logical row-major order: strided tensors go through one copy.
    weight = param.detach() if param.is_contiguous() else param.detach().contiguous()
    if cfg.code is MomentumCode.LEVELS:
        bad = launch_levels(weight, grad, state, cfg)
    else:
        bad = launch(weight, grad, state, cfg, rows, cols, 0, rows * cols)
    if weight.data_ptr() != param.data_ptr():
        param.detach().copy_(weight)
    return bad


def _plain_fp32(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Contiguous fp32 tensors with fp32 state, of the paper's code of M or its natural shape (or none):
    the ones :func:`many_kernel` and :func:`many_blocks_kernel` take."""
    return _fp32_contiguous(param, state) and cfg.code not in (MomentumCode.FLAG, MomentumCode.LEVELS)


def _fp32_contiguous(param: Tensor, state: dict[str, Any]) -> bool:
    return param.dtype == torch.float32 and param.is_contiguous() and state[ROW_V].dtype == torch.float32


def takes_many(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Small plain fp32 tensors: their step is mostly per-launch overhead, so they share one launch
    (:func:`many_kernel`), one tensor per thread at a time."""
    return 0 < param.numel() < PARALLEL_MIN_NUMEL and _plain_fp32(param, state, cfg)


def _small_fp32(param: Tensor, state: dict[str, Any], cfg: StepConfig, code: MomentumCode) -> bool:
    """Small contiguous fp32 tensors of ``code`` with fp32 state."""
    return cfg.code is code and 0 < param.numel() < PARALLEL_MIN_NUMEL and _fp32_contiguous(param, state)


def takes_many_levels(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Small fp32 tensors of the levels code: they share one launch (:func:`many_levels_kernel`), one tensor per
    thread at a time."""
    return _small_fp32(param, state, cfg, MomentumCode.LEVELS)


def takes_many_flag(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Small fp32 tensors of the magnitude flag: they share one launch (:func:`many_flag_kernel`)."""
    return _small_fp32(param, state, cfg, MomentumCode.FLAG)


def _address_row(param: Tensor, grad: Tensor, state: dict[str, Any], address: dict[str, int]) -> list[int]:
    """A row of a shared launch's ``addresses`` table: the data addresses of the weight, the gradient and the state
    fields (``address``: where each goes; the fields the state lacks stay 0)."""
    row = [param.data_ptr(), grad.data_ptr(), *[0] * len(address)]
    for key, at in address.items():
        if key in state:
            row[at] = state[key].data_ptr()
    return row


def _zeroed(counts: Sequence[int], configs: Sequence[StepConfig]) -> int:
    """The NaN/inf elements met by the tensors that zero them, of ``counts`` (one per tensor)."""
    return sum(int(count) for count, cfg in zip(counts, configs) if cfg.zero_nonfinite)


def _many_launch(kernel: Any, items: Sequence[StepItem], address: dict[str, int], sizes: Sequence[tuple[int, ...]],
                 flags: Sequence[tuple[int, ...]], *extra: Any) -> int:
    """One launch of ``kernel`` that steps each of ``items`` (small fp32 tensors) by its code's serial kernel: its
    tables (the addresses, :class:`Scalars`, ``sizes``, ``flags``, then ``extra`` arrays); returns the NaN/inf
    elements met by the tensors that zero them."""
    grads = [grad.contiguous() for _, grad, _, _ in items]  # alive until the launch is done
    addresses = [_address_row(param, grad, state, address) for (param, _, state, _), grad in zip(items, grads)]
    numbers = [(*_group_scalars(_group_of(cfg), torch.float32), _fp32_geometry(param.numel())[2])
               for param, _, _, cfg in items]
    return _run_shared(kernel, np.array(addresses, dtype=np.int64), sizes, np.array(numbers, dtype=np.float32),
                       np.array(flags, dtype=np.int64), [cfg for *_, cfg in items], *extra)


def _run_shared(kernel: Any, addresses: np.ndarray, sizes: Sequence[tuple[int, ...]], scalars: np.ndarray,
                flags: np.ndarray, configs: Sequence[StepConfig], *extra: Any) -> int:
    """One launch of a kernel that steps a tensor per row of its tables (:func:`many_kernel` and kin); returns
    the NaN/inf elements met by the tensors that zero them."""
    bad_counts = np.zeros(len(configs), dtype=np.int64)
    with PARALLEL_LAUNCH:
        kernel(addresses, np.array(sizes, dtype=np.int64), scalars, flags, *extra, bad_counts)
    return _zeroed(bad_counts.tolist(), configs) if bad_counts.any() else 0


def _many_levels_launch(items: Sequence[StepItem]) -> int:
    """The steps of :func:`takes_many_levels`' tensors in one launch."""
    sizes = [(*_fp32_geometry(param.numel())[:2], *levels_rows_cols(state[CODES_M], param.numel()))
             for param, _, state, _ in items]
    flags = [(cfg.zero_nonfinite, cfg.levels_salt is not None, cfg.levels_salt or 0) for *_, cfg in items]
    return _many_launch(many_levels_kernel, items, LEVELS_ADDRESS, sizes, flags, level_table(np.float32))


def _many_flag_launch(items: Sequence[StepItem]) -> int:
    """The steps of :func:`takes_many_flag`' tensors in one launch (as :func:`launch` steps each alone)."""
    sizes = []
    for param, _, state, _ in items:
        rows, cols, _ = _fp32_geometry(param.numel())
        m_cols = momentum_cols(state, cols)
        rows_per_block, _ = _block_layout(rows, cols, 1)
        width = _flag_scratch_layout(m_cols, cols, _m_rows_touched(rows_per_block, cols, m_cols))[3]
        sizes.append((rows, cols, m_cols, rows_per_block, width))
    return _many_launch(many_flag_kernel, items, FLAG_ADDRESS, sizes, [(cfg.zero_nonfinite,) for *_, cfg in items])


# Plain fp32 tensors from PARALLEL_MIN_NUMEL up to this many elements share the blocks launch. A larger one
# keeps a launch of its own: there the launch costs under 5% of its step, and its factors are finished while
# its sums are still in cache (the 52M set all in one launch stepped 2–4% slower than in its own launches).
BLOCKS_MAX_NUMEL = 1 << 20


def takes_blocks(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> bool:
    """Mid-sized plain fp32 tensors: one launch over all their blocks of rows (:func:`many_blocks_kernel`)."""
    return PARALLEL_MIN_NUMEL <= param.numel() < BLOCKS_MAX_NUMEL and _plain_fp32(param, state, cfg)


class _SharedTables:
    """The rows of a shared launch's tables (:func:`many_kernel`'s, :func:`many_blocks_kernel`'s), one
    tensor at a time: per tensor the data addresses of the weight, the gradient and the paper's code's state
    (:data:`~.launches.ADDRESS`; 0 for the arrays a code lacks); its :class:`Scalars`; (has_m, zero_nonfinite).
    A tensor's view and cap come from a cache by size, and a config's numbers and flags are made once per launch:
    per tensor and step the host reads its addresses and a few cached lookups (ResNet-50 has 151 tensors in these
    launches)."""

    def __init__(self) -> None:
        self.addresses: list[tuple[int, ...]] = []
        self.caps: list[float] = []
        self.configs: list[StepConfig] = []
        self.alive: list[Tensor] = []  # the contiguous gradients the addresses point to

    def add(self, param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> tuple[int, int, int]:
        """Add ``param``'s row; return its (rows, cols, M's cols)."""
        rows, cols, cap = _fp32_geometry(param.numel())
        grad = grad.contiguous()
        self.alive.append(grad)
        self.addresses.append(tuple(_address_row(param, grad, state, ADDRESS)))  # the paper's code's state
        self.caps.append(cap)
        self.configs.append(cfg)
        return rows, cols, state[COL_M].numel() if COL_M in state else cols

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The addresses, scalars and flags tables. The tensors of a param group share one config at a
        step: its numbers are made once, and broadcast when the launch has one config."""
        configs = self.configs
        scalars = np.empty((len(configs), len(Scalars._fields)), dtype=np.float32)
        flags = np.empty((len(configs), 2), dtype=np.int64)
        scalars[:, -1] = self.caps
        distinct = {id(cfg): cfg for cfg in configs}
        numbers = {key: _group_numbers(cfg, torch.float32) for key, cfg in distinct.items()}
        flag = {key: (cfg.beta1 is not None, cfg.zero_nonfinite) for key, cfg in distinct.items()}
        if len(distinct) == 1:
            (key,) = distinct
            scalars[:, :-1], flags[:] = numbers[key], flag[key]
        else:
            scalars[:, :-1] = [numbers[id(cfg)] for cfg in configs]
            flags[:] = [flag[id(cfg)] for cfg in configs]
        return np.array(self.addresses, dtype=np.int64), scalars, flags

    def bad(self, counts: Sequence[int]) -> int:
        """The NaN/inf elements met by the tensors that zero them, of ``counts`` (one per tensor)."""
        return _zeroed(counts, self.configs)


@functools.lru_cache(maxsize=65536)
def _fp32_geometry(numel: int) -> tuple[int, int, float]:
    """The rows × cols view of a real fp32 tensor of ``numel`` elements and its factor sum cap."""
    return (*square_matricize_shape(numel), factor_sum_cap(numel, torch.float32))


@functools.lru_cache(maxsize=256)  # one entry per set of shapes stepped together (each shape alone under
# the step inside backward)
def _work_parts(blocks_and_sizes: tuple[tuple[int, int], ...], parts: int) -> tuple[np.ndarray, np.ndarray]:
    """The (tensor, block) rows of :func:`many_blocks_kernel`'s work and where each of ``parts`` threads'
    part starts, for tensors of (blocks, elements per block): the k-th share of every tensor's blocks goes
    to part k, a tensor's blocks one after another (its column factors and sums stay in cache), and the
    parts are cut where the elements add up to an equal share."""
    items = sorted((b * parts // blocks, t, b, size) for t, (blocks, size) in enumerate(blocks_and_sizes)
                   for b in range(blocks))
    weights = np.cumsum([size for *_, size in items])
    cuts = np.searchsorted(weights, weights[-1] * np.arange(1, parts) / parts, side="right")
    work = np.array([(t, b) for _, t, b, _ in items], dtype=np.int64)
    return work, np.array([0, *cuts.tolist(), len(items)], dtype=np.int64)


_SCRATCH = np.empty(0, dtype=np.float32)


def _blocks_scratch(size: int) -> np.ndarray:
    """At least ``size`` floats of scratch for :func:`many_blocks_kernel`, kept from launch to launch (the
    blocks zero their sums first): fresh, a model's few MiB came from the OS at every step, page by page
    (the 52M set's step 1.04× the one-launch-per-tensor commit's before, 0.98× after, in one A/B each)."""
    global _SCRATCH
    if _SCRATCH.size < size:
        _SCRATCH = np.empty(size, dtype=np.float32)
    return _SCRATCH


@functools.lru_cache(maxsize=4096)
def _flag_scratch_layout(m_cols: int, m: int, touched: int) -> tuple[int, int, int, int]:
    """:func:`.flag.scratch_layout` for the host (as :func:`_m_rows_touched`)."""
    return flag.scratch_layout(m_cols, m, touched)


@functools.lru_cache(maxsize=4096)
def _m_rows_touched(rows_per_block: int, cols: int, m_cols: int) -> int:
    """:func:`m_rows_touched` for the host: numba's dispatch of the compiled one costs microseconds a call."""
    return m_rows_touched(rows_per_block, cols, m_cols)


def _blocks_launch(items: Sequence[StepItem]) -> int:
    """The steps of :func:`takes_blocks`' tensors in one launch."""
    tables, sizes, shape = _SharedTables(), [], []
    threads = numba.get_num_threads()
    start = first_block = 0
    for param, grad, state, cfg in items:
        rows, cols, m_cols = tables.add(param, grad, state, cfg)
        rows_per_block, blocks = _block_layout(rows, cols, threads)
        m_width, touched = (m_cols, _m_rows_touched(rows_per_block, cols, m_cols)) if cfg.beta1 is not None else (0, 0)
        v_start = start + blocks * m_width + SCRATCH_PAD  # the three sums, |M|'s columns from start
        rows_start = v_start + blocks * cols + SCRATCH_PAD
        sizes.append((rows, cols, m_cols, rows_per_block, blocks, start, v_start, rows_start, first_block))
        shape.append((blocks, rows_per_block * cols))
        start = rows_start + blocks * touched + SCRATCH_PAD
        first_block += blocks
    work, part_starts = _work_parts(tuple(shape), threads)
    addresses, scalars, flags = tables.arrays()
    bad_counts = np.zeros(first_block, dtype=np.int64)
    with PARALLEL_LAUNCH:  # which also keeps the scratch to one launch at a time
        many_blocks_kernel(addresses, np.array(sizes, dtype=np.int64), scalars, flags, work, part_starts,
                           _blocks_scratch(start), bad_counts)
    if not bad_counts.any():
        return 0
    return tables.bad([int(bad_counts[first:first + blocks].sum()) for *_, blocks, _, _, _, first in sizes])


# The launches a whole tensor's step may take (launch_of), each with the rule that sends a tensor there.
LAUNCHES = {
    "many_blocks_kernel": f"contiguous fp32, {PARALLEL_MIN_NUMEL} to {BLOCKS_MAX_NUMEL - 1} elements, the paper's "
                          "code, its natural shape or no first moment: one launch over every such tensor's blocks",
    "many_kernel": f"contiguous fp32, under {PARALLEL_MIN_NUMEL} elements, the paper's code, its natural shape or no "
                   "first moment: one launch for every such tensor, a tensor per thread",
    "many_levels_kernel": f"contiguous fp32, under {PARALLEL_MIN_NUMEL} elements, the levels code: one launch for "
                          "every such tensor, a tensor per thread",
    "many_flag_kernel": f"contiguous fp32, under {PARALLEL_MIN_NUMEL} elements, the magnitude flag: one launch for "
                        "every such tensor, a tensor per thread",
    "own launch": "a launch of its own (bf16, fp64, strided, large, or a large tensor of the flag or the levels "
                  f"code), parallel over blocks of rows from {PARALLEL_MIN_NUMEL} elements",
}


def launch_of(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> str:
    """Which of :data:`LAUNCHES` steps a whole tensor."""
    if takes_blocks(param, state, cfg):
        return "many_blocks_kernel"
    if takes_many(param, state, cfg):
        return "many_kernel"
    if takes_many_levels(param, state, cfg):
        return "many_levels_kernel"
    if takes_many_flag(param, state, cfg):
        return "many_flag_kernel"
    return "own launch"


def steps_(items: Sequence[StepItem]) -> int:
    """The steps of many tensors: the small plain fp32 ones in one launch (:func:`many_kernel`), the
    mid-sized ones in another (:func:`many_blocks_kernel`), the small fp32 ones of the levels code and of the
    magnitude flag in one each (:func:`many_levels_kernel`, :func:`many_flag_kernel`), each also when alone; the
    rest one by one (:func:`launch_of`)."""
    follow_torch_threads()
    bad = 0
    tables, sizes = _SharedTables(), []
    taken: dict[str, list[StepItem]] = {name: [] for name in LAUNCHES}
    for item in items:
        param, grad, state, cfg = item
        route = launch_of(param, state, cfg)
        if route == "many_kernel":
            sizes.append(tables.add(param, grad, state, cfg))
        else:
            taken[route].append(item)
    large, small_levels = taken["many_blocks_kernel"], taken["many_levels_kernel"]
    small_flag, own = taken["many_flag_kernel"], taken["own launch"]
    if large:
        bad += _blocks_launch(large)
    if small_levels:
        bad += _many_levels_launch(small_levels)
    if small_flag:
        bad += _many_flag_launch(small_flag)
    if sizes:
        addresses, scalars, flags = tables.arrays()
        bad += _run_shared(many_kernel, addresses, sizes, scalars, flags, tables.configs)
    # Last: each streams its tensor through the caches, which the host work above would then find cold.
    for param, grad, state, cfg in own:
        bad += own_launch(param, grad, state, cfg)
    return bad
