"""Generic optimizer tests, run over every entry and input variant of ``optim_db``."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from optim_db import OptimizerInfo, optim_db

CASES = [(info, variant.kwargs) for info in optim_db for variant in info.inputs]
CASE_IDS = [f"{info}-{variant.desc}" for info in optim_db for variant in info.inputs]
parametrize_cases = pytest.mark.parametrize("info,kwargs", CASES, ids=CASE_IDS)
parametrize_infos = pytest.mark.parametrize("info", optim_db, ids=str)


def _model(device: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, 3)
    ).to(device=device, dtype=dtype)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, 5, 5, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x, y = _batch(seed)
    param = next(model.parameters())
    return torch.nn.functional.mse_loss(model(x.to(param.device, param.dtype)), y.to(param.device, param.dtype))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        opt.zero_grad()
        loss = _loss(model, s)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fresh_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@parametrize_infos
def test_errors(info: OptimizerInfo) -> None:
    for err in info.error_inputs:
        with pytest.raises(err.error, match=err.match):
            info.factory([torch.nn.Parameter(torch.randn(2, 2))], **err.kwargs)


@parametrize_cases
def test_goes_the_right_direction(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8, device=info.device))
    target = torch.randn(8, 8, device=info.device)
    opt = info.factory([w], **_fresh_kwargs(kwargs))
    sign = -1.0 if kwargs.get("maximize") else 1.0
    initial = (w - target).pow(2).sum().item()
    for _ in range(100):
        opt.zero_grad()
        (sign * (w - target).pow(2).sum()).backward()
        opt.step()
    final = (w - target).pow(2).sum().item()
    assert final < 0.98 * initial  # maximizing −loss minimizes loss too


@parametrize_cases
def test_frozen_layer_and_missing_grad(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    model = _model(info.device)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = info.factory(model.parameters(), **_fresh_kwargs(kwargs))
    _train(model, opt, range(3))
    bias_before = model[3].bias.detach().clone()
    opt.zero_grad()
    _loss(model, 3).backward()
    model[3].bias.grad = None  # a param without a grad mid-run
    opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert torch.equal(model[3].bias, bias_before)
    assert model[0].weight not in opt.state


@parametrize_cases
def test_zero_dim_and_empty_params(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    dev = info.device
    params = [torch.nn.Parameter(torch.tensor(1.5, device=dev)), torch.nn.Parameter(torch.empty(0, device=dev)),
              torch.nn.Parameter(torch.empty(3, 0, device=dev))]
    opt = info.factory(params, **_fresh_kwargs(kwargs))
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert torch.isfinite(params[0]) and params[0].item() != 1.5


@parametrize_cases
def test_zero_grads_are_a_no_op(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    if kwargs.get("weight_decay"):
        pytest.skip("weight decay moves params even with zero grads")
    model = _model(info.device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = info.factory(model.parameters(), **_fresh_kwargs(kwargs))
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert torch.isfinite(v).all()


@parametrize_infos
def test_tiny_lr_in_one_group_leaves_it_unchanged(info: OptimizerInfo) -> None:
    model = _model(info.device)
    still = model[0].weight.detach().clone()
    opt = info.factory([{"params": [model[0].weight], "lr": 1e-20}, {"params": list(model[3].parameters())}], lr=1e-2)
    _train(model, opt, range(5))
    assert torch.equal(model[0].weight, still)


@parametrize_cases
def test_state_dict_load_into_clone_is_deterministic(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    model = _model(info.device)
    opt = info.factory(model.parameters(), **_fresh_kwargs(kwargs))
    _train(model, opt, range(3))
    clone = copy.deepcopy(model)
    opt_clone = info.factory(clone.parameters(), **_fresh_kwargs(kwargs))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt_clone.load_state_dict(torch.load(buffer, weights_only=True))
    losses = _train(model, opt, range(3, 13))
    losses_clone = _train(clone, opt_clone, range(3, 13))
    assert losses == losses_clone
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


@parametrize_cases
@pytest.mark.parametrize("named_0", [True, False], ids=["named0", "plain0"])
@pytest.mark.parametrize("named_1", [True, False], ids=["named1", "plain1"])
def test_can_load_from_to_named_state_dict(info: OptimizerInfo, kwargs: dict[str, Any], named_0: bool,
                                           named_1: bool) -> None:
    """torch's ``TestOptimRenewed.test_can_load_from_to_named_state_dict``: an optimizer built from
    ``named_parameters()`` records ``param_names`` in its groups; its checkpoint loads into one built
    from ``parameters()`` and back, continues identically, and keeps the names where either had them."""
    model = _model(info.device)
    opt = info.factory(model.named_parameters() if named_0 else model.parameters(), **_fresh_kwargs(kwargs))
    _train(model, opt, range(3))
    clone = copy.deepcopy(model)
    opt_clone = info.factory(clone.named_parameters() if named_1 else clone.parameters(), **_fresh_kwargs(kwargs))
    opt_clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert _train(model, opt, range(3, 8)) == _train(clone, opt_clone, range(3, 8))
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    if named_0 or named_1:
        names = [name for name, _ in model.named_parameters()]
        assert opt_clone.state_dict()["param_groups"][0]["param_names"] == names


@parametrize_cases
def test_named_state_dict_is_deterministic(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    """torch's ``test_state_dict_deterministic`` with an optimizer built from ``named_parameters()``:
    its state dict loads into a fresh one and gives the same state dict back."""
    model = _model(info.device)
    opt = info.factory(model.named_parameters(), **_fresh_kwargs(kwargs))
    _train(model, opt, range(2))
    clone = copy.deepcopy(model)
    opt_clone = info.factory(clone.named_parameters(), **_fresh_kwargs(kwargs))
    opt_clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    a, b = opt.state_dict(), opt_clone.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for pid, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][key])), key


@parametrize_cases
def test_deepcopy_continues_identically(info: OptimizerInfo, kwargs: dict[str, Any]) -> None:
    model = _model(info.device)
    opt = info.factory(model.parameters(), **_fresh_kwargs(kwargs))
    _train(model, opt, range(2))
    model2, opt2 = copy.deepcopy((model, opt))
    assert _train(model, opt, range(2, 6)) == _train(model2, opt2, range(2, 6))


@parametrize_infos
def test_closure_returns_the_loss(info: OptimizerInfo) -> None:
    model = _model(info.device)
    opt = info.factory(model.parameters())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0


@parametrize_infos
def test_works_with_lr_scheduler(info: OptimizerInfo) -> None:
    """An LR that a scheduler drives to zero stops the params from moving."""
    model = _model(info.device)
    opt = info.factory(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 2 else 0.0)
    for s in range(2):
        _train(model, opt, range(s, s + 1))
        scheduler.step()
    frozen = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, range(2, 4))
    assert all(torch.equal(p, f) for p, f in zip(model.parameters(), frozen))


@parametrize_infos
def test_complex_params_match_their_real_view(info: OptimizerInfo) -> None:
    if not info.supports_complex:
        pytest.skip("no complex support")
    torch.manual_seed(0)
    z = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64, device=info.device))
    r = torch.nn.Parameter(torch.view_as_real(z.detach()).clone())
    opt_z, opt_r = info.factory([z], lr=1e-2), info.factory([r], lr=1e-2)
    for _ in range(5):
        g = torch.randn(4, 3, dtype=torch.complex64, device=info.device)
        z.grad, r.grad = g, torch.view_as_real(g).clone()
        opt_z.step()
        opt_r.step()
    torch.testing.assert_close(torch.view_as_real(z.detach()), r.detach())


@parametrize_infos
def test_sparse_grads_are_rejected_and_change_nothing(info: OptimizerInfo) -> None:
    dev = info.device
    dense, sparse = torch.nn.Parameter(torch.randn(3, 3, device=dev)), torch.nn.Parameter(torch.randn(4, 2, device=dev))
    opt = info.factory([dense, sparse])
    dense.grad = torch.randn(3, 3, device=dev)
    sparse.grad = torch.randn(4, 2, device=dev).to_sparse()
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(dense, before)
    if info.atomic_step:
        assert len(opt.state) == 0


@parametrize_infos
def test_grad_scaler_skips_inf_steps_and_keeps_state(info: OptimizerInfo) -> None:
    model = _model(info.device)
    opt = info.factory(model.parameters())
    scaler = torch.amp.GradScaler(info.device, init_scale=2.0**4)
    for s in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, s)).backward()
        scaler.step(opt)
        scaler.update()
    state_before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(_loss(model, 3)).backward()
    next(model.parameters()).grad[0].fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params_before))
    after = opt.state_dict()
    for pid, st in state_before["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(after["state"][pid][k]), torch.as_tensor(v)), k
