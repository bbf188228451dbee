"""Low-precision params, stochastic rounding, state size, and long-run stability."""

from __future__ import annotations

import pytest
import torch

from helpers import state_tensors_bytes
import smmf
from smmf import SMMF
from smmf.functional import write_back_
from smmf.matrix import square_matricize_shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_low_precision_trains_with_fp32_factors(dtype: torch.dtype, backend: str) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16).to(dtype))
    target = torch.randn(16, 16)
    opt = SMMF([w], lr=1e-2, backend=backend)
    first = (w.float() - target).pow(2).sum().item()
    for _ in range(100):
        opt.zero_grad()
        (w.float() - target).pow(2).sum().backward()
        opt.step()
    assert w.dtype == dtype
    assert (w.float() - target).pow(2).sum().item() < 0.8 * first
    for key in ("row_m", "col_m", "row_v", "col_v"):
        assert opt.state[w][key].dtype == torch.float32


def test_fp16_tiny_gradients_do_not_underflow_eps() -> None:
    """In fp16 1e-8 is 0; the math runs in fp32 so tiny and zero grads stay finite."""
    w = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.float16))
    opt = SMMF([w], lr=1e-3, backend="torch")
    for g in (torch.zeros(8, 8), torch.full((8, 8), 1e-7)):
        w.grad = g.to(torch.float16)
        opt.step()
        assert torch.isfinite(w).all()
        assert all(torch.isfinite(v).all() for k, v in opt.state[w].items() if k != "step")


def test_stochastic_rounding_is_unbiased() -> None:
    target = torch.full((20000,), 1.0 + 2.0**-10, dtype=torch.float32)  # 1/8 ulp of bf16 above 1
    nearest = torch.empty(20000, dtype=torch.bfloat16)
    write_back_(nearest, target, rounding_key=None)
    assert torch.equal(nearest.float(), torch.ones(20000))
    rounded = torch.empty(20000, dtype=torch.bfloat16)
    write_back_(rounded, target, rounding_key=12345)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(rounded.float().mean().item() - target[0].item()) < 2e-4


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_stochastic_rounding_moves_bf16_weights_that_nearest_rounding_freezes(backend: str) -> None:
    results = {}
    for sr in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.ones(32, 32, dtype=torch.bfloat16))
        opt = SMMF([w], lr=1e-4, stochastic_rounding=sr, backend=backend)
        for _ in range(50):
            w.grad = torch.ones_like(w)
            opt.step()
        results[sr] = w.float().mean().item()
    assert results[False] == 1.0  # each update is below half an ulp
    assert results[True] < 0.999


def test_recommended_bf16_is_recommended_with_stochastic_rounding_of_bf16_weights_only() -> None:
    """smmf.RECOMMENDED_BF16 moves bf16 weights that smmf.RECOMMENDED's round to nearest freezes, and steps fp32
    weights exactly as smmf.RECOMMENDED does."""
    assert smmf.RECOMMENDED_BF16 == {**smmf.RECOMMENDED, "stochastic_rounding": True}
    ends = {}
    for name, options in (("recommended", smmf.RECOMMENDED), ("bf16", smmf.RECOMMENDED_BF16)):
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.nn.Parameter(torch.ones(32, 32, dtype=dtype))
            opt = SMMF([w], lr=1e-4, **options)
            for _ in range(30):
                w.grad = torch.ones_like(w)
                opt.step()
            ends[name, dtype] = w.detach().clone()
    assert torch.equal(ends["recommended", torch.bfloat16], torch.ones(32, 32, dtype=torch.bfloat16))
    assert ends["bf16", torch.bfloat16].float().mean().item() < 0.999
    assert torch.equal(ends["recommended", torch.float32], ends["bf16", torch.float32])
    assert ends["bf16", torch.float32].mean().item() < 0.999


