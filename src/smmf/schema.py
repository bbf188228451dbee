"""The step schema: for each code of M, the state it keeps between steps, the numbers a step takes and the options
it runs under, each under one name.

Everything that lists them is derived from here: :func:`smmf.state.state_layout` (which the optimizer builds its
state from, checkpoints are checked against and the memory predictor counts), the numba kernels' structures of
numbers and options and the order of their state arrays, and the Triton kernels' table of tensors (a column per
state field). Adding a state field is one line in :data:`SCHEMA` and the kernel lines that read and write it.

A field's shape is a rule of the tensor's :class:`Dims`; its dtype is ``"factor"`` (fp32, fp64 for fp64 params),
``"uint8"`` (packed bits or codes) or ``"bf16"`` (the levels code's scales); ``own`` fields hold one value per
element (or block) of the tensor, so a rank holding a piece of it keeps its piece's, where the others are whole on
every rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

__all__ = ["CODES_M", "COL_M", "COL_V", "EXP_AVG", "EXP_AVG_SQ", "FLAG_M", "FLAG_GAINS_M", "ROW_M", "ROW_V", "SCALES_M",
           "SIGN_M", "STEP", "STEP_NUMBERS", "STEP_OPTIONS", "Dims", "MomentumCode", "StateField", "TensorSpec"]


class MomentumCode(enum.Enum):
    """How a parameter's state stores its moments: decided by the group's options and the param
    (:func:`smmf.state.momentum_code`), carried to every path by :attr:`smmf.functional.StepConfig.code`, and
    the source of the state's layout (:data:`SCHEMA`). No path infers it from the state's keys. M's view (V's
    square one, or the natural one) is geometry, not code: ``row_m``/``col_m``'s lengths."""

    DENSE = "dense"  # Adam's elementwise V (and M when beta is set): 1-D tensors under vector_reshape=False
    NO_M = "no-m"  # factored V, no first moment (beta=None)
    SIGN = "sign"  # the paper's: M's 1-bit signs and a rank-1 NNMF of |M|
    FLAG = "flag"  # SIGN plus a 1-bit magnitude flag and two gains (magnitude_bits=1)
    LEVELS = "levels"  # a sign and a 3-bit level per element, a bf16 scale per block of a row (magnitude_bits=3)

    # A member equals only itself: hashed by identity, in C (Enum's hashes its name in Python, and the
    # code is part of several keys looked up for every param at every step).
    __hash__ = object.__hash__


# The state's keys: the names in ``optimizer.state``, checkpoints and the kernels' tables.
ROW_M, COL_M, SIGN_M = "row_m", "col_m", "sign_m"  # the factors of |M| in M's view; M's sign bits
ROW_V, COL_V = "row_v", "col_v"  # the factors of V in its square view
# The magnitude flag's bits [|M| > r cᵀ]; its two gains (high, low) of r cᵀ, under the key its checkpoints have
# always had.
FLAG_M, FLAG_GAINS_M = "flag_m", "levels_m"
CODES_M, SCALES_M = "codes_m", "scales_m"  # the levels code: 4-bit codes two per byte; a bf16 scale per block
EXP_AVG, EXP_AVG_SQ = "exp_avg", "exp_avg_sq"  # the dense state of vectors (vector_reshape=False)
STEP = "step"  # a plain int
PIECES, PLACES = "pieces", "places"  # a DeepSpeed ZeRO buffer's state: its pieces' states, their places


class Dims(NamedTuple):
    """A tensor's geometry, which every shape rule reads: V's ``rows`` × ``cols`` view, M's ``m_rows`` × ``m_cols``
    one (the natural shape's, else V's), M's rows × columns under the levels code, the real view's ``shape``, and
    the bytes of one packed bit per element (``bit_bytes``: a shard's, per rank)."""

    rows: int
    cols: int
    m_rows: int
    m_cols: int
    levels_rows: int
    levels_cols: int
    shape: tuple[int, ...]
    bit_bytes: int


@dataclass(frozen=True)
class StateField:
    """One tensor of a code's state: its key, shape rule and dtype (module docstring); ``own``: one value per
    element or block of the tensor; ``bits``: one packed bit per element (laid out as
    :func:`smmf.matrix.pack_signs` lays them out: a shard keeps its own elements', a checkpoint holds them by rows
    of the param); ``first_moment``: kept only when the group has a first moment (beta set)."""

    key: str
    shape: Callable[[Dims], tuple[int, ...]]
    dtype: str
    own: bool = False
    first_moment: bool = False
    bits: bool = False


class TensorSpec(NamedTuple):
    """A state tensor's shape and dtype, as a param's layout has it (:func:`smmf.state.state_layout`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


# The numbers of a step, in the work dtype, as the kernels take them (``StepConfig.numbers`` in smmf.functional makes them):
# lr; β1_t and 1 − β1_t (0 and 1 without a first moment); β2_t and 1 − β2_t (each rounded once from float64, as on
# the torch path); ε; −1 to maximize, else 1; decoupled weight decay's factor 1 − lr·wd; coupled (L2) decay's
# coefficient; the dtype's largest finite value (|g| above it is NaN/inf); what one element may add to a factor sum.
STEP_NUMBERS = ("lr", "beta1", "rest1", "beta2", "rest2", "eps", "gsign", "shrink", "l2", "big", "cap")
# The options of a step, as the kernels take them (a code's kernels need no flag for it: each code has its own):
# bf16 weights rounded stochastically; NaN/inf gradient elements count as 0 (and are counted; nonfinite_grads=
# "zero"); the whole tensor (normalize the factors here, else leave a piece's raw sums); the tensor's key of its
# bf16 rounding noise at this step (smmf.noise.rounding_key).
STEP_OPTIONS = ("stochastic_rounding", "zero_nonfinite", "whole", "rounding_key")
