"""The named arguments of the numba kernels, defined once: a field is added here and read by name.

Arrays travel in :class:`Moments`, :class:`Scratch` and :class:`FlagArrays`; numbers in
:class:`Scalars` (floats in the work dtype), :class:`Geometry` (ints) and :class:`Options` (bools, and the
tensor's key of its stochastic rounding noise).
Only the numbers cross into the compiled kernels as tuples: numba (0.68) loses some writes to
arrays held in a tuple (any made inside a ``prange`` body, and a slice assignment from another
array), so the host builds the array tuples and the kernels take their fields one by one, in the
tuples' order (``host.launch`` splats them).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Scalars(NamedTuple):
    """The step's numbers in the work dtype (float32, or float64 for fp64 params); :func:`scalars`."""

    lr: Any
    beta1: Any  # β1_t of this step (0 without a first moment)
    rest1: Any  # 1 − β1_t, rounded once from float64 as on the torch path: opaque to LLVM, which
    beta2: Any  # would otherwise rewrite β·a + (1 − β)·b as b + β·(a − b), NaN when b is inf
    rest2: Any  # 1 − β2_t
    eps: Any
    gsign: Any  # −1 to maximize, else 1 (StepConfig.folded)
    shrink: Any  # decoupled weight decay's factor 1 − lr·wd
    l2: Any  # coupled (L2) weight decay's coefficient
    big: Any  # the work dtype's largest finite value: |g| above it is NaN/inf
    cap: Any  # what one element may add to a factor sum (smmf.matrix.factor_sum_cap)


class Geometry(NamedTuple):
    """Where the step runs: the n×m view of V, M's own columns (``m_cols``; m unless
    momentum_shape="natural"), the elements ``lo .. hi`` of the row-major flattening that the arrays
    hold (0 .. n·m, or an FSDP2 shard's), and blocks of ``rows_per_block`` rows from ``row0``
    (lo // m), each starting on a byte of the packed bits."""

    n: int
    m: int
    m_cols: int
    row0: int
    rows_per_block: int
    lo: int
    hi: int


class LevelsGeometry(NamedTuple):
    """The levels code's step (``magnitude_bits=3``): V's n×m view, M's ``rows`` × ``cols`` one (rows of the
    param; an FSDP2 shard's own rows, from element ``lo`` of the flattening on), blocks of ``rows_per_block``
    of M's rows, one per thread at a time, and how levels round."""

    n: int
    m: int
    rows: int
    cols: int
    lo: int  # the arrays' first element in the param's row-major flattening: 0, or a shard's start
    rows_per_block: int
    dither: bool  # stochastic rounding of the levels (smmf.levels.dither); else the nearest level
    salt: int  # the dither's salt at this step


class PieceGeometry(NamedTuple):
    """The levels code's step of a piece of a param that may cut its blocks (a DeepSpeed ZeRO partition's): V's
    n×m view, the ``cols`` of M's rows (rows of the param), the elements ``lo .. hi`` the arrays hold, and how
    levels round."""

    n: int
    m: int
    cols: int
    lo: int
    hi: int
    dither: bool
    salt: int


class Options(NamedTuple):
    has_m: bool  # a first moment (beta is set)
    sr: bool  # stochastic rounding of bf16 weights
    zero_bad: bool  # NaN/inf gradient elements count as 0 (and are counted)
    whole: bool  # the whole matrix: normalize the factors here (else leave this piece's raw sums)
    sr_seed: int  # under sr, the tensor's key of the rounding noise at this step (StepConfig.rounding_key)


class Moments(NamedTuple):
    """The state, flat: the sign bits of M (uint8, bit k%8 of byte k//8 for element lo + k: the layout
    of :func:`smmf.matrix.pack_signs`), the factors of |M| in M's view and of V (work dtype)."""

    signs: Any
    row_m: Any
    col_m: Any
    row_v: Any
    col_v: Any


class Scratch(NamedTuple):
    """Per block of rows (work dtype): its column sums of |M| (blocks × m_cols) and of V (blocks × m),
    its sums of the rows of M's view it touches (blocks × :func:`m_rows_touched`), and the NaN/inf
    gradient elements it met (int64, blocks)."""

    col_acc_m: Any
    col_acc_v: Any
    row_acc_m: Any
    bad_counts: Any


class FlagArrays(NamedTuple):
    """The magnitude flag's: its bits (uint8, laid out as the signs), the new factors of |M| (as
    ``row_m``/``col_m``), its levels (high, low) and each block's four level sums (blocks × 4)."""

    flags: Any
    new_row_m: Any
    new_col_m: Any
    levels: Any
    fits: Any


class FlagPasses(NamedTuple):
    """The flag's passes a call makes: 0 .. 2 for a whole matrix, one (p .. p + 1) for a shard."""

    first: int
    end: int
