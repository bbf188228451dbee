"""Bad input to a step or to the constructor never corrupts: a rejected call raises a clear error
and changes nothing; crashes are tested in a subprocess."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS, assert_unchanged, run_script, snapshot_of, trained_smmf
from smmf import SMMF

BACKENDS = ["torch", *CPU_FUSED_BACKENDS]


# Shapes swapped under the optimizer: a clear RuntimeError, never an out-of-bounds kernel.

SWAPPED = """
import sys, torch
from smmf import SMMF
p = torch.nn.Parameter(torch.randn(16, 12)); opt = SMMF([p], backend=sys.argv[1]); p.grad = torch.randn(16, 12); opt.step()
p.data = torch.randn(300, 300); p.grad = torch.randn(300, 300)
try:
    opt.step()
except RuntimeError as err:
    print("RAISED:", err)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_swapped_for_a_larger_one_is_an_error_not_a_crash(backend: str) -> None:
    out = run_script(SWAPPED, backend)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RAISED:" in out.stdout and "(300, 300)" in out.stdout and "(16, 12)" in out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_another_shape_is_rejected_before_any_update(backend: str) -> None:
    p = torch.nn.Parameter(torch.randn(512, 512))
    opt = SMMF([p], backend=backend)
    p.grad = torch.randn(512, 512)
    opt.step()
    snapshot = snapshot_of(opt, [p])
    p.grad.data = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"shape \(512, 512\) .* gradient of shape \(3,\)"):
        opt.step()
    assert_unchanged(opt, [p], snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrunk_param_is_rejected(backend: str) -> None:
    params, opt = trained_smmf(backend)
    params[0].data = torch.randn(8, 12)
    params[0].grad = torch.randn(8, 12)
    snapshot = snapshot_of(opt, params)
    with pytest.raises(RuntimeError, match=r"shape \(8, 12\) has SMMF state made for another shape"):
        opt.step()
    assert_unchanged(opt, params, snapshot)


# Every tensor of the state of every code, its .data swapped (the object, and so the keys, unchanged): refused
# before any update, whichever tensor it is. In a subprocess: the kernels write through the tensor's address,
# so a state let through can corrupt the heap (a narrower dtype did, before dtypes were checked).
EDITED_STATE = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from helpers import assert_unchanged, snapshot_of, trained_smmf
OPTIONS = [{}, {"magnitude_bits": 1}, {"magnitude_bits": 3}, {"beta": None}, {"momentum_shape": "natural"},
           {"vector_reshape": False}]
for options in OPTIONS:
    for edit in ("longer", "shorter", "empty", "other dtype"):
        params, opt = trained_smmf(sys.argv[1], **options)
        edited = params[1] if "vector_reshape" in options else params[0]
        for key in [key for key in opt.state[edited] if key != "step"]:
            tensor = opt.state[edited][key]
            kept = tensor.data
            if edit == "other dtype":
                tensor.data = kept.to(torch.bfloat16 if kept.dtype != torch.bfloat16 else torch.uint8)
            else:
                tensor.data = torch.zeros({"longer": kept.numel() + 8, "shorter": kept.numel() - 1, "empty": 0}[edit],
                                          dtype=kept.dtype)
            snapshot = snapshot_of(opt, params)
            try:
                opt.step()
                print("ACCEPTED", options, edit, key)
            except RuntimeError as err:
                named = f"SMMF state '{key}' of " in str(err) or "made for another shape" in str(err)
                print("REFUSED" if named else f"OTHER MESSAGE {err}", options, edit, key)
            assert_unchanged(opt, params, snapshot)
            tensor.data = kept
        opt.step()  # each put back: the state fits again
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_tensor_edited_in_place_is_rejected(backend: str) -> None:
    out = run_script(EDITED_STATE, backend, str(Path(__file__).parent))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert [line for line in lines if not line.startswith("REFUSED")] == []
    # sign, flag, levels, no M, natural, dense: their state tensors, 4 edits each
    assert len(lines) == 4 * (5 + 7 + 4 + 2 + 5 + 2), lines


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_value_that_is_not_a_tensor_is_rejected(backend: str) -> None:
    params, opt = trained_smmf(backend)
    opt.state[params[0]]["row_v"] = [0.0] * 16
    snapshot = snapshot_of(opt, params)
    with pytest.raises(RuntimeError, match=r"SMMF state 'row_v' of list where it needs a tensor"):
        opt.step()
    assert_unchanged(opt, params, snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_grad", ["dtype", "device_shape"])
def test_grad_dtype_mismatch_is_rejected(backend: str, bad_grad: str) -> None:
    params, opt = trained_smmf(backend)
    snapshot = snapshot_of(opt, params)
    if bad_grad == "dtype":
        params[1].grad.data = params[1].grad.data.double()
    else:
        params[1].grad.data = torch.ones(12, 1)
    with pytest.raises(RuntimeError, match="they must match"):
        opt.step()
    assert_unchanged(opt, params, snapshot)


# A rejected step changes nothing: every check runs before the first param is touched.

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_second_param_leaves_the_first_untouched(backend: str) -> None:
    params, opt = trained_smmf(backend)
    params[0].grad = torch.randn(16, 12)
    params[1].grad.data = torch.randn(5)
    snapshot = snapshot_of(opt, params)
    with pytest.raises(RuntimeError):
        opt.step()
    assert_unchanged(opt, params, snapshot)


# Integer params.

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_params_are_rejected_at_construction(dtype: torch.dtype) -> None:
    p = torch.zeros(4, 4, dtype=dtype)
    with pytest.raises(ValueError, match="floating-point or complex parameters"):
        SMMF([p])
    opt = SMMF([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="floating-point or complex parameters"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name,value", [("lr", "abc"), ("eps", None), ("beta", "0.9"), ("weight_decay", [0.1])])
def test_non_numeric_hyperparameters_are_a_clear_error(name: str, value) -> None:
    with pytest.raises(ValueError, match=f"{name} should be a"):
        SMMF([torch.nn.Parameter(torch.zeros(2))], **{name: value})


@pytest.mark.parametrize("name,value,message", [
    ("lr", math.inf, "Invalid learning rate"), ("eps", math.inf, "Invalid epsilon"),
    ("weight_decay", math.inf, "Invalid weight_decay"), ("magnitude_bits", 3.0, "magnitude_bits should be one of"),
    ("magnitude_bits", True, "magnitude_bits should be one of")])
def test_infinite_or_non_integer_hyperparameters_are_a_clear_error(name: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SMMF([torch.nn.Parameter(torch.zeros(2))], **{name: value})
    opt = SMMF([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], name: value})
    assert len(opt.param_groups) == 1


def test_a_state_without_its_step_count_is_refused_before_anything_changes() -> None:
    """A state edited to lose its ``step`` used to fail with a KeyError part-way through a step,
    after the params before it had been stepped."""
    params = [torch.nn.Parameter(torch.randn(6, 6)) for _ in range(3)]
    opt = SMMF(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    del opt.state[params[1]]["step"]
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="without its 'step' count"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_step_params_refuses_a_param_outside_its_group_before_anything_changes() -> None:
    """``step_params`` with a param that no group holds used to step it and make state for it, after which
    ``state_dict()`` failed with a bare KeyError; with another group's options it stepped it under them."""
    params, opt = trained_smmf()
    stranger = torch.nn.Parameter(torch.randn(4, 4))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "lr": 0.5})
    for p in (*params, stranger):
        p.grad = torch.randn_like(p)
    snapshot, kept = snapshot_of(opt, params), stranger.detach().clone()
    with pytest.raises(ValueError, match="none of the optimizer's param groups"):
        opt.step_params([(opt.param_groups[0], params[0]), (opt.param_groups[0], stranger)])
    with pytest.raises(ValueError, match="in another param group"):
        opt.step_params([(opt.param_groups[1], params[1])])
    assert_unchanged(opt, params, snapshot)
    assert torch.equal(stranger, kept) and stranger not in opt.state
    opt.load_state_dict(opt.state_dict())  # new group dicts: the step finds its params in them
    opt.step_params([(group, p) for group in opt.param_groups for p in group["params"] if p.grad is not None])
    opt.state_dict()
    dropped = opt.param_groups[1]["params"].pop()  # a list edited in place: the map follows it
    dropped.grad = torch.randn_like(dropped)
    with pytest.raises(ValueError, match="none of the optimizer's param groups"):
        opt.step_params([(opt.param_groups[1], dropped)])


def test_a_param_cast_after_its_state_was_made_is_refused_with_the_cast_named() -> None:
    """``model.double()`` mid-run: the state no longer fits, and the error says why, before anything changes."""
    model = torch.nn.Linear(64, 64)
    opt = SMMF(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    model.double()
    model(torch.randn(4, 64, dtype=torch.float64)).sum().backward()
    params = list(model.parameters())
    saved = snapshot_of(opt, params)
    with pytest.raises(RuntimeError, match=r"cast to torch.float64 \(model.double\(\)"):
        opt.step()
    assert_unchanged(opt, params, saved)


def test_a_state_key_added_by_hand_is_called_an_edit_not_an_option_change() -> None:
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = SMMF([param])
    param.grad = torch.randn(4, 6)
    opt.step()
    opt.state[param]["ema"] = torch.zeros(4, 6)
    saved = snapshot_of(opt, [param])
    with pytest.raises(RuntimeError, match=r"state keys \[.*'ema'.*\] where its options need .*state edited"):
        opt.step()
    assert_unchanged(opt, [param], saved)


def test_a_group_with_a_param_twice_warns_as_torch_and_steps_it_once() -> None:
    """torch warns (its generic suite expects the warning, not an error); the param is stepped once per step,
    as if given once (a fused launch would otherwise race it with itself)."""
    param = torch.nn.Parameter(torch.randn(4, 6))
    twin = torch.nn.Parameter(param.detach().clone())
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt = SMMF([param, param])
    ref = SMMF([twin])
    for _ in range(3):
        param.grad, twin.grad = torch.randn(4, 6), None
        twin.grad = param.grad.clone()
        opt.step()
        ref.step()
    assert torch.equal(param, twin) and opt.state[param]["step"] == 3
    other = SMMF([torch.nn.Parameter(torch.randn(3))])
    with pytest.warns(UserWarning, match="duplicate"):
        other.add_param_group({"params": [param, param]})
    assert len(other.param_groups) == 2


# torch's generic error cases for every optimizer (torch.testing._internal.common_optimizers'
# get_error_inputs_for_all_optims, which TestOptimRenewed.test_errors runs): (params, kwargs, error, message).
_P, _Q = torch.nn.Parameter(torch.randn(1, 1)), torch.nn.Parameter(torch.randn(1, 1))
TORCH_ERROR_CASES = [
    (_P, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors or dicts"),
    ([_P, _P], {}, UserWarning, ".*a parameter group with duplicate parameters.*"),
    ([{"params": _P}, {"params": _P}], {}, ValueError, "some parameters appear in more than one parameter group"),
    (None, {"lr": torch.tensor([0.001, 0.001])}, ValueError, "Tensor lr must be 1-element"),
    ([("weight", _P), _Q], {}, ValueError, "all optimizer params should be with/without names. Some param names are "
     "missing"),
    ([{"params": [_P], "lr": 1e-2}, {"params": [("weight", _Q)]}], {}, ValueError,
     "all optimizer param groups should be with/without names. cannot add param group with names to the optimizer"),
]


@pytest.mark.parametrize("params,kwargs,error,match", TORCH_ERROR_CASES,
                         ids=[str(i) for i in range(len(TORCH_ERROR_CASES))])
def test_torch_generic_error_cases(params, kwargs, error, match: str) -> None:
    params = [torch.nn.Parameter(torch.randn(1, 1))] if params is None else params
    if issubclass(error, Warning):
        with pytest.warns(error, match=match):
            SMMF(params, **kwargs)
    else:
        with pytest.raises(error, match=match):
            SMMF(params, **kwargs)


# Options a scheduler, a framework or a user may write into param_groups after construction, and the
# constructor's message for each.
CHANGED_OPTIONS = [("nonfinite_grads", "Zero", "Unknown nonfinite_grads: 'Zero'"),
                   ("decay_rate", 0.5, r"Invalid decay_rate: 0.5 \(must be in \[-1, 0\]\)"),
                   ("lr", float("nan"), "Invalid learning rate: nan"),
                   ("lr", -1e-3, "Invalid learning rate: -0.001"),
                   ("beta", 1.5, r"Invalid beta: 1.5"),
                   ("eps", float("inf"), "Invalid epsilon value: inf"),
                   ("growth_rate", 2.0, "Invalid growth_rate: 2.0"),
                   ("weight_decay_mode", "AdamW", "Unknown weight_decay_mode: 'AdamW'"),
                   ("maximize", 1, "maximize should be a bool"),
                   ("momentum_rounding", "Stochastic", "Unknown momentum_rounding"),
                   ("backend", "cuda", "Unknown backend: 'cuda'"),
                   ("lr", torch.tensor([1e-3, 1e-3]), "Tensor lr must be 1-element"),
                   ("maximize", 0, "maximize should be a bool"),  # equal to False, not a bool
                   ("magnitude_bits", 0.0, "magnitude_bits should be one of"),  # equal to 0
                   ("eps", torch.tensor([1e-8, 1e-8]), "eps should be a number")]


@pytest.mark.parametrize("backend", ["torch", *CPU_FUSED_BACKENDS])
@pytest.mark.parametrize("key,value,message", CHANGED_OPTIONS, ids=[f"{k}={v!r}" for k, v, _ in CHANGED_OPTIONS])
def test_an_option_changed_in_param_groups_is_checked_before_the_step_changes_anything(
        backend: str, key: str, value, message: str) -> None:
    """The constructor refuses each of these values; written into ``param_groups`` later, they were taken (a
    ``decay_rate`` of 0.5 made 794 of 2080 weights NaN, ``"Zero"`` acted as ``"propagate"``)."""
    params, opt = trained_smmf(backend)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5, 7))]})
    for p in opt.param_groups[1]["params"]:
        p.grad = torch.randn_like(p)
    for p in params:
        p.grad = torch.randn_like(p)
    everything = [p for group in opt.param_groups for p in group["params"]]
    saved = snapshot_of(opt, everything)
    original, opt.param_groups[1][key] = opt.param_groups[1][key], value
    with pytest.raises(ValueError, match=message):
        opt.step()
    with pytest.raises(ValueError, match=message):  # refused at every step until it is mended
        opt.step()
    opt.param_groups[1][key] = original
    assert_unchanged(opt, everything, saved)
    opt.step()  # mended, it steps
    assert opt.state[everything[0]]["step"] == 4


