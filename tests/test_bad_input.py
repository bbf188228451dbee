"""Bad input never corrupts: a rejected call raises a clear error and changes nothing; crashes are
tested in a subprocess. One test (or more) per case of issue #9; each failed on 0.1."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from helpers import CPU_FUSED_BACKENDS
from smmf import SMMF

BACKENDS = ["torch", *CPU_FUSED_BACKENDS]
STATE_TENSORS = ("row_m", "col_m", "sign_m", "row_v", "col_v")


def _run_script(source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _snapshot(opt: SMMF, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_unchanged(opt: SMMF, params: list[torch.Tensor], snapshot: tuple[list[torch.Tensor], dict]) -> None:
    before_params, before = snapshot
    assert all(torch.equal(p, b) for p, b in zip(params, before_params))
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for pid, st in before["state"].items():
        assert after["state"][pid].keys() == st.keys()
        for key, value in st.items():
            got = after["state"][pid][key]
            assert type(got) is type(value) and torch.equal(torch.as_tensor(got), torch.as_tensor(value)), key


def _trained(backend: str = "torch", steps: int = 3, **options) -> tuple[list[torch.nn.Parameter], SMMF]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12))]
    opt = SMMF(params, lr=1e-2, backend=backend, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


# 1. Shapes swapped under the optimizer: a clear RuntimeError, never an out-of-bounds kernel.

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
    out = _run_script(SWAPPED, backend)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RAISED:" in out.stdout and "(300, 300)" in out.stdout and "(16, 12)" in out.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_of_another_shape_is_rejected_before_any_update(backend: str) -> None:
    p = torch.nn.Parameter(torch.randn(512, 512))
    opt = SMMF([p], backend=backend)
    p.grad = torch.randn(512, 512)
    opt.step()
    snapshot = _snapshot(opt, [p])
    p.grad.data = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"shape \(512, 512\) .* gradient of shape \(3,\)"):
        opt.step()
    _assert_unchanged(opt, [p], snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrunk_param_is_rejected(backend: str) -> None:
    params, opt = _trained(backend)
    params[0].data = torch.randn(8, 12)
    params[0].grad = torch.randn(8, 12)
    snapshot = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match=r"shape \(8, 12\) has SMMF state made for another shape"):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_grad", ["dtype", "device_shape"])
def test_grad_dtype_mismatch_is_rejected(backend: str, bad_grad: str) -> None:
    params, opt = _trained(backend)
    snapshot = _snapshot(opt, params)
    if bad_grad == "dtype":
        params[1].grad.data = params[1].grad.data.double()
    else:
        params[1].grad.data = torch.ones(12, 1)
    with pytest.raises(RuntimeError, match="they must match"):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


# 2. A rejected step changes nothing: every check runs before the first param is touched.

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_second_param_leaves_the_first_untouched(backend: str) -> None:
    params, opt = _trained(backend)
    params[0].grad = torch.randn(16, 12)
    params[1].grad.data = torch.randn(5)
    snapshot = _snapshot(opt, params)
    with pytest.raises(RuntimeError):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


# 3. A checkpoint is loaded whole or not at all.

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
    params, opt = _trained()
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    _assert_unchanged(opt, params, snapshot)
    opt.step()  # and it still trains


# 4. load_state_dict honours torch's hooks, in torch's order.

def test_pre_hook_output_is_what_gets_validated_and_loaded() -> None:
    params, opt = _trained()
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
    params, opt = _trained()
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


# 5. One bad element never destroys a tensor's state.

@pytest.mark.parametrize("backend", BACKENDS)
def test_one_huge_finite_grad_keeps_params_and_factors_finite(backend: str) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64))
    adam_p = torch.nn.Parameter(p.detach().clone())
    opt, adam = SMMF([p], backend=backend), torch.optim.Adam([adam_p])
    for step in range(4):
        g = torch.randn(64, 64)
        if step == 1:
            g[3, 5], g[9, 1] = 2e19, 1e30  # both square to inf in fp32
        p.grad, adam_p.grad = g, g.clone()
        opt.step()
        adam.step()
    assert torch.isfinite(adam_p).all()  # the control
    assert torch.isfinite(p).all()
    for key in ("row_m", "col_m", "row_v", "col_v"):
        assert torch.isfinite(opt.state[p][key]).all(), key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_grad_element_counts_as_zero_and_warns_once(backend: str, bad: float) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 30))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = SMMF([p], backend=backend), SMMF([q], backend=backend)
    for step in range(3):
        g = torch.randn(40, 30)
        g[7, 11] = 0.0
        p.grad, q.grad = g.clone(), g.clone()
        p.grad[7, 11] = bad
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt_p.step()
        assert len([w for w in caught if "NaN/inf gradient" in str(w.message)]) == (1 if step == 0 else 0)
        opt_q.step()
    assert torch.equal(p, q)
    for key in STATE_TENSORS:
        assert torch.equal(opt_p.state[p][key], opt_q.state[q][key]), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_propagate_lets_a_nan_through(backend: str) -> None:
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = SMMF([p], backend=backend, nonfinite_grads="propagate")
    p.grad = torch.randn(8, 8)
    p.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(p).any()


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs numba")
def test_backends_agree_on_huge_and_nonfinite_grads() -> None:
    torch.manual_seed(0)
    ps = {b: torch.nn.Parameter(torch.randn(300, 300)) for b in BACKENDS}
    for p in ps.values():
        p.data.copy_(ps["torch"].data)
    opts = {b: SMMF([p], backend=b) for b, p in ps.items()}
    for step in range(4):
        g = torch.randn(300, 300)
        g[1, 2], g[5, 6], g[7, 8] = 3e19, float("nan"), -float("inf")
        for b, p in ps.items():
            p.grad = g.clone()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opts[b].step()
    for b in CPU_FUSED_BACKENDS:
        torch.testing.assert_close(ps[b], ps["torch"], rtol=1e-5, atol=1e-6)


# 6. Backend is a runtime choice; another optimizer's state dict is not SMMF's.

def test_checkpoint_written_with_triton_loads_on_cpu_and_keeps_the_constructors_backend() -> None:
    params, opt = _trained()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["backend"] = "triton"  # as saved on a CUDA machine
    fresh = SMMF(params, lr=1e-2, backend="auto")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["backend"] == "auto"
    fresh.step()


def test_adam_state_dict_is_rejected_and_changes_nothing() -> None:
    params, opt = _trained()
    adam_state = torch.optim.Adam(params).state_dict()  # empty state: only Adam's group options
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match="another optimizer's state dict"):
        opt.load_state_dict(adam_state)
    _assert_unchanged(opt, params, snapshot)


def test_group_without_lr_is_rejected_at_load() -> None:
    params, opt = _trained()
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["lr"]
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match=r"lacks \['lr'\]"):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, params, snapshot)


def test_scheduler_keys_in_a_checkpoint_are_accepted() -> None:
    params, opt = _trained()
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to the groups
    saved = copy.deepcopy(opt.state_dict())
    SMMF(params, lr=1e-2).load_state_dict(saved)


# 7. Integer params.

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


# 8. Two threads under numba's workqueue threading layer.

TWO_THREADS = """
import threading, torch
from smmf import SMMF
def train():
    p = torch.nn.Parameter(torch.randn(512, 512))
    opt = SMMF([p], backend="numba")
    for _ in range(40):
        p.grad = torch.randn(512, 512)
        opt.step()
