"""The math of SMMF on plain tensors: shape choice, rank-1 NNMF, sign packing.

Everything here is pure (no optimizer state, no dispatch) so that the torch path, the fused
kernels, the memory predictor and the tests all share one definition.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "square_matricize_shape",
    "nnmf",
    "nnmf_from_sums",
    "pack_signs",
    "unpack_signs",
    "packed_sign_bytes",
    "factor_sum_cap",
    "factor_sums",
    "store_factors_",
]

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


@functools.lru_cache(maxsize=65536)  # called every step; a prime N would cost sqrt(N) each time
def square_matricize_shape(numel: int) -> tuple[int, int]:
    """Shape ``(n, m)`` with ``n * m == numel``, ``n >= m`` and ``n + m`` minimal (Alg. 2).

    ``m`` is the largest divisor of ``numel`` not above ``floor(sqrt(numel))``; a prime gives
    ``(numel, 1)``, ``1`` gives ``(1, 1)`` and an empty tensor gives ``(0, 0)``.
    """
    if numel < 0:
        raise ValueError(f"numel should be >= 0 but is: {numel}")
    if numel == 0:
        return 0, 0
    for cols in range(math.isqrt(numel), 0, -1):
        if numel % cols == 0:
            return numel // cols, cols
    raise AssertionError("unreachable: 1 divides every positive integer")


def nnmf(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Rank-1 non-negative factorization ``matrix ≈ r cᵀ`` (Adafactor's NNMF).

    ``r`` holds the row sums and ``c`` the column sums divided by the total, so that
    ``r cᵀ = rowsum · colsum / total``. An all-zero matrix gives all-zero factors, never NaN.
    """
    return nnmf_from_sums(matrix.sum(dim=1), matrix.sum(dim=0))


def nnmf_from_sums(rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`nnmf` from the row and column sums (which shards can add up before factorizing)."""
    total = rows.sum()
    return rows, cols / torch.where(total > 0, total, torch.ones_like(total))


@functools.lru_cache(maxsize=65536)  # asked per tensor at every step; torch.finfo costs a microsecond
def factor_sum_cap(numel: int, dtype: torch.dtype) -> float:
    """The largest value one element may add to a factor sum: ``numel`` of them, and therefore every
    row sum, column sum and the total, stay finite. Finite gradients then never give non-finite
    factors (one fp32 gradient of 2e19 squares to inf). So large that it never binds in training."""
    return torch.finfo(dtype).max / (2 * max(numel, 1))


def packed_sign_bytes(numel: int) -> int:
    """Bytes needed to hold ``numel`` signs at 8 per byte."""
    return (numel + 7) // 8


def pack_signs(nonnegative: Tensor) -> Tensor:
    """Pack a boolean tensor (True = ``M >= 0``) into uint8, 8 per byte, little-endian bits.

    Element ``k`` of the row-major flattening lives in bit ``k % 8`` of byte ``k // 8``; the
    padding bits of the last byte are zero.
    """
    flat = nonnegative.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = _BIT_SHIFTS.to(flat.device)
    return (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack_signs`: a flat boolean tensor of ``numel`` elements."""
    shifts = _BIT_SHIFTS.to(packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].bool()


def factor_sums(matrix: Tensor, numel: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Row and column sums of a non-negative matrix, each element capped at
    :func:`factor_sum_cap` (of a matrix of ``numel`` elements, by default its own)."""
    capped = matrix.clamp(max=factor_sum_cap(matrix.numel() if numel is None else numel, matrix.dtype))
    return capped.sum(dim=1), capped.sum(dim=0)


def store_factors_(state: dict[str, Any], row_key: str, col_key: str, row_sums: Tensor, col_sums: Tensor) -> None:
    """The rank-1 NNMF from the sums (:func:`nnmf_from_sums`), into the state."""
    rows, cols = nnmf_from_sums(row_sums, col_sums)
    state[row_key].copy_(rows)
    state[col_key].copy_(cols)
