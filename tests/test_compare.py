"""The comparison job: data is deterministic, every baseline trains, the CLI writes everything;
the opt-in tasks build and train at tiny sizes, the pretrained checkpoint is cached, a missing peer
is a skipped row, state bytes are the real storage of quantized tensor subclasses."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from smmf.bench import tasks as tasks_module
from smmf.bench.compare import summary_rows, train_one
from smmf.bench.optimizers import DEFAULT_OPTIMIZERS, PEERS, optimizer_specs, parse_opt_args
from smmf.bench.storage import optimizer_state_bytes, storage_bytes
from smmf.bench.tasks import (DEFAULT_TASKS, TASKS, ByteGPT, Task, digits_split, finetune_lm_task, is_held_out,
                              pretrained_checkpoint, pydoc_bytes, stdlib_bytes, stdlib_files, stdlib_lm_task)

pytest.importorskip("pytorch_optimizer")
pytest.importorskip("sklearn")


def test_data_loaders_are_deterministic() -> None:
    (x1, y1), (tx1, ty1) = digits_split()
    (x2, y2), (tx2, ty2) = digits_split()
    assert torch.equal(x1, x2) and torch.equal(ty1, ty2)
    assert len(y1) + len(ty1) == 1797 and x1.shape[1:] == (1, 8, 8)
    a, b = pydoc_bytes()
    assert torch.equal(a, pydoc_bytes()[0]) and len(a) > 400_000 and len(b) > 40_000
    for task in TASKS.values():
        first = next(task.batches(3, torch.device("cpu")))
        again = next(task.batches(3, torch.device("cpu")))
        other = next(task.batches(4, torch.device("cpu")))
        assert all(torch.equal(u, v) for u, v in zip(first, again))
        assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("name", [*DEFAULT_OPTIMIZERS, "smmf-natural", "smmf-natural-flag", "smmf-recommended"])
def test_every_optimizer_trains_the_cnn(name: str) -> None:
    result = train_one(TASKS["digits-cnn"], name, {}, steps=40, eval_every=40, seed=0, device=torch.device("cpu"),
                       show_progress=False)
    losses = result["losses"]
    assert not result["diverged"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert result["state_bytes"] > 0


@pytest.mark.parametrize("steps, overrides", [(1, {}), (30, {"lr": 1e30})])
def test_a_run_with_no_timed_step_is_recorded(steps: int, overrides: dict) -> None:
    """One step, or a run that diverges within the memory window (whose steps are not timed), is a result with
    no step time, not a crash of the whole comparison."""
    result = train_one(TASKS["digits-cnn"], "adam", overrides, steps=steps, eval_every=steps, seed=0,
                       device=torch.device("cpu"), show_progress=False)
    assert result["diverged"] == (steps > 1) and len(result["losses"]) < 10
    assert math.isnan(result["mean_step_ms"]) and math.isnan(result["mean_train_step_ms"])


def test_opt_args_parse_and_reject() -> None:
    assert parse_opt_args(["smmf:lr=3e-3,decay_rate=-0.8", "adam:amsgrad=True"]) == {
        "smmf": {"lr": 3e-3, "decay_rate": -0.8}, "adam": {"amsgrad": True}}
    with pytest.raises(ValueError, match="NAME:key=value"):
        parse_opt_args(["smmf"])
    assert parse_opt_args(["adam:betas=(0.9,0.99),lr=1e-3", "came:betas=[0.9,0.999,0.9999]"]) == {
        "adam": {"betas": (0.9, 0.99), "lr": 1e-3}, "came": {"betas": [0.9, 0.999, 0.9999]}}


def test_the_default_run_is_every_default_task_and_optimizer(tmp_path) -> None:
    """What ``smmf compare`` runs with no arguments (the README's main job); each default optimizer trains
    in-process on the CNN and with the LM settings, and the default tasks run through the CLI below."""
    from smmf.bench.compare import build_parser, check_args

    tasks, optimizers, *_ = check_args(build_parser().parse_args(["--out", str(tmp_path)]))
    assert (tasks, optimizers) == (list(DEFAULT_TASKS), list(DEFAULT_OPTIMIZERS))
    assert set(DEFAULT_TASKS) == {"digits-cnn", "pydoc-lm"}
    assert {"smmf", "adam", "smmf-recommended", "adamw"} <= set(DEFAULT_OPTIMIZERS)  # each SMMF beside its like


def test_each_smmf_row_is_set_against_its_like_for_like_baseline() -> None:
    """The paper's SMMF (L2 decay) against Adam, the recommended option (decoupled decay) against AdamW: set against
    Adam, the recommended option's 2.154 on pydoc-lm read as "beats Adam" (2.317), most of it the decay."""
    from smmf.bench.compare import smmf_note, summary_rows

    def run(optimizer: str, label: str, final: float) -> dict:
        return {"task": "pydoc-lm", "optimizer": optimizer, "label": label, "metric": "val_loss", "final_metric": final,
                "best_metric": final, "losses": [3.0], "state_bytes": 1024, "peak_bytes": None, "mean_step_ms": 1.0,
                "mean_train_step_ms": 2.0, "seed": 0}

    results = [run("adam", "Adam", 2.317), run("smmf", "SMMF", 2.41), run("adamw", "AdamW (torch, fused)", 2.16),
               run("smmf-recommended", "SMMF recommended", 2.154), run("sm3", "SM3", 2.5)]
    headers, rows = summary_rows(results)
    versus = {row[1]: row[headers.index("final / like-for-like")] for row in rows}
    assert versus == {"Adam": None, "SMMF": f"{2.41 / 2.317:.3f}× Adam", "AdamW (torch, fused)": None,
                      "SMMF recommended": f"{2.154 / 2.16:.3f}× AdamW (torch, fused)", "SM3": None}
    assert "the recommended option against AdamW" in smmf_note(results)


def test_cli_quick_run_writes_all_outputs(tmp_path, monkeypatch) -> None:
    """The default tasks with the paper's SMMF, the recommended option and Adam, each run in a fresh process
    (every run of the default set would add a dozen processes and nothing else to check)."""
    from smmf.bench import compare
    from smmf.cli import main

    writes = []
    write = compare.write_outputs
    monkeypatch.setattr(compare, "write_outputs", lambda results, meta, out, plots=True: writes.append(
        (len(results), meta["complete"], plots)) or write(results, meta, out, plots))
    out = tmp_path / "run"
    optimizers = ["adam", "smmf", "smmf-recommended"]
    assert main(["compare", "--quick", "--steps", "2", "--optimizers", ",".join(optimizers), "--out", str(out),
                 "--opt-args", "smmf:decay_rate=-0.8"]) == 0
    runs = len(DEFAULT_TASKS) * len(optimizers)  # the tables after every run (a stopped study keeps them)
    assert writes == [(k, False, False) for k in range(1, runs + 1)] + [(runs, True, True)]
    for name in ("results.md", "results.csv", "results.json", "loss.png", "metric.png", "state_memory.png"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob("*.partial"))  # each file written whole, then renamed into place
    data = json.loads((out / "results.json").read_text())
    runs = {(r["task"], r["optimizer"]) for r in data["results"]}
    assert runs == {(t, o) for t in DEFAULT_TASKS for o in optimizers}
    table = (out / "results.md").read_text()
    assert "SMMF is the paper's algorithm" in table and "SMMF recommended is the recommended option" in table
    smmf = next(r for r in data["results"] if r["optimizer"] == "smmf")
    assert smmf["kwargs"]["decay_rate"] == "-0.8"
    assert all(len(r["losses"]) == 2 for r in data["results"])


def test_jobs_run_side_by_side_keep_the_order_and_report_every_finished_run() -> None:
    from smmf.bench.compare import run

    kwargs = dict(tasks=["digits-cnn"], optimizers=["adam", "smmf"], steps=4, seed=0, seeds=2,
                  device=torch.device("cpu"), opt_args=[], quick=True, show_progress=False)
    seen: dict[int, list[list[tuple[str, int]]]] = {1: [], 2: []}
    one, two = [run(**kwargs, jobs=jobs, finished=lambda results, jobs=jobs: seen[jobs].append(
        [(r["optimizer"], r["seed"]) for r in results])) for jobs in (1, 2)]
    order = [("adam", 0), ("smmf", 0), ("adam", 1), ("smmf", 1)]  # every optimizer's first seed first
    assert [(r["optimizer"], r["seed"]) for r in one] == [(r["optimizer"], r["seed"]) for r in two] == order
    assert seen[1] == [order[:k] for k in range(1, 5)]
    # Side by side, two runs may end together: each report holds the finished ones, in order, the last all.
    assert all(set(s) <= set(order) and s == sorted(s, key=order.index) for s in seen[2]) and seen[2][-1] == order
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert all(r["threads"] == threads for r in two) and all(r["threads"] is None for r in one)
    for a, b in zip(one, two):  # the same training; matmuls on fewer threads may sum in another order
        assert len(a["losses"]) == len(b["losses"]) == 4
        assert a["losses"][0] == pytest.approx(b["losses"][0], rel=1e-5)


def test_a_run_records_the_commit_it_started_from(monkeypatch) -> None:
    """A run's process loads the code as it starts: a commit made while it trains (an hour, on CPU) did not
    run, and recording it would put the run under the wrong code."""
    from smmf.bench import compare

    head = ["started"]

    def train(job: dict) -> dict:
        head[0] = "committed meanwhile"  # a commit lands while the run trains
        return {"label": job["optimizer"]}

    monkeypatch.setattr(compare, "_code_version", lambda: head[0])
    monkeypatch.setattr(compare, "train_in_fresh_process", train)
    job = dict(task="digits-cnn", optimizer="smmf", seed=0, steps=4, eval_every=1, device="cpu", threads=None)
    assert compare._timed_run(job)["code"] == "started"


def test_a_failing_report_of_finished_runs_does_not_stop_the_study(capsys) -> None:
    from smmf.bench.compare import run

    def fail(results: list) -> None:
        raise OSError("disk full")

    results = run(tasks=["digits-cnn"], optimizers=["smmf"], steps=2, seed=0, device=torch.device("cpu"),
                  opt_args=[], quick=True, show_progress=False, finished=fail)
    assert [r["optimizer"] for r in results] == ["smmf"]
    assert "could not write the results so far: OSError: disk full" in capsys.readouterr().err


def test_compare_reports_mean_and_spread_over_seeds() -> None:
    from smmf.bench.compare import LOSS_AT, loss_at, summary_rows

    def run(seed: int, optimizer: str, final: float, losses: list[float]) -> dict:
        return {"task": "t", "optimizer": optimizer, "label": optimizer, "metric": "m", "final_metric": final,
                "best_metric": final, "losses": losses, "state_bytes": 1024, "peak_bytes": None, "mean_step_ms": 1.0,
                "mean_train_step_ms": 2.0, "seed": seed}

    flat, rising = [2.0] * LOSS_AT, [float(i) for i in range(LOSS_AT)]
    assert loss_at(rising, LOSS_AT) == sum(rising[-10:]) / 10
    headers, rows = summary_rows([run(0, "smmf", 1.0, flat), run(1, "smmf", 3.0, rising), run(0, "adam", 5.0, flat)])
    assert [row[2] for row in rows] == [2, 1]  # seeds per optimizer
    final = headers.index("final")
    assert rows[0][final] == "2 ± 1.4" and rows[1][final] == "5"
    early = rows[0][headers.index(f"train loss@{LOSS_AT} (worst seed)")]
    assert early.endswith(f"({loss_at(rising, LOSS_AT):.4g})")  # the worse seed


# --------------------------------------------------------------------------- opt-in tasks

TINY = ByteGPT(n_layer=1, n_embd=32, n_head=2, context=32, batch=4)


def test_stdlib_corpus_is_split_by_file(tmp_path) -> None:
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 500
    assert not any(part in ("site-packages", "dist-packages", "pydoc_data") for f in files for part in f.split("/"))
    held = [f for f in files if is_held_out(f)]
    assert 0.02 < len(held) / len(files) < 0.1
    # A small library: every file lands whole on one side, in sorted order, each followed by NUL.
    names = [f"pkg/m{i}.py" for i in range(60)] + ["z.py", "site-packages/x.py", "pydoc_data/topics.py"]
    for i, name in enumerate(names):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(f"# file {i}\n".encode())
    kept = sorted(names[:61])
    assert stdlib_files(tmp_path) == kept
    train, held_out = stdlib_bytes(str(tmp_path))
    expect = {side: b"".join((tmp_path / f).read_bytes() + b"\0" for f in kept if is_held_out(f) == side)
              for side in (False, True)}
    assert bytes(train.tolist()) == expect[False] and bytes(held_out.tolist()) == expect[True]
    assert len(expect[True]) > 0 and len(expect[False]) > 0
    again = stdlib_bytes.__wrapped__(str(tmp_path))  # read afresh, not from the cache
    assert torch.equal(train, again[0]) and torch.equal(held_out, again[1])


@pytest.mark.parametrize("name", ["adam", "smmf-natural"])
def test_stdlib_lm_trains_a_few_steps_at_a_tiny_size(name: str) -> None:
    overrides = {"backend": "torch"} if name.startswith("smmf") else {}  # no JIT compilation in a quick test
    result = train_one(stdlib_lm_task(TINY), name, overrides, steps=12, eval_every=6, seed=0, device=torch.device("cpu"),
                       show_progress=False)
    assert not result["diverged"] and len(result["losses"]) == 12
    assert [e["step"] for e in result["evals"]] == [6, 12]
    assert result["losses"][0] == pytest.approx(math.log(256), abs=0.3)  # an untrained byte model
    assert result["final_metric"] < result["losses"][0]
    assert result["final_metric"] == result["evals"][-1]["held_out_loss"]


def test_pretraining_on_cpu_does_not_depend_on_the_callers_thread_count() -> None:
    # The thread count is pinned, not the caller's, so the checkpoint must not depend on the caller's setting:
    # torch's CPU kernels split their sums by thread, and unpinned, 1 and 3 threads gave other weights.
    caller = torch.get_num_threads()
    try:
        made = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            made.append(tasks_module.pretrain(TINY, 2, torch.device("cpu"), show_progress=False))
            assert torch.get_num_threads() == threads  # the caller's setting is given back
    finally:
        torch.set_num_threads(caller)
    assert all(torch.equal(made[0][name], made[1][name]) for name in made[0])


def test_finetune_lm_starts_every_run_from_the_cached_checkpoint(tmp_path, monkeypatch) -> None:
    calls = []
    real_pretrain = tasks_module.pretrain

    def counting(*args, **kwargs):
        calls.append(args)
        return real_pretrain(*args, **kwargs)

    monkeypatch.setattr(tasks_module, "pretrain", counting)
    cpu = torch.device("cpu")
    task = finetune_lm_task(TINY, pretrain_steps=3, cache=str(tmp_path))
    task.prepare(False)
    path = pretrained_checkpoint(TINY, 3, cpu, str(tmp_path))
    assert len(calls) == 1 and path.exists() and path.parent.parent == tmp_path
    pretrained = torch.load(path, weights_only=True)["state_dict"]
    assert not torch.equal(pretrained["transformer.h.0.mlp.c_fc.weight"],
                           TINY.build(0).state_dict()["transformer.h.0.mlp.c_fc.weight"])  # it did train

    # A hit: nothing is retrained, and every seed's model is the cached checkpoint.
    for seed in (0, 1):
        model = task.build_model(seed)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in pretrained.items())
    assert pretrained_checkpoint(TINY, 3, cpu, str(tmp_path)) == path and len(calls) == 1

    # Any change to what determines it is another key, built afresh: steps, model, data.
    assert pretrained_checkpoint(TINY, 4, cpu, str(tmp_path)) != path and len(calls) == 2
    other = ByteGPT(n_layer=1, n_embd=32, n_head=4, context=32, batch=4)
    assert pretrained_checkpoint(other, 3, cpu, str(tmp_path)) != path and len(calls) == 3
    train, held = stdlib_bytes()
    monkeypatch.setattr(tasks_module, "stdlib_bytes", lambda root=None: (train[:-1], held))
    assert pretrained_checkpoint(TINY, 3, cpu, str(tmp_path)) != path and len(calls) == 4
    monkeypatch.undo()

    # A missing file is rebuilt under the same key.
    monkeypatch.setattr(tasks_module, "pretrain", counting)
    path.unlink()
    assert pretrained_checkpoint(TINY, 3, cpu, str(tmp_path)) == path and path.exists() and len(calls) == 5

    result = train_one(task, "smmf", {"backend": "torch"}, steps=4, eval_every=2, seed=0, device=cpu,
                       show_progress=False)
    assert len(calls) == 5 and len(result["losses"]) == 4 and math.isfinite(result["final_metric"])
    assert result["kwargs"]["decay_rate"] == "-0.8"  # the fine-tuning table's


