"""Measurements that need a process of their own: a module's child mode, run fresh, and its result.

Peak memory is only a run's own in a new process: whatever an earlier run freed would otherwise be
there for the allocator to reuse. glibc can also be told to serve large blocks by mmap from the
start (``MALLOC_MMAP_THRESHOLD_``), so that freed memory leaves the process and the resident
high-water mark follows live memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional

RESULT = "SMMF-CHILD-RESULT "


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
    out = subprocess.run([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                         stderr=None if show_stderr else subprocess.PIPE, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or "").strip().splitlines()[-1:]
        raise RuntimeError(f"{what} failed (exit status {out.returncode}){': ' + tail[0] if tail else ''}")
    return json.loads(lines[-1][len(RESULT):])


def report(result: Any) -> None:
    """The child's side: hand ``result`` (JSON-serializable) back to :func:`run_child`."""
    print(RESULT + json.dumps(result), flush=True)
