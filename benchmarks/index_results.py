"""Write results/README.md: every run folder, by study, with the page that shows it and the command, commit and
machine its own report names.

    python benchmarks/index_results.py
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
HEADER_KEYS = {"Command": "command", "Runs": "command", "Code": "commit", "Code of the runs": "commit",
               "Machine": "machine"}


def run_folders() -> list[Path]:
    """results/<study>/<run>/: each folder two levels down."""
    return sorted(run for study in RESULTS.iterdir() if study.is_dir() for run in study.iterdir() if run.is_dir())


def header(run: Path) -> dict[str, str]:
    """The command, commit and machine lines of a run's own report (smmf compare's and the study tools' results.md
    start with them); empty where it has none."""
    report = run / "results.md"
    found: dict[str, str] = {}
    if report.exists():
        for line in report.read_text().splitlines()[:6]:
            key, _, value = line.partition(": ")
            if key in HEADER_KEYS and value:
                found.setdefault(HEADER_KEYS[key], value.strip().rstrip("\\").strip())
    return found


def pages_showing(run: Path) -> list[str]:
    rel = run.relative_to(ROOT).as_posix()
    return [page.name for page in sorted((ROOT / "docs").glob("*.md")) if rel in page.read_text()]


def index() -> str:
    lines = ["# Run data", "",
             "Every folder here is the output of one command: a study's run folders, by study. The pages in "
             "[docs/](../docs/) read them; each row names the page that shows the run, and the command, commit and "
             "machine the run's own report names (a folder without a report of its own: see its page). Regenerate "
             "with `python benchmarks/index_results.py`.", ""]
    study = None
    for run in run_folders():
        if run.parent.name != study:
            study = run.parent.name
            lines += [f"## {study}", "", "| run | page | command | commit | machine |", "|---|---|---|---|---|"]
        found = header(run)
        pages = ", ".join(f"[{p}](../docs/{p})" for p in pages_showing(run)) or "—"
        cells = [f"[{run.name}]({run.relative_to(RESULTS).as_posix()}/)", pages,
                 *(re.sub(r"\s+", " ", found.get(key, "—")).replace("|", "\\|") for key in ("command", "commit", "machine"))]
        lines.append("| " + " | ".join(cells) + " |")
        if run == run_folders()[-1] or run_folders()[run_folders().index(run) + 1].parent.name != study:
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    (RESULTS / "README.md").write_text(index())
    print(f"wrote {RESULTS / 'README.md'}: {len(run_folders())} run folders")
