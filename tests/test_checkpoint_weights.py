"""A checkpoint is weights (issue 43, item 5): ``--eval_only``, ``--predict`` and ``--export`` take ``--weights
<run>/checkpoints/step_XXXXXXXX``, so an interrupted run is measured and shipped without resuming it. The run
writes what its weights files carry (class names, category ids, normalisation, config) into every checkpoint
(``weights_metadata.json``, common/run_folder.py); the tensors are the trained model's (never an EMA); the final
checkpoint gives the metrics of ``final.safetensors`` exactly. A checkpoint without that file, a save cut short and
an FSDP run's sharded checkpoint are each one error line naming what is missing and the command that writes the
run's weights files.

The classifier's cases are the default suite's; the detectors and DINO (a minute or more each on two cores) are the
second tier's (-m configs)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

from common.run_folder import CHECKPOINT_METADATA, checkpoint_tensors
from common.weights import config_with_weights, read_metadata
from conftest import TINY_CLASSIFIER, TINY_RUNS, error_line, export_and_predict, load_recipe, scene_files

NONE = ["--report_to", "none", "--num_workers", "0"]


def _main(module, args: list[str]) -> tuple[dict[str, float], str]:
    """``module.main(args)`` in-process: its results and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = module.main(args)
    return results, out.getvalue()


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> Path:
    """TINY_CLASSIFIER's 4 steps with a checkpoint after steps 2 and 4 (the last one, the run's end)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    args = TINY_CLASSIFIER + NONE + ["--checkpoint_every", "2", "--keep_checkpoints", "5", "--output_dir", str(run)]
    _main(load_recipe("classifier"), args)
    return run


@pytest.mark.slow
def test_the_classifiers_last_checkpoint_is_its_final_weights(classifier_run, tmp_path, monkeypatch):
    """The checkpoint at the end of training holds final.safetensors' tensors under the same names and the same
    metadata; --eval_only on it gives final.safetensors' metrics exactly, in a folder named after the run and the
    checkpoint, and its first line says which checkpoint of which run, and that it is the trained model."""
    run, classifier = classifier_run, load_recipe("classifier")
    last = _checkpoint(run, 4)
    final = safetensors.torch.load_file(str(run / "final.safetensors"))
    tensors = checkpoint_tensors(last)
    assert tensors.keys() == final.keys() and all(torch.equal(tensors[k], final[k]) for k in final)
    meta = read_metadata(last)
    assert meta.pop("checkpoint") == {"step": 4, "run": str(run), "part": "", "complete": True}
    assert meta == read_metadata(run / "final.safetensors")

    monkeypatch.chdir(tmp_path)  # the default folder: runs/classifier/eval-<run>-<checkpoint>
    from_checkpoint, printed = _main(classifier, ["--eval_only", "--weights", str(last), *NONE])
    from_file, _ = _main(classifier, ["--eval_only", "--weights", str(run / "final.safetensors"), *NONE])
    assert from_checkpoint == from_file and from_checkpoint["eval/top1"] >= 0
    assert (tmp_path / "runs" / "classifier" / "eval-run-step_00000004" / "metrics.jsonl").is_file()
    assert (
        f"weights '{last}' (checkpoint at step 4 of {run}, saved by classifier.py for model test_vit: the trained "
        f"model, not an EMA): {len(final)} tensors loaded"
    ) in printed.splitlines()


@pytest.mark.slow
def test_a_mid_run_checkpoint_predicts_and_exports(classifier_run, tmp_path):
    """--export --weights <the step-2 checkpoint> writes model.onnx (with the class names) into its own folder;
    --predict from the checkpoint and from that file give the same top-5."""
    from common.data.builtin import CLASSIFICATION

    images = tmp_path / "images"
    images.mkdir()
    digits = CLASSIFICATION["digits"]()["test"]
    for i in range(4):
        digits[i]["image"].save(images / f"digit_{i}.png")
    middle = _checkpoint(classifier_run, 2)
    export, eager, onnx = export_and_predict("classifier", middle, images, tmp_path, "--data", "no/such-dataset")
    assert read_metadata(export / "model.onnx")["classes"] == [str(i) for i in range(10)]
    rows = [list(csv.DictReader(open(folder / "predictions.csv"))) for folder in (eager, onnx)]
    assert len(rows[0]) == 4
    for a, b in zip(*rows):
        assert [a[f"class_{k}"] for k in range(1, 6)] == [b[f"class_{k}"] for k in range(1, 6)]
        assert all(abs(float(a[f"prob_{k}"]) - float(b[f"prob_{k}"])) <= 1e-3 for k in range(1, 6))


def _copy_run(run: Path, step: int, to: Path) -> Path:
    """A copy of ``run``'s config.yaml and its checkpoint at ``step`` under ``to``; returns the copied checkpoint."""
    (to / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", to / "config.yaml")
    return Path(shutil.copytree(_checkpoint(run, step), _checkpoint(to, step)))


def test_a_checkpoint_without_its_metadata_is_one_line_naming_what_is_missing(classifier_run, tmp_path, capsys):
    """A checkpoint written before checkpoints carried weights_metadata.json: its model fields still come from the
    run's config.yaml, but the class names cannot, so --eval_only and --predict are one error line naming the file
    and the command that writes the run's weights files; nothing is written."""
    classifier = load_recipe("classifier")
    old = _copy_run(classifier_run, 2, tmp_path / "old")
    (old / CHECKPOINT_METADATA).unlink()
    cfg = config_with_weights(classifier.Config, ["--eval_only", "--weights", str(old)], classifier.MODEL_FIELDS)
    assert (cfg.model, cfg.img_size, cfg.weights) == ("test_vit", 32, str(old))
    expected = (
        f"error: checkpoint '{old}' has no {CHECKPOINT_METADATA} (written before checkpoints kept it): the class "
        f"names a classifier needs are unknown; its weights files come from finishing the run: the recipe with "
        f"--config {tmp_path / 'old' / 'config.yaml'} --resume auto"
    )
    out, images = tmp_path / "out", tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(images / "red.png")
    for mode in (["--eval_only"], ["--predict", str(images)]):
        assert error_line(capsys, classifier.main, [*mode, "--weights", str(old), *NONE, "--output_dir", str(out)]) == (
            expected
        )
    assert not out.exists()


def test_an_fsdp_checkpoint_and_a_save_cut_short_are_one_line(classifier_run, tmp_path, capsys):
    """An FSDP run's checkpoint holds the model as its processes sharded it (torch.distributed.checkpoint, whose
    index is a pickle): refused in one line naming the command that finishes the run; so is a checkpoint folder
    whose save was cut short (no train_state.json)."""
    classifier = load_recipe("classifier")
    sharded = _copy_run(classifier_run, 2, tmp_path / "fsdp")
    (sharded / "model.safetensors").unlink()
    (sharded / "pytorch_model_fsdp_0").mkdir()
    (sharded / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"a pickle")
    line = error_line(capsys, classifier.main, ["--eval_only", "--weights", str(sharded), *NONE])
    assert line == (
        f"error: weights '{sharded}' are an FSDP run's checkpoint (pytorch_model_fsdp_0: the model as the processes "
        "held it, not one safetensors file); its weights files come from finishing the run, launched as it was: "
        f"accelerate launch recipes/classifier.py --config {tmp_path / 'fsdp' / 'config.yaml'} --resume auto"
    )
    cut = _copy_run(classifier_run, 2, tmp_path / "cut")
    (cut / "train_state.json").unlink()
    line = error_line(capsys, classifier.main, ["--export", "--weights", str(cut), *NONE])
    assert line == f"error: weights '{cut}' are not a complete checkpoint (no train_state.json: its save was cut short)"


def test_a_compiled_ddp_models_checkpoint_is_named_as_the_weights_files(tmp_path):
    """Accelerate saves the prepared model's state dict: under DDP its keys start with ``module.``, under
    torch.compile they hold ``_orig_mod.``; the checkpoint's tensors are named without them, as save_weights names
    them (a model with a submodule called ``module`` keeps its name)."""
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    (folder / "train_state.json").write_text(json.dumps({"step": 3}))
    weights = {"module._orig_mod.head.weight": torch.ones(2), "module._orig_mod.anchors": torch.zeros(3)}
    safetensors.torch.save_file(weights, str(folder / "model.safetensors"))
    assert {k: v.tolist() for k, v in checkpoint_tensors(folder).items()} == {"head.weight": [1, 1], "anchors": [0] * 3}
    safetensors.torch.save_file({"module.x": torch.ones(1), "y": torch.ones(1)}, str(folder / "model.safetensors"))
    assert checkpoint_tensors(folder, keys_only=True) == {"module.x": "module.x", "y": "y"}


# ---- the detectors and DINO: the second tier ------------------------------------------------------------------


def _scenes(root: Path, train: int = 16, val: int = 8) -> Path:
    """A COCO folder of the first built-in digits_det scenes: a few seconds of evaluation instead of minutes."""
    from common.data.builtin import DETECTION

    source = DETECTION["digits_det"]()
    for split, count in (("train", train), ("val", val)):
        coco = json.loads((source / "annotations" / f"instances_{split}.json").read_text())
        images = coco["images"][:count]
        kept = {im["id"] for im in images}
        (root / split).mkdir(parents=True)
        for im in images:
            shutil.copy(source / split / im["file_name"], root / split / im["file_name"])
        coco.update(images=images, annotations=[a for a in coco["annotations"] if a["image_id"] in kept])
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return root


@pytest.mark.configs
@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, args",
    [
        ("yolo", ["--ema_decay", "0", "--conf_threshold", "0"]),  # the raw model is what final.safetensors holds
        ("detr", []),
        ("faster_rcnn", []),
    ],
)
def test_each_detectors_checkpoint_evaluates_predicts_and_exports_as_its_weights(recipe, args, tmp_path):
    """Two steps on a few scenes: --eval_only on the last checkpoint gives final.safetensors' metrics and
    predictions.json exactly (the dataset's category ids from the checkpoint's metadata), --predict from it writes
    one entry per image, and (Faster R-CNN's, the quickest) --export from it writes model.onnx."""
    module, data = load_recipe(recipe), ["--data", str(_scenes(tmp_path / "data"))]
    run = tmp_path / "run"
    _main(
        module,
        TINY_RUNS[recipe] + NONE + data + args + ["--max_steps", "2", "--export", "false", "--output_dir", str(run)],
    )
    last = _checkpoint(run, 2)
    assert read_metadata(last)["category_ids"] == read_metadata(run / "final.safetensors")["category_ids"]
    evaluated = []
    for weights in (last, run / "final.safetensors"):
        out = tmp_path / f"eval-{weights.name}"
        results, _ = _main(module, ["--eval_only", "--weights", str(weights), *NONE, *data, "--output_dir", str(out)])
        evaluated.append((results, json.loads((out / "predictions.json").read_text())))
    assert evaluated[0] == evaluated[1]
    images = scene_files(tmp_path / "photos", 3)
    _main(module, ["--predict", str(images), "--weights", str(last), *NONE, "--output_dir", str(tmp_path / "pred")])
    assert len(json.loads((tmp_path / "pred" / "detections.json").read_text())) == 3
    if recipe == "faster_rcnn":
        _main(module, ["--export", "--weights", str(last), *NONE, "--output_dir", str(tmp_path / "export")])
        assert read_metadata(tmp_path / "export" / "model.onnx")["classes"] == read_metadata(last)["classes"]


