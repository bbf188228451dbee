"""Beyond the paper, opt-in: M in the tensor's natural shape, the 1-bit magnitude flag, and the block-levels
code (``magnitude_bits=3``).

The math is checked against the dense reference in test_reference_parity.py; here: the options'
contract (validation, state layout and size, checkpoints).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import reconstruct_state
from smmf import SMMF
from smmf.memory import predict_state_bytes, state_bytes

NATURAL_FLAG = dict(momentum_shape="natural", magnitude_bits=1)
LEVELS = dict(magnitude_bits=3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))


def _train(opt: SMMF, model: torch.nn.Module, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(momentum_shape="cube"), "Unknown momentum_shape: 'cube'"),
        (dict(magnitude_bits=2), r"magnitude_bits should be one of \[0, 1, 3\] but is: 2"),
        (dict(magnitude_bits=True), "magnitude_bits should be one of"),
        (dict(magnitude_bits="1"), "magnitude_bits should be one of"),
    ],
)
def test_bad_options_are_clear_errors(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SMMF([torch.nn.Parameter(torch.zeros(2, 3))], **options)


def test_layout_natural_rows_are_dim_0_and_vectors_stay_square() -> None:
    model = _model()
    opt = SMMF(model.parameters(), **NATURAL_FLAG)
    _train(opt, model, 1)
    conv, conv_bias, linear, _ = model.parameters()
    st = opt.state[conv]
    assert (st["row_m"].numel(), st["col_m"].numel()) == (8, 27)  # out_channels × the rest
    assert (st["row_v"].numel(), st["col_v"].numel()) == (18, 12)  # V stays square (216 = 18·12)
    assert st["flag_m"].dtype == torch.uint8 and st["flag_m"].numel() == st["sign_m"].numel() == 27
    assert st["levels_m"].shape == (2,) and st["levels_m"][0] >= st["levels_m"][1] >= 0
    assert (opt.state[conv_bias]["row_m"].numel(), opt.state[conv_bias]["col_m"].numel()) == (4, 2)  # 1-D: square
    assert (opt.state[linear]["row_m"].numel(), opt.state[linear]["col_m"].numel()) == (10, 288)


@pytest.mark.parametrize("options", [dict(), dict(momentum_shape="natural"), dict(magnitude_bits=1), NATURAL_FLAG,
                                     LEVELS], ids=["paper", "natural", "flag", "natural+flag", "levels"])
def test_state_is_the_predicted_size(options: dict) -> None:
    model = _model()
    opt = SMMF(model.parameters(), **options)
    _train(opt, model, 1)
    assert state_bytes(opt) == predict_state_bytes(model, "smmf", **options)


def test_the_flag_costs_one_bit_per_element_plus_two_levels_per_tensor() -> None:
    shapes = [(128, 512), (50257, 768), (768,)]
    paper = predict_state_bytes(shapes, "smmf")
    flag = predict_state_bytes(shapes, "smmf", magnitude_bits=1)
    assert flag - paper == sum(math.ceil(math.prod(s) / 8) + 2 * 4 for s in shapes)


def test_flag_decodes_what_was_encoded() -> None:
    """The decoded M̂ is the flag's two-level code of the M that was just formed (first step: M = (1−β1)·G)."""
    p = torch.nn.Parameter(torch.zeros(6, 10, dtype=torch.float64))
    g = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    p.grad = g
    opt = SMMF([p], beta=0.9, growth_rate=None, **NATURAL_FLAG)
    opt.step()
    m_hat, _ = reconstruct_state(opt, p)
    m = 0.1 * g
    a = m.abs()
    r = a.sum(1, keepdim=True) @ (a.sum(0, keepdim=True) / a.sum())
    above = a > r
    high = (a * r)[above].sum() / (r * r)[above].sum()
    low = (a * r)[~above].sum() / (r * r)[~above].sum()
    expected = torch.sign(m) * r * torch.where(above, high, low)
    assert torch.allclose(m_hat, expected, rtol=1e-12, atol=1e-15)
    # The flag's code is closer to M than the paper's rank-1 magnitude alone.
    assert (m_hat - m).norm() < (torch.sign(m) * r - m).norm()


