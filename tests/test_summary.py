"""The generated tables of docs/benchmarks.md and README.md equal what benchmarks/summarize.py computes from
docs/results/, and every in-page link of those pages and of the architecture docs lands on a heading."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_tables_equal_what_the_results_give():
    done = subprocess.run([sys.executable, "benchmarks/summarize.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_the_check_fails_when_a_table_drifts(tmp_path):
    """The check is not vacuous: a copy of the tree whose table lost one digit is reported, naming the file."""
    for part in ("benchmarks/summarize.py", "benchmarks/summary_data.py", "benchmarks/summary_tables.py", "README.md",
                 "docs/benchmarks.md"):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / part).write_text((ROOT / part).read_text())
    (tmp_path / "docs" / "results").symlink_to(ROOT / "docs" / "results")
    page = tmp_path / "docs" / "benchmarks.md"
    text = page.read_text()
    drifted = re.sub(r"tau 1\.(\d)(\d)", lambda m: f"tau 1.{m.group(1)}{(int(m.group(2)) + 1) % 10}", text, count=1)
    assert drifted != text
    page.write_text(drifted)
    done = subprocess.run([sys.executable, "benchmarks/summarize.py", "--check"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 1 and "docs/benchmarks.md" in done.stderr


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


PAGES = ["README.md", "docs/benchmarks.md", "docs/benchmarks_archive.md", "docs/ARCHITECTURE.md", "docs/decisions.md",
         "docs/commands.md", "docs/training.md", "docs/distributed.md", "docs/reliability.md", "docs/support.md",
         "docs/extending.md", "recipes/README.md"]


@pytest.mark.parametrize("page", PAGES)
def test_every_anchor_link_lands_on_a_heading(page):
    path = ROOT / page
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", path.read_text()):
        linked = (path.parent / target).resolve() if target else path
        if not linked.exists() or anchor not in anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page}: links to missing headings: {broken}"
