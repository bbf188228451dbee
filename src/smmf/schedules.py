"""The per-step coefficients of SMMF's moments (Alg. 1): β1 grows towards 0, β2 towards 1."""

from __future__ import annotations

from typing import Optional

__all__ = ["beta1_at", "beta2_at"]


def beta1_at(beta: float, growth_rate: Optional[float], step: int) -> float:
    """First-moment coefficient ``β1·λ^(t-1)`` (AdamNC schedule); constant when ``λ`` is None."""
    if growth_rate is None:
        return beta
    return beta * growth_rate ** (step - 1)


def beta2_at(decay_rate: float, step: int) -> float:
    """Second-moment coefficient ``1 - t^γ`` (Adafactor schedule); ``β2_1 = 0``."""
    return 1.0 - step**decay_rate
