"""The folders import one way, as docs/ARCHITECTURE.md draws them: benchmarks -> train -> inference -> drafters.

Every `import` / `from` statement of the library is read from the source (module level and inside functions alike), so
a lazy import that runs back up is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ["drafters", "inference", "train", "benchmarks"]  # each may import only the floors before it


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a Python file imports (absolute imports; the project uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(FLOORS)


def test_the_scan_sees_imports_at_module_level_and_inside_functions(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import torch\nfrom drafters.base import Drafter\n\ndef f():\n    import train.cli\n")
    assert imported_packages(source) == {"drafters", "train"}


@pytest.mark.parametrize("floor", FLOORS)
def test_no_import_runs_back_up(floor):
    allowed = set(FLOORS[: FLOORS.index(floor) + 1])
    upward = {f"{path.relative_to(ROOT)}: {sorted(imported_packages(path) - allowed)}"
              for path in sorted((ROOT / floor).rglob("*.py")) if imported_packages(path) - allowed}
    assert not upward, f"{floor}/ imports a floor above it: {sorted(upward)}"
