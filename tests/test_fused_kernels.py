"""Every fused path equals the torch path (fp32/bf16) over 20 steps; state bytes unchanged."""

from __future__ import annotations

import pytest
import torch

from helpers import FUSED_BACKENDS, ZOO_SHAPES, reconstruct_state, state_tensors_bytes
from smmf import SMMF
from smmf.kernels import available_backends, check_backend, step_kernel
from smmf.functional import torch_step_

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend available")

CONFIGS = {
    "defaults": dict(),
    "adamw": dict(weight_decay=0.1),
    "adam-l2": dict(weight_decay=0.01, weight_decay_mode="adam"),
    "no-first-moment": dict(beta=None, growth_rate=None),
    "maximize": dict(maximize=True, decay_rate=-0.8),
}
SHAPES = [*ZOO_SHAPES, (768,), (64, 3, 7, 7), (257, 33)]


def _pair(backend: str, dtype: torch.dtype, config: dict) -> tuple[list, list, SMMF, SMMF]:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    ps = [torch.nn.Parameter(b.to(dtype).clone()) for b in base]
    qs = [torch.nn.Parameter(b.to(dtype).clone()) for b in base]
    return ps, qs, SMMF(ps, lr=1e-2, backend="torch", **config), SMMF(qs, lr=1e-2, backend=backend, **config)


def _scale(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_matches_torch_path(backend: str, dtype: torch.dtype, config: dict) -> None:
    ps, qs, ref, fused = _pair(backend, dtype, config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad, q.grad = g, g.clone()
        ref.step()
        fused.step()
    for p, q in zip(ps, qs):
        if dtype == torch.float32:
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        else:  # both round the same fp32 value to bf16; a rare 1-ulp split is allowed
            torch.testing.assert_close(q, p, rtol=8e-3, atol=1e-5)
            assert (q != p).float().mean().item() <= 0.01 if p.numel() else True
        m_ref, v_ref = reconstruct_state(ref, p)
        m_fused, v_fused = reconstruct_state(fused, q)
        # Sums run in another order on each path: compare at 1e-5 of each matrix's scale.
        torch.testing.assert_close(v_fused, v_ref, rtol=1e-5, atol=1e-5 * _scale(v_ref))
        if m_ref is not None:
            torch.testing.assert_close(m_fused.abs(), m_ref.abs(), rtol=1e-5, atol=1e-5 * _scale(m_ref))
            clear = m_ref.abs() > 1e-6 * (m_ref.abs().max() if m_ref.numel() else 0)
            assert torch.equal(m_fused[clear] >= 0, m_ref[clear] >= 0)
    assert state_tensors_bytes(fused) == state_tensors_bytes(ref)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_fused_is_chosen_by_default_and_covers_bf16(backend: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(4, 4, dtype=dtype))
        assert step_kernel("auto", p, {}) is not torch_step_
        assert step_kernel(backend, p, {}) is not torch_step_


def test_fp16_falls_back_to_torch_under_auto() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    assert step_kernel("auto", p, {}) is torch_step_


def test_unavailable_backend_is_a_clear_error() -> None:
    if "triton" not in available_backends():
        with pytest.raises(RuntimeError, match="backend 'triton' is not available here"):
            SMMF([torch.nn.Parameter(torch.randn(2))], backend="triton")
    with pytest.raises(ValueError, match="Unknown backend"):
        check_backend("cuda")
