"""``python -m common.vendor RECIPE DEST``: a recipe copied out with every line of code it runs, so that the copy
is its owner's: editing or deleting the checkout changes nothing in it.

``RECIPE`` is a recipe's name (``dino``) or the path of a recipe script (``recipes/dino.py``, or a renamed copy
beside it). ``DEST`` (new, or an empty folder) receives:

- the script and the files beside it that it imports, followed from import to import (``classifier.py``
  imports ``classifier_inference``, which imports ``classifier_model``);
- ``common/``: the modules those files import, followed the same way (imports inside functions included), with
  the ``__init__.py`` of every package on the way and any other file kept in those packages' folders;
- ``configs/``: the recipe's ready runs (``configs/<recipe>/*.yaml``), and ``requirements.txt``;
- ``common/VENDORED.json`` (:data:`common.origin.RECORD`): the checkout's git commit, whether the copied
  files differed from it, the date, and the sha256 of every file written; each run's ``config.yaml`` names it.

Imports are read with :mod:`ast`, not executed: nothing of the recipe runs. A module named by a string
(``importlib.import_module``) would not be found; ``common/`` has none, and the tests run every vendored
recipe with the checkout out of reach.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import shlex
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import UserError
from common.origin import HERE, RECORD, content_hash, git_state

#: The checkout this ``common/`` lies in: its ``recipes/``, ``configs/`` and ``requirements.txt`` are copied.
CHECKOUT = HERE.parent
# Every recipe script declares its config so (the sibling files do not): how a script is told from a sibling.
_RECIPE_MARK = "class Config(RunConfig)"


@dataclass
class Plan:
    """What :func:`vendor` copies: destination path (relative to ``DEST``) -> source file."""

    recipe: str  # the script's name without .py: its runs go to runs/<recipe>/
    files: dict[str, Path] = field(default_factory=dict)

    def count(self, prefix: str) -> int:
        return sum(name.startswith(prefix) for name in self.files)


def recipe_names(folder: Path = CHECKOUT / "recipes") -> list[str]:
    """The recipe scripts in ``folder``, by name."""
    return sorted(p.stem for p in folder.glob("*.py") if _RECIPE_MARK in p.read_text(errors="replace"))


def find_recipe(recipe: str) -> Path:
    """The script ``recipe`` names: a path (it ends in ``.py`` or holds a ``/``) or a name in ``recipes/``."""
    if recipe.endswith(".py") or "/" in recipe:
        script = Path(recipe).resolve()
        if not script.is_file():
            raise UserError(f"no recipe script '{recipe}'")
        if _RECIPE_MARK not in script.read_text(errors="replace"):
            raise UserError(f"'{recipe}' is not a recipe script: it declares no {_RECIPE_MARK}")
        return script
    names = recipe_names()
    if not names:  # common/ installed as a package, away from a checkout's recipes/
        raise UserError(f"no recipes/ beside {HERE}: give a recipe script's path, or run this in a checkout")
    if recipe not in names:
        raise UserError(f"unknown recipe '{recipe}': the recipes are {', '.join(names)} (or give a script's path)")
    return CHECKOUT / "recipes" / f"{recipe}.py"


def imported(path: Path, package: str = "") -> set[str]:
    """Every module an import statement anywhere in ``path`` names, absolute: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule: the caller keeps what exists);
    relative imports are resolved against ``package``, the dotted package the file belongs to."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def module_file(module: str, root: Path) -> Path | None:
    """The file of dotted ``module`` under ``root`` (``a.b`` -> ``root/a/b.py`` or ``root/a/b/__init__.py``)."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def siblings(script: Path) -> list[Path]:
    """The files beside ``script`` that it imports, directly or through one another."""
    folder, seen, todo = script.parent, set(), [script]
    while todo:
        for module in imported(todo.pop()):
            top = module.partition(".")[0]
            path = folder / f"{top}.py"
            if top not in seen and path.is_file() and path != script:
                seen.add(top)
                todo.append(path)
    return sorted(folder / f"{name}.py" for name in seen)


def common_modules(files: Iterable[Path], package: Path = HERE) -> list[Path]:
    """The files of ``package`` (``common/``) that ``files`` import, directly or through one another, with the
    ``__init__.py`` of each package on the way (Python runs it before the module)."""
    name, root = package.name, package.parent
    todo, seen = [(f, "") for f in files], set()
    while todo:
        path, own = todo.pop()
        for module in imported(path, own):
            if module != name and not module.startswith(name + "."):
                continue
            parts = module.split(".")
            for depth in range(1, len(parts) + 1):  # a.b.c: a, a.b, a.b.c; each an __init__.py or a module
                found = module_file(".".join(parts[:depth]), root)
                if found is not None and found not in seen:
                    seen.add(found)
                    dotted = ".".join(parts[:depth])
                    todo.append((found, dotted if found.name == "__init__.py" else dotted.rpartition(".")[0]))
    return sorted(seen)


def data_files(modules: Iterable[Path], package: Path = HERE) -> list[Path]:
    """Files other than Python beside the modules (in the folders of the packages they belong to), which a
    module may read at run time; subfolders are packages of their own and are taken only when imported."""
    folders = {m.parent for m in modules}
    return sorted(
        p
        for folder in folders
        for p in folder.iterdir()
        if p.is_file() and p.suffix not in (".py", ".pyc") and p.name != RECORD
    )


def plan(recipe: str) -> Plan:
    """Every file a vendored ``recipe`` needs, and where in ``DEST`` it goes."""
    script = find_recipe(recipe)
    own = [script, *siblings(script)]
    modules = common_modules(own)
    out = Plan(script.stem, {p.name: p for p in own})
    for path in [*modules, *data_files(modules)]:
        out.files[f"common/{path.relative_to(HERE).as_posix()}"] = path
    configs = _configs_of(script, own)
    out.files.update({f"configs/{p.name}": p for p in configs})
    if (CHECKOUT / "requirements.txt").is_file():
        out.files["requirements.txt"] = CHECKOUT / "requirements.txt"
    return out


def _configs_of(script: Path, own: Sequence[Path]) -> list[Path]:
    """``configs/<recipe>/*.yaml`` of the checkout; for a renamed copy (``my_dino.py``) without configs of its
    own, those of the recipe whose sibling files it imports (``dino_*.py``: ``configs/dino/``)."""
    names = [script.stem] + sorted({n for n in recipe_names() if any(p.stem.startswith(n + "_") for p in own)})
    for name in names:
        found = sorted((CHECKOUT / "configs" / name).glob("*.yaml"))
        if found:
            return found
    return []


def check_destination(dest: Path) -> None:
    """Refuse a ``dest`` that is a file, or a folder that holds anything."""
    if dest.is_file() or (dest.is_dir() and any(dest.iterdir())):
        raise UserError(f"'{dest}' exists and is not empty: name a new or empty folder")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vendor(recipe: str, dest: Path) -> Plan:
    """Copy ``recipe``'s :func:`plan` into ``dest`` (refused unless new or empty) with its record."""
    check_destination(dest)
    todo = plan(recipe)
    sources = [p for p in todo.files.values() if p.is_relative_to(CHECKOUT)]
    commit, changed = git_state(CHECKOUT, [p.relative_to(CHECKOUT).as_posix() for p in sources])
    for name, source in todo.files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / name)
    record = {
        "recipe": todo.recipe,
        "source": str(CHECKOUT),
        "commit": commit,
        "short": commit[:12] if commit != "unknown" else "unknown",
        "local_changes": "unknown" if changed is None else changed,  # of the copied files, against that commit
        "date": datetime.date.today().isoformat(),
        "common_sha256": content_hash(dest / "common"),  # common.origin says "edited since" when it differs
        "files": {name: _sha256(dest / name) for name in sorted(todo.files)},
    }
    (dest / "common" / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return todo


def smoke_command(dest: Path, recipe: str) -> str:
    """The one command that checks a vendored copy: two steps of its built-in demo, nothing exported or sent."""
    return f"cd {shlex.quote(str(dest))} && python {recipe}.py --max_steps 2 --report_to none"


def summary(dest: Path, done: Plan) -> str:
    """What :func:`vendor` wrote, in counts."""
    beside = len(done.files) - done.count("common/") - done.count("configs/") - done.count("requirements.txt") - 1
    extra = ", requirements.txt" if "requirements.txt" in done.files else ""
    return (
        f"wrote {dest}: {done.recipe}.py and {beside} files beside it, {done.count('common/')} files of common/ "
        f"with its record common/{RECORD}, {done.count('configs/')} configs in configs/{extra}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``RECIPE DEST``; a refusal is one ``error:`` line, exit status 2, nothing written."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(f"usage: python -m common.vendor RECIPE DEST\n\n{__doc__}")
        return
    try:
        if len(args) != 2:
            raise UserError("usage: python -m common.vendor RECIPE DEST (a recipe's name or script, a new folder)")
        dest = Path(args[1])
        done = vendor(args[0], dest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(summary(dest, done))
    print(f"smoke test: {smoke_command(dest, done.recipe)}")


if __name__ == "__main__":
    main()
