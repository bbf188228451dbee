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


# The contract for non-finite values, on every backend and every code of M (the torch path's behaviour): a NaN or
# infinite weight stays so and touches nothing else, as long as the weight does not enter the gradient (no L2
# decay); an infinite gradient element under "propagate" adds capped values to the factor sums, so the state stays
# finite and only its own weight becomes NaN (inf / inf).

CODES = {"paper": {}, "natural": {"momentum_shape": "natural"}, "flag": {"magnitude_bits": 1},
         "levels": {"magnitude_bits": 3, "momentum_rounding": "stochastic"}, "no-first-moment": {"beta": None}}
# The (20, 300), one small enough for the shared launch of small tensors, a vector, one of several blocks.
CONTRACT_SHAPES = [(20, 300), (8, 8), (300,), (130, 257)]
PLANTED = 17  # the flat index of the bad weight or gradient element in each tensor


def _contract_run(backend: str, code: dict, steps: int, weight: float | None = None, grad: float | None = None,
                  **options) -> list[tuple[list[torch.Tensor], list[dict]]]:
    """``steps`` steps of four params: ``weight`` planted before the first, ``grad`` in the second step's gradient;
    each step's weights and float state."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in CONTRACT_SHAPES]
    opt = SMMF(params, backend=backend, weight_decay=0.1, **code, **options)
    if weight is not None:
        with torch.no_grad():
            for p in params:
                p.view(-1)[PLANTED] = weight
    trace = []
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
            if grad is not None and step == 1:
                p.grad.view(-1)[PLANTED] = grad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        trace.append(([p.detach().clone() for p in params],
                      [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v) and v.is_floating_point()}
                       for p in params]))
    return trace


def _assert_traces_agree(trace: list, reference: list) -> None:
    for (weights, states), (ref_weights, ref_states) in zip(trace, reference):
        for w, ref, state, ref_state in zip(weights, ref_weights, states, ref_states):
            assert torch.equal(w.isfinite(), ref.isfinite()) and torch.equal(w.isnan(), ref.isnan())
            torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
            for key, value in state.items():
                assert torch.equal(value.isfinite(), ref_state[key].isfinite()), key
                scale = ref_state[key].nan_to_num(nan=0.0, posinf=0.0).abs().max().item()
                torch.testing.assert_close(value, ref_state[key], rtol=1e-4, atol=1e-6 * scale, equal_nan=True)


@pytest.mark.parametrize("nonfinite_grads", ["zero", "propagate"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("code", list(CODES))
def test_a_nonfinite_weight_stays_alone_on_every_backend(code: str, bad: float, nonfinite_grads: str) -> None:
    """One NaN or infinite weight per tensor, decoupled weight decay: on every backend it alone stays
    non-finite and the state stays finite for 3 steps, as the torch path does (the fused kernels added
    0·W to the gradient, which made a NaN weight the whole tensor's NaN: 6000 of 6000 weights)."""
    runs = {b: _contract_run(b, CODES[code], 3, weight=bad, nonfinite_grads=nonfinite_grads) for b in BACKENDS}
    for backend, trace in runs.items():
        weights, states = trace[-1]
        for w, state in zip(weights, states):
            bad_at = (~w.isfinite()).view(-1).nonzero().view(-1).tolist()
            assert bad_at == [PLANTED], (backend, bad_at[:5], len(bad_at))
            assert bool(w.view(-1)[PLANTED].isnan()) == (bad != bad), backend  # NaN stays NaN, inf stays inf
            assert all(bool(v.isfinite().all()) for v in state.values()), backend
        _assert_traces_agree(trace, runs["torch"])


@pytest.mark.parametrize("code", list(CODES))
def test_an_infinite_gradient_under_propagate_is_alike_on_every_backend(code: str) -> None:
    """``nonfinite_grads="propagate"``, one +inf gradient element per tensor at step 2: its weight becomes NaN
    (inf / inf), the capped factor sums keep the state finite, and no other weight becomes NaN in 5 steps, on
    every backend (numba had 7.6% of the weights NaN)."""
    runs = {b: _contract_run(b, CODES[code], 5, grad=float("inf"), nonfinite_grads="propagate") for b in BACKENDS}
    for backend, trace in runs.items():
        for w, state in zip(*trace[-1]):
            assert (~w.isfinite()).view(-1).nonzero().view(-1).tolist() == [PLANTED], backend
            assert all(bool(v.isfinite().all()) for v in state.values()), backend
        _assert_traces_agree(trace, runs["torch"])


@pytest.mark.parametrize("code", list(CODES))
def test_a_nan_weight_under_l2_decay_spreads_alike_on_every_backend(code: str) -> None:
    """L2 decay (``weight_decay_mode="adam"``) adds w·W to the gradient after the non-finite check, so a NaN weight
    is a NaN gradient element that spreads through the factor sums: the same on every backend."""
    runs = {b: _contract_run(b, CODES[code], 3, weight=float("nan"), weight_decay_mode="adam") for b in BACKENDS}
    for trace in runs.values():
        _assert_traces_agree(trace, runs["torch"])


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("magnitude_bits", [0, 3], ids=["paper", "levels"])
def test_a_nan_weight_stays_alone_in_the_fsdp2_shard_pass(magnitude_bits: int) -> None:
    """numba's FSDP2 shard pass, on pieces of a (48, 64) param with a NaN weight in one of them: the factors the
    pieces add up stay finite and equal the torch path's whole step, 3 steps."""
    from helpers import copied_state, levels_step_in_pieces, piece_cuts, step_in_pieces
    from smmf.functional import StepConfig, torch_step_
    from smmf.kernels.numba_cpu import numba_shard_step_
    from smmf.state import MomentumCode, init_state

    gen = torch.Generator().manual_seed(5)
    p = torch.randn(48, 64, generator=gen)
    p.view(-1)[1000] = float("nan")
    state = init_state(p, {"beta": 0.9, "vector_reshape": True, "magnitude_bits": magnitude_bits})
    code = MomentumCode.LEVELS if magnitude_bits else MomentumCode.SIGN
    for step in range(1, 4):
        cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
                         maximize=False, stochastic_rounding=False, code=code)
        g = torch.randn(48, 64, generator=gen)
        whole, whole_state = p.clone(), copied_state(state)
        torch_step_(whole, g, whole_state, cfg)
        if magnitude_bits:
            flat = levels_step_in_pieces(numba_shard_step_, p, g, state, cfg, [0, 16, 16, 30, 48])
        else:
            flat = step_in_pieces(numba_shard_step_, p, g, state, cfg, piece_cuts(p.numel(), 64))
        assert (~flat.isfinite()).nonzero().view(-1).tolist() == [1000]
        torch.testing.assert_close(flat, whole.reshape(-1), rtol=1e-5, atol=1e-5, equal_nan=True)
        for key in ("row_v", "col_v", "row_m", "col_m"):
            if key in state:
                assert bool(state[key].isfinite().all()), key
                torch.testing.assert_close(state[key], whole_state[key], rtol=1e-5, atol=1e-7)
        p, state = whole, whole_state
