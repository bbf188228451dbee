"""Command-line errors: one line on stderr, exit status 2, before any work is done."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` that reports a bad argument in one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


def comma_list(prog: str, flag: str, text: str, known: list[str]) -> list[str]:
    """The names of a comma-separated argument, each one of ``known``, at least one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        fail(prog, f"{flag} names nothing; choose from {known}")
    for name in names:
        if name not in known:
            fail(prog, f"{flag}: unknown {name!r}; choose from {known}")
    return names


def writable_dir(prog: str, flag: str, path: str) -> Path:
    """Create ``path`` if needed and check that a file can be written in it."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        fail(prog, f"{flag} {path}: cannot write there ({err.strerror or err})")
    return out


def cuda_or_fail(prog: str, device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        fail(prog, "--device cuda needs a CUDA device, and none is available")
