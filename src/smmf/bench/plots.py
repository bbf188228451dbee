"""PNG plots of a comparison: loss vs step, metric vs step (the mean over seeds, with a min–max
band when there are several), optimizer state per optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any


# task, optimizer, steps, evaluation interval, hyperparameters, pretraining steps, kind of device
Setting = tuple[str, str, Any, Any, tuple, Any, Any]


def run_setting(result: dict[str, Any]) -> Setting:
    """What decides a finished run but its seed: what it shares with the other seeds of its row (``compare``'s
    ``--resume`` keeps earlier runs of other hyperparameters, budgets or devices beside a command's). Its
    steps and evaluations are read from its curves where an earlier version did not record them (a run that
    diverged then has None)."""
    evals = result.get("evals") or [{}]
    steps = result.get("steps") or (None if result.get("diverged") else len(result.get("losses", [])))
    return (result["task"], result["optimizer"], steps, result.get("eval_every") or evals[0].get("step"),
            tuple(sorted(result.get("kwargs", {}).items())), result.get("pretrain_steps"), result.get("device"))


def by_run(results: list[dict[str, Any]]) -> dict[Setting, list[dict[str, Any]]]:
    """The results of each (task, optimizer) under one setting, one per seed, in order of first appearance."""
    groups: dict[Setting, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(run_setting(r), []).append(r)
    return groups


def run_labels(groups: dict[Setting, list[dict[str, Any]]]) -> dict[Setting, str]:
    """Each group's label: its optimizer's, and where that optimizer ran under several settings on one task,
    this one's values of what varies among them (hyperparameters, steps, evaluations, pretraining, device)."""
    labels = {}
    for key, runs in groups.items():
        label = runs[0]["label"]
        others = [k for k in groups if k[:2] == key[:2] and k != key and not groups[k][0].get("skipped")]
        if others:
            shared = set(key[4]).intersection(*(set(k[4]) for k in others))
            parts = [f"{name}={value}" for name, value in key[4] if (name, value) not in shared]
            for index, unit in ((2, " steps"), (3, "-step evaluations"), (5, " pretraining steps"), (6, "")):
                if key[index] is not None and any(k[index] not in (key[index], None) for k in others):
                    parts.append(f"{key[index]}{unit}")
            label += f" ({', '.join(parts)})" if parts else ""
        labels[key] = label
    return labels


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _mean_and_band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Pointwise mean, min and max of equally long curves (cut to the shortest: a diverged run stops)."""
    length = min(len(c) for c in curves)
    columns = [[c[i] for c in curves] for i in range(length)]
    return [sum(col) / len(col) for col in columns], [min(col) for col in columns], [max(col) for col in columns]


def plot_all(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_run(results)
    labels = run_labels(groups)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    # Past 10 rows a task's curves take tab20's colours (the default cycle repeats) and a legend beside the plot.
    most = max(sum(key[0] == task for key in groups) for task in tasks)
    colours = getattr(plt.get_cmap("tab20"), "colors") if most > 10 else None  # a ListedColormap's
    for kind, fname in (("loss", "loss.png"), ("metric", "metric.png")):
        fig, axes = plt.subplots(1, len(tasks), figsize=((6 if most <= 6 else 9) * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            if colours is not None:
                ax.set_prop_cycle(color=colours)
            for key, runs in groups.items():
                if key[0] != task:
                    continue
                first = runs[0]
                label = labels[key] + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
                if kind == "loss":
                    window = max(1, len(first["losses"]) // 50)
                    steps = list(range(1, len(first["losses"]) + 1))
                    mean, low, high = _mean_and_band([_smooth(r["losses"], window) for r in runs])
                    ax.set_ylabel(f"training loss (moving mean of {window})")
                else:
                    steps = [e["step"] for e in first["evals"]]
                    mean, low, high = _mean_and_band([[e[first["metric"]] for e in r["evals"]] for r in runs])
                    ax.set_ylabel(first["metric"].replace("_", " "))
                steps = steps[: len(mean)]
                (line,) = ax.plot(steps, mean, label=label, **({} if kind == "loss" else dict(marker="o", markersize=3)))
                if len(runs) > 1:
                    ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_title(task)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if most <= 6:
                ax.legend()
            else:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110, bbox_inches="tight")
        plt.close(fig)

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        keys = [key for key in groups if key[0] == task]
        rows = [groups[key][0] for key in keys]
        kib = [r["state_bytes"] / 1024 for r in rows]
        bars = ax.bar([labels[key] for key in keys], kib, color="tab:gray")
        for bar, r in zip(bars, rows):
            if r["optimizer"].startswith("smmf"):
                bar.set_color("tab:green")
        ax.set_yscale("log")
        ax.set_ylabel("optimizer state, KiB (log scale)")
        ax.set_title(task)
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in kib], fontsize=8)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out / "state_memory.png", dpi=110)
    plt.close(fig)
