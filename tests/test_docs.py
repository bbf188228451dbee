"""The front door stays readable: the release notes' unreleased section is short, one line per change."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _unreleased() -> list[str]:
    text = (ROOT / "CHANGELOG.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    return next(s for s in sections if "(unreleased)" in s.splitlines()[0]).splitlines()


def test_the_unreleased_notes_are_at_most_60_lines_grouped_once_one_line_per_change() -> None:
    lines = _unreleased()
    assert len(lines) <= 60, len(lines)
    groups = [line for line in lines if line.startswith("### ")]
    assert len(groups) == len(set(groups)) and set(groups) <= {"### Added", "### Changed", "### Fixed"}, groups
    assert not [line for line in lines if line.startswith("  ")], "a change takes one line"
