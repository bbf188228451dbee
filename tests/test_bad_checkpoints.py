"""A checkpoint is loaded whole or not at all, through torch's load hooks in torch's order; the
backend is a runtime choice; another optimizer's state dict is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_unchanged, snapshot_of, trained_smmf
from smmf import SMMF


# A checkpoint is loaded whole or not at all.

def _set_step(value):
    def corrupt(sd: dict) -> None:
        sd["state"][len(sd["state"]) - 1]["step"] = value  # the last param: the others would load first
    return corrupt


def _set_tensor(key: str, value):
    def corrupt(sd: dict) -> None:
        sd["state"][0][key] = value(sd["state"][0][key])
    return corrupt


CORRUPTIONS = {
    "step nan": (_set_step(float("nan")), "finite, non-negative whole number"),
    "step inf": (_set_step(float("inf")), "finite, non-negative whole number"),
    "step tensor inf": (_set_step(torch.tensor(float("inf"))), "finite, non-negative whole number"),
    "step 1.5": (_set_step(1.5), "finite, non-negative whole number"),
    "step bool": (_set_step(True), "finite, non-negative whole number"),
    "float signs": (_set_tensor("sign_m", lambda t: torch.full(t.shape, 300.0)), "must be uint8"),
    "bool signs": (_set_tensor("sign_m", lambda t: t.bool()), "must be uint8"),
    "int64 factor": (_set_tensor("row_v", lambda t: t.long()), "must be a floating-point tensor"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_checkpoint_is_rejected_and_changes_nothing(name: str) -> None:
    corrupt, match = CORRUPTIONS[name]
    params, opt = trained_smmf()
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    snapshot = snapshot_of(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert_unchanged(opt, params, snapshot)
    opt.step()  # and it still trains


# Values no step can leave, in the last param's state (the others would load first), for every code of M and the
# dense state: (options, key, value, message).
IMPOSSIBLE_VALUES = {
    "row_v nan": ({}, "row_v", float("nan"), "1 NaN or infinite"),
    "row_v negative": ({}, "row_v", -1.0, "1 negative"),
    "col_m inf": ({}, "col_m", float("inf"), "1 NaN or infinite"),
    "natural row_m negative": ({"momentum_shape": "natural"}, "row_m", -0.5, "1 negative"),
    "flag levels nan": ({"magnitude_bits": 1}, "levels_m", float("nan"), "1 NaN or infinite"),
    "flag levels negative": ({"magnitude_bits": 1}, "levels_m", -1.0, "1 negative"),
    "levels scales inf": ({"magnitude_bits": 3}, "scales_m", float("inf"), "1 NaN or infinite"),
    "levels scales negative": ({"magnitude_bits": 3}, "scales_m", -2.0, "1 negative"),
    "levels col_v nan": ({"magnitude_bits": 3}, "col_v", float("nan"), "1 NaN or infinite"),
    "dense exp_avg nan": ({"vector_reshape": False}, "exp_avg", float("nan"), "1 NaN"),
    "dense exp_avg_sq nan": ({"vector_reshape": False}, "exp_avg_sq", float("nan"), "1 NaN"),
    "fp64 factor beyond fp32": ({}, "row_v", 1e39, "1 NaN or infinite"),
    "dense exp_avg_sq negative": ({"vector_reshape": False}, "exp_avg_sq", -1.0, "1 negative"),
}


@pytest.mark.parametrize("name", IMPOSSIBLE_VALUES)
def test_a_checkpoint_with_values_no_step_leaves_is_rejected_and_changes_nothing(name: str) -> None:
    """A state dict whose ``row_v`` was NaN (or negative, or ``scales_m`` inf) loaded, and the next step made NaN
    weights."""
    options, key, value, match = IMPOSSIBLE_VALUES[name]
    params, opt = trained_smmf(**options)
    bad = copy.deepcopy(opt.state_dict())
    last = bad["state"][len(bad["state"]) - 1]
    assert key in last, sorted(last)
    if value == 1e39:  # saved in fp64, loaded into fp32 factors: inf once cast
        last[key] = last[key].double()
    last[key].view(-1)[0] = value
    snapshot = snapshot_of(opt, params)
    with pytest.raises(ValueError, match=f"parameter 1: state '{key}' holds {match}"):
        opt.load_state_dict(bad)
    assert_unchanged(opt, params, snapshot)
    opt.step()
    assert all(bool(p.isfinite().all()) for p in params)


def test_a_dense_first_moment_may_be_negative() -> None:
    params, opt = trained_smmf(vector_reshape=False)
    saved = opt.state_dict()
    assert bool((saved["state"][1]["exp_avg"] < 0).any())
    opt.load_state_dict(copy.deepcopy(saved))


def test_the_optimizers_own_checkpoint_after_a_huge_finite_gradient_loads() -> None:
    """The dense second moment is not capped: a finite gradient of 1e30 squares to inf there (as in Adam), and the
    checkpoint that state makes must load."""
    params, opt = trained_smmf(vector_reshape=False)
    params[1].grad = torch.full_like(params[1], 1e30)
    opt.step()
    saved = opt.state_dict()
    assert bool(saved["state"][1]["exp_avg_sq"].isinf().any())
    opt.load_state_dict(copy.deepcopy(saved))


# load_state_dict honours torch's hooks, in torch's order.

def test_pre_hook_output_is_what_gets_validated_and_loaded() -> None:
    params, opt = trained_smmf()
    legacy = copy.deepcopy(opt.state_dict())
    for st in legacy["state"].values():
        st["v_rows"] = st.pop("row_v")  # an older key name that a pre-hook migrates

    def migrate(optimizer, state_dict):
        for st in state_dict["state"].values():
            st["row_v"] = st.pop("v_rows")
        return state_dict

    fresh = SMMF(params, lr=1e-2)
    fresh.register_load_state_dict_pre_hook(migrate)
    fresh.load_state_dict(legacy)
    assert torch.equal(fresh.state[params[0]]["row_v"], opt.state[params[0]]["row_v"])


def test_pre_hook_edits_and_post_hook_edits_both_stick() -> None:
    params, opt = trained_smmf()
    saved = copy.deepcopy(opt.state_dict())

    def restart_schedule(optimizer, state_dict):  # returns a new state dict, as torch allows
        edited = copy.deepcopy(state_dict)
        for st in edited["state"].values():
            st["step"] = 0
        return edited

    def forget_second_moment(optimizer):  # replaces a state tensor
        for st in optimizer.state.values():
            st["row_v"] = torch.zeros_like(st["row_v"])

    fresh = SMMF(params, lr=1e-2)
    fresh.register_load_state_dict_pre_hook(restart_schedule)
    fresh.register_load_state_dict_post_hook(forget_second_moment)
    fresh.load_state_dict(saved)
    for st in fresh.state.values():
        assert st["step"] == 0
        assert not st["row_v"].any()
        assert st["row_v"].dtype == torch.float32


# Backend is a runtime choice; another optimizer's state dict is not SMMF's.

def test_checkpoint_written_with_triton_loads_on_cpu_and_keeps_the_constructors_backend() -> None:
    params, opt = trained_smmf()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["backend"] = "triton"  # as saved on a CUDA machine
    fresh = SMMF(params, lr=1e-2, backend="auto")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["backend"] == "auto"
    fresh.step()


def test_adam_state_dict_is_rejected_and_changes_nothing() -> None:
    params, opt = trained_smmf()
    adam_state = torch.optim.Adam(params).state_dict()  # empty state: only Adam's group options
    snapshot = snapshot_of(opt, params)
    with pytest.raises(ValueError, match="another optimizer's state dict"):
        opt.load_state_dict(adam_state)
    assert_unchanged(opt, params, snapshot)


def test_group_without_lr_is_rejected_at_load() -> None:
    params, opt = trained_smmf()
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["lr"]
    snapshot = snapshot_of(opt, params)
    with pytest.raises(ValueError, match=r"lacks \['lr'\]"):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, snapshot)


def test_scheduler_keys_in_a_checkpoint_are_accepted() -> None:
    params, opt = trained_smmf()
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to the groups
    saved = copy.deepcopy(opt.state_dict())
    SMMF(params, lr=1e-2).load_state_dict(saved)
