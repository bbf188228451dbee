"""Commits checked out side by side, for the benchmarks that compare two of them."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checked_out(commits: list[str], into: Path) -> Iterator[dict[str, Path]]:
    """Each commit in a detached worktree under ``into`` (by name), removed on exit."""
    trees: dict[str, Path] = {}
    try:
        for name in commits:
            tree = into / name.replace("/", "_").replace("^", "_parent").replace("~", "_back")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), name], check=True)
            trees[name] = tree
        yield trees
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
