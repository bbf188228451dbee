"""CUDA: the Triton kernel is the default there, deterministic, and its checkpoints move between
devices. Skipped without CUDA and triton (CI); the generic registry, the fused-vs-torch parity and
the resume tests also run the Triton kernel on CUDA params (see ``helpers.BACKEND_DEVICE``)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from helpers import HAS_CUDA
from smmf import SMMF
from smmf.functional import StepConfig, torch_step_
from smmf.dispatch import step_kernel
from smmf.kernels import available_backends
from smmf.state import MomentumCode, init_state

pytestmark = pytest.mark.skipif(not HAS_CUDA or "triton" not in available_backends(), reason="needs CUDA and triton")

# Several bands and column tiles; 1001×999 is not a multiple of 8 wide (sign bits via the scratch).
LARGE_SHAPES = [(1000, 1000), (999, 1001), (4096, 1536)]


def _cfg(step: int, **overrides) -> StepConfig:
    args = dict(lr=1e-2, beta1=0.9 * 0.999 ** (step - 1), beta2=1 - step**-0.8, eps=1e-8, weight_decay=0.0,
                decoupled_weight_decay=True, maximize=False, stochastic_rounding=False, code=MomentumCode.SIGN)
    return StepConfig(**(args | overrides))


def test_auto_takes_triton_for_cuda_params_and_torch_for_the_rest() -> None:
    sign, flag, dense = MomentumCode.SIGN, MomentumCode.FLAG, MomentumCode.DENSE
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.complex64):
        assert step_kernel("auto", torch.zeros(8, 8, dtype=dtype, device="cuda"), sign).name == "triton"
    # the magnitude flag: Triton takes it too, named or under auto
    assert step_kernel("auto", torch.zeros(8, 8, device="cuda"), flag).name == "triton"
    assert step_kernel("triton", torch.zeros(8, 8, device="cuda"), flag).name == "triton"
    fp64 = torch.zeros(8, 8, dtype=torch.float64, device="cuda")
    assert step_kernel("auto", fp64, sign).name == "torch"
    assert step_kernel("auto", torch.zeros(8, device="cuda"), dense).name == "torch"
    with pytest.raises(RuntimeError, match="backend 'triton' cannot update a torch.float64 parameter"):
        step_kernel("triton", fp64, sign)
    with pytest.raises(RuntimeError, match="backend 'triton' cannot update a torch.float32 parameter on cpu"):
        step_kernel("triton", torch.zeros(8, 8), sign)


@pytest.mark.parametrize("shape", LARGE_SHAPES)
def test_large_tensors_match_the_torch_path_step_by_step(shape: tuple[int, int]) -> None:
    """From identical inputs each step, over 5 steps: weights within 1e-6, factors within 1e-5."""
    from smmf.kernels.triton_gpu import triton_step_

    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=gen)
    state = init_state(p, {"beta": 0.9, "vector_reshape": True})
    for step in range(1, 6):
        g = torch.randn(shape, device="cuda", generator=gen)
        q, fused_state = p.clone(), copy.deepcopy(state)
        torch_step_(p, g, state, _cfg(step))
        triton_step_(q, g, fused_state, _cfg(step))
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        for key in ("row_m", "col_m", "row_v", "col_v"):
            torch.testing.assert_close(fused_state[key], state[key], rtol=1e-5, atol=1e-5 * state[key].abs().max().item())
        differing = (fused_state["sign_m"] != state["sign_m"]).sum().item()
        assert differing <= 1e-4 * state["sign_m"].numel()  # only |M| at float-noise level may flip
        p.copy_(q)
        state = fused_state


@pytest.mark.parametrize("shape", LARGE_SHAPES)
def test_the_step_is_deterministic(shape: tuple[int, int]) -> None:
    """The same step from the same state, twice: bit-identical weights, factors and signs."""
    from smmf.kernels.triton_gpu import triton_step_

    gen = torch.Generator(device="cuda").manual_seed(1)
    p = torch.randn(shape, device="cuda", generator=gen)
    state = init_state(p, {"beta": 0.9, "vector_reshape": True})
    for step in range(1, 4):
        triton_step_(p, torch.randn(shape, device="cuda", generator=gen), state, _cfg(step))
    g = torch.randn(shape, device="cuda", generator=gen)
    outcomes = []
    for _ in range(2):
        q, st = p.clone(), copy.deepcopy(state)
        triton_step_(q, g, st, _cfg(4))
        outcomes.append((q, st))
    (q1, s1), (q2, s2) = outcomes
    assert torch.equal(q1, q2)
    for key in ("row_m", "col_m", "row_v", "col_v", "sign_m"):
        assert torch.equal(s1[key], s2[key]), key


def _grads(shapes: list[torch.Size], steps: range) -> list[list[torch.Tensor]]:
    out = []
    for s in steps:
        gen = torch.Generator().manual_seed(100 + s)
        out.append([torch.randn(shape, generator=gen) for shape in shapes])
    return out


def _continue(params: list[torch.nn.Parameter], opt: SMMF, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.device)
        opt.step()


@pytest.mark.parametrize("src,dst", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_cuda_and_cpu(src: str, dst: str) -> None:
    """Saved on one device (its default kernel), loaded on the other: the state arrives bit for bit and
    the run continues as it does on the device it was saved on."""
    torch.manual_seed(0)
    shapes = [torch.Size(s) for s in [(64, 48), (31, 9), (40, 3, 3, 3), (13,)]]
    params = [torch.nn.Parameter(torch.randn(s, device=src)) for s in shapes]
    opt = SMMF(params, lr=1e-2, weight_decay=0.01)
    _continue(params, opt, _grads(shapes, range(5)))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True, map_location=dst)
    moved = [torch.nn.Parameter(t.clone()) for t in checkpoint["params"]]
    opt_moved = SMMF(moved, lr=1e-2, weight_decay=0.01)
    opt_moved.load_state_dict(checkpoint["optim"])
    for p, q in zip(params, moved):
        for key, value in opt.state[p].items():
            loaded = opt_moved.state[q][key]
            if isinstance(value, torch.Tensor):
                assert loaded.device.type == dst and loaded.dtype == value.dtype
                assert torch.equal(loaded.cpu(), value.cpu()), key
            else:
                assert loaded == value
    later = _grads(shapes, range(5, 10))
    _continue(params, opt, later)
    _continue(moved, opt_moved, later)
    for p, q in zip(params, moved):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_bf16_stochastic_rounding_keeps_updates_below_half_an_ulp() -> None:
    """bf16 has 8 bits of mantissa: an update of 1/8 ulp vanishes with nearest rounding, while
    stochastic rounding moves the weights by it on average."""
    def run(stochastic: bool) -> float:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.ones(256, 256, dtype=torch.bfloat16, device="cuda"))
        opt = SMMF([p], lr=2**-10, beta=None, growth_rate=None, stochastic_rounding=stochastic)
        for _ in range(32):
            p.grad = torch.ones_like(p)
            opt.step()
        return 1.0 - p.float().mean().item()

    assert run(stochastic=False) == 0.0
    assert run(stochastic=True) == pytest.approx(32 * 2**-10, rel=0.1)


def test_measured_cuda_state_matches_the_prediction() -> None:
    """`smmf memory --measure cuda` on one of the paper's rows: SMMF within 1% of the 512-B prediction."""
    from smmf.bench.memory import PAPER_TABLES, measure_row

    table = next(t for t in PAPER_TABLES if t.title == "Fine-tuning")
    row = next(r for r in table.rows if r.spec.name == "ALBERT-base-v2")
    entries = {e["optimizer"]: e for e in measure_row(row, table.unit, "cuda")}
    assert abs(entries["smmf"]["measured_vs_ours_pct"]) < 1.0
    assert abs(entries["adam"]["measured_vs_ours_pct"]) < 1.0


