"""The floors hold (-m floors, run by tests/floors.sh in an environment installed with
constraints/minimum.txt): every package is at its floor, and each recipe trains two steps on its built-in
data, evaluates, writes its model folder and exports to ONNX, and --predict runs through the exported file,
each as users run it (a subprocess through the recipe's entry point, whose dependency check passes)."""

from __future__ import annotations

import csv
import json
from importlib import metadata
from pathlib import Path

import pytest

from common import requirements
from conftest import TINY_CLASSIFIER, TINY_RUNS, check, run_recipe, scene_files

pytestmark = pytest.mark.floors

SHORT = ["--report_to", "none", "--num_workers", "0", "--max_steps", "2"]
#: Each recipe's tiny model and sizes (conftest.TINY_RUNS, as tests/test_end_of_run.py runs them).
RUNS = {"classifier": TINY_CLASSIFIER, **TINY_RUNS, "dino": [*TINY_RUNS["dino"], "--warmup_epochs", "0"]}


def test_every_package_is_at_its_floor():
    """This environment is the floors' (constraints/minimum.txt), so the runs below prove them."""
    installed = {name: metadata.version(name) for name in requirements.FLOORS}
    above = {n: v for n, v in installed.items() if requirements.at_least(v, requirements.FLOORS[n] + ".0.1")}
    assert not above and not requirements.problems(), installed


def _images(recipe: str, folder: Path) -> Path:
    """A few images of the recipe's built-in data as files, for --predict."""
    if recipe != "classifier":
        return scene_files(folder)
    from common.data.builtin import CLASSIFICATION

    folder.mkdir(parents=True)
    digits = CLASSIFICATION["digits"]()["test"]
    for i in range(4):
        digits[i]["image"].save(folder / f"digit_{i}.png")
    return folder


@pytest.mark.parametrize("recipe", list(RUNS))
def test_a_recipe_trains_exports_and_predicts_through_onnx(recipe, tmp_path):
    run = tmp_path / "run"
    export = ["--export", "true"] if recipe != "dino" else []
    check(run_recipe(recipe, [*RUNS[recipe], *SHORT, *export, "--output_dir", str(run)], timeout=900))
    if recipe == "dino":  # a backbone: its model folder is what it leaves (timm's save_for_hf)
        assert json.loads((run / "model" / "config.json").read_text())["pretrained_cfg"]["mean"]
        return
    onnx = run / "export" / "model.onnx"
    assert onnx.is_file()
    out = tmp_path / "predicted"
    args = ["--predict", str(_images(recipe, tmp_path / "images")), "--weights", str(onnx), "--output_dir", str(out)]
    check(run_recipe(recipe, [*args, "--report_to", "none"], timeout=900))
    if recipe == "classifier":
        assert len(list(csv.DictReader(open(out / "predictions.csv")))) == 4
    else:
        assert len(json.loads((out / "detections.json").read_text())) == 4
