"""``smmf compare``: train the same model with Adam, Adafactor, SM3, CAME and SMMF, side by side.

Same seed, initialization and batch order for every optimizer; ``--seeds K`` repeats every run on K
seeds and reports each figure as mean ± standard deviation over them. Writes a markdown and CSV
table, a JSON with every curve, and PNG plots (mean curves with a min–max band) to ``--out``.
The default run is the paper's five optimizers, AdamW and SMMF's recommended option (``smmf.RECOMMENDED``) on
the two quick tasks; ``--tasks stdlib-lm,finetune-lm`` and the peers (``--optimizers ...,torchao-adamw8bit``)
are opt-in. A peer whose package is missing is a skipped row, with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .args import OneLineParser, comma_list, cuda_or_fail, fail, writable_dir
from .optimizers import (DEFAULT_OPTIMIZERS, LIKE_FOR_LIKE, PAPER_SMMF, RECOMMENDED_SMMF, missing_package, optimizer_specs,
                         parse_opt_args, warmup_cosine)
from .plots import by_run, plot_all, run_labels, run_setting
from .fresh_process import allow_children, die_with_parent, hold_interrupt, report, run_child, stop_children
from .machine import describe
from .procfs import reset_peak_rss, set_mmap_threshold, status_kib
from .progress import progress
from .storage import optimizer_state_bytes
from ..table import format_table
from .tasks import DEFAULT_TASKS, PRETRAIN_STEPS, TASKS, Batch, Task, cache_root, make_task


DEFAULT_JOBS = 1
MAX_SEEDS = 1000
# What stops a study: each ends the runs in flight, starts no other, and keeps the finished ones.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(BaseException):
    """A stop signal arrived (a BaseException, as KeyboardInterrupt: no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StudyStopped(Exception):
    """The study was stopped by a signal: ``finished`` holds the runs that ended before it, in order."""

    def __init__(self, signum: int, finished: list[dict[str, Any]], not_run: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.finished, self.not_run = signum, finished, not_run


@contextlib.contextmanager
def signals_stop_the_study() -> Iterator[None]:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread (held while it starts a
    child: :func:`~smmf.bench.fresh_process.hold_interrupt`); a second one while the study stops is ignored, so
    that the stop can write what finished. A signal ignored when the study started stays ignored (``nohup``: the
    terminal's hangup must not stop it). Elsewhere than the main thread, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        for other in handled:
            signal.signal(other, signal.SIG_IGN)

        def raise_it() -> None:
            raise Interrupted(signum)

        if not hold_interrupt(raise_it):
            raise_it()

    handled = [signum for signum in STOP_SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]
    previous = {signum: signal.signal(signum, interrupt) for signum in handled}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class PeakMemory:
    """Peak memory of a run: CUDA allocator peak, or the process's RSS high-water mark increase."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            reset_peak_rss()
            self.base = (status_kib("VmRSS") or 0) * 1024

    def peak_bytes(self) -> Optional[int]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        hwm = status_kib("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self.base)


# Peak memory is read over the first steps (optimizer state and activations all exist by then)
# with large blocks mmap-ed, so the figure is stable; the rest runs with glibc's usual heap.
PEAK_STEPS = 10
PINNED_MMAP_THRESHOLD = 128 << 10
FAST_MMAP_THRESHOLD = 32 << 20


def train_one(task: Task, name: str, overrides: dict[str, Any], steps: int, eval_every: int, seed: int,
              device: torch.device, show_progress: bool = True) -> dict[str, Any]:
    spec = optimizer_specs(task.kind)[name]
    model = _model(task, seed, device, spec.weights)
    model.train()
    kwargs = {**spec.kwargs, **overrides}
    optimizer = spec.build(model.parameters(), **kwargs)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, min(100, max(1, steps // 10))))
                 if spec.scheduled else None)
    batches = task.batches(seed, device)
    pinned = os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(PINNED_MMAP_THRESHOLD)
    peak = PeakMemory(device)
    peak_bytes = None
    losses: list[float] = []
    evals: list[dict[str, float]] = []
    step_ms: list[float] = []
    train_ms: list[float] = []
    diverged = False
    for step in progress(range(1, steps + 1), f"{task.name} {spec.label}", steps, show_progress):
        batch = _in_weights_dtype(next(batches), spec.weights)
        start = time.perf_counter()
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        before_step = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if scheduler is not None:
            scheduler.step()
        if step == min(PEAK_STEPS, steps):
            peak_bytes = peak.peak_bytes()
            if pinned:
                set_mmap_threshold(FAST_MMAP_THRESHOLD)
        elif step > PEAK_STEPS or steps <= PEAK_STEPS:  # time the steps after the memory window
            step_ms.append((end - before_step) * 1e3)
            train_ms.append((end - start) * 1e3)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            diverged = True
            break
        if step % eval_every == 0 or step == steps:
            evals.append({"step": step, **task.evaluate(_evaluated(model, spec.weights), device)})
    metric_values = [e[task.metric] for e in evals]
    best = (max if task.higher_is_better else min)(metric_values) if metric_values else float("nan")
    return {
        "task": task.name,
        "optimizer": name,
        "label": spec.label,
        "kwargs": _recorded(kwargs),
        "metric": task.metric,
        "final_metric": metric_values[-1] if metric_values else float("nan"),
        "best_metric": best,
        "final_eval": evals[-1] if evals else {},
        "losses": losses,
        "evals": evals,
        "state_bytes": optimizer_state_bytes(optimizer),
        "peak_bytes": peak_bytes if peak_bytes is not None else peak.peak_bytes(),
        "mean_step_ms": _mean_ms(step_ms),
        "mean_train_step_ms": _mean_ms(train_ms),
        "diverged": diverged,
        "weights": spec.weights,
    }


def _model(task: Task, seed: int, device: torch.device, weights: str) -> torch.nn.Module:
    """The task's model, in bf16 for an optimizer of bf16 weights."""
    model = task.build_model(seed).to(device)
    return model.to(torch.bfloat16) if weights == "bf16" else model


def _in_weights_dtype(batch: Batch, weights: str) -> Batch:
    """A batch's float inputs in bf16 for a bf16 model (token ids stay as they are)."""
    if weights != "bf16":
        return batch
    inputs, targets = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
    return inputs, targets


def _evaluated(model: torch.nn.Module, weights: str) -> torch.nn.Module:
    """What a run's evaluation runs: bf16 weights as fp32 numbers, so that the held-out loss measures the weights,
    not bf16's arithmetic in the evaluation."""
    return model if weights == "fp32" else copy.deepcopy(model).float()


def _mean_ms(times: list[float]) -> float:
    """The mean of a run's timed steps but the first (its caches warm up); NaN where none was timed: a run of one
    step, or one that diverged within the memory window (whose steps are not timed)."""
    return statistics.fmean(times[1:] or times) if times else float("nan")


# Training loss "at step k" is the mean of the LOSS_WINDOW steps ending at k (one batch is noisy).
LOSS_AT = 100
LOSS_WINDOW = 10


def loss_at(losses: list[float], step: int) -> float:
    window = losses[max(0, step - LOSS_WINDOW) : step]
    return statistics.fmean(window) if window and len(losses) >= step else float("nan")


def _spread(values: list[float]) -> str:
    """``mean ± standard deviation`` (just the value for one seed; NaN where a value is not finite: a run
    shorter than the step asked for, or one that diverged — Python 3.11's ``stdev`` raises on them)."""
    if len(values) == 1:
        return f"{values[0]:.4g}"
    spread = statistics.stdev(values) if all(math.isfinite(v) for v in values) else float("nan")
    return f"{statistics.fmean(values):.4g} ± {spread:.2g}"


def summary_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One row per (task, optimizer) and setting (:func:`~smmf.bench.plots.by_run`): every figure as mean ± std
    over the seeds it ran on; a skipped optimizer (its package missing) is a row that says why."""
    headers = ["task", "optimizer", "seeds", "metric", "final", "best", "final / like-for-like",
               f"train loss@{LOSS_AT} (worst seed)", "final train loss", "state KiB", "state / SMMF",
               f"peak MiB (steps 1-{PEAK_STEPS})", "opt step ms", "train step ms", "run s"]
    groups = by_run(results)
    labels = run_labels(groups)
    smmf_state: dict[str, int] = {}  # the first paper-SMMF row of each task, as the ratio's reference
    finals: dict[tuple[str, str], tuple[float, str]] = {}  # each task's first row of an optimizer: its final, label
    for key, runs in groups.items():
        if runs[0].get("skipped"):
            continue
        if key[1] == PAPER_SMMF:
            smmf_state.setdefault(key[0], runs[0]["state_bytes"])
        finals.setdefault((key[0], key[1]), (statistics.fmean(r["final_metric"] for r in runs), labels[key]))
    rows: list[list[Any]] = []
    for key, runs in groups.items():
        task, first = key[0], runs[0]
        if first.get("skipped"):
            rows.append([task, labels[key], 0, f"skipped: {first['skipped']}", *[None] * (len(headers) - 4)])
            continue
        ratio = first["state_bytes"] / smmf_state[task] if smmf_state.get(task) else None
        peaks = [r["peak_bytes"] / 2**20 for r in runs if r["peak_bytes"] is not None]
        early = [loss_at(r["losses"], LOSS_AT) for r in runs]
        final_loss = [loss_at(r["losses"], len(r["losses"])) for r in runs]
        worst = (max(early) if all(math.isfinite(x) for x in early) else float("nan"))
        short = all((r.get("steps") or len(r["losses"])) < LOSS_AT for r in runs)  # no loss@100 to give: blank
        baseline = finals.get((task, LIKE_FOR_LIKE.get(key[1], "")))
        final = statistics.fmean(r["final_metric"] for r in runs)
        versus = f"{final / baseline[0]:.3f}× {baseline[1]}" if baseline and baseline[0] else None
        rows.append([task, labels[key], len(runs), first["metric"], _spread([r["final_metric"] for r in runs]),
                     _spread([r["best_metric"] for r in runs]), versus,
                     None if short else f"{_spread(early)} ({worst:.4g})",
                     _spread(final_loss),
                     first["state_bytes"] / 1024, ratio, statistics.fmean(peaks) if peaks else None,
                     statistics.fmean(r["mean_step_ms"] for r in runs),
                     statistics.fmean(r["mean_train_step_ms"] for r in runs),
                     statistics.fmean(r.get("wall_s", float("nan")) for r in runs)])
    return headers, rows


def smmf_note(results: list[dict[str, Any]]) -> str:
    """Which SMMF row is the paper's algorithm and which the recommended option (where they ran)."""
    labels = {r["optimizer"]: r["label"] for r in results if not r.get("skipped")}
    notes = []
    if PAPER_SMMF in labels:
        notes.append(f"{labels[PAPER_SMMF]} is the paper's algorithm (M square-matricized, L2 weight decay as Adam's)")
    if RECOMMENDED_SMMF in labels:
        notes.append(f"{labels[RECOMMENDED_SMMF]} is the recommended option (smmf.RECOMMENDED: magnitude_bits=3, "
                     "a 3-bit level per element rounded stochastically and a scale per 128, decay_rate=-0.8, "
                     "growth_rate=None; "
                     "decoupled weight decay as AdamW's; see docs/beyond-the-paper.md)")
    if any(name in labels and baseline in labels for name, baseline in LIKE_FOR_LIKE.items()):
        notes.append("'final / like-for-like' sets each SMMF row's final metric against the baseline with its "
                     "weight decay: the paper's SMMF against Adam, the recommended option against AdamW")
    return "; ".join(notes) + "." if notes else ""


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a study stopped by a signal mid-write keeps the previous complete file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _commits(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """The commit of this command, and the others its runs were made at: runs kept from earlier commands
    (``--resume``), or started after a commit made while this one ran (each run loads the code as it starts)."""
    others = sorted({r["code"] for r in results if r.get("code", meta["code"]) != meta["code"]})
    return meta["code"] + (f" (runs at other commits, kept from earlier commands or started after a later commit: "
                           f"{', '.join(others)})" if others else "")


def write_outputs(results: list[dict[str, Any]], meta: dict[str, Any], out: Path, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    headers, rows = summary_rows(results)
    note = smmf_note(results)
    _write(out / "results.md",
        f"Command: `{meta['command']}`  \nCode: commit {_commits(meta, results)}  \nMachine: {meta['machine']}\n\n"
        + format_table(headers, rows, "markdown") + (f"\n{note}\n" if note else "")
    )
    _write(out / "results.csv", format_table(headers, rows, "csv"))
    _write(out / "results.json", json.dumps({"meta": meta, "results": results}, indent=1))
    ran = [r for r in results if not r.get("skipped")]
    if ran and plots:
        plot_all(ran, out)


def _warm_up(task: Task, optimizers: list[str], seed: int, device: torch.device) -> None:
    """One untimed step of each optimizer on a throwaway model, so that no run's time or peak
    memory carries start-up costs (library initialization, JIT compilation)."""
    specs = optimizer_specs(task.kind)
    for weights in sorted({specs[name].weights for name in optimizers}):
        model = _model(task, seed, device, weights)
        task.loss(model, _in_weights_dtype(next(task.batches(seed, device)), weights)).backward()
        task.evaluate(_evaluated(model, weights), device)
        for name in optimizers:
            if specs[name].weights == weights:
                specs[name].build(model.parameters(), **specs[name].kwargs).step()


def run(tasks: list[str], optimizers: list[str], steps: Optional[int], seed: int, device: torch.device,
        opt_args: list[str], quick: bool, show_progress: bool = True, seeds: int = 1, cache: Optional[str] = None,
        pretrain_steps: Optional[int] = None, jobs: int = 1,
        finished: Optional[Callable[[list[dict[str, Any]]], None]] = None,
        kept: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every (task, optimizer, seed) run, each in a fresh process (see :func:`train_in_fresh_process`);
    seeds ``seed .. seed + seeds - 1``, every optimizer's first seed before any second one. An optimizer
    whose package is missing gets one skipped entry per task (and a note on stderr) instead of runs.
    ``cache`` and ``pretrain_steps`` are finetune-lm's. ``jobs``: runs at a time, each in its own process
    with an equal share of the CPU cores (a line per finished run then stands in for the progress bars).
    ``finished`` is called with the results so far (in submission order) whenever a run ends, so that a
    long study that is stopped keeps what it finished. ``kept``: results of earlier runs (``--resume``); a run
    that one of them already made (:func:`_job_key`: the same task, optimizer, seed, steps, evaluations,
    hyperparameters, pretraining and kind of device) is taken from there instead of being run again, and the
    earlier runs that this command would not make come first in the results, as they were (so that writing
    the results never loses one)."""
    pool = ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None
    threads = max(1, _cores() // jobs) if pool is not None else None
    skipped = {name: why for name in optimizers if (why := missing_package(optimizer_specs("cnn")[name]))}
    for name, why in skipped.items():
        print(f"{PROG}: skipping {name}: {why}", file=sys.stderr, flush=True)
    planned: dict[str, list[dict[str, Any]]] = {}
    for task_name in tasks:
        n_steps = steps or (20 if quick else TASKS[task_name].default_steps)
        planned[task_name] = [
            dict(task=task_name, optimizer=name, opt_args=[a for a in opt_args if a.partition(":")[0] == name],
                 steps=n_steps, eval_every=max(1, n_steps // (4 if quick else 20)), seed=run_seed, device=str(device),
                 progress=show_progress and pool is None, cache=cache, pretrain_steps=pretrain_steps, threads=threads)
            for run_seed in range(seed, seed + seeds) for name in optimizers]
    earlier = {_run_key(r): r for r in kept if not r.get("skipped")}
    made_here = {_job_key(TASKS[job["task"]], job) for task_jobs in planned.values() for job in task_jobs}
    slots: list[Any] = [r for key, r in earlier.items() if key not in made_here]
    if slots:
        print(f"{PROG}: --resume: {len(slots)} earlier run(s) that this command would not make are kept in its results "
              "as they were", file=sys.stderr, flush=True)
    lock = threading.Lock()
    stopping = threading.Event()

    def ended() -> list[dict[str, Any]]:
        """The finished runs in order, and the earlier runs this command takes that it has not reached yet."""
        done_now = [s.result() if isinstance(s, Future) else s for s in list(slots)
                    if not isinstance(s, Future) or (s.done() and not s.cancelled() and s.exception() is None)]
        reached = {id(r) for r in done_now}
        return done_now + [r for key, r in earlier.items() if id(r) not in reached and key in made_here]

    def done(_: Any = None) -> None:
        if finished is None or stopping.is_set():
            return
        with lock:
            try:
                finished(ended())
            except Exception as err:  # the runs go on either way (a pool would swallow it; say so instead)
                print(f"{PROG}: could not write the results so far: {type(err).__name__}: {err}", file=sys.stderr,
                      flush=True)

    try:
        _submit(planned, earlier, skipped, slots, pool, seed, device, cache, pretrain_steps, show_progress, done)
        if pool is not None:
            results = [s if isinstance(s, dict) else s.result() for s in slots]
            pool.shutdown(wait=True)  # the last run's report (done) is written before the caller's final one
            return results
        return slots
    except Interrupted as interrupt:
        stopping.set()
        stop_children()  # the runs in flight end now: their threads see their child gone
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        allow_children()
        with lock:
            finished_now = ended()
        to_run = [job for jobs in planned.values() for job in jobs
                  if job["optimizer"] not in skipped and _job_key(TASKS[job["task"]], job) not in earlier]
        taken = {id(r) for r in earlier.values()}
        ran = [r for r in finished_now if not r.get("skipped") and id(r) not in taken]
        raise StudyStopped(interrupt.signum, finished_now, len(to_run) - len(ran)) from None
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _submit(planned: dict[str, list[dict[str, Any]]], earlier: dict[tuple, dict[str, Any]], skipped: dict[str, str],
            slots: list[Any], pool: Optional[ThreadPoolExecutor], seed: int, device: torch.device, cache: Optional[str],
            pretrain_steps: Optional[int], show_progress: bool, done: Callable[..., None]) -> None:
    """:func:`run`'s jobs into ``slots`` in order: an earlier run taken as it was, a skipped row, a result (one job
    at a time), or a future of ``pool``."""
    for task_name, task_jobs in planned.items():
        task = make_task(task_name, cache, pretrain_steps, str(device))
        made_before = [earlier.get(_job_key(task, job)) for job in task_jobs]
        if task.prepare is not None and any(made is None and job["optimizer"] not in skipped
                                            for job, made in zip(task_jobs, made_before)):
            task.prepare(show_progress)  # once, here, so that no run's time includes it
        for job, made in zip(task_jobs, made_before):
            name = job["optimizer"]
            if made is not None:  # made by an earlier command (even where its package is now missing)
                slots.append(made)
                done()
            elif name in skipped:
                if job["seed"] == seed:
                    slots.append({"task": task_name, "optimizer": name, "label": optimizer_specs(task.kind)[name].label,
                                  "skipped": skipped[name], "seed": seed})
            elif pool is None:
                slots.append(_timed_run(job))
                done()
            else:
                slots.append(future := pool.submit(_timed_run, job, show_progress))
                future.add_done_callback(done)


def _job_key(task: Task, job: dict[str, Any]) -> tuple:
    """What decides a run's result, as :func:`_run_key` reads it from a finished one."""
    spec = optimizer_specs(task.kind)[job["optimizer"]]
    overrides = parse_opt_args(job["opt_args"]).get(job["optimizer"], {})
    kwargs = _recorded({**spec.kwargs, **overrides})
    return (job["task"], job["optimizer"], job["seed"], job["steps"], job["eval_every"], tuple(sorted(kwargs.items())),
            _pretraining(job["task"], job.get("pretrain_steps")), torch.device(job["device"]).type)


def _recorded(kwargs: dict[str, Any]) -> dict[str, str]:
    """An optimizer's keyword arguments as a run records them (and ``--resume`` matches them)."""
    return {k: repr(v) for k, v in kwargs.items()}


def _pretraining(task_name: str, pretrain_steps: Optional[int]) -> Optional[int]:
    """The pretraining steps a run of ``task_name`` starts from (None for a task without pretraining)."""
    return (pretrain_steps or PRETRAIN_STEPS) if TASKS[task_name].prepare is not None else None


def _run_key(result: dict[str, Any]) -> tuple:
    """A finished run's :func:`_job_key` (:func:`~smmf.bench.plots.run_setting` and its seed)."""
    task, optimizer, *rest = run_setting(result)
    return (task, optimizer, result.get("seed"), *rest)


_RUN_KEYS = ("task", "optimizer", "label")  # what every run of a results file has, run or skipped
# ... and what every run that trained has (the tables and plots read them)
_RAN_KEYS = ("metric", "final_metric", "best_metric", "losses", "evals", "state_bytes", "peak_bytes", "mean_step_ms",
             "mean_train_step_ms")


def _well_formed(data: Any) -> bool:
    """``data`` has the shape of a results file: a 'meta' object and runs whose fields the report reads."""
    if not (isinstance(data, dict) and isinstance(data.get("results", []), list)
            and isinstance(data.get("meta", {}), dict) and isinstance(data.get("meta", {}).get("command", ""), str)):
        return False
    for run in data.get("results", []):
        if not (isinstance(run, dict) and all(key in run for key in _RUN_KEYS)):
            return False
        if not run.get("skipped") and not (all(key in run for key in _RAN_KEYS)
                                           and isinstance(run["losses"], list) and isinstance(run["evals"], list)
                                           and isinstance(run.get("kwargs", {}), dict)):
            return False
    return True


def stored_results(out: Path) -> list[dict[str, Any]]:
    """The runs of ``out/results.json`` (none if there is none), each with the commit, the kind of device and
    the pretraining it ran with (from the file's header where the run does not say: files of an earlier
    version)."""
    path = out / "results.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a results file of smmf compare ({err})") from None
    if not _well_formed(data):
        raise ValueError(f"{path} is not a results file of smmf compare (a 'meta' object and a 'results' list whose "
                         f"runs each have {', '.join(_RUN_KEYS)}, and those that trained {', '.join(_RAN_KEYS)}): "
                         "move it away, or give another --out")
    meta = data.get("meta", {})
    command = meta.get("command", "").split()
    device = meta.get("device") or ("cuda" if "NVIDIA" in str(meta.get("machine", "")) else "cpu")
    try:
        pretrain = int(command[command.index("--pretrain-steps") + 1]) if "--pretrain-steps" in command else None
    except (IndexError, ValueError):
        raise ValueError(f"{path}: its command's --pretrain-steps is not a number ({meta['command']!r})") from None
    return [{"device": device, "code": meta.get("code", "unknown"),
             "pretrain_steps": _pretraining(r["task"], pretrain) if r.get("task") in TASKS else None, **r}
            for r in data.get("results", [])]


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _timed_run(job: dict[str, Any], announce: bool = False) -> dict[str, Any]:
    code = _code_version()  # as the run starts: its process loads the code then (a commit made meanwhile did not run)
    started = time.perf_counter()
    result = train_in_fresh_process(job)
    result = {**result, "seed": job["seed"], "steps": job["steps"], "eval_every": job["eval_every"],
              "pretrain_steps": _pretraining(job["task"], job.get("pretrain_steps")),
              "device": torch.device(job["device"]).type, "code": code, "wall_s": time.perf_counter() - started,
              "threads": job["threads"]}
    if announce:
        print(f"{job['task']} {result['label']} (seed {job['seed']}): {result['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return result


def train_in_fresh_process(job: dict[str, Any]) -> dict[str, Any]:
    """One run in a new Python process, so that its peak memory is its own: nothing that an earlier
    run freed is there for the allocator to reuse, which made in-process figures swing. glibc serves
    blocks of 128 KiB and more by mmap from the start (so the heap holds no large free chunk to reuse)
    until the peak has been read; see ``PEAK_STEPS``."""
    return run_child("smmf.bench.compare", ["--child", json.dumps(job)], f"the {job['optimizer']} run on {job['task']}",
                     PINNED_MMAP_THRESHOLD, show_stderr=True, threads=job.get("threads"), own_session=True)


def _child(job: dict[str, Any]) -> None:
    die_with_parent()
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    task = make_task(job["task"], job.get("cache"), job.get("pretrain_steps"), str(device))
    _warm_up(task, [job["optimizer"]], job["seed"], device)
    overrides = parse_opt_args(job["opt_args"]).get(job["optimizer"], {})
    result = train_one(task, job["optimizer"], overrides, job["steps"], job["eval_every"], job["seed"], device,
                       job["progress"])
    report(result)


PROG = "smmf compare"


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--tasks", nargs="+", default=[",".join(DEFAULT_TASKS)],
                        help=f"comma- or space-separated, of {list(TASKS)} (default: {','.join(DEFAULT_TASKS)})")
    parser.add_argument("--optimizers", nargs="+", default=[",".join(DEFAULT_OPTIMIZERS)],
                        help=f"comma- or space-separated, of {', '.join(optimizer_specs('cnn'))} "
                             f"(default: {','.join(DEFAULT_OPTIMIZERS)})")
    parser.add_argument("--steps", type=int, help="training steps per run (default: per task)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="run every optimizer on this many seeds (from --seed)")
    parser.add_argument("--out", default="runs/compare", help="output directory")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when available")
    parser.add_argument("--opt-args", action="append", default=[], metavar="NAME:key=value,...",
                        help="override an optimizer's hyperparameters, e.g. smmf:decay_rate=-0.8 or "
                             "adam:betas=(0.9,0.99)")
    parser.add_argument("--quick", action="store_true", help="a tiny run for smoke tests")
    parser.add_argument("--cache", help="finetune-lm: where its pretrained checkpoint is kept (default: $SMMF_CACHE, "
                                        "else $XDG_CACHE_HOME/smmf or ~/.cache/smmf)")
    parser.add_argument("--pretrain-steps", type=int,
                        help=f"finetune-lm: AdamW steps of its pretraining on stdlib-lm (default {PRETRAIN_STEPS})")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS,
                        help="runs at a time, each in its own process with an equal share of the CPU cores "
                             f"(on CUDA all share the GPU, and so do their step times) (default: {DEFAULT_JOBS})")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs of --out's results.json that this command would make again (same task, "
                             "optimizer, seed, steps, hyperparameters, pretraining, kind of device) and run only the "
                             "others; the file's other runs stay in the results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str], torch.device, dict[str, dict[str, Any]], Path]:
    """Every argument checked before the first step: a bad one fails in one line, exit status 2."""
    tasks = comma_list(PROG, "--tasks", ",".join(args.tasks), list(TASKS))
    known = optimizer_specs("cnn")
    optimizers = comma_list(PROG, "--optimizers", ",".join(args.optimizers), list(known))
    if args.steps is not None and args.steps < 1:
        fail(PROG, f"--steps must be at least 1, got {args.steps}")
    if args.pretrain_steps is not None and args.pretrain_steps < 1:
        fail(PROG, f"--pretrain-steps must be at least 1, got {args.pretrain_steps}")
    if not 1 <= args.seeds <= MAX_SEEDS:
        fail(PROG, f"--seeds must be between 1 and {MAX_SEEDS}, got {args.seeds}")
    if not 0 <= args.seed <= 2**63 - args.seeds:  # torch.manual_seed takes less than 2**64; numpy less than 2**63
        fail(PROG, f"--seed must be between 0 and 2**63 - --seeds, got {args.seed}")
    if args.jobs < 1:
        fail(PROG, f"--jobs must be at least 1, got {args.jobs}")
    cuda_or_fail(PROG, args.device)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    try:
        opt_args = parse_opt_args(args.opt_args)
    except ValueError as err:
        fail(PROG, str(err))
    probe = [torch.nn.Parameter(torch.zeros(2, 2))]
    for name, overrides in opt_args.items():
        if name not in optimizers:
            fail(PROG, f"--opt-args names {name!r}, which is not among --optimizers {optimizers}")
        for kind in sorted({TASKS[t].kind for t in tasks}):
            spec = optimizer_specs(kind)[name]
            if missing_package(spec):
                continue  # skipped when it runs
            given = f"--opt-args {name}:{','.join(f'{k}={v}' for k, v in overrides.items())}"
            try:
                built = spec.build(probe, **{**spec.kwargs, **overrides})
            except (TypeError, ValueError) as err:
                fail(PROG, f"{given}: {err}")
            # pytorch_optimizer's AdaFactor, SM3 and CAME take **kwargs (and keep them in their defaults, unused):
            # a misspelled option would run as the default
            named = inspect.signature(type(built).__init__).parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in named.values())
            unknown = sorted(set(overrides) - set(named)) if takes_any else []
            if unknown:
                fail(PROG, f"{given}: {type(built).__name__} has no option {', '.join(map(repr, unknown))}")
    if not args.out.strip():
        fail(PROG, "--out names no directory")
    if not args.resume:
        _refuse_another_study(Path(args.out))
    if "finetune-lm" in tasks:  # last, with --out: these create their folders
        writable_dir(PROG, "--cache", str(cache_root(args.cache)))
    return tasks, optimizers, device, opt_args, writable_dir(PROG, "--out", args.out)


def _refuse_another_study(out: Path) -> None:
    """A rerun into a folder that holds a study would drop its runs from the tables: refused, naming it."""
    path = out / "results.json"
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text())
        what = f"{len(data['results'])} run(s) of `{data['meta']['command']}`"
    except (OSError, ValueError, KeyError, TypeError):
        what = "a results.json that is not smmf compare's"
    fail(PROG, f"--out {out} holds another study ({what}): add --resume to keep its runs and run only the missing "
               "ones, or give another --out")


def main(args: Optional[argparse.Namespace] = None) -> int:
    args = args or build_parser().parse_args()
    if args.child:
        _child(json.loads(args.child))
        return 0
    tasks, optimizers, device, _, out = check_args(args)
    try:
        kept = stored_results(out) if args.resume else []
    except ValueError as err:
        fail(PROG, f"--resume: {err}")
    started = time.time()
    meta = {
        "command": "smmf compare " + " ".join(_argv_echo(args)),
        "code": _code_version(),
        "machine": describe(device),
        "device": device.type,
        "seeds": list(range(args.seed, args.seed + args.seeds)),
        "jobs": args.jobs,
    }

    def so_far(results: list[dict[str, Any]]) -> None:  # the tables (not the plots) after every run
        write_outputs(results, {**meta, "seconds": time.time() - started, "complete": False}, out, plots=False)

    try:
        with signals_stop_the_study():
            try:
                results = run(tasks, optimizers, args.steps, args.seed, device, args.opt_args, args.quick,
                              seeds=args.seeds, cache=args.cache, pretrain_steps=args.pretrain_steps, jobs=args.jobs,
                              finished=so_far, kept=kept)
            except StudyStopped as stopped:
                return _stopped(stopped, {**meta, "seconds": time.time() - started, "complete": False}, out, args)
            meta |= {"seconds": time.time() - started, "complete": True}
            write_outputs(results, meta, out)
    except Interrupted as interrupt:  # while the finished study was written: its files are whole (_write)
        print(f"{PROG}: stopped by {interrupt} while writing {out}", file=sys.stderr, flush=True)
        return 128 + interrupt.signum
    headers, rows = summary_rows(results)
    print(format_table(headers, rows))
    note = smmf_note(results)
    if note:
        print(note)
    plots = ", loss.png, metric.png, state_memory.png" if any(not r.get("skipped") for r in results) else ""
    print(f"wrote {out}/results.md, results.csv, results.json{plots} ({meta['seconds']:.0f} s on {meta['machine']})")
    return 0


def _stopped(stopped: StudyStopped, meta: dict[str, Any], out: Path, args: argparse.Namespace) -> int:
    """A study stopped by a signal: its finished runs written (tables and plots, so that none of an earlier
    study's are left beside them), how to go on said, and the exit status of a process the signal ended."""
    write_outputs(stopped.finished, meta, out)
    ran = sum(not r.get("skipped") for r in stopped.finished)
    again = meta["command"] if args.resume else f"{meta['command']} --resume"
    print(f"{PROG}: stopped by {stopped}: {ran} finished run(s) kept in {out}/results.json, {stopped.not_run} not "
          f"run; to finish the study: {again}", file=sys.stderr, flush=True)
    return 128 + stopped.signum


def _code_version() -> str:
    """The git commit of the code that ran (``-dirty`` with uncommitted changes), where known."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _argv_echo(args: argparse.Namespace) -> list[str]:
    echo = [f"--tasks {','.join(args.tasks)}", f"--optimizers {','.join(args.optimizers)}", f"--seed {args.seed}",
            f"--out {args.out}"]
    if args.seeds != 1:
        echo.insert(3, f"--seeds {args.seeds}")
    if args.jobs != DEFAULT_JOBS:
        echo.append(f"--jobs {args.jobs}")
    if args.steps:
        echo.append(f"--steps {args.steps}")
    if args.quick:
        echo.append("--quick")
    if args.pretrain_steps:
        echo.append(f"--pretrain-steps {args.pretrain_steps}")
    if args.cache:
        echo.append(f"--cache {args.cache}")
    if args.resume:
        echo.append("--resume")
    echo += [f"--opt-args {a}" for a in args.opt_args]
    return echo


if __name__ == "__main__":
    raise SystemExit(main())
