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


def test_long_curves_keep_an_earlier_training_only_when_asked():
    """A run retrained into the same directory: its earlier rows (no checkpoint clock of the new training matches)
    are dropped, or kept renamed with --earlier-suffix; rows of other runs and of the new training's checkpoints
    that were already measured stay as they are; rows of other prompts go."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.training.long_curves import kept_rows

    described = "held x 16 first turns, 64 new tokens"
    old = {"run": "runs/d", "step": 250, "cpu_hours": 0.17, "heldout_prompts": described}
    again = {"run": "runs/d", "step": 250, "cpu_hours": 0.5, "heldout_prompts": described}
    other = {"run": "runs/e", "step": 250, "cpu_hours": 0.4, "heldout_prompts": described}
    elsewhere = {**other, "heldout_prompts": "mt_bench x 8 first turns, 64 new tokens"}
    found = {"runs/d": [(250, "runs/d/checkpoints/step_250", 900.0)]}  # 900 s x 2 threads = 0.5 CPU-hours
    previous = [old, again, other, elsewhere]
    assert kept_rows(previous, found, described, 2, None) == [other]
    assert kept_rows(previous, found, described, 2, "_v1") == [other, {**old, "run": "runs/d_v1"}]


def test_a_served_export_enters_a_long_row_only_as_its_drafter_or_a_retraining_of_it():
    """The README long table's vLLM/ours cells: the row's own checkpoint, or one provenance.json records as a
    retraining of it; an earlier recipe version's export (another data set) or another kind's stays out."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.summary_data import provenance
    from benchmarks.summary_tables import measures_row

    trained = provenance()["trained"]
    retrainings = {name: t["retrains"] for name, t in trained.items() if "retrains" in t}
    assert retrainings, "provenance.json records no retraining"
    for name, original in retrainings.items():
        assert measures_row(name, original) and measures_row(original, original)
        assert trained[name]["recipe"] == trained[original]["recipe"] and trained[name]["data"] == trained[original]["data"]
        assert not measures_row(name, next(other for other in trained if other not in (name, original)))
    assert not measures_row("eagle3_long_v1", "eagle3_long")  # the earlier recipe version (3,000 conversations)
