"""One SMMF step on one tensor, in plain torch: the readable path and the fallback of the kernels.

The step follows Alg. 1 of the paper with the decompression → compression scheme: the previous
momenta are rebuilt from their factors, updated with the current gradient, compressed again, and
the *uncompressed* momenta of this step drive the weight update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .matrix import factor_sum_cap, nnmf_from_sums, pack_signs, unpack_signs
from .state import (
    COL_M,
    COL_V,
    EXP_AVG,
    EXP_AVG_SQ,
    ROW_M,
    ROW_V,
    SIGN_M,
    factor_dtype,
    matrix_shape,
    real_view,
)

__all__ = ["StepConfig", "Band", "torch_step_", "write_back_"]

# Sums partial row/column sums across the ranks that share a matrix (identity on one device).
Reducer = Callable[[list[Tensor]], list[Tensor]]


@dataclass(frozen=True)
class StepConfig:
    """Scalars of one step of one parameter group."""

    lr: float
    beta1: Optional[float]  # β1_t of this step; None when there is no first moment
    beta2: float  # β2_t of this step
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool  # True: AdamW-style W·(1 − lr·wd); False: L2, G + wd·W
    maximize: bool
    stochastic_rounding: bool
    zero_nonfinite: bool = True  # NaN/inf gradient elements count as 0 (else they propagate)


@dataclass(frozen=True)
class Band:
    """The part of the n×m matrix that a tensor holds: rows ``[row0, row1)``, of whose row-major
    flattening the tensor owns ``numel`` elements from ``first`` on (a shard's first and last rows
    may be partial). A whole tensor is ``Band(n, m, 0, n, 0, n·m)``."""

    rows: int
    cols: int
    row0: int
    row1: int
    first: int
    numel: int

    @classmethod
    def whole(cls, rows: int, cols: int) -> "Band":
        return cls(rows, cols, 0, rows, 0, rows * cols)

    @classmethod
    def of_range(cls, rows: int, cols: int, start: int, numel: int) -> "Band":
        row0 = start // cols if cols else 0
        row1 = -(-(start + numel) // cols) if numel else row0
        return cls(rows, cols, row0, row1, start - row0 * cols, numel)

    @property
    def padded(self) -> bool:
        return self.first != 0 or self.numel != (self.row1 - self.row0) * self.cols

    def to_matrix(self, flat: Tensor) -> Tensor:
        if not self.padded:
            return flat.view(self.row1 - self.row0, self.cols)
        out = flat.new_zeros(self.row1 - self.row0, self.cols)
        out.view(-1)[self.first : self.first + self.numel] = flat
        return out

    def owned(self, matrix: Tensor) -> Tensor:
        """The owned elements of a band matrix, flat."""
        return matrix.reshape(-1)[self.first : self.first + self.numel]

    def zero_padding_(self, matrix: Tensor) -> None:
        if self.padded:
            flat = matrix.view(-1)
            flat[: self.first] = 0
            flat[self.first + self.numel :] = 0


def torch_step_(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    cfg: StepConfig,
    band: Optional[Band] = None,
    reduce: Optional[Reducer] = None,
) -> int:
    """Update ``param`` and its ``state`` in place (``state['step']`` already advanced); return the
    number of NaN/inf gradient elements that were treated as zero (``cfg.zero_nonfinite``).

    ``band`` and ``reduce`` serve sharded parameters (see :mod:`smmf.sharding`): ``param`` is then
    this rank's shard of a larger matrix, and ``reduce`` sums partial row/column sums over ranks.
    """
    work_dtype = factor_dtype(param)
    weight = real_view(param)
    # Logical row-major order: channels_last and other strided params are copied once.
    work = weight.to(work_dtype).contiguous()
    g = real_view(grad).to(work_dtype).contiguous()
    if cfg.maximize:
        g = -g
    nonfinite = 0
    if cfg.zero_nonfinite:
        bad = g.isfinite().logical_not_()
        nonfinite = int(bad.sum())
        if nonfinite:
            g = g.masked_fill(bad, 0.0)  # out of place: never touch p.grad
    if cfg.weight_decay != 0.0:
        if cfg.decoupled_weight_decay:
            work.mul_(1.0 - cfg.lr * cfg.weight_decay)
        else:
            g = g.add(work, alpha=cfg.weight_decay)  # out of place: never touch p.grad
    if EXP_AVG_SQ in state:
        update = _dense_update(g, state, cfg)
    else:
        band = band or Band.whole(*matrix_shape(param))
        update = band.owned(_factored_update(band.to_matrix(g.view(-1)), state, cfg, band, reduce))
    work.add_(update.view_as(work), alpha=-cfg.lr)
    if work is not weight:
        write_back_(weight, work, cfg.stochastic_rounding)
    return nonfinite


def _dense_update(g: Tensor, state: dict[str, Any], cfg: StepConfig) -> Tensor:
    exp_avg_sq = state[EXP_AVG_SQ]
    exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    denom = exp_avg_sq.sqrt().add_(cfg.eps)
    if cfg.beta1 is None:
        return g / denom
    exp_avg = state[EXP_AVG]
    exp_avg.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
    return exp_avg / denom


def _factored_update(g: Tensor, state: dict[str, Any], cfg: StepConfig, band: Band, reduce: Optional[Reducer]) -> Tensor:
    rows = slice(band.row0, band.row1)
    # Second moment: decompress, update; this step's V drives the update.
    v = torch.outer(state[ROW_V][rows], state[COL_V])
    v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    band.zero_padding_(v)
    moments = [(ROW_V, COL_V, v)]
    if cfg.beta1 is not None:
        # First moment: |M| from its factors, the sign from the 1-bit matrix.
        magnitude = torch.outer(state[ROW_M][rows], state[COL_M])
        nonneg = band.to_matrix(unpack_signs(state[SIGN_M], band.numel))
        m = torch.where(nonneg, magnitude, -magnitude)
        m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
        band.zero_padding_(m)
        packed = pack_signs(band.owned(m) >= 0)
        state[SIGN_M][: packed.numel()].copy_(packed)
        moments.append((ROW_M, COL_M, m.abs()))
    _compress(state, band, moments, reduce)
    denom = v.sqrt_().add_(cfg.eps)
    return g.div(denom) if cfg.beta1 is None else m.div_(denom)


def _compress(state: dict[str, Any], band: Band, moments: list[tuple[str, str, Tensor]], reduce: Optional[Reducer]) -> None:
    """Rank-1 NNMF of each moment: row sums and column sums / total (summed over ranks first)."""
    sums: list[Tensor] = []
    cap = factor_sum_cap(band.rows * band.cols, moments[0][2].dtype)
    for _, _, matrix in moments:
        capped = matrix.clamp(max=cap)
        rows = matrix.new_zeros(band.rows)
        rows[band.row0 : band.row1] = capped.sum(dim=1)  # other ranks' rows stay 0 until reduced
        sums += [rows, capped.sum(dim=0)]
    if reduce is not None:
        sums = reduce(sums)
    for (row_key, col_key, _), rows, cols in zip(moments, sums[::2], sums[1::2]):
        rows, cols = nnmf_from_sums(rows, cols)
        state[row_key].copy_(rows)
        state[col_key].copy_(cols)


def write_back_(dst: Tensor, src: Tensor, stochastic_rounding: bool) -> None:
    """Write fp32 ``src`` into ``dst``; bf16 ``dst`` may use stochastic rounding."""
    if stochastic_rounding and dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
        bits = src.view(torch.int32)
        noise = torch.randint_like(bits, 0, 1 << 16)
        # Adding uniform noise below the kept 16 bits, then truncating, rounds up with
        # probability equal to the dropped fraction; the truncated value is exact in bf16.
        src = bits.add(noise).bitwise_and_(-65536).view(torch.float32)
    dst.copy_(src)
