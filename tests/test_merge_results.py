"""benchmarks/merge_results.py: one report from the runs of several `smmf compare` outputs, each run once."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from smmf.bench.compare import write_outputs

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_results.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("merge_results", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(optimizer: str, seed: int, loss: float, task: str = "stdlib-lm", **extra) -> dict:
    return {"task": task, "optimizer": optimizer, "label": {"adamw": "AdamW (torch)", "smmf": "SMMF"}[optimizer],
            "seed": seed, "steps": 120, "eval_every": 6, "kwargs": {"lr": "0.001"}, "losses": [loss] * 120,
            "evals": [{"step": 120, "held_out_loss": loss}], "metric": "held_out_loss", "final_metric": loss,
            "best_metric": loss, "state_bytes": 100, "peak_bytes": None, "mean_step_ms": 1.0,
            "mean_train_step_ms": 2.0, "wall_s": 3.0, "diverged": False, **extra}


def _folder(path: Path, code: str, runs: list[dict], device: str = "cpu") -> Path:
    write_outputs(runs, {"command": "smmf compare", "code": code, "machine": "x86_64 CPU", "device": device}, path,
                  plots=False)
    return path


def test_runs_of_several_folders_merge_once_each_in_order(tmp_path) -> None:
    merge = _load()
    first = _folder(tmp_path / "a", "aaa", [_run("smmf", 0, 2.0), _run("adamw", 0, 1.0)])
    second = _folder(tmp_path / "b", "bbb", [_run("adamw", 0, 1.0), _run("smmf", 1, 4.0), _run("adamw", 1, 3.0),
                                            _run("adamw", 0, 9.0, task="finetune-lm")])
    on_gpu = _folder(tmp_path / "c", "ccc", [_run("adamw", 2, 5.0)], device="cuda")
    out = tmp_path / "merged"
    assert merge.main(["--task", "stdlib-lm", "--out", str(out), "--no-plots", str(first), str(second),
                       str(on_gpu)]) == 0
    runs = json.loads((out / "results.json").read_text())["results"]
    assert [(r["optimizer"], r["seed"], r["code"]) for r in runs] == [
        ("adamw", 0, "aaa"), ("adamw", 1, "bbb"), ("smmf", 0, "aaa"), ("smmf", 1, "bbb")]
    table = (out / "results.md").read_text()
    assert "kept from earlier commands or started after a later commit: aaa, bbb" in table
    assert "| stdlib-lm | AdamW (torch) | 2 | held_out_loss | 2 ± 1.4 |" in table
    assert "| stdlib-lm | SMMF | 2 | held_out_loss | 3 ± 1.4 |" in table


def test_the_output_must_not_be_an_input(tmp_path) -> None:
    merge = _load()
    first = _folder(tmp_path / "a", "aaa", [_run("adamw", 0, 1.0)])
    with pytest.raises(SystemExit):
        merge.main(["--task", "stdlib-lm", "--out", str(first), str(first)])
    assert len(json.loads((first / "results.json").read_text())["results"]) == 1
