"""The fused kernels behave like the torch ops they replace: autograd sees their in-place writes,
finite gradients keep the state finite under every code of M, non-finite ones propagate alike on
every backend, ``torch.compile`` of a training step works, and a step that raises changes nothing."""

from __future__ import annotations

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS, assert_unchanged, run_script, snapshot_of
from smmf import SMMF
from smmf.dispatch import Kernel

BACKENDS = ["torch", *CPU_FUSED_BACKENDS]


def _net(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [32, 5000], ids=["shared_launch", "own_launch"])
@pytest.mark.parametrize("magnitude_bits", [0, 1], ids=["paper", "flag"])
@pytest.mark.parametrize("bump_many", [True, False], ids=["one_bump", "a_bump_per_tensor"])
def test_autograd_refuses_a_graph_whose_weights_the_step_changed(backend: str, width: int, magnitude_bits: int,
                                                                 bump_many: bool, monkeypatch) -> None:
    """Either way of bumping versions: one call for a launch, or one per tensor where torch's
    increment_version takes a single tensor (older torch)."""
    from smmf import dispatch as optimizer

    if bump_many and not optimizer._VERSION_BUMP_TAKES_MANY:
        pytest.skip("this torch's increment_version takes one tensor")
    monkeypatch.setattr(optimizer, "_VERSION_BUMP_TAKES_MANY", bump_many)
    net = _net(width)
    opt = SMMF(net.parameters(), backend=backend, magnitude_bits=magnitude_bits)
    loss = net(torch.randn(4, 16)).pow(2).mean()
    loss.backward(retain_graph=True)
    versions = [p._version for p in net.parameters()]
    opt.step()
    assert all(p._version > v for p, v in zip(net.parameters(), versions))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _huge(kind: str) -> torch.Tensor:
    g = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    if kind == "two_elements":
        g[0, 0] = g[5, 7] = 3e38
        return g
    return g * 1e20


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("momentum_shape", ["square", "natural"])
@pytest.mark.parametrize("kind", ["two_elements", "scaled_by_1e20"])
def test_finite_gradients_keep_the_magnitude_flag_finite(backend: str, momentum_shape: str, kind: str) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256, 256))
    opt = SMMF([p], magnitude_bits=1, momentum_shape=momentum_shape, backend=backend)
    p.grad = _huge(kind)
    opt.step()
    for _ in range(3):
        p.grad = torch.randn(256, 256)
        opt.step()
        assert bool(p.isfinite().all())
        assert all(bool(t.isfinite().all()) for t in opt.state[p].values() if isinstance(t, torch.Tensor)
                   and t.is_floating_point())


def test_the_issue_flag_reproducer() -> None:
    p = torch.nn.Parameter(torch.randn(64, 48))
    o = SMMF([p], magnitude_bits=1)
    g = torch.randn(64, 48)
    g[0, 0] = g[5, 7] = 3e38
    p.grad = g
    o.step()
    p.grad = torch.randn(64, 48)
    o.step()
    assert bool(p.isfinite().all())


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs a fused CPU kernel")
@pytest.mark.parametrize("momentum_shape", ["square", "natural"])
@pytest.mark.parametrize("magnitude_bits", [0, 1], ids=["paper", "flag"])
def test_nonfinite_gradients_propagate_alike_on_every_backend(momentum_shape: str, magnitude_bits: int) -> None:
    """``nonfinite_grads="propagate"``: one NaN gradient element spreads through the factors; every
    backend gives the same NaN pattern, factors and levels at each step."""
    runs = {}
    for backend in BACKENDS:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 48))
        opt = SMMF([p], magnitude_bits=magnitude_bits, momentum_shape=momentum_shape, nonfinite_grads="propagate",
                   backend=backend)
        gen = torch.Generator().manual_seed(2)
        trace = []
        for step in range(5):
            g = torch.randn(64, 48, generator=gen)
            if step == 1:
                g[3, 4] = float("nan")
            p.grad = g
            opt.step()
            trace.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()
                                               if isinstance(v, torch.Tensor) and v.is_floating_point()}))
        runs[backend] = trace
    reference = runs.pop("torch")
    for trace in runs.values():
        for (w, state), (w_ref, state_ref) in zip(trace, reference):
            assert torch.equal(w.isnan(), w_ref.isnan())
            torch.testing.assert_close(w, w_ref, equal_nan=True, rtol=1e-5, atol=1e-5)
            for key, value in state.items():
                torch.testing.assert_close(value, state_ref[key], equal_nan=True, rtol=1e-4, atol=1e-6)


