"""The layout of common/ (DESIGN.md, "Layout"): layers without an import cycle, function-level imports
included; the built-in data package a leaf; every file short enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

MAX_LINES = 400  # as ruff format writes them (120 columns, one argument a line when a call overflows)


def module_name(path: Path, root: Path) -> str:
    """``common/data/builtin/__init__.py`` -> ``common.data.builtin``; ``common/run.py`` -> ``common.run``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[str, list[str]]]:
    """Every import in a file, wherever it is (module level, in a function, under TYPE_CHECKING), as
    (absolute module, names imported from it); relative imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def graph(root: Path, package: str = "common") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports. ``from common import x`` names the submodule
    ``common.x`` where there is one, else ``common`` itself (its ``__init__``)."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    edges: dict[str, set[str]] = {}
    for f in files:
        targets = set()
        for base, names in imports(f, root):
            if base != package and not base.startswith(package + "."):
                continue
            submodules = {f"{base}.{n}" for n in names} & modules
            targets |= submodules
            if not names or len(submodules) < len(names):  # `import common.x`, or names defined in `base`
                targets.add(base)
        edges[module_name(f, root)] = targets - {module_name(f, root)}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none (depth-first search)."""
    state: dict[str, str] = {}  # module -> "open" (on the current path) or "done"
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def leaf_violations(root: Path) -> list[str]:
    """Imports in common/data/builtin of anything in common/ but its own modules and ``from common import
    UserError``."""
    wrong = []
    for f in sorted((root / "common" / "data" / "builtin").rglob("*.py")):
        for base, names in imports(f, root):
            if (
                base == "common"
                and names == ["UserError"]
                or base == "common.data.builtin"
                or base.startswith("common.data.builtin.")
            ):
                continue
            if base == "common" or base.startswith("common."):
                wrong.append(f"{f.relative_to(root)}: from {base} import {', '.join(names) or '*'}")
    return wrong


def long_files(root: Path) -> dict[str, int]:
    """Files in common/ over MAX_LINES lines -> their line counts."""
    return {
        str(f.relative_to(root)): n
        for f in sorted((root / "common").rglob("*.py"))
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }


def test_common_has_no_import_cycle():
    edges = graph(ROOT)
    assert "common.data.builtin" in edges["common.data.classification"]  # the graph is the real one
    cycle = find_cycle(edges)
    assert not cycle, "import cycle in common/: " + " -> ".join(cycle)


def test_builtin_is_a_leaf():
    wrong = leaf_violations(ROOT)
    assert not wrong, "common/data/builtin must import nothing from common/ but UserError:\n" + "\n".join(wrong)


def test_every_file_in_common_is_short():
    long = long_files(ROOT)
    assert not long, f"files in common/ over {MAX_LINES} lines: {long}"


# Each check above must be able to fail: here each finds a planted fault in a small fake tree.
def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_function_level_cycle_through_a_package_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "class UserError(Exception): ...\n",
            "common/a.py": "def f():\n    from common.sub import c\n",
            "common/sub/__init__.py": "",
            "common/sub/c.py": "from . import d\n",
            "common/sub/d.py": "from common import UserError, a\n",
        },
    )
    assert find_cycle(graph(root)) == ["common.a", "common.sub.c", "common.sub.d", "common.a"]
    (root / "common/sub/d.py").write_text("from common import UserError\n")  # the cycle removed
    assert graph(root)["common.sub.d"] == {"common"} and find_cycle(graph(root)) == []


@pytest.mark.parametrize(
    "line",
    [
        "import common.data.classification",
        "from common.data.classification import x",
        "from common.data import classification",
        "from ..classification import x",
        "from .. import classification",
    ],
)
def test_every_import_form_is_seen(tmp_path, line):
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/data/__init__.py": "",
            "common/data/classification.py": "",
            "common/data/builtin/__init__.py": "",
            "common/data/builtin/x.py": f"def f():\n    {line}\n",
        },
    )
    assert graph(root)["common.data.builtin.x"] == {"common.data.classification"}
    assert len(leaf_violations(root)) == 1  # common.data.classification is outside the leaf


def test_a_leaf_import_and_a_long_file_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/data/builtin/__init__.py": "from common import UserError\n",
            "common/data/builtin/x.py": "from .y import z\nfrom common.data.builtin import w\n",
            "common/data/builtin/y.py": "\n" * MAX_LINES,
        },
    )
    assert leaf_violations(root) == [] and long_files(root) == {}
    (root / "common/data/builtin/y.py").write_text("from common import UserError, schedules\n" + "\n" * MAX_LINES)
    assert leaf_violations(root) == ["common/data/builtin/y.py: from common import UserError, schedules"]
    assert long_files(root) == {"common/data/builtin/y.py": MAX_LINES + 1}


FOLDERS = ("common.data", "common.detection", "common.artifacts")  # what a reader of the loop core can skip


def core_reaches(root: Path) -> list[str]:
    """Imports, by a module at the top of common/ (the loop core), of anything in its folders."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph(root).items()
        if module.count(".") == 1
        for target in targets
        if target in FOLDERS or target.startswith(tuple(f + "." for f in FOLDERS))
    )


def test_the_core_imports_none_of_the_folders():
    """DESIGN.md, "What it is": the loop core at the top of common/, the data, detection and artifact helpers
    in folders below it that a reader can skip; the core imports none of them (the artifacts least of all)."""
    assert {m.split(".")[1] for m in graph(ROOT) if m.count(".") >= 2} >= {"data", "detection", "artifacts"}
    assert core_reaches(ROOT) == []


def test_a_core_import_of_a_folder_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/run.py": "def f():\n    from common.artifacts import figures\n",
            "common/artifacts/__init__.py": "",
            "common/artifacts/figures.py": "from common import run\n",
        },
    )
    assert core_reaches(root) == ["common.run imports common.artifacts.figures"]
