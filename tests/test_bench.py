"""The step-time benchmark's plumbing (not its timings), and the fused kernel's no-temporaries contract."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from smmf.bench.shapes import gpt2_like_shapes, gpt2_xl_like_shapes, gpt2_xl_subset_shapes, make_params
from smmf.bench.bench import LIMIT, bytes_per_param, extra_peak_ratio, format_results, interleaved_medians, optim_map
from smmf.kernels import available_backends


def test_gpt2_like_shape_set_has_52m_parameters() -> None:
    assert sum(torch.Size(s).numel() for s in gpt2_like_shapes()) == 52_125_696


def test_gpt2_xl_sets_have_their_stated_sizes() -> None:
    def count(shapes):
        return sum(torch.Size(s).numel() for s in shapes)

    assert count(gpt2_xl_like_shapes()) == 50257 * 1600 + 48 * 30_723_200  # 1.555B
    assert count(gpt2_xl_subset_shapes()) == 50257 * 1600 + 8 * 30_723_200  # 326M, the same shapes


def test_every_benchmarked_optimizer_steps_and_the_table_reports_ratios() -> None:
    for name, factory in optim_map("cpu", momentum_codes=True).items():
        params = make_params([(64, 32), (32,)])
        before = [p.detach().clone() for p in params]
        interleaved_medians({name: factory}, params, repeats=2, device="cpu", limit=False)
        assert all(not torch.equal(p, b) for p, b in zip(params, before)), name
    params = make_params([(64, 32), (32,)])
    seconds = interleaved_medians(optim_map("cpu"), params, repeats=2, device="cpu")
    assert set(seconds) == set(optim_map("cpu")) | {LIMIT}
    results = {"device": "cpu", "threads": 2, "repeats": 2, "baseline": "Adam(fused)", "copy_bytes_per_second": 1e10,
               "params": {"tiny": 64 * 32 + 32}, "step_seconds": {"tiny": seconds}, "extra_peak_over_param_bytes": {}}
    text = format_results(results)
    assert "/ Adam(fused)" in text and "SMMF(torch)" in text and "/ axpy" in text
    assert list(optim_map("cpu"))[:2] == ["Adam(fused)", "Adam(foreach)"]  # the strongest baseline first
    if "numba" in available_backends():
        assert {"SMMF natural(numba)", "SMMF natural+flag(numba)"} <= set(optim_map("cpu", momentum_codes=True))
        assert not any("natural" in name for name in optim_map("cpu"))  # opt-in


PEER_ROWS = {"AdamW8bit(torchao)": "torchao", "AdamW4bit(torchao)": "torchao",
             "AdamW8bit(bitsandbytes)": "bitsandbytes", "AdamW_adv factored(adv_optm)": "adv_optm"}


def test_peers_are_opt_in_rows_with_their_state_bytes() -> None:
    installed = {row for row, module in PEER_ROWS.items() if importlib.util.find_spec(module)}
    if not installed:
        pytest.skip("no peer installed (pip install smmf[peers])")
    assert not set(PEER_ROWS) & set(optim_map("cpu"))
    peers = {name: f for name, f in optim_map("cpu", peers=True).items() if name in PEER_ROWS}
    assert set(peers) == installed
    params = make_params([(128, 64)])  # one shape: torchao compiles its step once
    state: dict[str, int] = {}
    seconds = interleaved_medians({"Adam(foreach)": optim_map("cpu")["Adam(foreach)"], **peers}, params, repeats=2,
                                  device="cpu", limit=False, state_bytes=state)
    assert state["Adam(foreach)"] == 2 * 128 * 64 * 4
    for name in peers:
        assert 0 < state[name] < state["Adam(foreach)"] / 3, name  # 8-bit, 4-bit or factored moments
        assert bytes_per_param(name) < 28
    seconds[LIMIT] = 1e-6
    results = {"device": "cpu", "threads": 1, "repeats": 2, "baseline": "Adam(foreach)", "copy_bytes_per_second": 1e10,
               "params": {"tiny": 128 * 64}, "step_seconds": {"tiny": seconds}, "state_bytes": {"tiny": state},
               "extra_peak_over_param_bytes": {}}
    text = format_results(results)
    assert "state MiB" in text and all(name in text for name in peers)


def test_a_missing_peer_is_left_out_with_a_note(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    names = optim_map("cpu", peers=True)
    assert "AdamW8bit(bitsandbytes)" not in names and "Adam(fused)" in names
    assert "skipping AdamW8bit(bitsandbytes): bitsandbytes is not available" in capsys.readouterr().err


@pytest.mark.skipif("numba" not in available_backends() or not os.path.exists("/proc/self/clear_refs"),
                    reason="needs numba and Linux /proc")
def test_fused_step_allocates_nothing_of_the_parameters_size() -> None:
    """One step of an 8192×4096 fp32 param, in a fresh process: Adam's temporaries are the size of the
    param, the fused SMMF step's must stay below 5% of it."""
    assert extra_peak_ratio("SMMF(numba)") < 0.05
    assert extra_peak_ratio("SMMF natural+flag(numba)") < 0.05  # the flag's two passes: no temporaries either
    assert extra_peak_ratio("Adam(foreach)") > 0.5  # the measurement does see a param-sized temporary


