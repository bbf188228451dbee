"""``smmf compare`` stopped by Ctrl-C or SIGTERM: the whole study stops within seconds, no process is left
behind, every finished run stays in the tables, and it says how to resume. Each case is a real study in a
process of its own, stopped by a real signal."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

OPTIMIZERS = "adam,adamw,sm3,came,adafactor"  # five cheap runs: some finished, some in flight, some queued


def _marked(mark: str) -> list[int]:
    """The processes whose environment carries ``mark``: the study and every child it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _as_a_foreground_job() -> None:
    """In the study's process before it runs: the stop signals at their defaults, as a shell starts a foreground job.
    A runner started as a background job of a script (``pytest ... &``) ignores SIGINT, and so would the study it
    starts: rightly, as it keeps an ignored signal ignored (``nohup``), but then a Ctrl-C could not stop it."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _runs(out: Path) -> list[dict]:
    try:
        return json.loads((out / "results.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the study's processes through /proc")
@pytest.mark.parametrize("jobs,how", [(2, "ctrl-c"), (1, "ctrl-c"), (2, "SIGTERM"), (1, "SIGTERM")])
def test_a_stopped_study_ends_whole_keeps_its_finished_runs_and_says_how_to_resume(jobs: int, how: str,
                                                                                  tmp_path: Path) -> None:
    """Before: with ``--jobs 2`` a Ctrl-C killed the two runs in flight and dropped them, then ran the queued ones to
    the end; SIGTERM left the children running and wrote no results; ``--jobs 1`` printed a traceback."""
    out = tmp_path / "study"
    mark = f"SMMF_STOP_TEST={os.getpid()}-{jobs}-{how}"
    env = dict(os.environ, SMMF_STOP_TEST=mark.split("=", 1)[1])
    # Its own session, as a shell's job: Ctrl-C at a terminal signals the whole foreground process group.
    study = subprocess.Popen([sys.executable, "-m", "smmf.cli", "compare", "--tasks", "digits-cnn", "--optimizers",
                              OPTIMIZERS, "--steps", "10", "--jobs", str(jobs), "--out", str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=_as_a_foreground_job)
    try:
        deadline = time.monotonic() + 300
        while not _runs(out):
            assert study.poll() is None, study.communicate()
            assert time.monotonic() < deadline, "no run finished in 5 minutes"
            time.sleep(0.2)
        time.sleep(1.0)  # the next runs are in flight
        finished_before = len(_runs(out))
        assert finished_before < 5 and len(_marked(mark)) > 1, "no run in flight to stop"
        signalled = time.monotonic()
        if how == "ctrl-c":
            os.killpg(study.pid, signal.SIGINT)
        else:
            os.kill(study.pid, signal.SIGTERM)
        try:  # twice the bound below: a slow stop fails there, with its time
            _, err = study.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in _marked(mark):  # the study and its runs (each leads a session of its own)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the study had not ended 30 s after the {how}; its stderr: "
                        f"{study.communicate(timeout=10)[1][-2000:]}")
        took = time.monotonic() - signalled
    finally:
        if study.poll() is None:
            os.killpg(study.pid, signal.SIGKILL)
    signum = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    assert study.returncode == 128 + signum, err
    assert took < 15, f"{took:.1f} s from the {how} to the end of the study; stderr: {err[-2000:]}"
    time.sleep(0.5)
    assert _marked(mark) == [], "processes left behind"
    assert "Traceback" not in err, err
    runs = _runs(out)
    assert finished_before <= len(runs) < 5 and all(r["losses"] for r in runs)
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["complete"] is False
    assert f"stopped by {signal.Signals(signum).name}: {len(runs)} finished run(s) kept" in err, err
    assert f"{5 - len(runs)} not run; to finish the study: smmf compare" in err and "--resume" in err, err
    table = (out / "results.md").read_text()
    assert all(r["label"] in table for r in runs)
    assert (out / "loss.png").exists()  # the plots are of these runs, not of an earlier study's


def test_a_stop_during_a_resume_keeps_the_earlier_runs_it_had_not_reached(monkeypatch) -> None:
    """``--resume`` takes an earlier run when it reaches its job: a stop before that wrote the results without it,
    and the run was lost from the folder."""
    import torch

    from smmf.bench import compare

    kwargs = dict(tasks=["digits-cnn"], steps=2, seed=0, device=torch.device("cpu"), opt_args=[], quick=True,
                  show_progress=False)
    kept = compare.run(optimizers=["adam", "smmf"], **kwargs)

    def interrupted(job: dict, announce: bool = False) -> dict:
        raise compare.Interrupted(signal.SIGINT)  # Ctrl-C while sm3, the first job, trains

    monkeypatch.setattr(compare, "_timed_run", interrupted)
    with pytest.raises(compare.StudyStopped) as stopped:
        compare.run(optimizers=["sm3", "adam", "smmf"], kept=kept, **kwargs)
    assert stopped.value.finished == kept and stopped.value.not_run == 1


def test_a_signal_ignored_when_the_study_starts_stays_ignored() -> None:
    """``nohup smmf compare ...`` ignores SIGHUP: the study must not stop when the terminal closes."""
    from smmf.bench.compare import signals_stop_the_study

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_stop_the_study():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGHUP, before)


_SLEEPER = """
import sys, time
from smmf.bench.fresh_process import die_with_parent
die_with_parent()
print("started", flush=True)
time.sleep(60)
"""

_PARENT = """
import sys
sys.path.insert(0, sys.argv[1])
from smmf.bench.fresh_process import run_child
run_child("sleeper", [], "the sleeper", own_session=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_in_its_own_session_ends_with_its_parent_even_when_the_parent_is_killed(tmp_path: Path) -> None:
    """A child in a session of its own no longer gets the signals of its parent's process group: when the parent is
    killed outright (SIGKILL, a CI cancel), the child must still end."""
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    mark = f"SMMF_STOP_TEST=orphan-{os.getpid()}"
    env = dict(os.environ, SMMF_STOP_TEST=mark.split("=", 1)[1], PYTHONPATH=os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(_marked(mark)) < 2:  # the parent and its child
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)  # the child has asked for its parent's death signal
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _marked(mark) == [], "the child outlived its killed parent"
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
