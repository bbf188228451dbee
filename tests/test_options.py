"""SMMF's options come from one registry (``smmf.options.OPTIONS``): the constructor's keywords and defaults, the
checks, a checkpoint's fill-ins and the runtime choices follow it, and a launch shared by many tensors groups them by
every field of the step's configuration."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import smmf.options
from smmf import SMMF
from smmf.functional import StepConfig
from smmf.options import OPTIONS, Option
from smmf.state import MomentumCode


def test_the_constructor_takes_the_registrys_options_at_their_defaults() -> None:
    signature = inspect.signature(SMMF.__init__).parameters
    keywords = {name: p.default for name, p in signature.items() if name not in ("self", "params")}
    assert keywords == {option.name: option.default for option in OPTIONS}
    assert list(keywords) == [option.name for option in OPTIONS]  # the docs list them in this order
    assert SMMF([torch.nn.Parameter(torch.ones(2))]).defaults == keywords


def test_an_option_added_to_the_registry_is_carried_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new option registered once: the groups hold it at its default, a step checks it (again when it changes),
    a checkpoint that lacks it keeps the optimizer's value when it is optional, and is refused when it is not."""
    checked = []

    def check(group: dict) -> None:
        checked.append(group["extra"])
        if group["extra"] < 0:
            raise ValueError(f"Invalid extra: {group['extra']} (must be >= 0)")

    for optional in (True, False):
        monkeypatch.setattr(smmf.options, "OPTIONS", (*OPTIONS, Option("extra", 7, check, optional=optional)))
        checked.clear()
        param = torch.nn.Parameter(torch.ones(4, 4))
        opt = SMMF([param])
        assert opt.param_groups[0]["extra"] == 7 and checked
        checked.clear()
        for _ in range(2):
            param.grad = torch.ones_like(param)
            opt.step()
        assert checked == [7]  # the first step's check of the group; the second's found it unchanged
        opt.param_groups[0]["extra"] = -1
        before = param.detach().clone()
        with pytest.raises(ValueError, match="Invalid extra: -1"):
            opt.step()
        assert torch.equal(param, before) and opt.state[param]["step"] == 2
        opt.param_groups[0]["extra"] = 3
        saved = opt.state_dict()
        del saved["param_groups"][0]["extra"]  # a checkpoint of a version without it
        fresh = SMMF([torch.nn.Parameter(torch.ones(4, 4))])
        if optional:
            fresh.load_state_dict(saved)
            assert fresh.param_groups[0]["extra"] == 7
        else:
            with pytest.raises(ValueError, match=r"lacks \['extra'\]"):
                fresh.load_state_dict(saved)


def test_a_runtime_option_is_never_taken_from_a_checkpoint() -> None:
    assert [option.name for option in OPTIONS if not option.from_checkpoint] == ["backend"]
    saved = SMMF([torch.nn.Parameter(torch.ones(4, 4))], backend="torch").state_dict()
    fresh = SMMF([torch.nn.Parameter(torch.ones(4, 4))], backend="auto")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["backend"] == "auto"


def _config(**changes) -> StepConfig:
    base = StepConfig(lr=1e-3, beta1=0.9, beta2=0.5, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                      maximize=False, stochastic_rounding=False, code=MomentumCode.SIGN)
    return dataclasses.replace(base, **changes)


def test_a_shared_launch_keeps_apart_configs_that_differ_in_any_field() -> None:
    """Triton grouped a launch's tensors by a key that listed the config's fields by hand: a field left out would
    have let two groups share one launch with the first group's value. The key is every field but the per-param
    ones, so a field added to the config is in it."""
    base = _config()
    for field in dataclasses.fields(StepConfig):
        if field.name in ("levels_salt", "rounding_key"):
            continue
        value = getattr(base, field.name)
        other = {bool: lambda v: not v, float: lambda v: v + 0.25, MomentumCode: lambda v: MomentumCode.FLAG}
        changed = _config(**{field.name: other[type(value)](value)})
        assert changed.launch_key(torch.bfloat16) != base.launch_key(torch.bfloat16), field.name
    per_param = base.for_param(levels_salt=5, rounding_key=9)
    assert per_param.launch_key(torch.float32) == base.launch_key(torch.float32)

    extended = dataclasses.make_dataclass("Extended", [("extra", int, dataclasses.field(default=0))],
                                          bases=(StepConfig,), frozen=True)
    one, two = (extended(**dataclasses.asdict(base), extra=value) for value in (1, 2))
    assert one.launch_key(torch.float32) != two.launch_key(torch.float32)


def test_the_kernels_numbers_follow_the_schemas_order() -> None:
    from smmf.schema import STEP_NUMBERS

    numbers = dict(zip(STEP_NUMBERS, _config(lr=0.25, eps=0.125).numbers(torch.float32)))
    assert numbers["lr"] == 0.25 and numbers["eps"] == 0.125 and numbers["beta2"] == 0.5 and numbers["gsign"] == 1.0
    assert len(numbers) == len(STEP_NUMBERS) - 1  # the cap is the tensor's own
