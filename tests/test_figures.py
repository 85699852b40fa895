"""The pictures of an evaluation: common/artifacts/figures (curves, confusion matrix, tables),
common/detection/figures (detections, PR curves) and the set one detection evaluation writes
(common/detection/outputs), and the details of one COCO evaluation pass (common/detection/coco_eval). DINO's
pictures (attention, neighbours) are tested beside its recipe, in tests/test_dino.py."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from common.artifacts.figures import confusion_counts, format_table, plot_confusion_matrix, save_table_csv
from common.curves import _panels, plot_curves, read_metrics
from common.detection.coco_eval import CocoEvaluator, detection_confusion
from common.detection.figures import class_colour, font, plot_pr_curves, save_detections
from common.detection.outputs import evaluation_samples, save_evaluation_figures
from conftest import ROOT, detection_table


def check_png(path: Path, returned: Image.Image, width: tuple[int, int], height: tuple[int, int]) -> np.ndarray:
    """The PNG at ``path`` opens, is what the function returned, has a size in the given ranges and
    content (not one flat colour); returns its pixels."""
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[:2] == (returned.height, returned.width)
    assert width[0] <= returned.width <= width[1] and height[0] <= returned.height <= height[1], returned.size
    assert pixels.std() > 20, "an almost uniform picture"
    return pixels


# --------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------
def _write_metrics(path: Path) -> Path:
    lines = []
    for step in range(5, 105, 5):
        record = {
            "step": step,
            "train/loss": 3.0 / step**0.5,
            "train/loss_ce": 2.0 / step**0.5,
            "train/loss_giou": 0.5,
            "train/lr": 1e-3 * min(step, 20) / 20,
            "train/images_per_s": 80.0,
            "train/data_wait": 0.01,
            "train/eta_s": 100.0 - step,
            "train/grad_norm": 5.0,
            "epoch": step // 50,
        }
        if step == 40:
            record["train/loss"] = float("nan")  # json writes NaN; the curve gets a gap
        lines.append(json.dumps(record))
        if step % 50 == 0:
            lines.append(
                json.dumps(
                    {
                        "step": step,
                        "eval/top1": step / 2,
                        "eval/top5": step,
                        "eval/loss": 1 / step,
                        "eval/map_large": -1.0,
                        "best/top1": step / 2,
                        "epoch": step // 50,
                    }
                )
            )
    lines.append(json.dumps({"step": 0, "knn/raw_pixels_top1": 41.5}))  # a key that appears once
    lines.append('{"step": 105, "train/lo')  # a run killed while writing
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plot_curves_panels_and_png(tmp_path):
    metrics = _write_metrics(tmp_path / "metrics.jsonl")
    series = read_metrics(metrics)
    assert math.isnan(series["train/loss"][1][7]) and len(series["train/loss"][0]) == 20
    assert series["knn/raw_pixels_top1"][0].tolist() == [0.0]
    titles = {title: keys for title, keys, _ in _panels(list(series))}
    assert titles == {
        "training loss": ["train/loss", "train/loss_ce", "train/loss_giou"],
        "train/lr": ["train/lr"],
        "eval metrics": ["eval/top1", "eval/top5", "eval/map_large"],
        "eval/loss": ["eval/loss"],
        "knn/raw_pixels_top1": ["knn/raw_pixels_top1"],
        "train/grad_norm": ["train/grad_norm"],
    }
    picture = plot_curves(metrics, tmp_path / "curves.png")
    # six panels (eval/map_large is -1 throughout: left out, not a panel) in 3 columns, 2 rows
    check_png(tmp_path / "curves.png", picture, (1440, 1440), (670, 670))
    assert plot_curves(tmp_path / "missing.jsonl", tmp_path / "none.png") is None
    (tmp_path / "bookkeeping.jsonl").write_text(json.dumps({"step": 1, "epoch": 0, "best/top1": 3.0}) + "\n")
    assert plot_curves(tmp_path / "bookkeeping.jsonl", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_curves_with_one_point_and_with_thirty_keys(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"step": 3, "train/loss": 2.0}) + "\n")
    check_png(tmp_path / "one.png", plot_curves(one, tmp_path / "one.png"), (480, 480), (350, 350))
    many = tmp_path / "many.jsonl"
    rng = np.random.default_rng(0)
    many.write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    **{f"train/loss_term{t}": float(rng.random()) for t in range(10)},
                    **{f"eval/metric{m}": float(rng.random()) for m in range(20)},
                }
            )
            + "\n"
            for s in range(100)
        )
    )
    panels = _panels(list(read_metrics(many)))
    assert max(len(keys) for _, keys, _ in panels) <= 6 and sum(len(keys) for _, keys, _ in panels) == 30
    check_png(tmp_path / "many.png", plot_curves(many, tmp_path / "many.png"), (1920, 1920), (1000, 2000))


# --------------------------------------------------------------------------------------------
# Confusion matrix and tables
# --------------------------------------------------------------------------------------------
def test_confusion_counts():
    counts = confusion_counts(torch.tensor([0, 1, 1, 2, 2, 2]), np.array([0, 1, 2, 2, 2, 0]), 3)
    assert counts.tolist() == [[1, 0, 1], [0, 1, 0], [0, 1, 2]]  # rows true, columns predicted
    with pytest.raises(ValueError, match="outside 0..2"):
        confusion_counts([3], [0], 3)


@pytest.mark.parametrize("k", [3, 200])
def test_plot_confusion_matrix(tmp_path, k):
    rng = np.random.default_rng(k)
    true = rng.integers(0, k, 20 * k)
    pred = np.where(rng.random(true.size) < 0.7, true, rng.integers(0, k, true.size))
    counts = confusion_counts(pred, true, k)
    counts[0] = 0  # a class without samples: a white row, no division by zero
    picture = plot_confusion_matrix(counts, [f"class {i}" for i in range(k)], tmp_path / "cm.png", "test")
    size = (400, 800) if k == 3 else (1000, 1700)  # bounded however many classes
    pixels = check_png(tmp_path / "cm.png", picture, size, size)
    assert (pixels < 100).all(-1).any()  # dark cells or text: the diagonal shows
    with pytest.raises(ValueError, match="do not match"):
        plot_confusion_matrix(counts, ["a"], tmp_path / "x.png")


def test_tables(tmp_path):
    rows = [
        {"class": "person", "instances": 12, "ap50": 0.5, "ap": float("nan")},
        {"class": "a" * 200, "instances": 3, "ap50": 0.123456, "ap": 0.1},
    ]
    text = format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and max(map(len, lines)) <= 120
    assert lines[0].split() == ["class", "instances", "ap50", "ap"]
    assert lines[2].split() == ["person", "12", "0.500", "-"] and lines[3].split()[2] == "0.123"
    assert lines[3].split()[0].endswith("…")
    assert format_table(rows, ["ap", "class"]).splitlines()[0].split() == ["ap", "class"]
    save_table_csv(rows, tmp_path / "t" / "table.csv")
    with open(tmp_path / "t" / "table.csv") as f:
        read = list(csv.DictReader(f))
    assert read[1]["class"] == "a" * 200 and read[0]["instances"] == "12"


# --------------------------------------------------------------------------------------------
# One evaluation pass, with its details
# --------------------------------------------------------------------------------------------
CLASSES = ["cat", "dog", "bird", "fish"]  # fish: no ground truth anywhere


@pytest.fixture(scope="module")
def split():
    """Two 100 x 80 images. Image 1: a cat and a dog. Image 2: a cat, a dog and a bird."""
    images = [Image.new("RGB", (100, 80), (40, 40, 40)) for _ in range(2)]
    for image in images:
        ImageDraw.Draw(image).ellipse((10, 10, 60, 60), fill=(200, 180, 60))
    boxes = [[[10, 10, 20, 20], [50, 40, 30, 30]], [[5, 5, 20, 30], [40, 10, 25, 25], [70, 50, 20, 20]]]
    return detection_table(images, boxes, [[0, 1], [0, 1, 2]])


def _predictions():
    """Cats: both found exactly. Dogs: image 1's found; image 2's called a bird. Image 2's bird: missed.
    Also a spurious dog (score 0.6) and a spurious cat under the confusion matrix's score (0.1)."""
    return [
        {
            "image_id": 1,
            "boxes": torch.tensor([[10.0, 10, 30, 30], [50, 40, 80, 70], [0, 60, 15, 75], [85, 0, 99, 10]]),
            "scores": torch.tensor([0.9, 0.8, 0.6, 0.1]),
            "labels": torch.tensor([0, 1, 1, 0]),
        },
        {
            "image_id": 2,
            "boxes": torch.tensor([[5.0, 5, 25, 35], [40, 10, 65, 35]]),
            "scores": torch.tensor([0.95, 0.7]),
            "labels": torch.tensor([0, 2]),
        },
    ]


