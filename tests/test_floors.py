"""The floors hold (-m floors, run by tests/floors.sh in an environment holding what uv's lowest-direct resolution of
requirements.txt picks, then again with torch raised to each export floor). Each test checks what holds for the
torch installed:

* at the training floor (requirements.txt's torch line) each recipe trains two steps on its built-in data and
  evaluates, and --predict runs from its safetensors weights; --export is refused in one line before the run
  folder exists where the recipe's export floor (``common.requirements.EXPORT_TORCH``) is newer, and where it is
  this torch the run exports and --predict runs through the ONNX file;
* at a newer export floor, --export of the weights trained at the training floor writes model.onnx and --predict
  runs through it.

Every run is a subprocess through the recipe's entry point, as users run it, whose dependency check runs."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
from importlib import metadata
from pathlib import Path

import pytest

from common import requirements
from conftest import ROOT, TINY_CLASSIFIER, TINY_RUNS, check, run_recipe, scene_files

pytestmark = pytest.mark.floors

SHORT = ["--report_to", "none", "--num_workers", "0", "--max_steps", "2"]
#: Each recipe's tiny model and sizes (conftest.TINY_RUNS, as tests/test_end_of_run.py runs them).
RUNS = {"classifier": TINY_CLASSIFIER, **TINY_RUNS, "dino": [*TINY_RUNS["dino"], "--warmup_epochs", "0"]}
#: The weights file each recipe's run keeps, which --predict and --export take.
KEPT = {"classifier": "best", "dino": "teacher_backbone", "yolo": "best", "detr": "best", "faster_rcnn": "best"}
#: The dependency check runs even where the caller's environment skips it.
CHECKED = {requirements.SKIP_ENV: ""}


def _declared() -> dict[str, str]:
    """requirements.txt: distribution -> its floor (or pinned version)."""
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(?:>=|==)\s*([^\s;]+)", line).groups()
            found[name.lower()] = version
    return found


def _same(a: str, b: str) -> bool:
    """The same release: '2.4.0' and '2.4'."""
    return requirements.at_least(a, b) and requirements.at_least(b, a)


TORCH = metadata.version("torch")
TRAINING_FLOOR = _declared()["torch"]


def test_every_package_is_at_its_floor():
    """Each line of requirements.txt is installed at its floor (lowest-direct), torch and torchvision apart when
    torch is an export floor (floors.sh's later runs)."""
    floors = _declared()
    at_training_floor = _same(TORCH, TRAINING_FLOOR)
    assert at_training_floor or any(_same(TORCH, v) for v in requirements.EXPORT_TORCH.values()), TORCH
    moved = set() if at_training_floor else {"torch", "torchvision"}
    installed = {name: metadata.version(name) for name in floors if name not in moved}
    assert {n: v for n, v in installed.items() if not _same(v, floors[n])} == {}


def _runs(tmp_path: Path) -> Path:
    """Where the runs go: floors.sh's FLOORS_RUNS, the same folder for its pytest runs at each torch."""
    return Path(os.environ["FLOORS_RUNS"]) if os.environ.get("FLOORS_RUNS") else tmp_path


def _images(recipe: str, folder: Path) -> Path:
    """A few images of the recipe's built-in data as files, for --predict."""
    if folder.is_dir():
        return folder
    if recipe != "classifier":
        return scene_files(folder)
    from common.data.builtin import CLASSIFICATION

    folder.mkdir(parents=True)
    digits = CLASSIFICATION["digits"]()["test"]
    for i in range(4):
        digits[i]["image"].save(folder / f"digit_{i}.png")
    return folder


def _predict(recipe: str, weights: Path, images: Path, out: Path) -> None:
    """--predict through ``weights`` (safetensors or model.onnx) on the 4 images: a row, features or an entry each."""
    args = ["--predict", str(images), "--weights", str(weights), "--report_to", "none", "--output_dir", str(out)]
    check(run_recipe(recipe, args, timeout=900, **CHECKED))
    if recipe == "classifier":
        assert len(list(csv.DictReader(open(out / "predictions.csv")))) == 4
    elif recipe == "dino":
        assert len(list(csv.DictReader(open(out / "features.csv")))) == 4
    else:
        assert len(json.loads((out / "detections.json").read_text())) == 4


def _refused(recipe: str, run: Path) -> None:
    """--export on a torch below the recipe's export floor: exit 2 and one error line naming the installed torch and
    the floor, before the run folder exists."""
    proc = run_recipe(recipe, [*RUNS[recipe], *SHORT, "--export", "true", "--output_dir", str(run)], **CHECKED)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (proc.returncode, err)
    assert f"torch {TORCH} is installed" in err and f"torch>={requirements.EXPORT_TORCH[recipe]}" in err, err
    assert not run.exists()


@pytest.mark.parametrize("recipe", list(RUNS))
def test_a_recipe_at_the_installed_torch(recipe, tmp_path):
    """At the training floor: --export refused (below the recipe's export floor), then two steps trained and
    evaluated (exporting where this torch is the export floor), --predict from the weights (and through the ONNX
    file). At a newer export floor: the weights exported, and --predict through the file."""
    export_floor = requirements.EXPORT_TORCH[recipe]
    exports = _same(TORCH, export_floor)
    folder = _runs(tmp_path) / recipe
    run, weights = folder / "run", folder / "run" / f"{KEPT[recipe]}.safetensors"
    if _same(TORCH, TRAINING_FLOOR):
        assert requirements.at_least(export_floor, TORCH)
        shutil.rmtree(folder, ignore_errors=True)
        images = _images(recipe, folder / "images")
        if not exports:
            _refused(recipe, run)
        export = ["--export", "true" if exports else "false"]  # YOLO exports unless told
        check(run_recipe(recipe, [*RUNS[recipe], *SHORT, *export, "--output_dir", str(run)], timeout=900, **CHECKED))
        _predict(recipe, weights, images, folder / "predicted")
        if exports:
            _predict(recipe, run / "export" / "model.onnx", images, folder / "predicted_onnx")
        return
    if not exports:
        pytest.skip(f"{recipe} trains at torch {TRAINING_FLOOR} and exports at {export_floor}, not {TORCH}")
    if not weights.is_file():  # this file run by itself at an export floor: train here
        check(run_recipe(recipe, [*RUNS[recipe], *SHORT, "--export", "false", "--output_dir", str(run)], **CHECKED))
    images = _images(recipe, folder / "images")
    exported, predicted = folder / f"export-torch-{TORCH}", folder / f"predicted_onnx-torch-{TORCH}"
    for done in (exported, predicted):
        shutil.rmtree(done, ignore_errors=True)
    args = ["--export", "--weights", str(weights), "--report_to", "none", "--output_dir", str(exported)]
    check(run_recipe(recipe, args, timeout=900, **CHECKED))
    _predict(recipe, exported / "model.onnx", images, predicted)
