"""Memory accounting: the predictor equals the measured state of real optimizers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from smmf import SMMF
from smmf.memory import CUDA_ALLOCATOR_BLOCK, predict_state_bytes, report, state_bytes

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 1),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 7),
    )


def _transformer() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=16, n_embd=24, n_layer=2, n_head=2))


def _step_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adafactor": lambda ps: pytorch_optimizer.AdaFactor(ps, betas=(0.9, 0.999), momentum_dtype=torch.float32),
    "sm3": lambda ps: pytorch_optimizer.SM3(ps, momentum=0.9),
    "came": lambda ps: pytorch_optimizer.CAME(ps),
    "smmf": lambda ps: SMMF(ps),
}


@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["cnn", "gpt2-tiny"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_prediction_equals_measured_state(name: str, build) -> None:
    model = build()
    optimizer = OPTIMIZERS[name](model.parameters())
    _step_once(model, optimizer)
    assert state_bytes(optimizer) == predict_state_bytes(model, name)
    assert state_bytes(optimizer, CUDA_ALLOCATOR_BLOCK) == predict_state_bytes(model, name, CUDA_ALLOCATOR_BLOCK)


def test_smmf_options_change_the_prediction_like_the_state() -> None:
    model = _cnn()
    optimizer = SMMF(model.parameters(), beta=None, vector_reshape=False)
    _step_once(model, optimizer)
    assert state_bytes(optimizer) == predict_state_bytes(model, "smmf", beta=None, vector_reshape=False)
    assert predict_state_bytes(model, "smmf", beta=None) < predict_state_bytes(model, "smmf")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("options", [{}, {"vector_reshape": False}, {"magnitude_bits": 3}, {"momentum_shape": "natural"}],
                         ids=["paper", "dense-1d", "levels", "natural"])
def test_complex_params_are_predicted_as_the_real_view_smmf_steps(dtype: torch.dtype, options: dict) -> None:
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in [(64, 33), (7,), (3, 4, 5), ()]]
    for name, build in [("smmf", lambda ps: SMMF(ps, **options)), ("adam", lambda ps: torch.optim.Adam(ps))]:
        optimizer = build(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        assert state_bytes(optimizer) == predict_state_bytes(params, name, **(options if name == "smmf" else {}))
    assert report(params).params == 64 * 33 + 7 + 60 + 1  # a complex element is one parameter


def test_frozen_params_are_not_counted_and_shapes_are_accepted() -> None:
    model = _cnn()
    model[0].weight.requires_grad_(False)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    assert predict_state_bytes(model, "adam") == predict_state_bytes(shapes, "adam") == 8 * sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


def test_report_on_meta_model_allocates_nothing() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(50_000, 40_000)  # 2 G parameters: would need 8 GB if real
    rep = report(model)
    assert rep.params == 50_000 * 40_000 + 40_000
    assert rep.exact["adam"] == 8 * rep.params
    assert rep.exact["adam"] / rep.exact["smmf"] > 60
    assert "smmf" in rep.table("markdown")


def test_unknown_optimizer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"Unknown optimizer: 'lion'. It needs to be one of"):
        predict_state_bytes([(3, 3)], "lion")


@pytest.mark.parametrize("optimizer, options, message", [
    ("smmf", {"magnitude_bits": 2}, "magnitude_bits should be one of"),
    ("smmf", {"momentum_shape": "bogus"}, "Unknown momentum_shape"),
    ("smmf", {"typo_option": 1}, "SMMF has no option 'typo_option'"),
    ("adam", {"magnitude_bits": 3}, "are options of SMMF, not of 'adam'")])
def test_options_the_optimizer_would_refuse_are_a_clear_error(optimizer: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        predict_state_bytes([(64, 64)], optimizer, **options)


def test_memory_is_reachable_from_the_package() -> None:
    """As the README writes it: ``import smmf`` then ``smmf.memory.report(model)``."""
    code = "import smmf, torch; print(smmf.memory.report(torch.nn.Linear(4, 4)).exact['smmf'] > 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_memory_cli_reproduces_a_paper_row() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "smmf.cli", "memory", "--model", "ResNet-50", "--format", "json"],
        capture_output=True, text=True, check=True,
    )
    tables = json.loads(out.stdout)
    rows = {(t["table"], r["optimizer"]): r for t in tables for r in t["rows"]}
    imagenet = {o: r for (t, o), r in rows.items() if t == "CNN, ImageNet"}
    assert imagenet["adam"]["params"] == 25_557_032
    assert abs(imagenet["adam"]["diff_pct"]) < 1
    assert abs(imagenet["smmf"]["ours_exact"] - 3.54) < 0.01  # MiB
    assert abs(imagenet["smmf"]["ours_allocated"] - 3.77) < 0.01


def test_memory_cli_reports_any_transformers_config(tmp_path) -> None:
    from transformers import GPT2Config

    GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "smmf.cli", "memory", "--config", str(tmp_path / "config.json"), "--format", "json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout)
    assert result["exact"]["adam"] == 8 * result["params"]
    assert result["exact"]["smmf"] < result["exact"]["adam"] / 20
