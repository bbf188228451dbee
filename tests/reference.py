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
    state: dict[int, ReferenceState] = field(default_factory=dict)

    def matrix_shape(self, p: Tensor) -> tuple[int, ...]:
        if p.dim() <= 1 and not self.vector_reshape:
            return tuple(p.shape)
        return reference_shape(p.numel())

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state.setdefault(id(p), ReferenceState())
            shape = self.matrix_shape(p)
            dense = p.dim() <= 1 and not self.vector_reshape
            if st.v_hat is None:
                st.v_hat = torch.zeros(shape, dtype=p.dtype)
                st.m_hat = torch.zeros(shape, dtype=p.dtype)
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
                m = beta1_t * st.m_hat + (1 - beta1_t) * g
            if dense:
                st.m_hat, st.v_hat = m, v
            else:
                st.sign = m >= 0
                st.m_hat = torch.where(st.sign, 1.0, -1.0).to(m.dtype) * reference_nnmf_reconstruct(m.abs())
                st.v_hat = reference_nnmf_reconstruct(v)
            u = m / (v.sqrt() + self.eps)
            w = w - self.lr * u
            p.copy_(w.reshape(p.shape))
