"""A recipe is copied and changed: every recipe, copied with the files beside it that carry its name
(``detr_model.py`` beside ``detr.py``) into an empty folder outside the repository and renamed, runs its
demo with only ``common/`` installed: no PYTHONPATH to the repository, no ``recipes`` package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

RECIPES = ["classifier", "dino", "yolo", "detr", "faster_rcnn"]
# the slow extras of three demos: YOLO's export, DETR's backbone pre-training, DINO's full-size kNN banks
QUICK = {
    "yolo": ["--export", "false"],
    "detr": ["--pretrain_crops_epochs", "0"],
    "dino": ["--knn_train_limit", "200", "--knn_pixel_limit", "0"],
}


def copy_recipe(name: str, folder: Path) -> Path:
    """``recipes/<name>.py`` as ``folder/my_<name>.py`` and its own files (``<name>_*.py``) beside it."""
    folder.mkdir()
    for helper in (ROOT / "recipes").glob(f"{name}_*.py"):
        shutil.copy(helper, folder / helper.name)
    shutil.copy(ROOT / "recipes" / f"{name}.py", folder / f"my_{name}.py")
    return folder / f"my_{name}.py"


def installed_common(site: Path) -> dict[str, str]:
    """An environment where ``common`` is importable as after ``pip install -e <checkout>``, and nothing
    else of the repository is."""
    shutil.copytree(ROOT / "common", site / "common", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=str(site), PYTHONUNBUFFERED="1")


# the classifier in the default suite; the other four in the second tier (-m configs), beside their vendored runs
@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n if n == "classifier" else pytest.param(n, marks=pytest.mark.configs) for n in RECIPES]
)
def test_a_copied_recipe_runs_outside_the_repository(name, tmp_path):
    script = copy_recipe(name, tmp_path / "work")
    args = ["--max_steps", "2", "--epochs", "1", "--num_workers", "0", "--report_to", "none", *QUICK.get(name, [])]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=script.parent,
        env=installed_common(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # a copy under another name is its own recipe: its runs/<name>/, and its name where the run folder is said
    assert f"my_{name}: runs/my_{name}/default" in done.stdout.splitlines()
    assert (script.parent / "runs" / f"my_{name}" / "default" / "metrics.jsonl").is_file()


def test_without_common_a_copied_recipe_says_how_to_install_it(tmp_path):
    script = copy_recipe("classifier", tmp_path / "work")
    copied = sorted(script.parent.iterdir())  # the recipe and its own files
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site-packages, so no installed common/ either; the check comes before any third-party import
    missing = subprocess.run(
        [sys.executable, "-S", str(script)], cwd=script.parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "error: this recipe needs the package common/: run `pip install -e <cv-recipes checkout>` once"
    ]
    assert sorted(script.parent.iterdir()) == copied  # nothing written


@pytest.mark.parametrize("name", ["detr", "yolo", "dino", "faster_rcnn"])
def test_a_recipe_copied_without_its_own_files_says_which(name, tmp_path):
    """Copied alone, without the files that carry its name: one line naming the first missing one, exit 2."""
    (tmp_path / "work").mkdir()
    script = tmp_path / "work" / f"my_{name}.py"
    shutil.copy(ROOT / "recipes" / f"{name}.py", script)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, env=installed_common(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: this recipe needs {name}_") and f"copy recipes/{name}_*.py with it" in line


def test_the_installed_package_is_common_alone():
    """``pip install -e .`` ships common/ and nothing else: a recipe's own files travel with the recipe."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["common", "common.*"]