def test_cache_root_follows_flag_then_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SMMF_CACHE", str(tmp_path / "env"))
    assert tasks_module.cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert tasks_module.cache_root() == tmp_path / "env"
    monkeypatch.delenv("SMMF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tasks_module.cache_root() == tmp_path / "xdg" / "smmf"


# --------------------------------------------------------------------------- peers


def test_missing_peer_is_a_skipped_row_with_a_note(tmp_path, monkeypatch, capsys) -> None:
    from smmf.cli import main

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if torchao were not installed
    out = tmp_path / "run"
    assert main(["compare", "--tasks", "digits-cnn", "--optimizers", "torchao-adamw8bit", "--steps", "2",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipping torchao-adamw8bit: torchao is not available" in captured.err
    data = json.loads((out / "results.json").read_text())
    assert [(r["optimizer"], "torchao" in r["skipped"]) for r in data["results"]] == [("torchao-adamw8bit", True)]
    assert "skipped: torchao is not available" in (out / "results.md").read_text()
    headers, rows = summary_rows(data["results"] + [
        {"task": "digits-cnn", "optimizer": "adam", "label": "Adam", "metric": "m", "final_metric": 1.0,
         "best_metric": 1.0, "losses": [1.0], "state_bytes": 2048, "peak_bytes": None, "mean_step_ms": 1.0,
         "mean_train_step_ms": 1.0, "wall_s": 3.0}])
    assert len(rows) == 2 and rows[0][3].startswith("skipped") and rows[1][headers.index("state KiB")] == 2


def _two_layer_task() -> Task:
    """Regression with two weights (8192 elements: quantized by the 8/4-bit peers; 512: kept in fp32),
    so that torchao compiles its step for two shapes only."""
    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(128, 4, bias=False))

    def batches(seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(32, 64, generator=gen)
            yield x, x[:, :4] - x[:, 4:8]

    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    return Task("two-layer", "transformer", "loss", False, 8, build, batches, loss,
                lambda model, device: {"loss": loss(model, next(batches(99, device))).item()})


@pytest.mark.parametrize("name", DEFAULT_OPTIMIZERS)
def test_every_default_optimizer_trains_with_the_lm_settings(name: str) -> None:
    """The default run's LM task builds each optimizer with its Transformer settings (Adafactor's fixed lr and
    warmup, for one), not the CNN's."""
    result = train_one(_two_layer_task(), name, {}, steps=8, eval_every=8, seed=0, device=torch.device("cpu"),
                       show_progress=False)
    assert not result["diverged"] and result["losses"][-1] < result["losses"][0]
    assert result["state_bytes"] > 0


@pytest.mark.parametrize("name", list(PEERS))
def test_every_installed_peer_trains_and_reports_its_state(name: str) -> None:
    spec = optimizer_specs("transformer")[name]
    pytest.importorskip(spec.requires)
    task, cpu = _two_layer_task(), torch.device("cpu")
    result = train_one(task, name, {}, steps=8, eval_every=8, seed=0, device=cpu, show_progress=False)
    adamw = train_one(task, "adamw", {}, steps=8, eval_every=8, seed=0, device=cpu, show_progress=False)
    assert not result["diverged"] and result["losses"][-1] < result["losses"][0]
    assert 0 < result["state_bytes"] < adamw["state_bytes"] / 2  # quantized or factored: under half of AdamW's
    assert adamw["state_bytes"] == 2 * 4 * (64 * 128 + 128 * 4)


# --------------------------------------------------------------------------- state bytes


class _Packed(torch.Tensor):
    """A tensor subclass that looks like fp32 of ``shape`` but holds 1-byte codes and a scale per 64."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self.codes, self.scale = codes, scale

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_state_bytes_open_tensor_subclasses_and_count_shared_storage_once() -> None:
    packed = _Packed(torch.zeros(128, 64, dtype=torch.uint8), torch.zeros(128))
    naive = packed.numel() * packed.element_size()
    assert naive == 128 * 64 * 4
    assert storage_bytes([packed]) == 128 * 64 + 128 * 4  # codes + scales, not the wrapper's fp32 look
    nested = _Packed(_Packed(torch.zeros(8, 8, dtype=torch.uint8), torch.zeros(1)), torch.zeros(2))
    assert storage_bytes([nested]) == 64 + 4 + 8
    table = torch.zeros(256)
    assert storage_bytes([table, table[:10], torch.zeros(3)]) == 1024 + 12  # a shared lookup table is one table
    assert storage_bytes([torch.zeros(0), torch.zeros(0, 5)]) == 0

    param = torch.nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.Adam([param])
    param.grad = torch.ones_like(param)
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 16 * 4  # exp_avg, exp_avg_sq; the step counter is not counted


def test_state_bytes_of_torchao_quantized_state_are_its_inner_tensors() -> None:
    pytest.importorskip("torchao")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    eight = OptimState8bit.zeros((128, 64), signed=True, block_size=256)
    assert storage_bytes([eight]) == 128 * 64 + (128 * 64 // 256) * 4 + 256 * 4  # codes, scales, qmap
    assert storage_bytes([eight]) < eight.numel() * eight.element_size() / 3  # the naive count is 4 B/element
    four = OptimState4bit.zeros((128, 64), signed=False, block_size=128)
    assert storage_bytes([four]) == 128 * 64 // 2 + (128 * 64 // 128) * 4 + 16 * 4  # 4-bit codes, scales, qmap


def test_resume_takes_the_runs_already_made_and_runs_the_others(tmp_path, capsys, monkeypatch) -> None:
    """``--resume``: a finished run that this command would make again (same task, optimizer, seed, steps,
    hyperparameters, kind of device) is kept as it is, whether its file recorded steps and device or only
    its curves (an earlier version's), and even where its optimizer's package is now missing; one made with
    other hyperparameters or steps runs again, and earlier runs the command does not make stay in its results."""
    from smmf.bench import compare
    from smmf.bench.compare import run, stored_results, write_outputs

    kwargs = dict(tasks=["digits-cnn"], optimizers=["adam", "smmf"], steps=4, seed=0, device=torch.device("cpu"),
                  opt_args=[], quick=True, show_progress=False)
    adam, smmf = run(**kwargs)
    assert (adam["steps"], adam["eval_every"], adam["device"], adam["pretrain_steps"]) == (4, 1, "cpu", None)
    adam = {**adam, "losses": [123.0] * 4}  # a mark: kept, not run again
    old = {k: v for k, v in smmf.items() if k not in ("steps", "eval_every", "device", "code", "pretrain_steps")}
    other = {**smmf, "kwargs": {**smmf["kwargs"], "lr": "0.5"}, "seed": 1}
    write_outputs([adam, old, other], {"command": "smmf compare", "code": "0123abc", "machine": "cpu"}, tmp_path,
                  plots=False)
    kept = stored_results(tmp_path)
    assert [r["code"] for r in kept] == [adam["code"], "0123abc", smmf["code"]]
    again = run(**kwargs, kept=kept)
    assert again[0] is kept[2] and again[1]["losses"] == [123.0] * 4 and again[2] is kept[1]
    assert "1 earlier run(s) that this command would not make are kept" in capsys.readouterr().err
    rerun = run(**{**kwargs, "steps": 3}, kept=kept)  # other steps: nothing matches, nothing is lost
    assert rerun[:3] == kept and [len(r["losses"]) for r in rerun[3:]] == [3, 3]
    changed = run(**{**kwargs, "opt_args": ["smmf:lr=0.5"]}, kept=kept)  # smmf's lr differs from seed 0's
    assert changed[:3] == [kept[1], kept[2], kept[0]] and changed[3]["kwargs"]["lr"] == "0.5"
    monkeypatch.setattr(compare, "missing_package", lambda spec: "gone" if spec.label == adam["label"] else None)
    assert run(**kwargs, kept=kept)[1] is kept[0]  # adam's package missing now: its earlier run still counts
    write_outputs(again, {"command": "smmf compare --resume", "code": adam["code"], "machine": "cpu"}, tmp_path,
                  plots=False)
    assert "kept from earlier commands or started after a later commit: 0123abc" in (tmp_path / "results.md").read_text()


def test_runs_of_other_settings_are_rows_of_their_own_not_more_seeds() -> None:
    """Runs ``--resume`` keeps from another command (other hyperparameters, steps) are not averaged with this
    command's as if they were seeds: each setting is a row, labelled by what varies among them."""
    from smmf.bench.compare import summary_rows

    def result(seed: int, lr: str, steps: int = 4, metric: float = 1.0) -> dict:
        return {"task": "digits-cnn", "optimizer": "smmf", "label": "SMMF", "seed": seed, "steps": steps,
                "eval_every": 1, "kwargs": {"lr": lr, "eps": "1e-08"}, "device": "cpu", "pretrain_steps": None,
                "losses": [2.0] * steps, "evals": [{"step": 1}], "metric": "test_accuracy", "final_metric": metric,
                "best_metric": metric, "state_bytes": 100, "peak_bytes": None, "mean_step_ms": 1.0,
                "mean_train_step_ms": 2.0, "wall_s": 3.0, "diverged": False}

    _, rows = summary_rows([result(0, "0.001"), result(1, "0.001", metric=3.0), result(0, "0.002", metric=8.0),
                            result(0, "0.001", steps=6)])
    assert [(row[1], row[2], row[4]) for row in rows] == [("SMMF (lr=0.001, 4 steps)", 2, "2 ± 1.4"),
                                                          ("SMMF (lr=0.002, 4 steps)", 1, "8"),
                                                          ("SMMF (lr=0.001, 6 steps)", 1, "1")]
    assert [row[7] for row in rows] == [None] * 3  # no loss@100 in runs of 4 and 6 steps (not "nan (nan)")
    _, alone = summary_rows([result(0, "0.001", steps=120), result(1, "0.001", steps=120)])
    assert [(row[1], row[2], row[7]) for row in alone] == [("SMMF", 2, "2 ± 0 (2)")]


def test_resume_tells_finetune_runs_apart_by_their_pretraining(tmp_path) -> None:
    """A fine-tuning run starts from a checkpoint pretrained for ``--pretrain-steps``: runs from another
    pretraining are not taken, as recorded by the run or, in an older file, by its command."""
    from smmf.bench.compare import _job_key, _run_key, stored_results, write_outputs
    from smmf.bench.tasks import PRETRAIN_STEPS, TASKS

    job = dict(task="finetune-lm", optimizer="adamw", opt_args=[], steps=300, eval_every=15, seed=0, device="cpu",
               pretrain_steps=None)
    task = TASKS["finetune-lm"]
    assert _job_key(task, job) == _job_key(task, {**job, "pretrain_steps": PRETRAIN_STEPS})
    assert _job_key(task, job) != _job_key(task, {**job, "pretrain_steps": 100})
    kwargs = {"lr": "0.0003", "betas": "(0.9, 0.999)", "eps": "1e-08", "weight_decay": "0.0005", "fused": "True"}
    result = {"task": "finetune-lm", "optimizer": "adamw", "label": "AdamW (torch, fused)", "seed": 0, "kwargs": kwargs,
              "losses": [1.0] * 300, "evals": [{"step": 15 * k} for k in range(1, 21)], "diverged": False,
              "metric": "held_out_loss", "final_metric": 1.0, "best_metric": 1.0, "state_bytes": 8, "peak_bytes": None,
              "mean_step_ms": 1.0, "mean_train_step_ms": 2.0}
    for command, pretrain in (("smmf compare --tasks finetune-lm", None), ("smmf compare --pretrain-steps 100", 100)):
        write_outputs([], {"command": command, "code": "0123abc", "machine": "cpu"}, tmp_path, plots=False)
        data = json.loads((tmp_path / "results.json").read_text())
        (tmp_path / "results.json").write_text(json.dumps({**data, "results": [result]}))
        (stored,) = stored_results(tmp_path)
        assert _run_key(stored) == _job_key(task, {**job, "pretrain_steps": pretrain})
        assert (_run_key(stored) == _job_key(task, job)) == (pretrain is None)


def test_spread_over_seeds_of_runs_too_short_for_loss_at_100() -> None:
    """Several seeds of runs shorter than 100 steps (loss@100 is NaN) or that diverged make a table, not a crash."""
    from smmf.bench.compare import _spread

    assert _spread([float("nan"), float("nan")]) == "nan ± nan"
    assert _spread([1.0, float("inf")]) == "inf ± nan"
    assert _spread([1.0, 3.0]) == "2 ± 1.4"


def test_plots_of_many_rows_have_a_colour_each_and_a_legend_beside(tmp_path) -> None:
    """Past 10 rows the default colour cycle repeats: the curves take tab20's colours instead."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from smmf.bench import plots

    runs = [{"task": "digits-cnn", "optimizer": "smmf", "label": "SMMF", "seed": seed, "steps": 4, "eval_every": 2,
             "kwargs": {"lr": str(k)}, "losses": [1.0, 0.5, 0.4, 0.3], "metric": "test_accuracy",
             "evals": [{"step": 2, "test_accuracy": 50.0 + k}, {"step": 4, "test_accuracy": 60.0 + k}],
             "state_bytes": 100 + k} for k in range(12) for seed in (0, 1)]
    colours = []
    saved = plt.Figure.savefig

    def savefig(fig, path, **kwargs):
        colours.append([line.get_color() for line in fig.axes[0].get_lines()])
        return saved(fig, path, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt.Figure, "savefig", savefig)
        plots.plot_all(runs, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"loss.png", "metric.png", "state_memory.png"}
    assert all(len(set(c)) == 12 for c in colours[:2])


BF16_WEIGHTS = ["smmf-recommended-bf16", "smmf-recommended-bf16-sr", "adamw-bf16", "adamw-bf16-sr", "adamw-bf16-master"]


@pytest.mark.parametrize("name", BF16_WEIGHTS)
def test_the_bf16_weight_configurations_train_bf16_models(name: str) -> None:
    """The bf16 study's rows train the model in bf16; its held-out loss is of those weights as fp32 numbers; an fp32
    master copy counts as state (8 bytes of moments and 4 of master per parameter)."""
    overrides = {"backend": "torch"} if name.startswith("smmf") else {}  # no JIT compilation in a quick test
    seen = []
    task = stdlib_lm_task(TINY)
    evaluate = task.evaluate
    task = Task(**{**task.__dict__, "evaluate": lambda model, device: seen.append(next(model.parameters()).dtype)
                   or evaluate(model, device)})
    result = train_one(task, name, overrides, steps=6, eval_every=6, seed=0, device=torch.device("cpu"),
                       show_progress=False)
    assert result["weights"] == "bf16" and not result["diverged"] and seen == [torch.float32]
    numel = sum(p.numel() for p in TINY.build(0).parameters())
    if name.startswith("adamw"):
        assert result["state_bytes"] == (12 if name.endswith("master") else 8) * numel


def test_bf16_weights_round_the_fp32_step_to_nearest_or_stochastically() -> None:
    """AdamW's bf16 rows: the step of fp32 copies (made from the weights at each step, or kept), written back
    rounded to nearest (the nearest bf16 of the fp32 step) or stochastically (up or down, never further)."""
    from smmf.bench.bf16_weights import BF16Weights

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=gen).bfloat16()
    grads = [torch.randn(4096, generator=gen).bfloat16() for _ in range(3)]
    runs = {}
    for key, options in {"nearest": {}, "stochastic": dict(stochastic_rounding=True), "master": dict(master=True)}.items():
        weight = torch.nn.Parameter(start.clone())
        reference = start.float().clone().requires_grad_()
        optimizer = BF16Weights([weight], torch.optim.AdamW, lr=1e-2, **options)
        fp32 = torch.optim.AdamW([reference], lr=1e-2)
        for grad in grads:
            if key != "master":
                reference.data.copy_(weight.detach().float())
            weight.grad, reference.grad = grad.clone(), grad.float()
            optimizer.step()
            fp32.step()
            if key == "stochastic":  # one of the two bf16 numbers around the fp32 step: less than bf16's spacing away
                exact = reference.detach()
                assert ((weight.detach().float() - exact).abs() < exact.abs() * 2.0**-7).all()
            else:
                assert torch.equal(weight.detach(), reference.detach().bfloat16())
        runs[key] = weight.detach().clone()
    assert not torch.equal(runs["stochastic"], runs["nearest"])
