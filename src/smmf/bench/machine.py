"""What every report names: the CPU model (or the GPU) a figure was measured on."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s, else the platform's), e.g. "AMD EPYC 7B13"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or f"{platform.machine()} CPU"


def describe(device: str | torch.device = "cpu") -> str:
    """The machine of a measurement on ``device``: the GPU's name, or the CPU's model, its cores and torch's
    threads; with torch's version."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
