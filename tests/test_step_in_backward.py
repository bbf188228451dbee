"""The step inside backward equals the ordinary loop bit for bit, keeps the optimizer contract, and
refuses what cannot work."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS, assert_nothing_installed, assert_unchanged, snapshot_of
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


@pytest.mark.parametrize("options", [{}, dict(magnitude_bits=3, momentum_rounding="stochastic")],
                         ids=["paper", "levels-stochastic"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make_model", [_cnn, _transformer], ids=["cnn", "transformer"])
def test_equals_the_ordinary_loop_bit_for_bit(backend: str, make_model, options: dict) -> None:
    ordinary, fused = make_model(), make_model()
    opt_a = SMMF(ordinary.parameters(), lr=1e-2, weight_decay=0.01, backend=backend, **options)
    opt_b = SMMF(fused.parameters(), lr=1e-2, weight_decay=0.01, backend=backend, **options)
    step_in_backward(opt_b)
    _ordinary(ordinary, opt_a, range(20))
    _fused(fused, opt_b, range(20))
    for p, q in zip(ordinary.parameters(), fused.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(ordinary.parameters(), fused.parameters()):
        for key, value in opt_a.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state[q][key])), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_stochastic_rounding_equals_the_ordinary_loop_bit_for_bit(backend: str) -> None:
    """bf16 weights rounded stochastically: the step inside backward steps the params in another order than the
    loop, and draws the same noise (it was drawn from torch's generator, in the order of the steps)."""
    ordinary, fused = _transformer().bfloat16(), _transformer().bfloat16()
    opt_a = SMMF(ordinary.parameters(), lr=1e-2, stochastic_rounding=True, backend=backend)
    opt_b = SMMF(fused.parameters(), lr=1e-2, stochastic_rounding=True, backend=backend)
    step_in_backward(opt_b)
    _ordinary(ordinary, opt_a, range(5))
    _fused(fused, opt_b, range(5))
    start = _transformer().bfloat16()
    for p, q, p0 in zip(ordinary.parameters(), fused.parameters(), start.parameters()):
        assert torch.equal(p, q)
    assert sum(not torch.equal(p, p0) for p, p0 in zip(ordinary.parameters(), start.parameters())) > 10


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


def _dcp_resume(saver: torch.nn.Module, opt_saver: SMMF, loader: torch.nn.Module, opt_loader: SMMF, path: Path) -> None:
    """Save ``saver`` and its optimizer through DCP and load them into ``loader``'s, as users do: a
    template state dict of the loader, filled by DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(saver, opt_saver)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    model_sd, optim_sd = get_state_dict(loader, opt_loader)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(loader, opt_loader, model_state_dict=state["model"], optim_state_dict=state["optim"])


@pytest.mark.parametrize("saved_in_backward", [False, True], ids=["ordinary-to-in-backward", "in-backward-to-ordinary"])
def test_dcp_checkpoints_of_a_partly_frozen_model_cross_between_the_loops(tmp_path, saved_in_backward: bool) -> None:
    """A fine-tuning model with a frozen layer: DCP's template has state for the params that take
    gradients only, in either loop, so each loop's checkpoint loads into the other and continues its run."""

    def make(in_backward: bool) -> tuple[torch.nn.Module, SMMF]:
        model = _cnn()
        model[0].requires_grad_(False)
        opt = SMMF(model.parameters(), lr=1e-2)
        if in_backward:
            step_in_backward(opt)
        return model, opt

    reference, opt_ref = make(False)
    _ordinary(reference, opt_ref, range(4))  # (under the hooks its step() and zero_grad() do nothing)
    saver, opt_saver = make(saved_in_backward)
    _ordinary(saver, opt_saver, range(2))
    loader, opt_loader = make(not saved_in_backward)
    _dcp_resume(saver, opt_saver, loader, opt_loader, tmp_path)
    assert loader[0].weight not in opt_loader.state  # a frozen param has no state, in either loop
    _ordinary(loader, opt_loader, range(2, 4))
    assert _same(reference, loader)


def test_dcp_checkpoint_loads_into_a_run_that_unfroze_a_param_after_install(tmp_path) -> None:
    """DCP makes a template's state only for an optimizer without any: a param unfrozen after the hooks
    were installed gets its state from ``state_dict()``, so the checkpoint's state for it is loaded."""
    reference, saver = _cnn(), _cnn()
    opt_ref, opt_saver = SMMF(reference.parameters(), lr=1e-2), SMMF(saver.parameters(), lr=1e-2)
    _ordinary(reference, opt_ref, range(4))
    _ordinary(saver, opt_saver, range(2))
    loader = _cnn()
    loader[0].requires_grad_(False)
    opt_loader = SMMF(loader.parameters(), lr=1e-2)
    step_in_backward(opt_loader)
    loader[0].requires_grad_(True)  # unfrozen after install, before the resume
    _dcp_resume(saver, opt_saver, loader, opt_loader, tmp_path)
    _fused(loader, opt_loader, range(2, 4))
    assert _same(reference, loader)


def test_a_refused_param_group_leaves_no_trace() -> None:
    """A group that cannot be hooked (a non-leaf that retains its grad, which torch's add_param_group takes) is
    refused before its params get state or hooks: the optimizer saves and steps as before."""
    model = _cnn()
    opt = SMMF(model.parameters(), lr=1e-2)
    handle = step_in_backward(opt)
    leaf = torch.nn.Parameter(torch.randn(4, 3))
    non_leaf = leaf * 2
    non_leaf.retain_grad()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="leaf tensors only"):
        opt.add_param_group({"params": [leaf, non_leaf]})
    assert len(opt.param_groups) == 1 and leaf not in opt.state and leaf not in handle._handles
    assert opt.state_dict()["state"].keys() == before["state"].keys()


