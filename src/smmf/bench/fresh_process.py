"""Measurements that need a process of their own: a module's child mode, run fresh, and its result.

Peak memory is only a run's own in a new process: whatever an earlier run freed would otherwise be
there for the allocator to reuse. glibc can also be told to serve large blocks by mmap from the
start (``MALLOC_MMAP_THRESHOLD_``), so that freed memory leaves the process and the resident
high-water mark follows live memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Optional

RESULT = "SMMF-CHILD-RESULT "
STOP_GRACE_S = 3.0  # a stopped child's time to end on SIGTERM before it is killed


class Stopped(Exception):
    """No child starts, and those running were ended: :func:`stop_children` was called."""


class _Children:
    """The children running now, so that a stop can end them all; none starts once stopping."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entered by a signal handler on the thread that holds it
        self.running: set[subprocess.Popen] = set()
        self.stopping = False


_children = _Children()


def stop_children() -> None:
    """End every child (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and start no new one: what a stopped
    study does before it writes what it finished. :func:`allow_children` undoes it."""
    with _children.lock:
        _children.stopping = True
        running = list(_children.running)
    for process in running:
        _end(process, signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _end(process, signal.SIGKILL)
            process.wait()


def allow_children() -> None:
    with _children.lock:
        _children.stopping = False


def _end(process: subprocess.Popen, signum: int) -> None:
    """Signal a child's whole process group (it leads one of its own: its workers go too)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(module: str, args: list[str], what: str, mmap_threshold: Optional[int] = None,
              show_stderr: bool = False, threads: Optional[int] = None) -> Any:
    """``python -m module *args`` in a fresh process; the result it gave :func:`report`.

    ``show_stderr`` lets the child's progress bars through; otherwise the last line of its stderr
    goes into the error raised when it fails. ``threads``: the CPU threads of torch (OpenMP) and numba
    in the child."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    with _children.lock:
        if _children.stopping:
            raise Stopped(f"{what} was not started: stopping")
        # A session of its own: a Ctrl-C at the terminal reaches the parent alone, which ends the children
        # (stop_children, or below when this call is interrupted) rather than each dying mid-write.
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                   stderr=None if show_stderr else subprocess.PIPE, text=True, env=env,
                                   start_new_session=True)
        _children.running.add(process)
    try:
        stdout, stderr = process.communicate()
    except BaseException:  # an interrupt, a signal turned into an exception: the child goes with it
        _end(process, signal.SIGKILL)
        process.wait()
        raise
    finally:
        with _children.lock:
            _children.running.discard(process)
    if _children.stopping:
        raise Stopped(f"{what} was stopped")
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if process.returncode != 0 or not lines:
        tail = (stderr or "").strip().splitlines()[-1:]
        raise RuntimeError(f"{what} failed (exit status {process.returncode}){': ' + tail[0] if tail else ''}")
    return json.loads(lines[-1][len(RESULT):])


def report(result: Any) -> None:
    """The child's side: hand ``result`` (JSON-serializable) back to :func:`run_child`."""
    print(RESULT + json.dumps(result), flush=True)
