"""The step inside backward equals the ordinary loop bit for bit, keeps the optimizer contract, and
refuses what cannot work."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS
from smmf import SMMF, step_in_backward

BACKENDS = ["torch", *CPU_FUSED_BACKENDS]


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5)
    )


def _transformer() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)  # its head is tied to the embedding: one param used twice


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(step)  # the same dropout masks in both loops
    gen = torch.Generator().manual_seed(step)
    if isinstance(model, torch.nn.Sequential):
        return model(torch.randn(4, 3, 8, 8, generator=gen)).pow(2).mean()
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    return model(input_ids=ids, labels=ids).loss


def _ordinary(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _fused(model: torch.nn.Module, opt: SMMF, steps: range) -> None:
    for step in steps:
        _loss(model, step).backward()
        assert all(p.grad is None for p in model.parameters())  # freed inside backward
        opt.step()  # harmless: no gradient is left
        opt.zero_grad()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make_model", [_cnn, _transformer], ids=["cnn", "transformer"])
def test_equals_the_ordinary_loop_bit_for_bit(backend: str, make_model) -> None:
    ordinary, fused = make_model(), make_model()
    opt_a = SMMF(ordinary.parameters(), lr=1e-2, weight_decay=0.01, backend=backend)
    opt_b = SMMF(fused.parameters(), lr=1e-2, weight_decay=0.01, backend=backend)
    step_in_backward(opt_b)
    _ordinary(ordinary, opt_a, range(20))
    _fused(fused, opt_b, range(20))
    for p, q in zip(ordinary.parameters(), fused.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(ordinary.parameters(), fused.parameters()):
        for key, value in opt_a.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state[q][key])), key


def test_checkpoints_are_interchangeable_both_ways_and_schedulers_drive_it() -> None:
    reference, fused, ordinary = _cnn(), _cnn(), _cnn()
    opt_ref = SMMF(reference.parameters(), lr=1e-2)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=3, gamma=0.5)
    opt_fused = SMMF(fused.parameters(), lr=1e-2)
    sched_fused = torch.optim.lr_scheduler.StepLR(opt_fused, step_size=3, gamma=0.5)
    handle = step_in_backward(opt_fused)
    for step in range(12):
        _ordinary(reference, opt_ref, range(step, step + 1))
        sched_ref.step()
        if step < 4:  # in backward
            _fused(fused, opt_fused, range(step, step + 1))
            sched_fused.step()
        elif step == 4:  # its checkpoint, loaded into an ordinary loop
            handle.remove()
            buffer = io.BytesIO()
            torch.save({"model": fused.state_dict(), "optim": opt_fused.state_dict(), "sched": sched_fused.state_dict()},
                       buffer)
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            ordinary.load_state_dict(checkpoint["model"])
            opt_ordinary = SMMF(ordinary.parameters(), lr=1e-2)
            opt_ordinary.load_state_dict(checkpoint["optim"])
            sched_ordinary = torch.optim.lr_scheduler.StepLR(opt_ordinary, step_size=3, gamma=0.5)
            sched_ordinary.load_state_dict(checkpoint["sched"])
            _ordinary(ordinary, opt_ordinary, range(step, step + 1))
            sched_ordinary.step()
        elif step < 8:
            _ordinary(ordinary, opt_ordinary, range(step, step + 1))
            sched_ordinary.step()
        else:  # and the ordinary loop's checkpoint, back into backward
            if step == 8:
                fused.load_state_dict(ordinary.state_dict())
                opt_fused = SMMF(fused.parameters(), lr=1e-2)
                opt_fused.load_state_dict(copy.deepcopy(opt_ordinary.state_dict()))
                sched_fused = torch.optim.lr_scheduler.StepLR(opt_fused, step_size=3, gamma=0.5)
                sched_fused.load_state_dict(sched_ordinary.state_dict())
                step_in_backward(opt_fused)
            _fused(fused, opt_fused, range(step, step + 1))
            sched_fused.step()
    assert opt_fused.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"] < 1e-2
    for p, q in zip(reference.parameters(), fused.parameters()):
        assert torch.equal(p, q)


def test_accumulation_steps_on_the_kth_micro_batch() -> None:
    ordinary, fused = _cnn(), _cnn()
    opt_a, opt_b = SMMF(ordinary.parameters(), lr=1e-2), SMMF(fused.parameters(), lr=1e-2)
    step_in_backward(opt_b, accumulation_steps=3)
    for step in range(4):
        opt_a.zero_grad()
        for micro in range(3):
            _loss(ordinary, 10 * step + micro).backward()
            _loss(fused, 10 * step + micro).backward()
            kept = [p.grad is not None for p in fused.parameters()]
            assert all(kept) if micro < 2 else not any(kept)
        opt_a.step()
    for p, q in zip(ordinary.parameters(), fused.parameters()):
        assert torch.equal(p, q)


def test_grad_scaler_fails_loudly() -> None:
    model = _cnn()
    opt = SMMF(model.parameters())
    step_in_backward(opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.step(opt)


def test_refused_under_a_multi_rank_process_group(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    with pytest.raises(RuntimeError, match="cannot run under DDP"):
        step_in_backward(SMMF(_cnn().parameters()))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="takes an smmf.SMMF optimizer"):
        step_in_backward(torch.optim.Adam(_cnn().parameters()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulation_steps should be an int >= 1"):
        step_in_backward(SMMF(_cnn().parameters()), accumulation_steps=0)