def test_a_plain_param_added_across_ranks_without_the_module_is_refused(monkeypatch) -> None:
    """As at install: without the module that reduces it, its step would see this rank's gradient."""
    model = _cnn()
    opt = SMMF(model.parameters(), lr=1e-2)
    step_in_backward(opt)  # one process: plain params are fine
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="needs the module that reduces the gradients across ranks"):
        opt.add_param_group({"params": [stray]})
    assert len(opt.param_groups) == 1 and stray not in opt.state


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


def test_plain_params_need_the_module_under_a_multi_rank_process_group(monkeypatch) -> None:
    """Without the DDP module, a param's step would see this rank's gradient before the all-reduce."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    opt = SMMF(_cnn().parameters())
    with pytest.raises(RuntimeError, match="needs the module that reduces the gradients across ranks"):
        step_in_backward(opt)
    assert_nothing_installed(opt)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="takes an smmf.SMMF optimizer"):
        step_in_backward(torch.optim.Adam(_cnn().parameters()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulation_steps should be an int >= 1"):
        step_in_backward(SMMF(_cnn().parameters()), accumulation_steps=0)
    model = _cnn()
    with pytest.raises(TypeError, match="DistributedDataParallel or FSDP2 .* not Sequential"):
        step_in_backward(SMMF(model.parameters()), module=model)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _same_state(opt_a: SMMF, a: torch.nn.Module, opt_b: SMMF, b: torch.nn.Module) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if set(opt_a.state.get(p, {})) != set(opt_b.state.get(q, {})):
            return False
        for key, value in opt_a.state.get(p, {}).items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state[q][key])):
                return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loaded_checkpoint_sets_the_lr_the_hooks_step_at(backend: str) -> None:
    torch.manual_seed(0)
    m, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(m.state_dict())
    checkpoint = SMMF(m.parameters(), lr=1e-3).state_dict()
    opt = SMMF(m.parameters(), lr=1.0, backend=backend)
    step_in_backward(opt)
    opt.load_state_dict(checkpoint)
    opt_ref = SMMF(ref.parameters(), lr=1.0, backend=backend)
    opt_ref.load_state_dict(checkpoint)
    x = torch.randn(2, 8)
    m(x).sum().backward()
    ref(x).sum().backward()
    opt_ref.step()
    assert _same(m, ref)  # stepped at the loaded lr=1e-3, not the constructor's 1.0


def test_params_of_a_group_added_after_installing_are_stepped_in_backward() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    opt = SMMF(a.parameters(), lr=1e-2)
    step_in_backward(opt)
    opt.add_param_group({"params": list(b.parameters()), "lr": 3e-2})
    ref = SMMF(a2.parameters(), lr=1e-2)
    ref.add_param_group({"params": list(b2.parameters()), "lr": 3e-2})
    for s in range(4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(s))
        b(a(x)).pow(2).sum().backward()
        assert all(p.grad is None for p in b.parameters())
        opt.step()  # does not step b a second time
        ref.zero_grad()
        b2(a2(x)).pow(2).sum().backward()
        ref.step()
    assert _same(a, a2) and _same(b, b2)


def test_installing_twice_is_refused_and_the_first_keeps_working() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = SMMF(m.parameters())
    handle = step_in_backward(opt, accumulation_steps=2)
    with pytest.raises(RuntimeError, match="already installed"):
        step_in_backward(opt, accumulation_steps=3)
    for _ in range(6):
        m(torch.randn(2, 4)).sum().backward()
    assert opt.state[m.weight]["step"] == 3
    handle.remove()
    step_in_backward(opt)  # after remove() it may be installed again


@pytest.mark.parametrize("in_backward", [False, True], ids=["loop", "in_backward"])
@pytest.mark.parametrize("change", [("magnitude_bits", 1), ("momentum_shape", "natural"), ("beta", None),
                                    ("vector_reshape", False)], ids=lambda c: str(c[0]))
def test_a_layout_option_changed_mid_run_is_refused_before_anything_changes(change, in_backward: bool) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    opt = SMMF(m.parameters())
    handle = step_in_backward(opt) if in_backward else None
    for _ in range(2):
        m(torch.randn(2, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    key, value = change
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    before = snapshot_of(opt, list(m.parameters()))
    with pytest.raises(RuntimeError, match="cannot change mid-run"):
        m(torch.randn(2, 6)).sum().backward()
        opt.step()
    assert_unchanged(opt, list(m.parameters()), before)
    opt.param_groups[0][key] = old
    opt.load_state_dict(opt.state_dict())  # its own checkpoint still loads
    if in_backward:  # the refused backward's gradients are not folded into the next one's
        before = snapshot_of(opt, list(m.parameters()))  # the option set back
        with pytest.raises(RuntimeError, match="Call reset"):
            m(torch.randn(2, 6)).sum().backward()
        assert_unchanged(opt, list(m.parameters()), before)
        assert handle is not None
        handle.reset()
    opt.zero_grad()
    ref = copy.deepcopy(m)
    opt_ref = SMMF(ref.parameters())
    opt_ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    x = torch.randn(2, 6)
    m(x).sum().backward()
    opt.step()
    ref(x).sum().backward()
    opt_ref.step()
    assert _same(m, ref)


def _branchy() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


def _micro_loss(a, b, c, step: int) -> torch.Tensor:
    """Micro-batch ``step`` reaches a always, b on some steps, c on others (a branch, routing)."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
    h = a(x)
    if step % 3 == 1:
        h = b(h)
    if step % 4 == 2:
        h = c(h)
    return h.pow(2).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accumulation_windows_are_counted_per_backward(backend: str, k: int) -> None:
    ref, fused = _branchy(), _branchy()
    opt_ref = SMMF([p for mod in ref for p in mod.parameters()], lr=1e-2, backend=backend)
    opt = SMMF([p for mod in fused for p in mod.parameters()], lr=1e-2, backend=backend)
    step_in_backward(opt, accumulation_steps=k)
    for window in range(5):
        for micro in range(k):
            _micro_loss(*ref, k * window + micro).backward()
            _micro_loss(*fused, k * window + micro).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        assert all(p.grad is None for mod in fused for p in mod.parameters())
    for r, f in zip(ref, fused):
        assert _same(r, f)
        assert _same_state(opt_ref, r, opt, f)