threads = [threading.Thread(target=train) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
import numba
print("OK", numba.threading_layer())
"""


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs numba")
def test_two_threads_stepping_under_the_workqueue_layer() -> None:
    out = _run_script(TWO_THREADS, env={"NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK workqueue" in out.stdout


# 9. CLI errors: one line, exit status 2, before any work.

CLI_CASES = {
    "config missing": (["memory", "--config", "/nonexistent.json"], "No such file"),
    "config a directory": (["memory", "--config", "/"], "Is a directory"),
    "config malformed": (["memory", "--config", "{tmp}/bad.json"], "not valid JSON"),
    "config a list": (["memory", "--config", "{tmp}/list.json"], "a JSON object with a 'model_type'"),
    "config unknown type": (["memory", "--config", "{tmp}/unknown.json"], "unknown model_type 'nope'"),
    "memory unknown model": (["memory", "--model", "nope"], "--model: unknown 'nope'"),
    "opt-args not a number": (["compare", "--opt-args", "smmf:lr=abc"], "lr should be a number but is: 'abc'"),
    "opt-args unknown key": (["compare", "--opt-args", "smmf:foo=1"], "unexpected keyword argument 'foo'"),
    "opt-args no colon": (["compare", "--opt-args", "smmflr=1"], "expects NAME:key=value"),
    "opt-args after adam": (["compare", "--optimizers", "adam,smmf", "--opt-args", "smmf:lr=abc"], "lr should be"),
    "opt-args unlisted optimizer": (["compare", "--optimizers", "adam", "--opt-args", "smmf:lr=1"], "not among"),
    "compare device": (["compare", "--device", "nope"], "invalid choice: 'nope'"),
    "compare no tasks": (["compare", "--tasks", ","], "--tasks names nothing"),
    "compare unknown task": (["compare", "--tasks", "digits-cnn,nope"], "--tasks: unknown 'nope'"),
    "compare negative steps": (["compare", "--steps", "-5"], "--steps must be at least 1, got -5"),
    "compare zero steps": (["compare", "--steps", "0"], "--steps must be at least 1, got 0"),
    "compare zero seeds": (["compare", "--seeds", "0"], "--seeds must be at least 1, got 0"),
    "compare unwritable out": (["compare", "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write"),
    "bench unknown set": (["bench", "--sets", "nope"], "--sets: unknown 'nope'"),
    "bench one unknown set": (["bench", "--sets", "resnet50,nope"], "--sets: unknown 'nope'"),
    "bench zero repeats": (["bench", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    "bench zero threads": (["bench", "--threads", "0"], "--threads must be between 1 and"),
}
if not torch.cuda.is_available():
    CLI_CASES |= {
        "compare cuda": (["compare", "--device", "cuda"], "needs a CUDA device"),
        "bench cuda": (["bench", "--device", "cuda"], "needs a CUDA device"),
        "memory measure cuda": (["memory", "--measure", "cuda"], "needs a CUDA device"),
    }


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error_is_one_line_exit_2_before_any_work(case: str, tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("transformers")
    from smmf import cli
    from smmf.bench import compare, paper_memory, step_time

    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "unknown.json").write_text('{"model_type": "nope"}')

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    for module in (compare, paper_memory, step_time):
        monkeypatch.setattr(module, "run", no_work)
    monkeypatch.setattr(paper_memory, "config_report", no_work)
    argv, match = CLI_CASES[case]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smmf"), err
    assert match in err


def test_memory_without_peft_skips_the_lora_row_with_a_note(monkeypatch, capsys) -> None:
    pytest.importorskip("transformers")
    from smmf.bench import paper_memory

    monkeypatch.setitem(sys.modules, "peft", None)  # as if the [bench] extra were not installed
    assert paper_memory.main(paper_memory.build_parser().parse_args(["--model", "LLaMA-7b LoRA"])) == 0
    assert "LLaMA-7b LoRA: skipped, it needs peft (pip install 'smmf[bench]')" in capsys.readouterr().out

