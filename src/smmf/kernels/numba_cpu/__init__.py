"""Fused single-pass SMMF step on CPU (numba): the numba backend of :class:`smmf.kernels.Backend`.

One pass over the n×m view of a tensor, parallel over blocks of rows: each element's gradient,
weight and sign bit are read once, M̂ and V̂ are rebuilt from the factors on the fly, the weight
and the sign bit are written in place, and the row / column sums of |M| and V (the next factors)
are accumulated as the pass goes. Nothing of size N is allocated; each block keeps two column
accumulators of length m. Blocks start on a byte boundary of the packed signs, so no two threads
write the same byte. With the magnitude flag (``magnitude_bits=1``) a step takes two passes: the
flag compares |M| with the *new* factors, which need every row first.

Read top to bottom: :mod:`.structs` (the kernels' named arguments), :mod:`.elements` (the math of
one element and of a run of them), :mod:`.access` (bf16 rows, packed bits, prefetches), :mod:`.rows` (a
block of rows walked in tiles, the factors finished from the blocks' sums), a module per code of M with its pass,
its step and its kernels (:mod:`.sign`, the paper's code and its natural shape; :mod:`.none`; :mod:`.flag`;
:mod:`.levels`), :mod:`.launches` (many small and mid-sized tensors in one launch), :mod:`.host` (torch tensors in,
which launch), :mod:`.cache` (compiled once per machine: a fresh process loads the kernels instead of spending
seconds of LLVM and ~100 MiB of RSS on its first step).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...functional import StepConfig
from ...state import COL_V, ROW_V, MomentumCode
from ..contract import FlagPass
from .host import (LAUNCHES, follow_torch_threads, launch, launch_levels, launch_of, levels_piece_ends,
                   levels_piece_pass, steps_, updating_flag_pass)

__all__ = ["BACKEND", "numba_flag_shard_pass_", "numba_shard_step_", "numba_step_", "numba_steps_",
           "updating_flag_pass"]

numba_steps_ = steps_


def numba_step_(param: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig) -> int:
    """The fused step of one tensor: same contract as :func:`smmf.functional.torch_step_`."""
    return steps_([(param, grad, state, cfg)])


def numba_shard_step_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int) -> int:
    """The fused pass over an FSDP2 shard (:meth:`smmf.kernels.Backend.shard_step_`). Returns the
    NaN/inf gradient elements met."""
    follow_torch_threads()
    if cfg.code is MomentumCode.LEVELS:
        return launch_levels(weight, grad, state, cfg, start, whole=False)
    rows, cols = state[ROW_V].numel(), state[COL_V].numel()
    return launch(weight, grad, state, cfg, rows, cols, start, start + weight.numel())


def numba_flag_shard_pass_(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                           flag_pass: FlagPass) -> int:
    """One of the magnitude flag's two passes over an FSDP2 shard
    (:meth:`smmf.kernels.Backend.flag_shard_pass_`). Returns the NaN/inf gradient elements the
    updating pass met (0 from the other)."""
    follow_torch_threads()
    rows, cols = state[ROW_V].numel(), state[COL_V].numel()
    return launch(weight, grad, state, cfg, rows, cols, start, start + weight.numel(), flag_pass)


class _Numba:
    """The numba backend (:class:`smmf.kernels.Backend`, and :class:`smmf.kernels.contract.LevelsPieces`)."""

    name = "numba"
    steps_ = staticmethod(numba_steps_)
    shard_step_ = staticmethod(numba_shard_step_)
    flag_shard_pass_ = staticmethod(numba_flag_shard_pass_)
    updating_flag_pass = staticmethod(updating_flag_pass)

    @staticmethod
    def launch_of(param: Tensor, state: dict[str, Any], cfg: StepConfig) -> tuple[str, str]:
        """The launch that steps a whole tensor, and the rule that sends it there."""
        name = launch_of(param, state, cfg)
        return name, LAUNCHES[name]

    levels_piece_pass_ = staticmethod(levels_piece_pass)  # serial: a piece is one rank's
    levels_piece_ends_ = staticmethod(levels_piece_ends)


BACKEND = _Numba()