def test_the_issue_branch_reproducer() -> None:
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    o = SMMF([*a.parameters(), *b.parameters()])
    step_in_backward(o, accumulation_steps=2)
    for s in range(4):
        (b(a(torch.randn(2, 4))) if s == 1 else a(torch.randn(2, 4))).sum().backward()
    assert o.state[b.weight]["step"] == 1 and b.weight.grad is None
    assert o.state[a.weight]["step"] == 2


@pytest.mark.parametrize("k", [1, 2])
def test_the_readme_loop_with_step_and_zero_grad_each_micro_batch_takes_the_ordinary_steps(k: int) -> None:
    ordinary, fused = _cnn(), _cnn()
    opt_a, opt_b = SMMF(ordinary.parameters(), lr=1e-2), SMMF(fused.parameters(), lr=1e-2)
    step_in_backward(opt_b, accumulation_steps=k)
    for step in range(6):
        _loss(fused, step).backward()
        opt_b.step()  # no-ops mid-window: the hooks own these gradients
        opt_b.zero_grad()
        _loss(ordinary, step).backward()
        if (step + 1) % k == 0:
            opt_a.step()
            opt_a.zero_grad()
    assert opt_b.state[next(fused.parameters())]["step"] == 6 // k
    assert _same(ordinary, fused)


