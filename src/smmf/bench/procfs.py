"""Resident-memory readings from /proc (Linux); None where /proc is not there."""

from __future__ import annotations

from typing import Optional


def status_kib(field: str) -> Optional[int]:
    """A ``VmRSS``/``VmHWM``-style field of /proc/self/status, in KiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the resident high-water mark (VmHWM) to the current resident size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
