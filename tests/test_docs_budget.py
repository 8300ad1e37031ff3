"""The docs stay bounded and self-contained: docs/benchmarks.md and docs/results/ within their budgets, every archived
study pointing at what replaced it, and no page citing a file outside the repository, a machine's own paths or
working notes a reader cannot see (docs/benchmarks.md, "Result files and the archive")."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
MAX_BENCHMARK_LINES = 1200
MAX_RESULTS_BYTES = 5_000_000
MAX_RESULT_FILE_BYTES = 250_000

PAGES = sorted([ROOT / "README.md", ROOT / "recipes" / "README.md", *(ROOT / "docs").glob("*.md")])
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
WRITTEN_BY_COMMANDS = {"summary.md"}  # files a command writes into its output folder (benchmarks/gpu_check.sh)
SKIPPED = {".git", ".venv", "runs", "node_modules", "__pycache__"}  # not the repository's pages
MACHINE_PATH = re.compile(r"(?<![\w$.])/(?:work|home|root|Users|mnt)/")
WORKING_NOTES = re.compile(r"the lead's|\b(?:this|previous|the) session\b|\bin progress\b|numbers to read|"
                           r"not (?:built|trained) yet|\bthe issue\b|issue's", re.I)


def repository_pages() -> set[str]:
    names = set(WRITTEN_BY_COMMANDS)
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        names.update(f for f in files if f.endswith(".md"))
    return names


KNOWN = repository_pages()


def prose(path: Path) -> str:
    """What a reader reads: a page whole, a recipe's comments only."""
    if path.suffix == ".md":
        return path.read_text()
    return "\n".join(line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line)


def test_benchmarks_page_and_results_fit_their_budgets():
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARK_LINES, (f"docs/benchmarks.md has {lines} lines, the budget is {MAX_BENCHMARK_LINES}: "
                                          "move a replaced study to docs/benchmarks_archive.md")
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    big = {p.name: p.stat().st_size for p in files if p.stat().st_size > MAX_RESULT_FILE_BYTES}
    assert not big, f"docs/results files over {MAX_RESULT_FILE_BYTES} bytes (gzip -9n them, NAME.json.gz): {big}"
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_RESULTS_BYTES, f"docs/results holds {total} bytes, the budget is {MAX_RESULTS_BYTES}"


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_archived_study_opens_with_what_replaced_it():
    """The archive's rule: each "## " section starts with "Replaced by" and links a heading of docs/benchmarks.md."""
    bench = re.sub(r"```.*?```", "", (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.S)
    anchors = {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", bench, flags=re.M)}
    archive = (ROOT / "docs" / "benchmarks_archive.md").read_text()
    sections = re.split(r"^## ", archive, flags=re.M)[1:]
    assert sections, "docs/benchmarks_archive.md has no section"
    wrong = []
    for section in sections:
        title, _, body = section.partition("\n")
        opening = body.strip().split("\n\n")[0]
        targets = re.findall(r"\]\(benchmarks\.md#([^)\s]+)\)", opening)
        if not opening.startswith("Replaced by") or not any(t in anchors for t in targets):
            wrong.append(title)
    assert not wrong, f"archive sections without a 'Replaced by' link to docs/benchmarks.md: {wrong}"


def test_a_link_into_results_names_a_file_that_is_there():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]*results/[^)#\s]+)\)", page.read_text()):
            if not (page.parent / target).resolve().is_file():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, f"links to result files that do not exist: {missing}"


@pytest.mark.parametrize("path", PAGES + RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_outside_file_machine_path_or_working_note(path):
    """A page (or a recipe's comments) cites only files the repository holds, names no machine's own directories and
    no working notes: what a reader cannot open, reach or know is restated in our words or dropped."""
    text = prose(path)
    outside = sorted({name for name in re.findall(r"[\w./-]+\.md\b", text)
                      if not (path.parent / name).exists() and not (ROOT / name).exists()
                      and ("/" in name or name not in KNOWN)})
    assert not outside, f"{path.relative_to(ROOT)} cites files outside the repository: {outside}"
    assert not MACHINE_PATH.search(text), f"{path.relative_to(ROOT)}: a machine path: {MACHINE_PATH.search(text)[0]!r}"
    note = WORKING_NOTES.search(text)
    assert not note, f"{path.relative_to(ROOT)}: a working note a reader cannot see: {note[0]!r}"