def _shared_segments(use_reentrant: bool, outside: bool):
    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8)

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
        for _ in range(3):
            x = torch.utils.checkpoint.checkpoint(shared, x, use_reentrant=use_reentrant)
        if outside:
            x = shared(x)
        return x.tanh().sum()

    return shared, loss


def _shared_segments_match_the_loop(shared, loss, opt: SMMF, ref, ref_loss, opt_ref: SMMF, steps: range) -> None:
    for step in steps:
        loss(step).backward()
        assert shared.weight.grad is None
        ref_loss(step).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    assert opt.state[shared.weight]["step"] == steps.stop
    assert _same(shared, ref)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_layer_shared_by_checkpointed_segments_is_stepped_once_per_backward(use_reentrant: bool) -> None:
    shared, loss = _shared_segments(use_reentrant, outside=False)
    ref, ref_loss = _shared_segments(use_reentrant, outside=False)
    opt = SMMF(shared.parameters(), lr=1e-2)
    opt_ref = SMMF(ref.parameters(), lr=1e-2)
    step_in_backward(opt)
    _shared_segments_match_the_loop(shared, loss, opt, ref, ref_loss, opt_ref, range(3))


def test_reentrant_checkpointing_of_a_layer_also_used_outside_is_refused_loudly() -> None:
    """Its step outside the checkpoint runs before the checkpoint's gradient exists: refused, with the
    way out; after reset() it is stepped once, at the end of each backward."""
    shared, loss = _shared_segments(True, outside=True)
    opt = SMMF(shared.parameters(), lr=1e-2)
    handle = step_in_backward(opt)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss(0).backward()
    handle.reset()
    ref, ref_loss = _shared_segments(True, outside=True)
    ref.load_state_dict(shared.state_dict())
    opt_ref = SMMF(ref.parameters(), lr=1e-2)
    opt_ref.load_state_dict(opt.state_dict())
    _shared_segments_match_the_loop(shared, loss, opt, ref, ref_loss, opt_ref, range(1, 4))


class _FailOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise ValueError("a failure inside backward")
        return grad


@pytest.mark.parametrize("k", [1, 2])
def test_after_an_exception_in_backward_the_next_backward_refuses_until_reset(k: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        return model[1](_FailOnce.apply(model[0](x))).pow(2).sum()

    opt = SMMF(model.parameters(), lr=1e-2)
    handle = step_in_backward(opt, accumulation_steps=k)
    for step in range(k):  # a whole window, then a failure in the next one's last micro-batch
        loss(step).backward()
    for step in range(k, 2 * k - 1):
        loss(step).backward()
    _FailOnce.armed = True
    with pytest.raises(ValueError, match="a failure inside backward"):
        loss(99).backward()
    # The layer after the failure point was stepped (k == 1) or holds partial gradients; then:
    before = snapshot_of(opt, list(model.parameters()))
    with pytest.raises(RuntimeError, match="Call reset"):
        loss(100).backward()
    assert_unchanged(opt, list(model.parameters()), before)
    handle.reset()
    assert all(p.grad is None for p in model.parameters())
    # From here it equals an ordinary loop started from the same params and state.
    ref = copy.deepcopy(model)
    opt_ref = SMMF(ref.parameters(), lr=1e-2)
    opt_ref.load_state_dict(opt.state_dict())
    for window in range(3):
        for micro in range(k):
            loss(200 + window * k + micro).backward()
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(200 + window * k + micro))
            ref[1](ref[0](x)).pow(2).sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
    assert _same(model, ref)


