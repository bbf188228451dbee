"""The comparison job: data is deterministic, every baseline trains, the CLI writes everything."""

from __future__ import annotations

import json

import pytest
import torch

from smmf.bench.compare import train_one
from smmf.bench.optimizers import DEFAULT_OPTIMIZERS, parse_opt_args
from smmf.bench.tasks import TASKS, digits_split, pydoc_bytes

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


@pytest.mark.parametrize("name", [*DEFAULT_OPTIMIZERS, "smmf-natural", "smmf-natural-flag"])
def test_every_optimizer_trains_the_cnn(name: str) -> None:
    result = train_one(TASKS["digits-cnn"], name, {}, steps=40, eval_every=40, seed=0, device=torch.device("cpu"),
                       show_progress=False)
    losses = result["losses"]
    assert not result["diverged"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert result["state_bytes"] > 0


def test_opt_args_parse_and_reject() -> None:
    assert parse_opt_args(["smmf:lr=3e-3,decay_rate=-0.8", "adam:amsgrad=True"]) == {
        "smmf": {"lr": 3e-3, "decay_rate": -0.8}, "adam": {"amsgrad": True}}
    with pytest.raises(ValueError, match="NAME:key=value"):
        parse_opt_args(["smmf"])


def test_cli_quick_run_writes_all_outputs(tmp_path) -> None:
    from smmf.cli import main

    out = tmp_path / "run"
    assert main(["compare", "--quick", "--steps", "6", "--out", str(out), "--opt-args", "smmf:decay_rate=-0.8"]) == 0
    for name in ("results.md", "results.csv", "results.json", "loss.png", "metric.png", "state_memory.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    runs = {(r["task"], r["optimizer"]) for r in data["results"]}
    assert runs == {(t, o) for t in TASKS for o in DEFAULT_OPTIMIZERS}
    smmf = next(r for r in data["results"] if r["optimizer"] == "smmf")
    assert smmf["kwargs"]["decay_rate"] == "-0.8"
    assert all(len(r["losses"]) == 6 for r in data["results"])


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
