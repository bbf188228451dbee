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


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc: serve allocations of at least ``nbytes`` by mmap, so that freeing them returns them to
    the OS and the resident size follows live memory (heap reuse otherwise makes peaks swing by
    hundreds of MiB). False where glibc is not there."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False
