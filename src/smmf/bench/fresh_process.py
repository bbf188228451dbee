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
import time
from typing import Any, Callable, Optional

RESULT = "SMMF-CHILD-RESULT "
STOP_GRACE_S = 3.0  # a stopped child's time to end on SIGTERM before it is killed
_PARENT = "SMMF_PARENT_PID"  # the pid a child started with own_session checks in die_with_parent


class Stopped(Exception):
    """No child starts, and those running were ended: :func:`stop_children` was called."""


class _Children:
    """The children running now, so that a stop can end them all; none starts once stopping."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.running: set[subprocess.Popen] = set()
        self.stopping = False
        self.main_starting = False  # the main thread is between starting a child and knowing it
        self.held: Optional[Callable[[], None]] = None  # an interrupt held until then (hold_interrupt)


_children = _Children()


def hold_interrupt(interrupt: Callable[[], None]) -> bool:
    """For a signal handler on the main thread: while that thread starts a child (the child exists before
    :func:`run_child` knows it, and an exception then would leave it running), keep ``interrupt`` (it raises)
    for when the child is known, and return True; else return False, and the handler raises at once."""
    if _children.main_starting:
        _children.held = interrupt
        return True
    return False


def stop_children() -> None:
    """End every child (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and start no new one: what a stopped
    study does before it writes what it finished. :func:`allow_children` undoes it."""
    with _children.lock:
        _children.stopping = True
        running = list(_children.running)
    for process in running:
        _end(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end(process, signal.SIGKILL)
            process.wait()


def allow_children() -> None:
    with _children.lock:
        _children.stopping = False


def _end(process: subprocess.Popen, signum: int) -> None:
    """Signal a child's whole process group (it leads one of its own: its workers go too), unless it has been
    reaped: its pid may then be another process's."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent() -> None:
    """In a child started with ``own_session``: end when the parent does, however it ends (SIGKILL too), as a
    child in the parent's process group would with a signal to the group. Linux (``PR_SET_PDEATHSIG``); elsewhere
    nothing."""
    parent = os.environ.get(_PARENT)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent ended before the request was made
        os._exit(128 + int(signal.SIGTERM))


def run_child(module: str, args: list[str], what: str, mmap_threshold: Optional[int] = None,
              show_stderr: bool = False, threads: Optional[int] = None, own_session: bool = False) -> Any:
    """``python -m module *args`` in a fresh process; the result it gave :func:`report`.

    ``show_stderr`` lets the child's progress bars through; otherwise the last line of its stderr
    goes into the error raised when it fails. ``threads``: the CPU threads of torch (OpenMP) and numba
    in the child. ``own_session``: the child leads a session of its own, so that a Ctrl-C at the terminal
    reaches the parent alone, which ends its children itself (:func:`stop_children`) rather than each dying
    mid-write; the child should call :func:`die_with_parent`. Raises :class:`Stopped` when stopping."""
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    if own_session:
        env[_PARENT] = str(os.getpid())
    main = threading.current_thread() is threading.main_thread()
    with _children.lock:
        if _children.stopping:
            raise Stopped(f"{what} was not started: stopping")
        _children.main_starting = main
        try:
            process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                       stderr=None if show_stderr else subprocess.PIPE, text=True, env=env,
                                       start_new_session=own_session)
            _children.running.add(process)
        finally:
            _children.main_starting = False
    try:
        held, _children.held = (_children.held, None) if main else (None, None)
        if held is not None:
            held()  # the interrupt that arrived while the child started: it goes now, with the child
        stdout, stderr = process.communicate()
    except BaseException:  # an interrupt, a signal turned into an exception: the child goes with it
        _end(process, signal.SIGKILL)
        process.wait()
        raise
    finally:
        with _children.lock:
            _children.running.discard(process)
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if process.returncode == 0 and lines:  # a run that ended as the stop began is kept
        return json.loads(lines[-1][len(RESULT):])
    if _children.stopping:
        raise Stopped(f"{what} was stopped")
    tail = (stderr or "").strip().splitlines()[-1:]
    raise RuntimeError(f"{what} failed (exit status {process.returncode}){': ' + tail[0] if tail else ''}")


def report(result: Any) -> None:
    """The child's side: hand ``result`` (JSON-serializable) back to :func:`run_child`."""
    print(RESULT + json.dumps(result), flush=True)