def test_stochastic_rounding_asked_for_fp16_weights_warns_once_that_it_rounds_to_nearest() -> None:
    """fp16 weights with ``stochastic_rounding=True`` were rounded to nearest without a word. It warns once per
    optimizer (at the first step, not for its second fp16 group nor for the steps after), and bf16 and fp32 groups do
    not warn."""
    import warnings

    half = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.float16))
    other = [torch.nn.Parameter(torch.ones(8, 8, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = SMMF(other, stochastic_rounding=True)
        for param in other:
            param.grad = torch.ones_like(param)
        quiet.step()
        assert not [w for w in caught if "stochastic_rounding" in str(w.message)]
        vector = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        opt = SMMF([{"params": [half]}, {"params": [vector]}], stochastic_rounding=True)
        for _ in range(3):
            half.grad, vector.grad = torch.ones_like(half), torch.ones_like(vector)
            opt.step()
    said = [w for w in caught if "stochastic_rounding" in str(w.message)]
    assert len(said) == 1 and "fp16 weights are rounded to nearest" in str(said[0].message), said


def test_a_param_swapped_out_of_its_group_is_not_kept_alive() -> None:
    """Accelerate's FSDP2 flow builds the optimizer on the unsharded model, then swaps the groups' params for their
    shards: SMMF held every param it was given, so each rank kept the whole unsharded model resident. It frees
    them, as torch's optimizers do, and steps the new params."""
    import gc
    import weakref

    for make in (SMMF, torch.optim.AdamW):
        param = torch.nn.Parameter(torch.randn(64, 64))
        gone = weakref.ref(param)
        opt = make([param])
        swapped = torch.nn.Parameter(torch.randn(32, 64))
        opt.param_groups[0]["params"] = [swapped]
        del param
        gc.collect()
        assert gone() is None, make.__name__
        swapped.grad = torch.ones_like(swapped)
        opt.step()
        assert opt.state[swapped]["step"] not in (None, 0)


_NUMBA = "numba" in __import__("smmf.kernels", fromlist=["x"]).available_backends()


def _rounded_bf16_run(seed: int, shape: tuple[int, ...], steps: int = 3, **options) -> torch.Tensor:
    """bf16 weights after ``steps`` stochastically rounded steps: the same weights and gradients whatever
    ``seed``, which seeds torch's generator only (and it draws between steps, as dropout would)."""
    data = torch.Generator().manual_seed(123)
    w = torch.nn.Parameter(torch.randn(*shape, generator=data).bfloat16())
    grads = [torch.randn(*shape, generator=data).bfloat16() for _ in range(steps)]
    opt = SMMF([w], lr=1e-3, stochastic_rounding=True, **options)
    torch.manual_seed(seed)
    for grad in grads:
        w.grad = grad
        opt.step()
        torch.rand(seed + 1)
    return w.detach().view(torch.int16).clone()


_BACKENDS = ["torch"] + (["numba"] if _NUMBA else [])


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("code", [{}, {"magnitude_bits": 1}, {"magnitude_bits": 3}], ids=["paper", "flag", "levels"])
@pytest.mark.parametrize("shape", [(40, 24), (300, 300)], ids=["serial", "parallel"])
def test_stochastic_rounding_is_decided_by_the_step_not_torch_seed(backend: str, code: dict,
                                                                   shape: tuple[int, int]) -> None:
    """The noise is a hash of the step, the param's place and the element's index (``smmf.noise.rounding_key``):
    runs under other seeds, whose generators draw otherwise between steps, round bit for bit alike (DDP replicas
    seeded per rank stay equal; a resume is exact without torch's RNG state), and the step leaves torch's
    generator as it was."""
    first = _rounded_bf16_run(0, shape, backend=backend, **code)
    assert torch.equal(first, _rounded_bf16_run(1, shape, backend=backend, **code))
    w = torch.nn.Parameter(torch.randn(*shape).bfloat16())
    opt = SMMF([w], lr=1e-3, stochastic_rounding=True, backend=backend, **code)
    w.grad = torch.randn_like(w)
    before = torch.get_rng_state()
    opt.step()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(not _NUMBA, reason="no numba")
@pytest.mark.parametrize("code", [{}, {"magnitude_bits": 3}], ids=["paper", "levels"])
def test_numba_rounds_bf16_with_the_torch_paths_noise(code: dict) -> None:
    """Updates every path computes exactly (−2⁻⁹, half a bf16 ulp below 1: with β1 = 0 and γ = 0, M = G = 1 and
    V = G² = 1 at every step), rounded by both paths: the same bits, each param by its own key at each step (the
    two params, and the two steps, round apart), as ``write_back_`` rounds them with ``rounding_key(step, ordinal)``."""
    from smmf.noise import rounding_key

    runs: dict[str, list[list[torch.Tensor]]] = {}
    for backend in ("torch", "numba"):
        params = [torch.nn.Parameter(torch.ones(64, 48, dtype=torch.bfloat16)) for _ in range(2)]
        opt = SMMF(params, lr=2.0**-9, beta=0.0, decay_rate=0.0, stochastic_rounding=True, backend=backend, **code)
        runs[backend] = []
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            runs[backend].append([p.detach().clone() for p in params])
    for step in (1, 2):
        for ordinal in range(2):
            before = torch.ones(64, 48) if step == 1 else runs["torch"][0][ordinal].float()
            expected = torch.empty(64, 48, dtype=torch.bfloat16)
            write_back_(expected, before - 2.0**-9, rounding_key=rounding_key(step, ordinal))
            got = [runs[backend][step - 1][ordinal] for backend in ("torch", "numba")]
            assert torch.equal(got[0], expected) and torch.equal(got[1], expected), (step, ordinal)
    first_step = runs["torch"][0]
    assert 0.3 < (first_step[0] != 1).float().mean().item() < 0.7
    assert not torch.equal(first_step[0], first_step[1])
    moved_again = runs["torch"][1][0] != first_step[0]
    assert not torch.equal(moved_again, first_step[0] != 1)  # the second step drew other noise


def test_torch_path_rounding_adds_the_hash_of_the_index_and_keeps_nan() -> None:
    """``write_back_`` under a key: the top 16 bits of mix32(key + first + i) below bf16's kept bits, then
    truncated (infinities, the largest finite values, zeros and subnormals too; across a chunk's end and past 2³²
    of the index); NaN stays NaN. Without a key, nearest even. A bf16 step rounded stochastically without a key
    is refused."""
    from smmf.functional import StepConfig, torch_step_
    from smmf.noise import mix32
    from smmf.state import MomentumCode, init_state

    big = torch.finfo(torch.float32).max
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), big, -big, 0.0, -0.0, 1e-40, -1e-40])
    values = torch.cat([special, torch.randn((1 << 20) + 100, generator=torch.Generator().manual_seed(0)) * 10])
    key, first = 2**32 - 77, 5
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    write_back_(out, values, rounding_key=key, first=first)
    index = (torch.arange(values.numel(), dtype=torch.int64) + first + key) & 0xFFFFFFFF
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    expected = (((bits + (mix32(index) >> 16)) >> 16) & 0xFFFF).to(torch.int32)
    finite = ~values.isnan()
    assert torch.equal((out.view(torch.int16).to(torch.int32) & 0xFFFF)[finite], expected[finite])
    assert out[~finite].isnan().all()
    nearest = torch.empty_like(out)
    write_back_(nearest, values, rounding_key=None)
    assert torch.equal(nearest[finite], values[finite].bfloat16())

    w = torch.ones(8, 8, dtype=torch.bfloat16)
    cfg = StepConfig(lr=1e-3, beta1=None, beta2=0.0, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                     maximize=False, stochastic_rounding=True, code=MomentumCode.NO_M)
    with pytest.raises(ValueError, match="rounding_key"):
        torch_step_(w, torch.ones_like(w), init_state(w, {"beta": None, "vector_reshape": True}), cfg)
    assert torch.equal(w, torch.ones_like(w))


