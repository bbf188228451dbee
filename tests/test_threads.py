"""Steps of different optimizers in different Python threads."""

from __future__ import annotations

import pytest

from helpers import CPU_FUSED_BACKENDS, run_script


# Two threads under numba's workqueue threading layer.

TWO_THREADS = """
import threading, torch
from smmf import SMMF
def train():
    p = torch.nn.Parameter(torch.randn(512, 512))
    opt = SMMF([p], backend="numba")
    for _ in range(40):
        p.grad = torch.randn(512, 512)
        opt.step()
threads = [threading.Thread(target=train) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
import numba
print("OK", numba.threading_layer())
"""


@pytest.mark.skipif(not CPU_FUSED_BACKENDS, reason="needs numba")
def test_two_threads_stepping_under_the_workqueue_layer() -> None:
    out = run_script(TWO_THREADS, env={"NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK workqueue" in out.stdout
