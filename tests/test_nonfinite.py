"""One bad gradient element never destroys a tensor's state: huge finite ones stay finite, NaN/inf
ones count as zero (or propagate when asked), alike on every backend."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS, STATE_TENSORS
from smmf import SMMF

BACKENDS = ["torch", *CPU_FUSED_BACKENDS]


# One bad element never destroys a tensor's state.

@pytest.mark.parametrize("backend", BACKENDS)
def test_one_huge_finite_grad_keeps_params_and_factors_finite(backend: str) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    adam_p = torch.nn.Parameter(p.detach().clone())
    opt, adam = SMMF([p], backend=backend), torch.optim.Adam([adam_p])
    for step in range(4):
        g = torch.randn(64, 64)
        if step == 1:
            g[3, 5], g[9, 1] = 2e19, 1e30  # both square to inf in fp32
        p.grad, adam_p.grad = g, g.clone()
        opt.step()
        adam.step()
    assert torch.isfinite(adam_p).all()  # the control
    assert torch.isfinite(p).all()
    for key in ("row_m", "col_m", "row_v", "col_v"):
        assert torch.isfinite(opt.state[p][key]).all(), key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_grad_element_counts_as_zero_and_warns_once(backend: str, bad: float) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 30))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = SMMF([p], backend=backend), SMMF([q], backend=backend)
    for step in range(3):
        g = torch.randn(40, 30)
        g[7, 11] = 0.0
        p.grad, q.grad = g.clone(), g.clone()
        p.grad[7, 11] = bad
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_p.step()
        assert len([w for w in caught if "NaN/inf gradient" in str(w.message)]) == (1 if step == 0 else 0)
        opt_q.step()
    assert torch.equal(p, q)
    for key in STATE_TENSORS:
        assert torch.equal(opt_p.state[p][key], opt_q.state[q][key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_propagate_lets_a_nan_through(backend: str) -> None:
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = SMMF([p], backend=backend, nonfinite_grads="propagate")
    p.grad = torch.randn(8, 8)
    p.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(p).any()


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs numba")
def test_backends_agree_on_huge_and_nonfinite_grads() -> None:
    torch.manual_seed(0)
    ps = {b: torch.nn.Parameter(torch.randn(300, 300)) for b in BACKENDS}
    for p in ps.values():
        p.data.copy_(ps["torch"].data)
    opts = {b: SMMF([p], backend=b) for b, p in ps.items()}
    for step in range(4):
        g = torch.randn(300, 300)
        g[1, 2], g[5, 6], g[7, 8] = 3e19, float("nan"), -float("inf")
        for b, p in ps.items():
            p.grad = g.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts[b].step()
    for b in CPU_FUSED_BACKENDS:
        torch.testing.assert_close(ps[b], ps["torch"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_warning_counts_every_tensor_of_the_step(backend: str) -> None:
    """5 + 3 + 1 NaN elements in three tensors: the torch path, which steps one tensor at a time, warned 5."""
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3)]
    opt = SMMF(params, backend=backend)
    for param, count in zip(params, (5, 3, 1)):
        grad = torch.randn(8, 8)
        grad.view(-1)[:count] = float("nan")
        param.grad = grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert [str(w.message).split(" NaN")[0] for w in caught] == ["SMMF met 9"]
