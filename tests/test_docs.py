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


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "results").rglob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_every_relative_link_of_the_pages_resolves() -> None:
    broken = []
    for page in _pages():
        for target in _LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.partition("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_docs_holds_pages_and_results_holds_the_run_data() -> None:
    assert sorted({p.suffix for p in (ROOT / "docs").rglob("*") if p.is_file()}) == [".md"]
    assert not [p for p in (ROOT / "docs").iterdir() if p.is_dir()]


def test_results_readme_indexes_every_run_folder() -> None:
    index = (ROOT / "results" / "README.md").read_text()
    runs = [run for study in (ROOT / "results").iterdir() if study.is_dir() for run in study.iterdir() if run.is_dir()]
    assert runs
    missing = [run.relative_to(ROOT / "results").as_posix() for run in runs
               if f"]({run.relative_to(ROOT / 'results').as_posix()}/)" not in index]
    assert not missing, f"not in results/README.md (python benchmarks/index_results.py): {missing}"


def test_benchmarks_readme_names_every_script() -> None:
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert not [name for name in scripts if f"`{name}`" not in readme and name not in readme]


def test_the_readme_is_at_most_150_lines_without_commit_hashes() -> None:
    """The front door: what SMMF is, install, the two quick-start commands, the API and one table at a glance;
    the figures' commands, commits and machines are on the pages it links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert not re.findall(r"(?<![0-9a-z])[0-9a-f]{7,40}(?![0-9a-z])", readme.replace("arXiv:2412.08894", ""))
    for section in ("## Install", "## Quick start", "## Usage", "## At a glance", "## Where SMMF loses"):
        assert section in readme, section
    assert "python -m pytest -q -n 2 --dist worksteal" in readme and "smmf compare --out runs/compare" in readme


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_link_to_a_heading_of_a_page_finds_it() -> None:
    broken = []
    for page in _pages():
        for target in _LINK.findall(page.read_text()):
            path, _, anchor = target.partition("#")
            if not anchor or re.match(r"^[a-z]+:", target) or not (path == "" or path.endswith(".md")):
                continue
            linked = page if path == "" else page.parent / path
            if linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