def test_evaluate_details(split):
    evaluator = CocoEvaluator(split, CLASSES)
    state = dict(vars(evaluator))
    metrics, details = evaluator.evaluate([_predictions()], details=True)
    assert evaluator.evaluate([_predictions()]) == metrics  # details=False: the same numbers, a plain dict
    assert vars(evaluator) == state
    assert details.classes == CLASSES and details.instances.tolist() == [2, 2, 1, 0]
    assert details.ap50[0] == 1.0 and details.ap[0] == 1.0  # every cat found, exactly
    assert details.ap50[1] == pytest.approx(51 / 101)  # half the dogs: precision 1 up to recall 0.5
    assert details.ap50[2] == 0.0 and math.isnan(details.ap50[3]) and math.isnan(details.ap[3])
    assert np.nanmean(details.ap50) == pytest.approx(metrics["map_50"])
    assert details.precision.shape == (10, 101, 4, 4, 3) and (details.precision[:, :, 3] == -1).all()
    expected = np.zeros((5, 5), np.int64)  # rows true, columns predicted, 4 = background
    expected[0, 0] = 2  # both cats
    expected[1, 1] = 1  # image 1's dog
    expected[1, 2] = 1  # image 2's dog, called a bird
    expected[4, 1] = 1  # the spurious dog: background row
    expected[2, 4] = 1  # the missed bird: background column; the 0.1 cat is under the score threshold
    assert details.confusion.tolist() == expected.tolist()
    assert details.predictions[2]["boxes"].tolist() == [[5, 5, 25, 35], [40, 10, 65, 35]]
    assert details.predictions[1]["labels"].tolist() == [0, 1, 1, 0]
    assert [r["class"] for r in details.table()] == CLASSES and details.table()[0]["instances"] == 2