def test_a_failure_inside_a_reentrant_checkpoint_is_seen_by_the_next_backward() -> None:
    """The exception kept alive (a logger, a REPL) keeps the failed graph alive: still refused."""
    torch.manual_seed(0)
    inner = torch.nn.Linear(4, 4)
    opt = SMMF(inner.parameters())
    handle = step_in_backward(opt)

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step)).requires_grad_()
        return torch.utils.checkpoint.checkpoint(lambda t: inner(_FailOnce.apply(t)), x, use_reentrant=True).sum()

    loss(0).backward()
    _FailOnce.armed = True
    errors = []
    try:
        loss(1).backward()
    except ValueError as error:
        errors.append(error)
    before = snapshot_of(opt, list(inner.parameters()))
    with pytest.raises(RuntimeError, match="Call reset"):
        loss(2).backward()
    assert_unchanged(opt, list(inner.parameters()), before)
    handle.reset()
    loss(3).backward()
    assert opt.state[inner.weight]["step"] == 2 and inner.weight.grad is None


def test_a_failure_of_the_step_that_closes_a_window_is_refused_until_reset() -> None:
    """k=2, a sparse embedding reached only by the first micro-batch: its step, when the second
    backward ends, raises; the next backward refuses, and reset() drops its gradient."""
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)
    opt = SMMF([*emb.parameters(), *lin.parameters()])
    handle = step_in_backward(opt, accumulation_steps=2)
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        lin(torch.randn(2, 4)).sum().backward()
    before = snapshot_of(opt, list(lin.parameters()))
    with pytest.raises(RuntimeError, match="Call reset"):
        lin(torch.randn(2, 4)).sum().backward()
    assert_unchanged(opt, list(lin.parameters()), before)
    handle.reset()
    assert emb.weight.grad is None


@pytest.mark.parametrize("k", [1, 2])
def test_per_tensor_clipping_equals_clipping_each_gradient_before_the_step(k: int) -> None:
    """What can be offered instead of global-norm clipping: each tensor's own norm, on the window's gradient."""
    ordinary, inside = _cnn(), _cnn()
    opt_ordinary, opt_inside = SMMF(ordinary.parameters(), lr=1e-2), SMMF(inside.parameters(), lr=1e-2)
    step_in_backward(opt_inside, k, clip_grad_norm=0.05)
    clipped = 0
    for step in range(3):
        for micro in range(k):
            _loss(ordinary, step * k + micro).backward()
            _loss(inside, step * k + micro).backward()
        for p in ordinary.parameters():
            clipped += int(torch.nn.utils.clip_grad_norm_([p], 0.05) > 0.05)
        opt_ordinary.step()
        opt_ordinary.zero_grad()
    assert clipped > 0  # the clip did act
    assert _same(ordinary, inside)


def test_clip_grad_norm_is_validated() -> None:
    opt = SMMF(_cnn().parameters())
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="clip_grad_norm should be a finite number > 0"):
            step_in_backward(opt, clip_grad_norm=bad)  # type: ignore[arg-type]
    assert_nothing_installed(opt)


def test_a_dropped_model_and_optimizer_are_freed() -> None:
    """Autograd holds a param's hooks where the garbage collector cannot see them: a hook holding the
    handle strongly made a cycle that kept every model trained this way in memory for good (a sweep
    of runs in one process ran out of GPU memory)."""
    import gc
    import weakref

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    step_in_backward(SMMF(net.parameters(), lr=1e-2))  # neither the optimizer nor the handle kept
    before = net[0].weight.detach().clone()
    for _ in range(2):
        net(torch.randn(4, 64)).sum().backward()
    assert not torch.equal(before, net[0].weight)  # the params keep their handle alive while they live
    ref = weakref.ref(net[0].weight)
    del net
    gc.collect()
    assert ref() is None


