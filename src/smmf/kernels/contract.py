"""The contract between the fused kernels and their callers.

A fused backend (numba on CPU, Triton on CUDA) makes the step of :func:`smmf.functional.torch_step_`
in place, in one pass over each tensor: for many whole tensors at once (:meth:`Backend.steps_`), and
over an FSDP2 shard (:meth:`Backend.shard_step_`; the magnitude flag's two passes,
:meth:`Backend.flag_shard_pass_`), leaving raw factor sums for the caller to add up across ranks.
What a backend covers is declared beside it in :mod:`smmf.kernels` (:class:`Coverage`); which one
runs a param is decided in :mod:`smmf.dispatch` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from ..functional import Nonfinite, StepConfig
from ..state import MomentumCode, real_view

__all__ = ["Backend", "Coverage", "FlagPass", "LevelsEnds", "LevelsPieces", "StepItem"]

# One tensor's step: (param, grad, state, cfg); ``state['step']`` already advanced.
StepItem = tuple[Tensor, Tensor, dict[str, Any], StepConfig]


class FlagPass(NamedTuple):
    """One of the magnitude flag's two passes over a shard, and where it meets the caller's sums.

    Pass 0 leaves this shard's raw row and column sums of |M| in ``new_row_m``/``new_col_m``; pass 1
    encodes against the new factors the caller put there (sign and flag bits in place) and leaves the
    shard's four level sums (Σ_F |M|·R, Σ_F R², Σ_¬F |M|·R, Σ_¬F R²) in ``gain_sums``. One of the two
    passes also steps the weights (:meth:`Backend.updating_flag_pass`) and leaves V's raw sums in
    ``row_v``/``col_v``."""

    number: int  # 0 or 1
    new_row_m: Tensor
    new_col_m: Tensor
    gain_sums: Tensor


@dataclass(frozen=True)
class Coverage:
    """The params a fused backend takes: on ``device``, whose real view is one of ``dtypes``; complex
    ones (as their real view) where ``complex_params`` (``sharded_complex`` for FSDP2 shards); the
    codes of M in ``codes`` (factored ones: the dense state only the torch path takes)."""

    device: str
    dtypes: frozenset[torch.dtype]
    complex_params: bool
    sharded_complex: bool
    codes: frozenset[MomentumCode]

    def covers(self, param: Tensor, code: MomentumCode, sharded: bool) -> bool:
        if code not in self.codes or param.device.type != self.device:
            return False
        if param.is_complex() and not (self.sharded_complex if sharded else self.complex_params):
            return False
        return real_view(param).dtype in self.dtypes


class Backend(Protocol):
    """A fused backend. Every method updates in place and returns the NaN/inf gradient elements it
    met (:data:`smmf.functional.Nonfinite`)."""

    name: str

    def steps_(self, items: Sequence[StepItem]) -> Nonfinite:
        """The steps of many whole tensors, as few launches as the backend can make of them."""

    def shard_step_(self, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                    start: int) -> Nonfinite:
        """The pass over an FSDP2 shard: ``weight`` (contiguous) and ``grad`` hold the elements
        ``start ..`` of the parameter's row-major flattening, ``state`` is the rank-local state (whole
        factor vectors, this shard's bits). Updates the weight and sign bits; leaves this shard's raw
        row and column sums in the four factor vectors (0 for rows it lacks), for the caller to add
        up across shards and normalize (:func:`smmf.functional.store_factors_`). Codes SIGN and NO_M,
        and LEVELS for a param of two or more dims (the shard holds whole rows of M's code, ``state``'s
        codes and scales are its own, and only V's sums are left raw)."""

    def flag_shard_pass_(self, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int,
                         flag_pass: FlagPass) -> Nonfinite:
        """One of the magnitude flag's two passes over a shard (:class:`FlagPass`); ``row_m``,
        ``col_m`` and the flag's gains are the caller's to replace after both."""

    def updating_flag_pass(self, cfg: StepConfig) -> int:
        """Which of the flag's two shard passes steps the weights (and reports the NaN/inf count)."""

    def launch_of(self, param: Tensor, state: dict[str, Any], cfg: StepConfig) -> tuple[str, str]:
        """The launch that steps a whole tensor in :meth:`steps_`, and why, in words (:meth:`smmf.SMMF.routes`)."""


class LevelsEnds(NamedTuple):
    """A piece's first and last blocks under the levels code, between the ranks' sum and their codes: their M
    (2 × 128, the first and last block's elements from 0) and largest |M| (2) over the piece's elements."""

    m: Tensor
    tops: Tensor


class LevelsPieces(Protocol):
    """A backend that steps pieces of a param that may cut the levels code's blocks (a DeepSpeed ZeRO partition's;
    ``magnitude_bits=3``) in two calls around the ranks' sum (:func:`smmf.shards.levels_piece_rounds`)."""

    def levels_piece_pass_(self, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                           shape: tuple[int, ...], start: int) -> tuple[Nonfinite, LevelsEnds]:
        """The step of the piece ``weight`` (contiguous: elements ``start ..`` of a param of ``shape``; ``state``: its
        codes two per byte from its first element, the scales of the blocks it touches, V's whole factors): the
        weights stepped, V's raw row and column sums left in its factor vectors, every block coded but the
        first and last, which are returned."""

    def levels_piece_ends_(self, state: dict[str, Any], cfg: StepConfig, shape: tuple[int, ...], start: int,
                           numel: int, ends: LevelsEnds, tops: Tensor) -> None:
        """The first and last blocks' codes and scales, ``tops`` their largest |M| over every rank."""