def _cuda_net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)).to("cuda", dtype)


def _cuda_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=gen).to("cuda", next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("options", [{}, {"momentum_shape": "natural"}, {"magnitude_bits": 1}, {"magnitude_bits": 3}],
                         ids=["paper", "natural", "flag", "levels"])
def test_step_in_backward_on_cuda_equals_the_loop(k: int, options: dict) -> None:
    """The hooks fire on the autograd engine's CUDA thread: the Triton step there equals the loop's."""
    from smmf import step_in_backward

    loop, hooked = _cuda_net(), _cuda_net()
    opt_loop = SMMF(loop.parameters(), lr=1e-2, **options)
    opt = SMMF(hooked.parameters(), lr=1e-2, **options)
    step_in_backward(opt, accumulation_steps=k)
    for window in range(4):
        for micro in range(k):
            _cuda_loss(loop, window * k + micro).backward()
            _cuda_loss(hooked, window * k + micro).backward()
        opt_loop.step()
        opt_loop.zero_grad()
        assert all(p.grad is None for p in hooked.parameters())
    for p, q in zip(loop.parameters(), hooked.parameters()):
        assert torch.equal(p, q)


def test_the_triton_step_bumps_the_versions_autograd_checks() -> None:
    net = _cuda_net()
    opt = SMMF(net.parameters())
    loss = _cuda_loss(net, 0)
    loss.backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_compiled_training_step_on_cuda_equals_eager() -> None:
    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        net = _cuda_net()
        opt = SMMF(net.parameters(), lr=1e-2)

        def train_step(step: int) -> None:
            _cuda_loss(net, step).backward()
            opt.step()
            opt.zero_grad()

        fn = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        for step in range(3):
            fn(step)
        return [p.detach().clone() for p in net.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_a_param_off_16_bytes_takes_the_plain_loads_and_matches() -> None:
    """A param viewed at an odd offset of its storage cannot be read 16 bytes at a time: the launch
    leaves out the hints (host._vector) and the step still matches the torch path."""
    from smmf.kernels.triton_gpu import triton_step_
    from smmf.kernels.triton_gpu.host import _vector

    gen = torch.Generator(device="cuda").manual_seed(3)
    storage = torch.randn(1 + 640 * 256, device="cuda", generator=gen)
    p = storage[1:].view(640, 256)
    state = init_state(p, {"beta": 0.9, "vector_reshape": True})
    assert not _vector(p, p, state, 256, 0, p.numel())
    for step in range(1, 4):
        g = torch.randn(p.shape, device="cuda", generator=gen)
        q, fused_state = p.clone(), copy.deepcopy(state)
        torch_step_(q, g, state, _cfg(step))
        triton_step_(p, g, fused_state, _cfg(step))
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        state = fused_state


def test_the_cuda_training_study_measures_its_peak() -> None:
    pytest.importorskip("transformers")
    from smmf.bench.training_cuda import train

    for config in ("AdamW(fused)", "SMMF + step in backward, bf16 weights (SR)"):
        found = train((2, 64, 2), 2, 32, config, torch.device("cuda"), warm=1, timed=1)
        assert found["peak"] > found["weights"] + found["grads"] + found["state"]
