"""The study optimizer of studies/momentum_diagnosis.py is trustworthy: its SMMF configurations step
exactly as ``smmf.SMMF`` does, its all-Adam one as ``torch.optim.Adam``, and its loop as ``smmf compare``'s."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "studies" / "momentum_diagnosis.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("momentum_diagnosis", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


diag = _load()


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_variants_match_smmf_and_adam(kind: str) -> None:
    errors = diag.check(kind, steps=4)
    assert set(errors) == set(diag.CHECKS)
    assert all(error <= 1e-6 for error in errors.values()), errors


def test_the_check_tells_codes_apart() -> None:
    """A variant with another code of M does not pass for the paper's (the check is not vacuous)."""
    kwargs = diag.smmf_kwargs("transformer")
    lr = kwargs["lr"]
    want = diag.directions(lambda ps: diag.SMMF(ps, **kwargs), 6, lr)
    for other in ("dense-m", "natural", "bias-corr", "no-growth"):
        got = diag.directions(lambda ps: diag.SMMFVariant(ps, diag.VARIANTS[other][1], **kwargs), 6, lr)
        assert max(float((g - w).abs().max()) for g, w in zip(got, want)) > 1e-3, other


def test_block_codes_and_their_bits() -> None:
    m = torch.tensor([[0.5, -1.0, 0.0, 2.0, -4.0, 0.25]])
    cfg = diag.Config(m_code="block-mean", block=4, scale_bits=32)
    # Blocks [0.5, -1, 0, 2] (mean 0.875) and [-4, 0.25] (mean 2.125, a partial block).
    torch.testing.assert_close(diag.encode_decode(m, cfg),
                               torch.tensor([[0.875, -0.875, 0.875, 0.875, -2.125, 2.125]]))
    levels = diag.Config(m_code="block-levels", block=4, level_bits=2, scale_bits=32)
    # Levels {0, 1/3, 2/3, 1} × the block's max |M|: 2 and 4.
    torch.testing.assert_close(diag.encode_decode(m, levels),
                               torch.tensor([[2 / 3, -2 / 3, 0.0, 2.0, -4.0, 0.0]]))
    p = torch.zeros(64, 256)
    assert diag.m_bits_per_param([p], diag.VARIANTS["block-mean-32"][1]) == 1.5
    assert diag.m_bits_per_param([p], diag.VARIANTS["levels3log-128"][1]) == 4.125
    assert math.isclose(diag.m_bits_per_param([p], diag.PAPER), 1 + 32 * (128 + 128) / p.numel())


def test_loop_matches_smmf_compare() -> None:
    from smmf.bench.compare import train_one
    from smmf.bench.tasks import TASKS

    task = TASKS["digits-cnn"]
    theirs = train_one(task, "adamw", {}, 2, 1, 0, torch.device("cpu"), show_progress=False)
    ours = diag.train(task, "adamw", 2, 0, torch.device("cpu"))
    assert ours["losses"] == theirs["losses"]
    assert [{k: e[k] for k in ("step", task.metric)} for e in ours["evals"]] == [
        {k: e[k] for k in ("step", task.metric)} for e in theirs["evals"]]
