"""The folders import one way, as docs/ARCHITECTURE.md draws them: benchmarks -> train -> inference -> drafters.

Every `import` / `from` statement of the library is read from the source (module level and inside functions alike), so
a lazy import that runs back up is caught too.
"""

from __future__ import annotations

import ast
import sys
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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (module level and inside functions); `from a.b import c` names the
    module a.b.c when c is one, else a.b (an import of a package's __init__ counts as that package)."""
    modules = {module_name(path): path for path in paths}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else resolve(node.module)
                             for a in node.names)
        graph[name] = found - {None, name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_sees_a_circle_through_a_function_local_import(tmp_path, monkeypatch):
    package = tmp_path / "train"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from train.b import f\n")
    (package / "b.py").write_text("def f():\n    from train import c\n")
    (package / "c.py").write_text("import train.a\n")
    (package / "d.py").write_text("from train.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert circles(import_graph(sorted(package.rglob("*.py")))) == [["train.a", "train.b", "train.c"]]


def test_no_import_circle_anywhere():
    paths = [path for floor in FLOORS for path in sorted((ROOT / floor).rglob("*.py"))]
    assert circles(import_graph(paths)) == []


def map_tree() -> list[str]:
    """The paths docs/ARCHITECTURE.md's folder tree names: its first fenced block, two spaces per level, each line's
    leading names (up to a double space before a description) under the folders above it."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```\n", 2)[1]
    paths, folders = [], []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        folders = folders[:depth]
        names = []
        for word in line.split():
            if not (word.endswith("/") or word.endswith(".py")):
                break
            names.append(word)
        for name in names:
            if not name.startswith("<"):
                paths.append("/".join(folders + [name]))
        if len(names) == 1 and names[0].endswith("/"):
            folders = folders + [names[0].rstrip("/")]
    return paths


def test_every_file_the_map_names_exists():
    paths = map_tree()
    assert len(paths) > 60 and "inference/engine/tree/" in paths and "train/feature_source.py" in paths
    assert [path for path in paths if not (ROOT / path).exists()] == []


# train/ by stage, the way a batch travels: each floor may import only the floors before it (and itself); the
# commands and the composition root (build.py, feature_source.py, prepare.py, ...) sit on top of them all
TRAIN_FLOORS = [("train.data",), ("train.config", "train.recipe_checks"), ("train.features",), ("train.fit",)]


def train_floor(module: str) -> int:
    for index, prefixes in enumerate(TRAIN_FLOORS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    return len(TRAIN_FLOORS)


def test_train_stages_import_one_way():
    graph = import_graph(sorted((ROOT / "train").rglob("*.py")))
    upward = sorted(f"{module} -> {other}" for module, imports in graph.items() for other in imports
                    if other.startswith("train.") and train_floor(other) > train_floor(module))
    assert upward == []
    assert train_floor("train.data.dataset") == 0 and train_floor("train.fit.loop") == 3
    assert train_floor("train.build") == len(TRAIN_FLOORS)


# the target's backends plug in at one seam (inference/engine/backend.py): a backend's own modules are imported from
# inside its folder, and elsewhere in the library only through the folder's face (its __init__); benchmarks and
# tests may reach inside, as they time and check the kernels themselves
BACKENDS = ["inference.engine.cpu"]


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_a_backend_is_imported_only_through_its_face():
    paths = [path for floor in ("drafters", "inference", "train") for path in sorted((ROOT / floor).rglob("*.py"))]
    graph = import_graph(paths)
    reached = sorted(f"{module} -> {other}" for module, imports in graph.items() for other in imports
                     for backend in BACKENDS if other.startswith(backend + ".") and not inside(module, backend))
    assert reached == []
    assert "inference.engine.cpu" in graph["inference.evaluation.eval"]  # the rule sees the face's users


# What the engine's pieces may not import: the loop does not know the tree strategy (the facades in api.py do), the
# cost profile the policies read does not run the loop (evaluation/profile.py measures it), the accept rules and the
# policies import no model code, and nothing in the library imports the benchmarks' helpers.
ENGINE_MAY_NOT = {
    "inference.engine.generate": ("inference.engine.tree", "inference.engine.api"),
    "inference.engine.costs": ("inference.engine.generate", "inference.engine.api", "inference.engine.rounds",
                               "inference.engine.run", "inference.engine.target"),
    "inference.engine.adaptive": ("inference.engine.generate", "inference.engine.api", "inference.engine.target"),
    "inference.engine.verify": ("inference.engine", "drafters"),
}


def test_the_engine_loop_and_its_policies_stay_below_what_uses_them():
    paths = [path for floor in ("drafters", "inference") for path in sorted((ROOT / floor).rglob("*.py"))]
    graph = import_graph(paths)
    reached = sorted(f"{module} -> {other}" for module, banned in ENGINE_MAY_NOT.items()
                     for other in graph[module] for package in banned if inside(other, package))
    assert reached == []
    assert "inference.engine.tree.rounds" in graph["inference.engine.api"]  # the rule sees the facades' imports
    library = [path for floor in ("drafters", "inference", "train") for path in sorted((ROOT / floor).rglob("*.py"))]
    assert not [path for path in library if "benchmarks" in imported_packages(path)]


# A function-local import of a project module hides a dependency from the import graph; with no circle left, none is
# needed except where it buys something named here (docs/ARCHITECTURE.md, "Folders and imports"). Optional
# dependencies (vllm, torch.distributed, ...) are not project modules: they stay lazy without an entry.
LAZY_ALLOWED: dict[str, str] = {}  # file -> why its function-local project imports stay (none needed today)


def function_local_project_imports(path: Path) -> list[int]:
    """Lines of imports of project modules made inside a function of `path`."""
    lines = []
    for function in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                if any(name.split(".")[0] in FLOORS for name in names):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_the_lazy_import_scan_sees_an_import_inside_a_method(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import torch\n\nclass A:\n    def f(self):\n        import torch.nn\n"
                      "        from inference.engine import target\n")
    assert function_local_project_imports(source) == [6]


def test_no_function_local_import_of_a_project_module_without_a_reason():
    found = {}
    for floor in ("drafters", "inference", "train"):
        for path in sorted((ROOT / floor).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            lines = function_local_project_imports(path)
            if lines and name not in LAZY_ALLOWED:
                found[name] = lines
    assert found == {}, "import these at module level (no circle needs them), or say why in LAZY_ALLOWED"
