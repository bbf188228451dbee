"""PNG plots of a comparison: loss vs step, metric vs step, optimizer state per optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_all(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in results))
    for kind, fname in (("loss", "loss.png"), ("metric", "metric.png")):
        fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for r in (r for r in results if r["task"] == task):
                if kind == "loss":
                    window = max(1, len(r["losses"]) // 50)
                    ax.plot(range(1, len(r["losses"]) + 1), _smooth(r["losses"], window), label=r["label"])
                    ax.set_ylabel(f"training loss (moving mean of {window})")
                else:
                    ax.plot([e["step"] for e in r["evals"]], [e[r["metric"]] for e in r["evals"]], marker="o",
                            markersize=3, label=r["label"])
                    ax.set_ylabel(r["metric"].replace("_", " "))
            ax.set_title(task)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in results if r["task"] == task]
        kib = [r["state_bytes"] / 1024 for r in rows]
        bars = ax.bar([r["label"] for r in rows], kib, color="tab:gray")
        for bar, r in zip(bars, rows):
            if r["optimizer"] == "smmf":
                bar.set_color("tab:green")
        ax.set_yscale("log")
        ax.set_ylabel("optimizer state, KiB (log scale)")
        ax.set_title(task)
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in kib], fontsize=8)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out / "state_memory.png", dpi=110)
    plt.close(fig)