def test_evaluate_details_first_predictions_and_no_predictions(split):
    evaluator = CocoEvaluator(split, CLASSES)
    first = _predictions()
    repeat = {**first[0], "labels": torch.tensor([3, 3, 3, 3])}  # Accelerate's padding repeat: ignored
    metrics, details = evaluator.evaluate([first[:1], [repeat, first[1]]], details=True)
    assert metrics == evaluator.evaluate([first]) and details.predictions[1]["labels"].tolist() == [0, 1, 1, 0]
    metrics, details = evaluator.evaluate([], details=True)
    assert details.predictions[1]["boxes"].shape == (0, 4)
    assert details.confusion[:, 4].tolist() == [2, 2, 1, 0, 0] and details.confusion[:, :4].sum() == 0
    assert details.ap50[:3].tolist() == [0.0, 0.0, 0.0]


def test_detection_confusion_matching():
    gt = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float64)
    # two predictions of the first box: the more confident takes it, the other is spurious; a third
    # overlaps the second box at IoU 0.36 only: spurious, and the box is missed
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 11], [24, 24, 30, 30]], np.float64)
    m = detection_confusion(boxes, np.array([0.5, 0.9, 0.8]), np.array([0, 1, 1]), gt, np.array([0, 1]), 2)
    assert m.tolist() == [[0, 1, 0], [0, 0, 1], [1, 1, 0]]
    crowd = detection_confusion(boxes[2:], [0.8], [1], gt[1:], [1], 2, gt_crowd=[True])
    assert crowd.sum() == 0  # inside a crowd region: neither spurious nor missed


