"""The optimizer equals the dense reference of Algorithm 1 (float64, 1e-10) on every path."""

from __future__ import annotations

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS, make_zoo, random_grad, reconstruct_state
from reference import ReferenceSMMF
from smmf import SMMF

CONFIGS = {
    "defaults": dict(),
    "adamw-decay": dict(weight_decay=0.1, weight_decay_mode="adamw"),
    "adam-l2-decay": dict(weight_decay=0.5, weight_decay_mode="adam"),
    "no-first-moment": dict(beta=None, growth_rate=None),
    "maximize": dict(maximize=True),
    "dense-vectors": dict(vector_reshape=False, decay_rate=-0.8),
    "constant-beta1": dict(growth_rate=None, decay_rate=-1.0),
    # Beyond the paper: the numba kernel takes them all (the flag in two passes).
    "natural-shape": dict(momentum_shape="natural"),
    "magnitude-flag": dict(magnitude_bits=1),
    "natural-shape-and-flag": dict(momentum_shape="natural", magnitude_bits=1, weight_decay=0.1),
    "levels": dict(magnitude_bits=3, weight_decay=0.1),
    "levels-adam-l2": dict(magnitude_bits=3, weight_decay=0.5, weight_decay_mode="adam", maximize=True),
    "levels-stochastic": dict(magnitude_bits=3, momentum_rounding="stochastic", weight_decay=0.1),
}
STEPS = 12
FROZEN_STEPS = (4, 5, 9)  # the 4-D param gets no grad on these steps


def _run_pair(config: dict, backend: str) -> tuple[float, float]:
    params = make_zoo()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SMMF(params, lr=1e-2, backend=backend, **config)
    ref = ReferenceSMMF(ref_params, lr=1e-2, **config)
    gen = torch.Generator().manual_seed(1)
    worst_param = worst_state = 0.0
    for step in range(1, STEPS + 1):
        for i, (p, rp) in enumerate(zip(params, ref_params)):
            frozen = p.dim() == 4 and step in FROZEN_STEPS and i == 3
            grad = None if frozen else random_grad(p, gen, non_contiguous=step % 2 == 0)
            p.grad = grad
            rp.grad = None if grad is None else grad.clone()
        opt.step()
        ref.step()
        for p, rp in zip(params, ref_params):
            worst_param = max(worst_param, (p - rp).abs().max().item() if p.numel() else 0.0)
            rst = ref.state[id(rp)]
            m, v = reconstruct_state(opt, p)
            worst_state = max(worst_state, _max_diff(v, rst.v_hat))
            if config.get("beta", 0.9) is not None:
                worst_state = max(worst_state, _max_diff(m, rst.m_hat))
            else:
                assert m is None, "beta=None must keep no first moment"
    return worst_param, worst_state


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("backend", ["torch", *CPU_FUSED_BACKENDS])  # fp64: CPU kernels
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_dense_reference(config: dict, backend: str) -> None:
    worst_param, worst_state = _run_pair(config, backend)
    assert worst_param <= 1e-10
    assert worst_state <= 1e-10


def test_the_numba_kernel_takes_every_momentum_code() -> None:
    """The parity above is the numba kernel's own, not a silent fallback to the torch path."""
    from smmf.dispatch import step_kernel
    from smmf.state import momentum_code

    p = torch.nn.Parameter(torch.randn(12, 30, dtype=torch.float64))
    for backend in CPU_FUSED_BACKENDS:
        for options in CONFIGS.values():
            group = {"beta": 0.9, "vector_reshape": True, **options}
            assert step_kernel(backend, p, momentum_code(p, group)).name == backend


def test_natural_shape_equal_to_the_square_one_stays_on_the_fused_kernel() -> None:
    from smmf.dispatch import step_kernel
    from smmf.state import momentum_code

    p = torch.nn.Parameter(torch.randn(31, 9))  # square matricization of 279 is 31×9 too
    group = {"beta": 0.9, "vector_reshape": True, "momentum_shape": "natural", "magnitude_bits": 0}
    for backend in CPU_FUSED_BACKENDS:
        assert step_kernel(backend, p, momentum_code(p, group)).name == backend


def test_groups_carry_their_own_options() -> None:
    """Two groups, one per weight-decay mode, each equal to a reference with its options."""
    a, b = make_zoo(seed=2)[:4], make_zoo(seed=3)[:4]
    ref_a = ReferenceSMMF([torch.nn.Parameter(p.detach().clone()) for p in a], lr=1e-2, weight_decay=0.5, weight_decay_mode="adam")
    ref_b = ReferenceSMMF(
        [torch.nn.Parameter(p.detach().clone()) for p in b], lr=3e-2, weight_decay=0.2, decay_rate=-0.8, beta=None, growth_rate=None
    )
    opt = SMMF(
        [
            dict(params=a, weight_decay=0.5, weight_decay_mode="adam"),
            dict(params=b, lr=3e-2, weight_decay=0.2, decay_rate=-0.8, beta=None, growth_rate=None),
        ],
        lr=1e-2,
    )
    gen = torch.Generator().manual_seed(4)
    for _ in range(10):
        for ps, ref in ((a, ref_a), (b, ref_b)):
            for p, rp in zip(ps, ref.params):
                p.grad = random_grad(p, gen, non_contiguous=False)
                rp.grad = p.grad.clone()
        opt.step()
        ref_a.step()
        ref_b.step()
    for ps, ref in ((a, ref_a), (b, ref_b)):
        for p, rp in zip(ps, ref.params):
            torch.testing.assert_close(p, rp, rtol=0, atol=1e-10)


def test_adam_mode_weight_decay_is_not_a_no_op() -> None:
    """The authors' code computes L2 decay into an unused variable; ours must change the result."""
    results = []
    for wd in (0.0, 0.5):
        p = torch.nn.Parameter(torch.full((4, 4), 3.0, dtype=torch.float64))
        opt = SMMF([p], lr=1e-2, weight_decay=wd, weight_decay_mode="adam")
        for _ in range(3):
            p.grad = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4)
            opt.step()
        results.append(p.detach().clone())
    assert not torch.equal(results[0], results[1])


def test_vector_reshape_false_keeps_dense_moments() -> None:
    p = torch.nn.Parameter(torch.randn(10))
    q = torch.nn.Parameter(torch.randn(3, 4))
    opt = SMMF([p, q], vector_reshape=False)
    p.grad, q.grad = torch.randn(10), torch.randn(3, 4)
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[p]["exp_avg"].shape == (10,)
    assert "sign_m" in opt.state[q]