@pytest.mark.parametrize("options", [NATURAL_FLAG, LEVELS], ids=["natural+flag", "levels"])
def test_checkpoint_resumes_bit_identically(options: dict) -> None:
    model = _model()
    opt = SMMF(model.parameters(), **options)
    _train(opt, model, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(opt, model, 3, seed=1)
    resumed = _model()
    resumed.load_state_dict(saved_model)
    again = SMMF(resumed.parameters(), **options)
    again.load_state_dict(saved_opt)
    _train(again, resumed, 3, seed=1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("written, loading", [(dict(), NATURAL_FLAG), (NATURAL_FLAG, dict()),
                                              (dict(momentum_shape="natural"), dict(magnitude_bits=1)),
                                              (LEVELS, dict(magnitude_bits=1)), (dict(), LEVELS)])
def test_checkpoint_written_with_other_options_is_a_clear_error(written: dict, loading: dict) -> None:
    model = _model()
    opt = SMMF(model.parameters(), **written)
    _train(opt, model, 2)
    target = SMMF(model.parameters(), **loading)
    _train(target, model, 1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="was written with .*: its state has another layout"):
        target.load_state_dict(opt.state_dict())
    after = target.state_dict()
    for pid, st in before["state"].items():
        assert all(torch.equal(v, after["state"][pid][k]) if isinstance(v, torch.Tensor) else v == after["state"][pid][k]
                   for k, v in st.items())


def test_checkpoint_without_the_options_is_the_papers_code() -> None:
    """Checkpoints written before the options existed lack them: they load into a default optimizer
    and are refused by one with the natural shape."""
    model = _model()
    opt = SMMF(model.parameters())
    _train(opt, model, 2)
    old = opt.state_dict()
    for group in old["param_groups"]:
        del group["momentum_shape"], group["magnitude_bits"]
    SMMF(model.parameters()).load_state_dict(old)
    with pytest.raises(ValueError, match="momentum_shape='square'"):
        SMMF(model.parameters(), momentum_shape="natural").load_state_dict(old)


def test_groups_choose_their_own_code() -> None:
    model = _model()
    conv, conv_bias, linear, linear_bias = model.parameters()
    opt = SMMF([{"params": [conv, conv_bias], **NATURAL_FLAG}, {"params": [linear, linear_bias]}])
    _train(opt, model, 1)
    assert "flag_m" in opt.state[conv] and "flag_m" not in opt.state[linear]
    assert opt.state[linear]["row_m"].numel() == opt.state[linear]["row_v"].numel()  # square


def test_levels_layout_and_bits_per_param() -> None:
    """Rows of the param, two 4-bit codes per byte and a bf16 scale per 128 elements of a row: 4.125 bits
    per parameter where rows are whole blocks; V stays square."""
    model = _model()
    opt = SMMF(model.parameters(), **LEVELS)
    _train(opt, model, 1)
    conv, conv_bias, linear, _ = model.parameters()
    st = opt.state[conv]
    assert set(st) == {"step", "codes_m", "scales_m", "row_v", "col_v"}
    assert st["codes_m"].shape == (8, 14) and st["codes_m"].dtype == torch.uint8  # 27 columns: 14 bytes a row
    assert st["scales_m"].shape == (8, 1) and st["scales_m"].dtype == torch.bfloat16
    assert (st["row_v"].numel(), st["col_v"].numel()) == (18, 12)
    assert opt.state[conv_bias]["codes_m"].shape == (1, 4)  # a vector is one row
    assert opt.state[linear]["scales_m"].shape == (10, 3)  # 288 columns: blocks of 128, 128, 32
    shapes = [(64, 256)]
    m_bytes = predict_state_bytes(shapes, "smmf", **LEVELS) - 4 * (128 + 128)  # less V's factors (128×128)
    assert m_bytes * 8 / (64 * 256) == 4.125


def test_levels_decode_what_was_encoded() -> None:
    """After the first step (M = (1−β1)·G) the stored code decodes to the reference's M̂; a row's blocks
    have their own scales, zeros stay zero, and each element is within half a level of its block's max."""
    from reference import reference_levels

    p = torch.nn.Parameter(torch.zeros(3, 300, dtype=torch.float64))
    g = torch.randn(3, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g[1, 128:256] *= 100.0  # one block far larger than its neighbours
    g[2, :128] = 0.0
    p.grad = g
    opt = SMMF([p], beta=0.9, growth_rate=None, **LEVELS)
    opt.step()
    m_hat, _ = reconstruct_state(opt, p)
    m = 0.1 * g
    torch.testing.assert_close(m_hat, reference_levels(m), rtol=0, atol=0)
    assert torch.equal(m_hat[2, :128], torch.zeros(128, dtype=torch.float64))
    # Each element within half a level (1/14 of its block's max) and bf16's rounding of the max.
    for row in range(3):
        for b0 in range(0, 300, 128):
            block, got = m[row, b0 : b0 + 128], m_hat[row, b0 : b0 + 128]
            assert (got - block).abs().max() <= block.abs().max() * (1 / 14 + 2**-8) + 1e-300


def test_levels_code_stays_finite_and_zeroes_nan() -> None:
    """NaN codes as 0 and ±inf as ± bf16's largest value: decoding a stored code never gives NaN/inf."""
    from smmf.levels import SCALE_MAX, decode_levels, encode_levels

    m = torch.tensor([[1.0, float("nan"), -2.0, float("inf")], [0.0, 0.0, 0.0, 0.0], [-float("inf"), 1.0, 3.0, 0.5]])
    codes, scales = encode_levels(m)
    got = decode_levels(codes, scales, 4, torch.float32)
    assert got.isfinite().all()
    assert got[0, 1] == 0
    torch.testing.assert_close(got[[0, 2], [3, 0]], torch.tensor([SCALE_MAX, -SCALE_MAX]), rtol=1e-6, atol=0)
    assert torch.equal(got[1], torch.zeros(4))
    assert torch.equal(got[0, [0, 2]].abs(), torch.zeros(2))  # 1 and −2 are below half a level of bf16's largest
    assert torch.equal(got[2, 1:].abs(), torch.zeros(3))  # in the block of −inf


def test_recommended_options_build_the_levels_code_and_copy() -> None:
    import pickle

    import smmf

    model = _model()
    opt = SMMF(model.parameters(), **smmf.RECOMMENDED)
    _train(opt, model, 1)
    assert all("codes_m" in opt.state[p] for p in model.parameters())
    assert opt.param_groups[0]["weight_decay_mode"] == "adamw"  # decoupled decay: SMMF's default
    assert opt.param_groups[0]["momentum_rounding"] == "stochastic"
    assert opt.param_groups[0]["decay_rate"] == -0.8
    assert opt.param_groups[0]["growth_rate"] is None  # β1 held at beta
    assert copy.deepcopy(smmf.RECOMMENDED) == pickle.loads(pickle.dumps(smmf.RECOMMENDED)) == {
        "magnitude_bits": 3, "momentum_rounding": "stochastic", "decay_rate": -0.8, "growth_rate": None}
    assert SMMF(model.parameters(), **{**smmf.RECOMMENDED, "lr": 3e-4}).defaults["lr"] == 3e-4


def test_levels_complex_vector_is_one_row() -> None:
    """A complex vector's real view is (n, 2); its code is still one row of 2n (4.125 bits per real element)."""
    p = torch.nn.Parameter(torch.randn(1000, dtype=torch.complex64))
    opt = SMMF([p], **LEVELS)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["codes_m"].shape == (1, 1000) and opt.state[p]["scales_m"].shape == (1, 16)


def test_levels_state_loaded_from_strided_tensors_is_contiguous() -> None:
    """A checkpoint may hold the 2-D codes and scales with any strides: they are loaded row-major, which the
    kernels index, and the run continues as the uninterrupted one."""
    model = _model()
    opt = SMMF(model.parameters(), **LEVELS)
    _train(opt, model, 2)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        for key in ("codes_m", "scales_m"):
            strided = torch.empty(tuple(reversed(entry[key].shape)), dtype=entry[key].dtype).t()
            entry[key] = strided.copy_(entry[key])
    _train(opt, model, 2, seed=1)
    resumed = _model()
    resumed.load_state_dict(saved_model)
    again = SMMF(resumed.parameters(), **LEVELS)
    again.load_state_dict(saved)
    assert all(again.state[p]["codes_m"].is_contiguous() for p in resumed.parameters())
    _train(again, resumed, 2, seed=1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- levels rounded stochastically


def test_dither_is_the_reference_hash() -> None:
    """The torch path's dither equals the test reference's plain-integer hash, across the 2³² wrap."""
    from reference import reference_dither
    from smmf.noise import dither, step_salt

    for step in (1, 2, 977, 2**32 + 5):
        for first in (0, 1000, 2**32 - 3):
            for ordinal in (0, 7):
                got = dither(step_salt(step, ordinal), first, 6, torch.float64, torch.device("cpu"))
                assert got.tolist() == [reference_dither(step % 2**32, first + k, ordinal) for k in range(6)]
                assert bool(((got >= 0) & (got < 1)).all())
    # Each param draws its own: two of one shape do not round alike.
    assert not torch.equal(dither(step_salt(3, 0), 0, 64, torch.float64, torch.device("cpu")),
                           dither(step_salt(3, 1), 0, 64, torch.float64, torch.device("cpu")))


def test_stochastic_levels_are_unbiased_where_nearest_ones_drop_small_momentum() -> None:
    """Averaged over steps, stochastically rounded levels decode to M itself; nearest levels set every
    element below half a level (here most of a block with one large element) to 0 at every step."""
    from smmf.levels import decode_levels, encode_levels
    from smmf.noise import step_salt

    gen = torch.Generator().manual_seed(0)
    m = torch.randn(2, 256, generator=gen, dtype=torch.float64) * 0.05
    m[:, ::128] = 1.0  # one large element per block: the rest are below half a level (1/14)
    mean = sum(decode_levels(*encode_levels(m, step_salt(t)), 256, torch.float64) for t in range(1, 4001)) / 4000
    nearest = decode_levels(*encode_levels(m), 256, torch.float64)
    small = m.abs() < 1 / 14
    assert bool((nearest[small] == 0).all())
    level = 1 / 7
    assert (mean - m).abs().max().item() < 0.03 * level  # 4000 draws: σ ≤ level / (2·√4000) ≈ 0.008 level
    assert (mean[small] - m[small]).abs().mean().item() < 0.005 * level


def test_momentum_rounding_is_validated_and_recorded() -> None:
    model = _model()
    with pytest.raises(ValueError, match="Unknown momentum_rounding: 'up'"):
        SMMF(model.parameters(), magnitude_bits=3, momentum_rounding="up")  # type: ignore[arg-type]
    opt = SMMF(model.parameters(), magnitude_bits=3)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="momentum_rounding"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "momentum_rounding": "dither"})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == params
    stochastic = SMMF(model.parameters(), magnitude_bits=3, momentum_rounding="stochastic")
    _train(stochastic, model, 2)
    saved = stochastic.state_dict()
    assert saved["param_groups"][0]["momentum_rounding"] == "stochastic"
    # A checkpoint written before the option existed loads, keeping the constructor's rounding.
    del saved["param_groups"][0]["momentum_rounding"]
    fresh = SMMF(model.parameters(), magnitude_bits=3, momentum_rounding="stochastic")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["momentum_rounding"] == "stochastic"


def test_stochastic_rounding_changes_the_code_not_its_bytes() -> None:
    a, b = _model(), _model()
    nearest = SMMF(a.parameters(), magnitude_bits=3)
    stochastic = SMMF(b.parameters(), magnitude_bits=3, momentum_rounding="stochastic")
    _train(nearest, a, 3)
    _train(stochastic, b, 3)
    assert state_bytes(stochastic) == state_bytes(nearest) == predict_state_bytes(b.parameters(), "smmf", **LEVELS)
    assert any(not torch.equal(nearest.state[p]["codes_m"], stochastic.state[q]["codes_m"])
               for p, q in zip(a.parameters(), b.parameters()))


def test_recommended_options_leave_a_group_with_another_code_as_it_is() -> None:
    """``momentum_rounding`` rounds the levels code only: a group that keeps the paper's code under
    ``**smmf.RECOMMENDED`` steps exactly as that code with the rest of the recommendation (its γ)."""
    import smmf

    a, b = _model(), _model()
    rest = {k: v for k, v in smmf.RECOMMENDED.items() if k not in ("magnitude_bits", "momentum_rounding")}
    plain = SMMF(a.parameters(), magnitude_bits=0, **rest)
    mixed = SMMF([{"params": list(b.parameters()), "magnitude_bits": 0}], **smmf.RECOMMENDED)
    _train(plain, a, 3)
    _train(mixed, b, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_params_salt_copies_the_config_as_replace_does() -> None:
    """Each param of a dithered or stochastically rounded group takes its own salt and rounding key at every
    step: ``for_param`` copies the config as ``dataclasses.replace`` would, leaving the group's as it was."""
    from dataclasses import fields, replace

    from smmf.functional import StepConfig
    from smmf.state import MomentumCode

    cfg = StepConfig(lr=1e-3, beta1=0.9, beta2=0.5, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=False,
                     maximize=True, stochastic_rounding=True, code=MomentumCode.LEVELS, zero_nonfinite=False,
                     levels_salt=3, rounding_key=5)
    own = ("levels_salt", "rounding_key")
    for salt, key in ((7, 11), (None, None)):
        salted = cfg.for_param(salt, key)
        expected = replace(cfg, levels_salt=salt, rounding_key=key)
        assert salted == expected and hash(salted) == hash(expected)
        assert (salted.levels_salt, salted.rounding_key) == (salt, key)
        assert [getattr(salted, f.name) for f in fields(cfg) if f.name not in own] == [
            getattr(cfg, f.name) for f in fields(cfg) if f.name not in own]
    assert cfg.rounding_key == 5
    assert cfg.levels_salt == 3