# --------------------------------------------------------------------------------------------
# Detection pictures
# --------------------------------------------------------------------------------------------
def test_pr_curves(tmp_path, split):
    _, details = CocoEvaluator(split, CLASSES).evaluate([_predictions()], details=True)
    picture = plot_pr_curves(details.precision, details.classes, details.ap50, tmp_path / "pr.png")
    check_png(tmp_path / "pr.png", picture, (950, 950), (600, 600))  # legend beside the axes
    rng = np.random.default_rng(0)
    many = np.sort(rng.random((101, 80)), 0)[::-1]
    many[:, 5] = -1  # a class without ground truth
    picture = plot_pr_curves(many, [f"c{i}" for i in range(80)], None, tmp_path / "pr80.png")
    check_png(tmp_path / "pr80.png", picture, (700, 700), (600, 600))  # no legend column for 80 classes


def test_save_detections_on_scenes_and_photos(tmp_path, split):
    _, details = CocoEvaluator(split, CLASSES).evaluate([_predictions()], details=True)
    images, targets, predictions = evaluation_samples(split, details.predictions, 5)
    assert len(images) == 2 and images[0].size == (100, 80) and targets[1]["image_id"] == 2
    assert targets[0]["boxes"].tolist() == [[10, 10, 30, 30], [50, 40, 80, 70]]
    picture = save_detections(images, targets, predictions, CLASSES, tmp_path / "det.png")
    pixels = check_png(tmp_path / "det.png", picture, (1000, 1200), (450, 700))
    flat = pixels.reshape(-1, 3)
    for c in (0, 1, 2):  # the predicted classes' colours (boxes, labels, legend)
        assert (flat == class_colour(c)).all(1).sum() > 100
    # a 640 x 480 photo and a 96 x 96 scene: both drawn at the same size
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (480, 640, 3), np.uint8))
    scene = torch.rand(3, 96, 96)
    target = {"boxes": torch.tensor([[100.0, 100, 300, 400]]), "labels": torch.tensor([1])}
    prediction = {
        "boxes": torch.tensor([[110.0, 90, 310, 380]]),
        "labels": torch.tensor([1]),
        "scores": torch.tensor([0.8]),
    }
    small = {"boxes": torch.tensor([[10.0, 10, 50, 60]]), "labels": torch.tensor([0])}
    picture = save_detections(
        [photo, scene],
        [target, small],
        [prediction, {**prediction, "scores": torch.tensor([0.2])}],
        CLASSES,
        tmp_path / "mixed.png",
        score_threshold=0.3,
    )
    check_png(tmp_path / "mixed.png", picture, (1000, 1200), (450, 700))
    assert font(16).getbbox("Ag")[3] >= 14  # a scalable font, not PIL's 7-px bitmap


def test_save_evaluation_figures(tmp_path, split):
    _, details = CocoEvaluator(split, CLASSES).evaluate([_predictions()], details=True)
    pictures = save_evaluation_figures(details, tmp_path, split, plot_images=2)
    assert set(pictures) == {"pr_curves", "confusion_matrix", "detections"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "confusion_matrix.png",
        "detections.png",
        "per_class_ap.csv",
        "pr_curves.png",
    ]
    rows = (tmp_path / "per_class_ap.csv").read_text().splitlines()
    assert rows[0].split(",") == ["class", "instances", "ap50", "ap"] and len(rows) == 1 + len(CLASSES)


def test_save_evaluation_figures_sends_box_overlays_to_wandb(tmp_path, split):
    """With a W&B run, the drawn evaluation images also go to W&B with their boxes (interactive overlays)."""

    class Recording:
        def log(self, values, step):
            self.values, self.step = values, step

    _, details = CocoEvaluator(split, CLASSES).evaluate([_predictions()], details=True)
    wandb_run = Recording()
    save_evaluation_figures(details, tmp_path, split, plot_images=2, wandb_run=wandb_run, step=40)
    assert wandb_run.step == 40 and len(wandb_run.values["detections"]) == 2
    assert all(image._boxes for image in wandb_run.values["detections"])


def test_figures_do_not_import_matplotlib_until_they_draw():
    """Recipes import these modules; matplotlib's import time is paid only by a run that plots."""
    code = (
        "import sys\nimport common.artifacts.figures, common.detection.coco_eval\n"
        "import common.detection.figures, common.detection.outputs\n"
        "assert 'matplotlib' not in sys.modules, 'imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
