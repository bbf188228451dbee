"""The named arguments of the numba kernels, defined once: a field is added here (or in the step schema) and
read by name.

Numbers travel in :class:`Scalars` (floats in the work dtype) and :class:`Options` (bools, and the tensor's key of
its stochastic rounding noise), both named by the step schema (:mod:`smmf.schema`), and in :class:`Geometry` and
its kin (ints). Arrays never travel in a tuple: numba (0.68) loses some writes to arrays held in one (any made
inside a ``prange`` body, and a slice assignment from another array), so each kernel takes the weight, the
gradient, its code's state arrays in the schema's order and its scratch one by one (``host.launch`` splats them).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, NamedTuple

import numba

from ...schema import STEP_NUMBERS, STEP_OPTIONS


# The step's numbers in the work dtype (float32, or float64 for fp64 params) and its options, named by the step
# schema (smmf.schema.STEP_NUMBERS, STEP_OPTIONS; host.scalars and host.options make them).
def _named(name: str, fields: tuple[str, ...]) -> Any:
    return namedtuple(name, fields)


Scalars = _named("Scalars", STEP_NUMBERS)
Options = _named("Options", STEP_OPTIONS)


def _row_reader(cls: Any) -> Any:
    """An inlined numba function that makes ``cls`` (a named tuple of numbers) from a row of an array, field by
    field, written from its fields: the launches of many tensors keep each tensor's numbers in a table's row."""
    namespace = {"cls": cls}
    exec(f"def read(row):\n    return cls({', '.join(f'row[{i}]' for i in range(len(cls._fields)))})\n", namespace)
    return numba.njit(inline="always")(namespace["read"])


scalars_of = _row_reader(Scalars)


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
    dither: bool  # stochastic rounding of the levels (smmf.noise.dither); else the nearest level
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


class FlagPasses(NamedTuple):
    """The flag's passes a call makes: 0 .. 2 for a whole matrix, one (p .. p + 1) for a shard."""

    first: int
    end: int