def test_a_hooked_model_still_copies_and_pickles() -> None:
    """The attribute that keeps a param's handle alive is copied and pickled empty: deepcopy and
    torch.save of a model with the step inside backward installed failed on the handle's lock."""
    import pickle

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = SMMF(net.parameters(), lr=1e-2)
    handle = step_in_backward(opt)
    net(torch.randn(3, 8)).sum().backward()
    clone = copy.deepcopy(net)
    restored = pickle.loads(pickle.dumps(net))
    buffer = io.BytesIO()
    torch.save(net, buffer)
    for other in (clone, restored):
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), other.parameters()))
        before = [p.detach().clone() for p in other.parameters()]
        other(torch.randn(3, 8)).sum().backward()  # the copies are not hooked: their gradients stay
        assert all(p.grad is not None for p in other.parameters())
        assert all(torch.equal(p, b) for p, b in zip(other.parameters(), before))
    handle.remove()


_DROPPED_DDP_MODEL = """
import gc, sys, time, weakref
import torch, torch.distributed as dist
from smmf import SMMF, step_in_backward

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
net = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
step_in_backward(SMMF(net.parameters(), lr=1e-2), module=net)  # neither the optimizer nor the handle kept
before = net.module[0].weight.detach().clone()
for _ in range(2):
    net(torch.randn(4, 64)).sum().backward()
assert not torch.equal(before, net.module[0].weight)
ref = weakref.ref(net.module[0].weight)
del net
for _ in range(10):  # gloo's threads drop their last references to a step's futures a moment later
    gc.collect()
    if ref() is None:
        break
    time.sleep(0.1)
print("freed" if ref() is None else "kept")
dist.destroy_process_group()
"""


def test_a_dropped_ddp_model_with_the_step_inside_backward_is_freed(tmp_path) -> None:
    """DDP keeps its communication hook in C++, out of the garbage collector's sight: a hook holding
    our module sync strongly (the DDP module → its hook → the sync → the module) kept every such model
    in memory for good."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DROPPED_DDP_MODEL, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "freed"


def test_a_hook_whose_handle_is_gone_says_so_once() -> None:
    """A param keeps its handle alive through an attribute; with that attribute deleted (and no other
    reference) the handle is freed, and its hooks, which autograd still holds, used to do nothing in
    silence: the param's gradient then accumulates as in the ordinary loop, which the warning says."""
    import gc
    import warnings

    from smmf.backward import _KEEPS_ALIVE

    net = torch.nn.Linear(4, 2)
    step_in_backward(SMMF(net.parameters(), lr=1e-2))
    for p in net.parameters():
        delattr(p, _KEEPS_ALIVE)
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            net(torch.randn(3, 4)).sum().backward()
    gone = [w for w in caught if "step inside backward" in str(w.message)]
    assert len(gone) == 2 and all(w.category is RuntimeWarning for w in gone)  # one per param, not per backward
    assert all(p.grad is not None for p in net.parameters())


def test_the_example_resumes_bit_identically_with_its_scheduler_stepped_per_step() -> None:
    """``examples/step_in_backward.py``, as users copy it: the scheduler steps once per training step."""
    script = Path(__file__).resolve().parents[1] / "examples" / "step_in_backward.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("identical: True"), out.stdout
    assert "scheduler.step()" in script.read_text().split("def train", 1)[1].split("\n\n\n", 1)[0]


def test_a_param_taken_out_of_its_group_is_left_alone_as_the_loop_leaves_it() -> None:
    """Its hook stays installed; a backward used to fail on it with a KeyError (and refuse every later one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = SMMF(model.parameters())
    step_in_backward(opt)
    bias = opt.param_groups[0]["params"].pop(1)
    before = bias.detach().clone()
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert torch.equal(bias, before) and bias.grad is not None and model.weight.grad is None
    assert opt.state[model.weight]["step"] == 2 and opt.state[bias].get("step", 0) == 0