def test_a_tensor_lr_changed_in_place_is_checked_at_each_step() -> None:
    param = torch.nn.Parameter(torch.randn(4, 6))
    lr = torch.tensor(1e-3)
    opt = SMMF([param], lr=lr)
    param.grad = torch.randn(4, 6)
    opt.step()
    saved = snapshot_of(opt, [param])
    lr.fill_(float("nan"))
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        opt.step()
    lr.fill_(1e-3)
    assert_unchanged(opt, [param], saved)


@pytest.mark.parametrize("key", ["eps", "growth_rate"])
def test_a_deleted_option_is_named(key: str) -> None:
    """``growth_rate=None`` deleted reads as None to ``dict.get``: still missing."""
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = SMMF([param], growth_rate=None)
    param.grad = torch.randn(4, 6)
    opt.step()
    del opt.param_groups[0][key]
    with pytest.raises(ValueError, match=rf"lacks SMMF's options \['{key}'\]"):
        opt.step()


def test_options_are_checked_again_only_when_they_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchanged options cost a tuple comparison per group and step, not the constructor's checks; a scheduler's
    new lr is checked once."""
    import smmf.optimizer as optimizer_module

    calls = []
    check = optimizer_module.validate_group
    monkeypatch.setattr(optimizer_module, "validate_group", lambda group: (calls.append(1), check(group)))
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = SMMF([param])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    calls.clear()  # the constructor's
    for _ in range(6):
        param.grad = torch.randn(4, 6)
        opt.step()
        scheduler.step()
    assert len(calls) == 2  # the first step, and the step after the lr changed once at step 3


def test_the_step_inside_backward_checks_changed_options_too() -> None:
    from smmf import step_in_backward

    model = torch.nn.Linear(6, 4)
    opt = SMMF(model.parameters())
    step_in_backward(opt)
    model(torch.randn(3, 6)).sum().backward()
    opt.param_groups[0]["decay_rate"] = 0.5
    saved = snapshot_of(opt, list(model.parameters()))
    with pytest.raises(ValueError, match="Invalid decay_rate"):
        model(torch.randn(3, 6)).sum().backward()
    assert_unchanged(opt, list(model.parameters()), saved)


def test_numpy_hyperparameters_are_taken_as_python_floats() -> None:
    """A sweep over ``np.logspace`` gives ``np.float64`` (or float32) values; torch's optimizers take them."""
    np = pytest.importorskip("numpy")
    param = torch.nn.Parameter(torch.randn(4, 6))
    opt = SMMF([param], lr=np.float32(1e-3), beta=np.float64(0.9), weight_decay=np.float32(0.0))
    assert all(type(opt.param_groups[0][k]) is float for k in ("lr", "beta", "weight_decay"))
    twin = torch.nn.Parameter(param.detach().clone())
    ref = SMMF([twin], lr=float(np.float32(1e-3)), beta=0.9)
    param.grad = twin.grad = torch.randn(4, 6)
    opt.step()
    ref.step()
    assert torch.equal(param, twin)


def test_a_refused_step_leaves_a_users_own_list_of_groups_as_it_is() -> None:
    """A refused step puts back the groups DeepSpeed ZeRO-1/2 cut to the one it steps; a user's own shorter list of
    the same groups (holding the params given, not ZeRO's buffers) stays as the user left it."""
    first, second = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4, 6))
    opt = SMMF([{"params": [first]}, {"params": [second]}])
    kept = opt.param_groups[:1]
    opt.param_groups = kept
    kept[0]["lr"] = float("nan")
    first.grad = torch.randn(4, 6)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    assert opt.param_groups is kept
