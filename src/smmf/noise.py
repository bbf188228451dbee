"""Counter-based noise, the same on every path and every rank: the block-levels code's dither and the bf16
weights' stochastic rounding.

Each draw is a hash of an element's index in its param and a salt made of the step and the param's position in the
optimizer (counted over its param groups), so a run is reproducible and resumes exactly without torch's generator,
and DDP replicas draw alike. :func:`step_salt` salts the levels' dither (``momentum_rounding="stochastic"``,
:func:`dither`); :func:`rounding_key`, the same hash keyed apart, is the noise of every path's bf16 stochastic
rounding of the weights (``stochastic_rounding=True``). The kernels compute :func:`mix32` in their own lanes, with
:data:`HASH_MULTIPLIERS`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["DITHER_BITS", "HASH_MULTIPLIERS", "counter_hash", "dither", "mix32", "rounding_key", "step_salt"]

# The hash: a 32-bit integer finalizer (two multiply-xorshift rounds, shifts 16, 15, 16) applied
# to (salt + element index) mod 2³²; its top 24 bits make u = k · 2⁻²⁴, exact in fp32 and fp64.
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
DITHER_BITS = 24
_MASK32 = 0xFFFFFFFF
_ROUNDING_DOMAIN = 0x2545F491  # keys the weights' rounding noise apart from the dither (rounding_key)


def mix32(x: Any) -> Any:
    """The hash of 32-bit values ``x``: a Python int, or an int64 tensor, hashed in place (a product may wrap
    in int64; its low 32 bits, all that is kept, are still the product's)."""
    x ^= x >> 16
    x *= HASH_MULTIPLIERS[0]
    x &= _MASK32
    x ^= x >> 15
    x *= HASH_MULTIPLIERS[1]
    x &= _MASK32
    x ^= x >> 16
    return x


def step_salt(step: int, ordinal: int = 0) -> int:
    """The dither's salt at ``step`` (1, 2, …) for the optimizer's ``ordinal``-th parameter (counted over its
    param groups): a 32-bit hash of both, so that each step and each parameter draw anew (parameters of one
    shape would otherwise round alike at each index)."""
    return mix32((mix32(step & _MASK32) + mix32(ordinal & _MASK32)) & _MASK32)


def rounding_key(step: int, ordinal: int = 0) -> int:
    """The key of the bf16 stochastic rounding noise of the optimizer's ``ordinal``-th parameter at ``step``:
    :func:`step_salt` hashed once more, so that a weight's rounding and its levels' dither draw apart. A
    function of the step and the param's place alone, as the dither's salt: replicas round alike whatever
    each rank's random seed (DDP), the step inside backward rounds as the loop, and a resume rounds as the
    uninterrupted run without restoring torch's generator."""
    return mix32(step_salt(step, ordinal) ^ _ROUNDING_DOMAIN)


def counter_hash(salt: int, first: int, count: int, device: torch.device) -> Tensor:
    """``mix32((salt + index) mod 2³²)`` for the elements ``first .. first + count`` of a param's row-major
    flattening, int64 (the hash every path computes in its own lanes)."""
    x = torch.arange(first, first + count, dtype=torch.int64, device=device)
    x += salt
    x &= _MASK32
    return mix32(x)  # in place: one int64 temporary beside x at a time


def dither(salt: int, first: int, count: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``u`` in [0, 1) for the elements ``first .. first + count`` of a param's row-major flattening:
    ``mix32((salt + index) mod 2³²) >> 8``, times 2⁻²⁴."""
    x = counter_hash(salt, first, count, device)
    x >>= 32 - DITHER_BITS
    return x.to(dtype).mul_(2.0 ** -DITHER_BITS)