@pytest.mark.skipif(not _NUMBA, reason="no numba")
def test_numba_stochastic_rounding_is_unbiased() -> None:
    """Updates of 1/78 of an ulp, 50 steps: the rounded bf16 weights' mean lands on the fp32 run's."""
    means = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.ones(256, 256, dtype=dtype))
        opt = SMMF([w], lr=1e-4, stochastic_rounding=True, backend="numba")
        for _ in range(50):
            w.grad = torch.ones_like(w)
            opt.step()
        means[dtype] = w.double().mean().item()
    assert means[torch.float32] < 0.999
    assert abs(means[torch.bfloat16] - means[torch.float32]) < 2e-4  # ~8 standard deviations of the mean


def test_state_bytes_follow_the_formula() -> None:
    shapes = [(12564, 768), (2304, 768), (768, 3072), (768,), (64, 3, 7, 7), (13,), ()]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = SMMF(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    expected = 0
    for p in params:
        n, m = square_matricize_shape(p.numel())
        expected += (n * m + 7) // 8 + 4 * 2 * (n + m)
    assert state_tensors_bytes(opt) == expected
    adam = torch.optim.Adam(params)
    adam.step()
    assert state_tensors_bytes(adam) > 50 * expected


@pytest.mark.slow
def test_long_run_stays_finite() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = SMMF(model.parameters(), lr=1e-3, weight_decay=1e-4)
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    for _ in range(10_000):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(v).all() for st in opt.state.values() for k, v in st.items() if k != "step")


def test_rejected_param_group_is_not_added() -> None:
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = SMMF([p])
    with pytest.raises(ValueError, match="Invalid decay_rate: 3"):
        opt.add_param_group({"params": [q], "decay_rate": 3})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "decay_rate": -0.8})
    assert opt.param_groups[1]["decay_rate"] == -0.8 and opt.param_groups[1]["lr"] == 1e-3


@pytest.mark.skipif("numba" not in __import__("smmf.kernels", fromlist=["x"]).available_backends(), reason="no numba")
def test_named_backend_that_cannot_take_a_param_fails_before_any_update() -> None:
    ok = torch.nn.Parameter(torch.randn(4, 4))
    half = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    opt = SMMF([ok, half], backend="numba")
    ok.grad, half.grad = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float16)
    before = ok.detach().clone()
    with pytest.raises(RuntimeError, match="backend 'numba' cannot update a torch.float16 parameter"):
        opt.step()
    assert torch.equal(ok, before) and len(opt.state) == 0

