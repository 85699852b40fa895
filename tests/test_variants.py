"""The variants tier (-m variants, run by tests/variants.sh in an environment whose onnxruntime is
onnxruntime-gpu and whose PIL is Pillow-SIMD, as GPU machines install them): the start-up check counts the
modules by the distributions that provide them, and the classifier trains, exports and predicts through its
ONNX file there, each as users run it (a subprocess through the recipe's entry point)."""

from __future__ import annotations

import csv

import pytest

from common import requirements
from conftest import TINY_CLASSIFIER, check, run_recipe

pytestmark = pytest.mark.variants


def test_the_modules_come_from_the_other_distributions():
    provided = {f.module: requirements.provider(f) for f in requirements.CORE + requirements.ONNX_EXPORT}
    assert provided["onnxruntime"][0] == "onnxruntime-gpu" and provided["PIL"][0].lower() == "pillow-simd"
    assert requirements.problems(requirements.CORE + requirements.ONNX_EXPORT) == []


def test_the_classifier_trains_exports_and_predicts_through_onnx(tmp_path):
    run = tmp_path / "run"
    args = [*TINY_CLASSIFIER, "--report_to", "none", "--num_workers", "0", "--max_steps", "2", "--export", "true"]
    check(run_recipe("classifier", [*args, "--output_dir", str(run)], timeout=900))
    onnx = run / "export" / "model.onnx"
    from common.data.builtin import CLASSIFICATION

    images = tmp_path / "images"
    images.mkdir()
    digits = CLASSIFICATION["digits"]()["test"]
    for i in range(4):  # PNG files decoded by Pillow-SIMD
        digits[i]["image"].save(images / f"digit_{i}.png")
    out = tmp_path / "predicted"
    args = ["--predict", str(images), "--weights", str(onnx), "--output_dir", str(out), "--report_to", "none"]
    check(run_recipe("classifier", args, timeout=900))
    assert len(list(csv.DictReader(open(out / "predictions.csv")))) == 4