def test_training_memory_runs_each_configuration_in_a_fresh_process() -> None:
    pytest.importorskip("transformers")
    from smmf.bench.training_memory import format_results, run_fresh

    tiny = (2, 64, 2, 1, 16)  # n_layer, n_embd, n_head, batch, sequence
    adam = run_fresh("tiny", "Adam(foreach=False)", tiny, "cpu")
    fused = run_fresh("tiny", "SMMF + step in backward", tiny, "cpu")
    floor = run_fresh("tiny", "SGD + step in backward (floor)", tiny, "cpu")
    assert floor["state"] == 0 and floor["grads"] == fused["grads"]
    assert adam["state"] == 2 * adam["weights"]  # Adam's two moments, fp32
    assert adam["grads"] == adam["weights"] and fused["grads"] < fused["weights"]  # only the largest one at once
    assert 0 < fused["state"] < adam["state"] / 20
    assert adam["peak"] > adam["weights"] + adam["grads"] + adam["state"]
    text = format_results([adam, fused])
    assert "/ Adam(foreach=False)" in text and "SMMF + step in backward" in text


def test_the_cuda_training_study_trains_every_configuration() -> None:
    """The CUDA study's steps (bf16 autocast, the step inside backward, bf16 weights), on CPU with a tiny
    GPT-2: every configuration trains and reports its parts; the peak needs CUDA (tests/test_cuda.py)."""
    pytest.importorskip("transformers")
    from smmf.bench.training_cuda import CONFIGS, train

    tiny = (1, 64, 2)  # n_layer, n_embd, n_head
    found = {name: train(tiny, 1, 8, name, torch.device("cpu"), warm=1, timed=1) for name in CONFIGS}
    adamw, smmf, bf16 = found["AdamW(fused)"], found["SMMF"], found["SMMF + step in backward, bf16 weights (SR)"]
    assert all(r["peak"] is None and r["tokens_per_second"] > 0 for r in found.values())
    assert adamw["state"] == 2 * adamw["weights"] and 0 < smmf["state"] < adamw["state"] / 20
    assert bf16["weights"] == adamw["weights"] // 2 and bf16["grads"] < bf16["weights"]


@pytest.mark.parametrize("largest,device,error", [("0", "cpu", "positive"), ("card", "cpu", "positive"),
                                                  ("24,x", "cpu", "'x'")])
def test_training_budgets_are_checked(largest: str, device: str, error: str, capsys) -> None:
    from smmf.bench.bench import _budgets

    with pytest.raises(SystemExit):
        _budgets(largest, device)
    assert error in capsys.readouterr().err


def test_the_largest_model_search_fits_its_budget(monkeypatch) -> None:
    """Against a fake GPU whose peak is 3 + 2·layers GiB, out of memory past 40 layers: the search lands
    on the deepest depth within the budget, or below the memory's end."""
    from smmf.bench import training_cuda

    def fake_train(shape, batch, seq, config, device, warm, timed):
        if shape[0] > 40:
            raise torch.cuda.OutOfMemoryError("fake")
        return dict(params=shape[0], peak=(3 + 2 * shape[0]) * 2**30, tokens_per_second=1.0)

    monkeypatch.setattr(training_cuda, "train", fake_train)
    cpu = torch.device("cpu")
    assert training_cuda.largest_fitting("SMMF", 24 * 2**30, cpu)["layers"] == 10
    assert training_cuda.largest_fitting("SMMF", 1000 * 2**30, cpu)["layers"] <= 40
    assert training_cuda.largest_fitting("SMMF", 2 * 2**30, cpu)["layers"] == 0

    def small_gpu(shape, batch, seq, config, device, warm, timed):  # out of memory past 4 layers
        return fake_train((shape[0] * 10, *shape[1:]), batch, seq, config, device, warm, timed)

    monkeypatch.setattr(training_cuda, "train", small_gpu)  # 6 layers fail: the search used to report none
    assert training_cuda.largest_fitting("SMMF", 1000 * 2**30, cpu)["layers"] == 4


@pytest.mark.parametrize("case", ["linear", "oom_past_4", "flat", "budget_below_low", "curved", "barely"])
def test_the_depth_search_never_returns_a_depth_over_budget(case: str) -> None:
    """The search's edge cases: the deeper of the two first runs out of memory (no line to follow),
    peaks that do not grow (no slope), a budget the shallowest run misses, a peak that grows faster
    than the line predicts, and a budget the line overshoots by a fraction of a layer. Used to divide
    by a zero slope, fail an assert, or return a depth over budget when it reached 1 layer."""
    from smmf.bench.training_memory import deepest_within

    peak = {"linear": lambda n: 3 + 2 * n, "oom_past_4": lambda n: 3 + 2 * n, "flat": lambda n: 10,
            "budget_below_low": lambda n: 30 + n, "curved": lambda n: 3 + n * n / 4, "barely": lambda n: 3.5 + 2 * n}[case]
    budget = 24
    runs = []

    def measure(layers: int):
        runs.append(layers)
        if layers < 1 or (case == "oom_past_4" and layers > 4):
            return None
        return {"peak": peak(layers), "params": layers}

    layers, found, _ = deepest_within(measure, budget, 2, 6)
    if case == "budget_below_low":
        assert (layers, found) == (0, None)
        return
    assert found is not None and found["peak"] <= budget and layers >= 2
    assert {"linear": 10, "oom_past_4": 4, "flat": 6, "curved": 9, "barely": 10}[case] == layers  # the deepest
    assert len(runs) < 12 and min(runs) >= 2 and len(runs) == len(set(runs))  # no depth run twice
