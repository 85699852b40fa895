"""Exact resume in every recipe, through the entry point, from a checkpoint in a later epoch; and a stop
signal after the training steps, which keeps what is written and says how to finish.

Each case runs a recipe's ``main`` (in-process: a subprocess would add seconds of imports per run;
``cli_main`` and a real kill are tested in test_classifier.py) uninterrupted with evaluations after
every epoch and a checkpoint in the middle of epoch 1 (after epoch 0's evaluation). A second folder
is then made to look exactly like a run killed right after that checkpoint (the checkpoint and the
metrics written so far; what a ``kill -9`` leaves), and ``--resume auto`` continues it. Final
weights must be identical and every learned quantity logged after the checkpoint equal. The
classifier's test file kills a real process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
from PIL import Image, ImageDraw

from conftest import load_recipe

# Wall-clock meters differ between any two runs; everything else logged must not.
TIMING = ("images_per_s", "data_wait", "s_per_step", "eta_s")


@pytest.fixture(scope="module")
def coco_folder(tmp_path_factory) -> Path:
    """A small COCO-json folder as a user would write it: 64x48 images with 1-3 filled rectangles
    whose colour gives the class, category ids 3, 7 and 11 (not 0..C-1), 40 train and 12 val images."""
    root = tmp_path_factory.mktemp("coco")
    rng = np.random.default_rng(0)
    colours = {3: (230, 60, 60), 7: (60, 230, 60), 11: (80, 80, 240)}
    for split, count in (("train", 40), ("val", 12)):
        (root / split).mkdir()
        images, annotations = [], []
        for i in range(1, count + 1):
            image = Image.new("RGB", (64, 48), tuple(int(v) for v in rng.integers(0, 60, 3)))
            draw = ImageDraw.Draw(image)
            for _ in range(int(rng.integers(1, 4))):
                w, h = int(rng.integers(8, 24)), int(rng.integers(8, 20))
                x, y = int(rng.integers(0, 64 - w)), int(rng.integers(0, 48 - h))
                category = int(rng.choice(list(colours)))
                draw.rectangle((x, y, x + w - 1, y + h - 1), fill=colours[category])
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": i,
                        "category_id": category,
                        "bbox": [x, y, w, h],
                        "area": w * h,
                        "iscrowd": 0,
                    }
                )
            image.save(root / split / f"{i:04d}.png")
            images.append({"id": i, "file_name": f"{i:04d}.png", "width": 64, "height": 48})
        (root / "annotations").mkdir(exist_ok=True)
        categories = [{"id": c, "name": f"box{c}"} for c in colours]
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories})
        )
    return root


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """A small imagefolder (``train/<class>/*.png``, ``validation/<class>/*.png``) of 16 px images
    with two classes (a bright square or a bright bar), 80 train and 20 validation images."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("validation", 10)):
        for name in ("square", "bar"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 80, (16, 16, 3), dtype=np.uint8)
                x, y = rng.integers(0, 8, 2)
                pixels[y : y + 8, x : x + (8 if name == "square" else 3)] = 230
                Image.fromarray(pixels).save(root / split / name / f"{i:03d}.png")
    return root


# Per recipe: arguments giving short epochs, an evaluation after each, a checkpoint at step CUT in
# epoch 1, training on into epoch 2 (the first epoch the resumed run starts afresh: where a wrong
# epoch counter would show), and the method's randomness switched on (dropout, mosaic, crops,
# multi-scale, sampling).
COMMON = ["--report_to", "none", "--eval_every", "1", "--keep_checkpoints", "5", "--log_every", "1"]
CASES = {
    # the image folder: 80 images, 5 batches of 16 per epoch; the checkpoint at step 7 is batch 2 of epoch 1
    "dino": (
        7,
        [
            "--batch_size",
            "16",
            "--local_crops",
            "2",
            "--num_workers",
            "1",
            "--global_size",
            "16",
            "--local_size",
            "8",
            "--plot_images",
            "0",
            "--model",
            "vit_tiny_patch16_224",
            "--model_kwargs",
            "{patch_size: 4, embed_dim: 48, depth: 2, num_heads: 3}",
            "--head_use_bn",
            "false",
            "--out_dim",
            "256",
            "--max_steps",
            "12",
            "--checkpoint_every",
            "7",
        ],
    ),
    # the COCO folder: 40 images, 5 batches of 8 per epoch; the checkpoint at step 7 is batch 2 of epoch 1
    # (yolo: 3 epochs, so that its schedule and mosaic/mixup switch-off are those of a 3-epoch run)
    "yolo": (
        7,
        [
            "--batch_size",
            "8",
            "--img_size",
            "64",
            "--multiscale",
            "[32, 64]",
            "--multiscale_every",
            "2",
            "--mosaic",
            "0.5",
            "--mixup",
            "0.5",
            "--no_aug_epochs",
            "0",
            "--epochs",
            "3",
            "--export",
            "false",
            "--plot_images",
            "1",
            "--num_workers",
            "1",
            "--max_steps",
            "12",
            "--checkpoint_every",
            "7",
        ],
    ),
    "detr": (
        7,
        [
            "--batch_size",
            "8",
            "--scales",
            "[48, 64]",
            "--max_size",
            "96",
            "--crop",
            "0.5",
            "--crop_resize",
            "[40, 48]",
            "--crop_size",
            "[32, 48]",
            "--pretrain_crops_epochs",
            "0",
            "--plot_images",
            "1",
            "--num_workers",
            "1",
            "--max_steps",
            "12",
            "--checkpoint_every",
            "7",
        ],
    ),
    "faster_rcnn": (
        7,
        [
            "--batch_size",
            "8",
            "--min_size",
            "[40, 48]",
            "--max_size",
            "96",
            "--plot_images",
            "1",
            "--num_workers",
            "1",
            "--max_steps",
            "12",
            "--checkpoint_every",
            "7",
        ],
    ),
}


def _learned(run: Path, after: int) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if k.split("/")[-1] not in TIMING and not k.startswith("time/")} for r in rows]
    return [r for r in kept if r["step"] > after and len(r) > 1]  # a record of seconds alone is left out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(CASES))
def test_resume_in_a_later_epoch_ends_with_the_uninterrupted_weights(
    recipe, coco_folder, image_folder, tmp_path, capsys
):
    cut, args = CASES[recipe]
    args = COMMON + args + ["--data", str(image_folder if recipe == "dino" else coco_folder)]
    full, part = tmp_path / "full", tmp_path / "part"
    main = load_recipe(recipe).main
    main(args + ["--output_dir", str(full)])
    checkpoint = full / "checkpoints" / f"step_{cut:08d}"
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert state["epoch"] == 1 and state["batches_in_epoch"] > 0, state  # mid-epoch, after an evaluation
    evaluations = [r for r in _learned(full, 0) if any(k.startswith(("eval/", "knn/")) for k in r)]
    assert any(0 < r["step"] < cut for r in evaluations), "no evaluation before the checkpoint"

    # What a kill right after that checkpoint leaves: the checkpoint and the metrics logged so far.
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, part / "checkpoints" / checkpoint.name)
    shutil.copy(full / "config.yaml", part / "config.yaml")
    kept = [line for line in (full / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= cut]
    (part / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    capsys.readouterr()
    main(args + ["--output_dir", str(part), "--resume", "auto"])
    assert f"resumed from {part / 'checkpoints' / checkpoint.name}" in capsys.readouterr().out

    name = "teacher_backbone.safetensors" if recipe == "dino" else "final.safetensors"
    a, b = (safetensors.torch.load_file(str(run / name)) for run in (full, part))
    assert a.keys() == b.keys()
    differ = [k for k in a if not (a[k] == b[k]).all()]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ after resume, e.g. {differ[:3]}"
    after_full, after_part = _learned(full, cut), _learned(part, cut)
    assert after_full == after_part and len(after_full) >= 2


# Where a stop signal lands after the training steps: during the last evaluation (a checkpoint before it, and
# the resume evaluates again), the final weights, or the export; each is a function of the recipe
# that is wrapped to signal the process first.
# The first case of each recipe also runs the command that finishes it.
STOPS = [
    ("classifier", "evaluate", "final.safetensors"),
    ("classifier", "save_weights", "final.safetensors"),
    ("dino", "save_weights", "teacher_backbone.safetensors"),
    ("dino", "evaluate", "teacher_backbone.safetensors"),
    ("yolo", "export_files", "export/model.onnx"),
    ("yolo", "evaluate", "final.safetensors"),
    ("yolo", "save_weights", "final.safetensors"),
    ("detr", "evaluate", "final.safetensors"),
    ("detr", "save_weights", "final.safetensors"),
    ("faster_rcnn", "save_weights", "final.safetensors"),
    ("faster_rcnn", "evaluate", "final.safetensors"),
]
FINISHED = {recipe: phase for recipe, phase, _ in reversed(STOPS)}  # the first case of each recipe


@pytest.mark.slow
@pytest.mark.parametrize("recipe, phase, last", STOPS)
def test_a_stop_after_the_training_steps_keeps_what_is_written_and_says_how_to_finish(
    recipe, phase, last, coco_folder, image_folder, tmp_path, capsys, monkeypatch
):
    """SIGTERM during the last evaluation, the final save or the export: two lines (what stopped, the
    command that continues or finishes the run), exit status 0, no traceback, the checkpoints kept and no half
    file; the printed command then writes the rest (the evaluation and the final weights; YOLO's export is not
    repeated)."""
    import os
    import signal
    import sys

    from common.console import cli_main
    from conftest import TINY_CLASSIFIER

    module = load_recipe(recipe)
    if recipe == "classifier":
        args = TINY_CLASSIFIER + ["--report_to", "none", "--batch_size", "16", "--data", str(image_folder)]
    else:
        args = COMMON + CASES[recipe][1] + ["--data", str(image_folder if recipe == "dino" else coco_folder)]
    run = tmp_path / "run"
    args = args + ["--max_steps", "3", "--output_dir", str(run)] + (["--export", "true"] if recipe == "yolo" else [])
    original = getattr(module, phase)

    calls = []
    last_call = 2 if (recipe, phase) == ("dino", "evaluate") else 1  # DINO's first is the step-0 baseline

    def signalled(*a, **kw):
        calls.append(phase)
        if phase == "save_weights":
            due = Path(a[1]).name == last  # not best.safetensors during the steps
        else:
            due = len(calls) == last_call
        if due:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*a, **kw)

    monkeypatch.setattr(module, phase, signalled)
    monkeypatch.setattr(sys, "argv", [f"recipes/{recipe}.py"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(lambda: module.main(args))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0 and "Traceback" not in out + err, err[-2000:]
    lines = out.strip().splitlines()
    command = f"python recipes/{recipe}.py --config {run / 'config.yaml'} --resume auto"
    if phase == "evaluate":  # the last evaluation is in the loop: a checkpoint before it, which it redoes
        checkpoint = run / "checkpoints" / "step_00000003"
        assert lines[-2] == f"stopped by SIGTERM at step 3; checkpoint {checkpoint} (before the evaluation, which " \
            "runs again on resume)"  # fmt: skip
        finish = f"continue with: {command}"
    else:
        during = " during the export" if phase == "export_files" else ""  # the exporter's own region names it
        assert lines[-2].startswith(f"stopped by SIGTERM{during} after the training loop"), lines[-2]
        assert "step_00000003" in lines[-2]
        finish = f"finish it with: {command}"
    assert lines[-1] == finish
    assert (run / "checkpoints" / "step_00000003" / "train_state.json").is_file()
    assert not (run / last).exists() and not list(run.rglob("*.tmp*"))

    if FINISHED[recipe] != phase or recipe == "yolo":  # YOLO's finish is the export itself, a minute of CPU
        return
    monkeypatch.setattr(module, phase, original)
    module.main(finish.split(f"recipes/{recipe}.py ")[1].split())
    assert (run / last).is_file() and capsys.readouterr().out.strip().splitlines()[-1] == f"output: {run}"