@pytest.mark.configs
@pytest.mark.slow
def test_dinos_checkpoint_gives_the_students_backbone(tmp_path):
    """DINO's checkpoint holds the student (backbone and head) and its teacher pickled: --weights takes the
    student's backbone, says so, and --eval_only (the kNN) and --predict (features) run on it."""
    import numpy as np

    dino = load_recipe("dino")
    run = tmp_path / "run"
    fast = ["--max_steps", "2", "--warmup_epochs", "0", "--knn_pixel_limit", "0", "--export", "false"]
    _main(dino, TINY_RUNS["dino"] + NONE + fast + ["--output_dir", str(run)])
    last = _checkpoint(run, 2)
    student = safetensors.torch.load_file(str(last / "model.safetensors"))
    backbone = checkpoint_tensors(last, read_metadata(last)["checkpoint"]["part"])
    assert backbone.keys() == safetensors.torch.load_file(str(run / "teacher_backbone.safetensors")).keys()
    assert all(torch.equal(v, student[f"backbone.{k}"]) for k, v in backbone.items())
    knn = ["--knn_train_limit", "200", "--data", "digits"]
    results, printed = _main(
        dino, ["--eval_only", "--weights", str(last), *NONE, *knn, "--output_dir", str(tmp_path / "e")]
    )
    assert results["knn/teacher_top1"] > 10  # above chance on the ten digits
    assert (
        f"weights '{last}' (checkpoint at step 2 of {run}, saved by dino.py for model vit_tiny_patch16_224" in printed
    )
    assert f": the trained model's backbone, not an EMA): {len(backbone)} tensors loaded" in printed
    images = scene_files(tmp_path / "photos", 3)
    _main(dino, ["--predict", str(images), "--weights", str(last), *NONE, "--output_dir", str(tmp_path / "pred")])
    assert np.load(tmp_path / "pred" / "features.npy").shape[0] == 3
