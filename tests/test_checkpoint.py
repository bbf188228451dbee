"""Checkpoints: bit-identical resume, dtypes preserved, bad checkpoints rejected without loss."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from helpers import FUSED_BACKENDS, device_of
from smmf import SMMF


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5))
    return layers.to(device=device, dtype=dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    x = torch.randn(4, 3, 8, 8, generator=gen).to(param.device, param.dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


def _roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# The levels rounded stochastically: their dither is a hash of the step, so a resumed run draws the same.
@pytest.mark.parametrize("options", [{}, dict(magnitude_bits=3, momentum_rounding="stochastic")],
                         ids=["paper", "levels-stochastic"])
@pytest.mark.parametrize("backend", ["torch", *FUSED_BACKENDS])
def test_resume_is_bit_identical(backend: str, options: dict) -> None:
    device = device_of(backend)
    straight = _model(device=device)
    opt = SMMF(straight.parameters(), lr=1e-2, weight_decay=0.01, backend=backend, **options)
    for s in range(10):
        _step(straight, opt, s)

    first = _model(device=device)
    opt1 = SMMF(first.parameters(), lr=1e-2, weight_decay=0.01, backend=backend, **options)
    for s in range(4):
        _step(first, opt1, s)
    checkpoint = _roundtrip({"model": first.state_dict(), "optim": opt1.state_dict()})
    resumed = _model(device=device)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = SMMF(resumed.parameters(), lr=1e-2, weight_decay=0.01, backend=backend, **options)
    opt2.load_state_dict(checkpoint["optim"])
    for s in range(4, 10):
        _step(resumed, opt2, s)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_factors_and_uint8_signs_after_load(dtype: torch.dtype) -> None:
    model = _model(dtype)
    opt = SMMF(model.parameters(), lr=1e-2)
    for s in range(3):
        _step(model, opt, s)
    saved = _roundtrip(opt.state_dict())
    opt2 = SMMF(_model(dtype).parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for original, loaded in zip(opt.state.values(), opt2.state.values()):
        assert loaded["sign_m"].dtype == torch.uint8
        for key in ("row_m", "col_m", "row_v", "col_v"):
            assert loaded[key].dtype == torch.float32
            assert torch.equal(loaded[key], original[key])
        assert torch.equal(loaded["sign_m"], original["sign_m"])
        assert loaded["step"] == original["step"] == 3


def test_loaded_state_does_not_alias_the_checkpoint() -> None:
    model = _model()
    opt = SMMF(model.parameters())
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    _step(model, opt, 1)
    assert not torch.equal(saved["state"][0]["row_v"], opt.state[next(model.parameters())]["row_v"])


def _corrupt_shape(sd: dict) -> None:
    sd["state"][0]["row_v"] = torch.zeros(3)


def _drop_key(sd: dict) -> None:
    del sd["state"][0]["sign_m"]


def _extra_group(sd: dict) -> None:
    sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))


def _bad_option(sd: dict) -> None:
    sd["param_groups"][0]["decay_rate"] = 2.0


def _unknown_param(sd: dict) -> None:
    sd["state"][999] = dict(sd["state"][0])


def _mismatched_option(sd: dict) -> None:
    sd["param_groups"][0]["beta"] = None  # the saved state has a first moment


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (_corrupt_shape, r"state 'row_v' has shape \(3,\) but a parameter of shape"),
        (_drop_key, r"state keys .* do not fit"),
        (_extra_group, r"has 2 parameter groups, the optimizer has 1"),
        (_bad_option, r"Invalid decay_rate: 2.0"),
        (_mismatched_option, r"state keys .* do not fit"),
        (_unknown_param, r"state for parameters \[999\] that no group lists"),
    ],
)
def test_bad_checkpoint_is_rejected_and_changes_nothing(corrupt, match: str) -> None:
    model = _model()
    opt = SMMF(model.parameters())
    for s in range(2):
        _step(model, opt, s)
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    bad = copy.deepcopy(before)
    corrupt(bad)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(after["state"][pid][k]), torch.as_tensor(v))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params_before))


def test_bits_by_rows_of_an_fsdp2_checkpoint_load_into_plain_params() -> None:
    """FSDP2 checkpoints hold the bits by rows of the parameter; a full state dict of one loads on one
    process. Made here by hand from a plain optimizer's flat bits."""
    model = _model()
    opt = SMMF(model.parameters(), magnitude_bits=1)
    for seed in range(3):
        _step(model, opt, seed)
    saved = copy.deepcopy(opt.state_dict())
    for param, entry in zip(model.parameters(), saved["state"].values()):
        rows, inner = param.shape[0], param.numel() // param.shape[0]
        for key in ("sign_m", "flag_m"):
            bits = ((entry[key].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: param.numel()]
            by_rows = torch.nn.functional.pad(bits.view(rows, inner), (0, (-inner) % 8)).view(rows, -1, 8)
            entry[key] = (by_rows << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    fresh = SMMF(_model().parameters(), magnitude_bits=1)
    fresh.load_state_dict(saved)
    for state, own in zip(fresh.state.values(), opt.state.values()):
        assert torch.equal(state["sign_m"], own["sign_m"]) and torch.equal(state["flag_m"], own["flag_m"])
    wrong = copy.deepcopy(saved)
    wrong["state"][0]["sign_m"] = wrong["state"][0]["sign_m"][:, :1]
    with pytest.raises(ValueError, match="packed bits by rows of a parameter of shape"):
        SMMF(_model().parameters(), magnitude_bits=1).load_state_dict(wrong)


# Options a checkpoint may lack (it was written before they existed): the loading optimizer's value stays.
@pytest.mark.parametrize("key,value", [("maximize", True), ("stochastic_rounding", True),
                                       ("nonfinite_grads", "propagate"), ("momentum_rounding", "stochastic")])
def test_a_checkpoint_without_an_optional_option_keeps_the_constructors(key: str, value: object) -> None:
    extra = dict(magnitude_bits=3) if key == "momentum_rounding" else {}
    model = _model()
    saved = SMMF(model.parameters(), **extra).state_dict()
    del saved["param_groups"][0][key]
    opt = SMMF(model.parameters(), **extra, **{key: value})
    opt.load_state_dict(saved)
    assert opt.param_groups[0][key] == value


def test_a_checkpoint_written_with_swalr_attached_loads() -> None:
    """``torch.optim.swa_utils.SWALR`` adds ``swa_lr`` to each group; torch's optimizers load such a checkpoint."""
    param = torch.nn.Parameter(torch.randn(3, 4))
    opt = SMMF([param])
    torch.optim.swa_utils.SWALR(opt, swa_lr=0.05)
    param.grad = torch.randn(3, 4)
    opt.step()
    again = SMMF([torch.nn.Parameter(param.detach().clone())])
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["swa_lr"] == 0.05