def test_the_issue_compile_reproducer() -> None:
    p = torch.nn.Parameter(torch.randn(300, 300))
    o = SMMF([p])
    before = p.detach().clone()

    @torch.compile(backend="eager")
    def step() -> None:
        p.grad = torch.ones_like(p)
        o.step()

    step()
    assert o.state[p]["step"] == 1 and not torch.equal(p, before)


def test_importing_smmf_leaves_dynamo_unloaded() -> None:
    """The graph break on the step is dynamo's lazy disable: ``torch.compiler.disable`` imported
    torch._dynamo with smmf, which made ``import smmf`` take twice as long as ``import torch``."""
    out = run_script("import sys, smmf, smmf.bench.compare\n"
                     "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"  # (torch's C extension, torch._C._dynamo, comes with torch)


def _train(compile_backend: str | None, backend: str, steps: int = 4) -> list[torch.Tensor]:
    net = _net(5000)  # the 5000×16 weight takes its own launch, the small tensors the shared one
    opt = SMMF(net.parameters(), lr=1e-2, backend=backend)
    model = torch.compile(net, backend=compile_backend) if compile_backend else net

    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if compile_backend:
        train_step = torch.compile(train_step, backend=compile_backend)
    for step in range(steps):
        train_step(torch.randn(8, 16, generator=torch.Generator().manual_seed(step)))
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_a_compiled_model_and_training_step_equal_the_eager_run(backend: str, compile_backend: str) -> None:
    torch._dynamo.reset()
    eager, compiled = _train(None, backend), _train(compile_backend, backend)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fail_at", [0, 1], ids=["first_step", "later_step"])
def test_a_step_that_raises_in_its_kernel_leaves_params_and_state_as_they_were(backend: str, fail_at: int,
                                                                              monkeypatch) -> None:
    import smmf.optimizer

    net = _net(300)
    opt = SMMF(net.parameters(), backend=backend)
    for _ in range(fail_at):
        net(torch.randn(2, 16)).sum().backward()
        opt.step()
    net(torch.randn(2, 16)).sum().backward()
    before = snapshot_of(opt, list(net.parameters()))
    real = smmf.optimizer.step_kernel

    def failing_kernel(*args, **kwargs):
        raise RuntimeError("the kernel failed to compile")

    for batched in (False, True):  # one tensor per call, or all of them in one
        failing = Kernel("failing", failing_kernel, batched=batched, raw_writes=True)
        monkeypatch.setattr(smmf.optimizer, "step_kernel", lambda *args: failing)
        with pytest.raises(RuntimeError, match="failed to compile"):
            opt.step()
        assert_unchanged(opt, list(net.parameters()), before)
    monkeypatch.setattr(smmf.optimizer, "step_kernel", real)
    opt.step()  # and the same step then runs as it would have
    assert all(st["step"] == fail_at + 1 for st in opt.state.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_warning_raised_as_an_error_after_the_kernel_wrote_keeps_the_step_counted(backend: str) -> None:
    """Under ``-W error`` the non-finite warning raises after the kernel wrote: the step happened, and
    its count says so."""
    import warnings

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = SMMF([p], backend=backend)
    p.grad = torch.randn(8, 8)
    opt.step()
    before = p.detach().clone()
    g = torch.randn(8, 8)
    g[0, 0] = float("nan")
    p.grad = g
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="NaN/inf"):
            opt.step()
    assert not torch.equal(p, before) and opt.state[p]["step"] == 2
