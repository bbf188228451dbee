"""Ground truth: Algorithm 1 of the paper, line by line, with full M and V matrices.

Deliberately naive and independent of ``smmf``'s internals (its only import from the package
is none): every fast path is tested against this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


def reference_shape(numel: int) -> tuple[int, int]:
    """Alg. 2 as written: the first divisor counting down from floor(sqrt(N))."""
    if numel == 0:
        return 0, 0
    for i in range(math.isqrt(numel), 0, -1):
        if numel % i == 0:
            return numel // i, i
    raise AssertionError


def reference_nnmf_reconstruct(a: Tensor) -> Tensor:
    """Â = r cᵀ with r = A·1, c = 1ᵀA / 1ᵀA1 (zero when A is zero)."""
    r = a.sum(dim=1, keepdim=True)
    c = a.sum(dim=0, keepdim=True)
    total = a.sum()
    if total == 0:
        return torch.zeros_like(a)
    return r @ (c / total)


def _mix32(x: int) -> int:
    """A 32-bit integer hash: two rounds of multiply and xor-shift (shifts 16, 15, 16)."""
    x ^= x >> 16
    x = x * 0x7FEB352D % 2**32
    x ^= x >> 15
    x = x * 0x846CA68B % 2**32
    return x ^ (x >> 16)


def reference_dither(step: int, index: int, ordinal: int = 0) -> float:
    """The stochastic rounding offset u in [0, 1) of element ``index`` (row-major in its param) of the
    optimizer's ``ordinal``-th param at ``step``: the top 24 bits of mix32(salt + index), where the salt is
    mix32(mix32(step) + mix32(ordinal))."""
    salt = _mix32((_mix32(step) + _mix32(ordinal)) % 2**32)
    return (_mix32((salt + index) % 2**32) >> 8) / 2**24


def reference_levels(m: Tensor, block: int = 128, step: Optional[int] = None, ordinal: int = 0) -> Tensor:
    """M̂ of the block-levels code, element by element: each block of ``block`` elements of a row has the
    scale max |M| (NaN as 0, at most bf16's largest) rounded to bf16; each element the level j·(scale·⅐)
    nearest to |M|, j = floor(|M|·(7/scale) + ½) ≤ 7, with M's sign (fp64: Python floats round as the dtype).
    With ``step``: rounded stochastically, j = floor(|M|·(7/scale) + u) with u :func:`reference_dither`'s (of
    the ``ordinal``-th param)."""
    bf16_max = torch.finfo(torch.bfloat16).max
    out = torch.zeros_like(m)
    for i in range(m.shape[0]):
        for b0 in range(0, m.shape[1], block):
            part = [float(x) for x in m[i, b0 : b0 + block]]
            top = min(max((0.0 if math.isnan(x) else abs(x)) for x in part), bf16_max)
            scale = float(torch.tensor(top, dtype=torch.float32).to(torch.bfloat16))
            for k, x in enumerate(part):
                offset = 0.5 if step is None else reference_dither(step, i * m.shape[1] + b0 + k, ordinal)
                level = 0 if scale == 0 or math.isnan(x) else min(7, math.floor(abs(x) * (7 / scale) + offset))
                value = level * (scale * (1 / 7))
                out[i, b0 + k] = -value if x < 0 else value
    return out


@dataclass
class ReferenceState:
    step: int = 0
    m_hat: Optional[Tensor] = None  # decompressed first moment S ⊙ (r cᵀ), full matrix
    v_hat: Optional[Tensor] = None  # decompressed second moment r cᵀ, full matrix
    sign: Optional[Tensor] = None  # bool, M >= 0


@dataclass
class ReferenceSMMF:
    params: list[Tensor]
    lr: float = 1e-3
    beta: Optional[float] = 0.9
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_rate: float = -0.5
    growth_rate: Optional[float] = 0.999
    vector_reshape: bool = True
    weight_decay_mode: str = "adamw"
    maximize: bool = False
    momentum_shape: str = "square"  # beyond the paper: "natural" = (dim 0, the rest) for M of ≥2-D tensors
    magnitude_bits: int = 0  # beyond the paper: 1 = a flag [|M| > r cᵀ] and two least-squares levels;
    # 3 = by rows of the param, a sign and one of 8 levels j/7 of a bf16 max per 128 elements of a row
    momentum_rounding: str = "nearest"  # magnitude_bits=3: "stochastic" rounds the levels by reference_dither
    state: dict[int, ReferenceState] = field(default_factory=dict)

    def matrix_shape(self, p: Tensor) -> tuple[int, ...]:
        if p.dim() <= 1 and not self.vector_reshape:
            return tuple(p.shape)
        return reference_shape(p.numel())

    def momentum_shape_of(self, p: Tensor) -> tuple[int, ...]:
        if self.magnitude_bits == 3:  # rows of the param; a vector is one row
            if p.dim() < 2:
                return 1, p.numel()
            return (p.shape[0], p.numel() // p.shape[0]) if p.shape[0] else (0, 0)
        if self.momentum_shape == "natural" and p.dim() >= 2 and p.numel() > 0:
            return p.shape[0], p.numel() // p.shape[0]
        return self.matrix_shape(p)

    def encode_momentum(self, m: Tensor, step: int, ordinal: int) -> Tensor:
        """M̂ = S ⊙ r cᵀ, or with the flag S ⊙ r cᵀ ⊙ (h where |M| > r cᵀ, else l)."""
        if self.magnitude_bits == 3:
            stochastic = self.momentum_rounding == "stochastic"
            return reference_levels(m, step=step if stochastic else None, ordinal=ordinal)
        a = m.abs()
        r = reference_nnmf_reconstruct(a)
        if self.magnitude_bits:
            above = a > r
            levels = []
            for where in (above, ~above):
                den = (r[where] ** 2).sum()
                levels.append((a[where] * r[where]).sum() / den if den > 0 else torch.zeros((), dtype=m.dtype))
            r = r * torch.where(above, levels[0], levels[1])
        return torch.where(m >= 0, 1.0, -1.0).to(m.dtype) * r

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state.setdefault(id(p), ReferenceState())
            shape = self.matrix_shape(p)
            dense = p.dim() <= 1 and not self.vector_reshape
            m_shape = shape if dense else self.momentum_shape_of(p)
            if st.v_hat is None:
                st.v_hat = torch.zeros(shape, dtype=p.dtype)
                st.m_hat = torch.zeros(m_shape, dtype=p.dtype)
            st.step += 1
            t = st.step
            w = p.detach().clone().reshape(shape)  # row-major of the logical (contiguous) tensor
            g = p.grad.detach().clone().reshape(shape)
            if self.maximize:
                g = -g
            if self.weight_decay_mode == "adam":
                g = g + self.weight_decay * w
            else:
                w = w * (1 - self.lr * self.weight_decay)
            beta2_t = 1 - t**self.decay_rate
            v = beta2_t * st.v_hat + (1 - beta2_t) * g * g
            if self.beta is None:
                m = g
            else:
                beta1_t = self.beta * (1.0 if self.growth_rate is None else self.growth_rate ** (t - 1))
                m = beta1_t * st.m_hat + (1 - beta1_t) * g.reshape(m_shape)
            if dense:
                st.m_hat, st.v_hat = m, v
            else:
                st.sign = m >= 0
                st.m_hat = self.encode_momentum(m, t, next(i for i, q in enumerate(self.params) if q is p))
                st.v_hat = reference_nnmf_reconstruct(v)
            m = m.reshape(shape)
            u = m / (v.sqrt() + self.eps)
            w = w - self.lr * u
            p.copy_(w.reshape(p.shape))
