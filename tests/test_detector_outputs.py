"""The detectors on a user's own COCO folder whose category ids are 0, 3, 7, 8, 12, ... 90 (gaps, 0
included, listed out of order) and whose image ids start at 5000: the ids survive into the weights and
predictions.json, pycocotools scoring predictions.json against the user's json gives the numbers the
recipe reported, ``--eval_only`` reproduces them (in fp32 and under bf16 autocast), and ``--predict``
writes detections in the original images' pixels and ids.

Faster R-CNN learns these scenes within a minute, so it carries the learned checks; YOLO and DETR run
the same modes on weights trained for a few steps."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.data.builtin import DETECTION
from common.detection.data import load_detection
from common.weights import read_metadata
from conftest import assert_same_detections, check, error_line, export_and_predict, load_recipe, run_recipe

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
IDS = dict(enumerate([0, 3, 7, 8, 12, 15, 20, 31, 44, 90]))  # digit -> the user's category id
NAMES = {IDS[d]: WORDS[d] for d in range(10)}  # category id -> name


def _user_folder(root: Path, sizes: dict[str, int]) -> Path:
    """A COCO folder from the built-in scenes: digit d has category id IDS[d]; image ids 5000 + 3k."""
    source = DETECTION["digits_det"]()
    for split, count in sizes.items():
        coco = json.loads((source / "annotations" / f"instances_{split}.json").read_text())
        digit = {c["id"]: int(c["name"]) for c in coco["categories"]}
        images = coco["images"][:count]
        new_id = {im["id"]: 5000 + 3 * k for k, im in enumerate(images)}
        (root / split).mkdir(parents=True)
        for im in images:
            shutil.copy(source / split / im["file_name"], root / split / im["file_name"])
        annotations = [
            dict(a, image_id=new_id[a["image_id"]], category_id=IDS[digit[a["category_id"]]], id=k + 1)
            for k, a in enumerate(a for a in coco["annotations"] if a["image_id"] in new_id)
        ]
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps(
                {
                    "images": [dict(im, id=new_id[im["id"]]) for im in images],
                    "annotations": annotations,
                    "categories": [{"id": i, "name": NAMES[i]} for i in sorted(NAMES, key=str)],
                }
            )
        )  # 0, 12, 15, 20, 3, ...
    return root


def _pycocotools(gt_json: Path, results: list[dict]) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_json))
        evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return [float(v) for v in evaluation.stats[:6]]


def _last_eval(run: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval/map" in r][-1]


METRICS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large")
FRCNN = ["--report_to", "none", "--num_workers", "0", "--eval_every", "1", "--plot_images", "2"]


@pytest.fixture(scope="module")
def frcnn_run(tmp_path_factory):
    """Faster R-CNN's default model, 2 epochs on 800 of the user's scenes, evaluated on 100."""
    root = tmp_path_factory.mktemp("user_coco")
    data = _user_folder(root / "data", {"train": 800, "val": 100})
    run = root / "run"
    check(run_recipe("faster_rcnn", ["--data", str(data), "--output_dir", str(run), *FRCNN], timeout=600))
    return data, run


@pytest.mark.slow
def test_weights_and_predictions_json_keep_the_users_ids(frcnn_run):
    data, run = frcnn_run
    for name in ("best.safetensors", "final.safetensors"):
        meta = read_metadata(run / name)
        assert meta["classes"] == WORDS and meta["category_ids"] == list(IDS.values()), meta
    results = json.loads((run / "predictions.json").read_text())
    gt = json.loads((data / "annotations" / "instances_val.json").read_text())
    assert {r["category_id"] for r in results} == set(NAMES)
    assert {r["image_id"] for r in results} <= {im["id"] for im in gt["images"]}
    assert all(len(r["bbox"]) == 4 and 0 <= r["score"] <= 1 for r in results)
    reported = _last_eval(run)
    assert reported["eval/map_50"] > 0.3, reported  # a detector that found the digits, not an empty file
    # the user's own scoring of the file gives the numbers the recipe reported
    assert _pycocotools(data / "annotations" / "instances_val.json", results) == pytest.approx(
        [reported[f"eval/{k}"] for k in METRICS], abs=1e-12
    )


@pytest.mark.slow
def test_eval_only_reproduces_the_run_in_fp32_and_under_bf16(frcnn_run, tmp_path):
    """--eval_only on the final weights gives the last evaluation's metrics exactly, writes no
    checkpoints or weights, and bf16 autocast changes mAP by at most 0.02 (boxes decode in fp32)."""
    data, run = frcnn_run
    reported = _last_eval(run)
    scores = {}
    for precision in ("no", "bf16"):
        out = tmp_path / precision
        check(
            run_recipe(
                "faster_rcnn",
                [
                    "--eval_only",
                    "--weights",
                    str(run / "final.safetensors"),
                    "--data",
                    str(data),
                    "--output_dir",
                    str(out),
                    "--mixed_precision",
                    precision,
                    *FRCNN,
                ],
                timeout=300,
            )
        )
        scores[precision] = _last_eval(out)
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl", "plots", "predictions.json"]
        assert sorted(p.name for p in (out / "plots").iterdir()) == [
            "confusion_matrix.png",
            "detections.png",
            "per_class_ap.csv",
            "pr_curves.png",
        ]
    assert {k: scores["no"][f"eval/{k}"] for k in METRICS} == {k: reported[f"eval/{k}"] for k in METRICS}
    assert json.loads((tmp_path / "no" / "predictions.json").read_text()) == json.loads(
        (run / "predictions.json").read_text()
    )
    # bf16 features move scores and proposals a little, not the boxes' coordinates (rounded boxes cost
    # a perfect detector 0.19 mAP). A young detector's ranking is fragile, more so from one torch
    # release to the next: the whole split moves by up to 0.02, a size bucket of a few dozen boxes,
    # in steps of about 0.01, by up to 0.06.
    for k in METRICS:
        tolerance = 0.02 if k in ("map", "map_50", "map_75") else 0.06
        assert abs(scores["bf16"][f"eval/{k}"] - scores["no"][f"eval/{k}"]) <= tolerance, (k, scores)


@pytest.mark.slow
def test_predictions_through_onnx_are_those_of_the_weights(frcnn_run, tmp_path):
    """Faster R-CNN's export (TorchScript exporter: NMS inside the graph, one image of any size in, boxes
    in its pixels out) predicts what the weights predict: the same classes and the user's category ids,
    boxes within 0.5 px, scores within 1e-3. The run's model folder carries its config and card."""
    data, run = frcnn_run
    images = tmp_path / "images"
    images.mkdir()
    for entry in json.loads((data / "annotations" / "instances_val.json").read_text())["images"][:4]:
        shutil.copy(data / "val" / entry["file_name"], images / entry["file_name"])
    args = ["--predict_score", "0.3", *FRCNN]
    export, eager, onnx = export_and_predict("faster_rcnn", run / "best.safetensors", images, tmp_path, *args)
    assert sorted(p.name for p in export.iterdir()) == ["config.yaml", "metrics.jsonl", "model.onnx"]
    assert assert_same_detections(eager, onnx) >= 4
    found = json.loads((onnx / "detections.json").read_text())
    assert {d["category_id"] for e in found for d in e["detections"]} <= set(IDS.values())
    folder = json.loads((run / "model" / "config.json").read_text())
    assert folder["recipe"] == "faster_rcnn" and folder["category_ids"] == [IDS[d] for d in range(10)]
    card = (run / "model" / "README.md").read_text()
    assert "recipes/faster_rcnn.py --predict path/to/images --weights path/to/this/folder" in card


def test_predict_writes_detections_in_original_pixels_and_the_users_ids(frcnn_run, tmp_path):
    """Two evaluation images as files (one enlarged 1.5x, one in a subfolder) and no dataset: the
    detections are the evaluation pass's own for the plain copy, scaled by 1.5 for the enlarged one."""
    data, run = frcnn_run
    gt = json.loads((data / "annotations" / "instances_val.json").read_text())
    first, second = gt["images"][:2]
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    shutil.copy(data / "val" / first["file_name"], images / "plain.png")
    with Image.open(data / "val" / second["file_name"]) as picture:
        picture.resize((picture.width * 3 // 2, picture.height * 3 // 2), Image.BICUBIC).save(
            images / "sub" / "big.png"
        )
    out = tmp_path / "predict"
    proc = check(
        run_recipe(
            "faster_rcnn",
            [
                "--predict",
                str(images),
                "--weights",
                str(run / "final.safetensors"),
                "--data",
                "no/such/dataset",
                "--output_dir",
                str(out),
                "--predict_score",
                "0.3",
                *FRCNN,
            ],
            timeout=300,
        )
    )
    entries = {Path(e["file"]).name: e for e in json.loads((out / "detections.json").read_text())}
    assert sorted(entries) == ["big.png", "plain.png"]
    assert (entries["big.png"]["width"], entries["big.png"]["height"]) == (
        second["width"] * 3 // 2,
        second["height"] * 3 // 2,
    )
    assert sorted(str(p.relative_to(out / "predictions")) for p in (out / "predictions").rglob("*.png")) == [
        "plain.png",
        "sub/big.png",
    ]
    for e in entries.values():
        for d in e["detections"]:
            assert d["score"] >= 0.3 and NAMES[d["category_id"]] == d["class"]
            x0, y0, x1, y1 = d["box"]
            assert -0.5 <= x0 < x1 <= e["width"] + 0.5 and -0.5 <= y0 < y1 <= e["height"] + 0.5
    evaluated = [
        r
        for r in json.loads((run / "predictions.json").read_text())
        if r["image_id"] == first["id"] and r["score"] >= 0.3
    ]
    plain = entries["plain.png"]["detections"]
    assert plain and len(plain) == len(evaluated)
    # the detections under the threshold are counted on the console, not silently dropped
    low = [
        r
        for r in json.loads((run / "predictions.json").read_text())
        if r["image_id"] == first["id"] and r["score"] < 0.3
    ]
    # every threshold applied is named: the model's own (box_score_thresh) and --predict_score
    assert "scoring \u2265 0.3 (predict_score; the model drops scores below 0.05, box_score_thresh)" in proc.stdout
    said = re.search(r"(\d+) more detections? score between 0.05 and 0.3 \(the best (0\.\d+)\)", proc.stdout)
    assert said and int(said[1]) >= len(low) and float(said[2]) < 0.3, proc.stdout[-2000:]
    for d, r in zip(plain, sorted(evaluated, key=lambda r: -r["score"])):
        x, y, w, h = r["bbox"]
        assert d["category_id"] == r["category_id"] and d["score"] == pytest.approx(r["score"], abs=1e-4)
        assert d["box"] == pytest.approx([x, y, x + w, y + h], abs=0.01)
    assert any(len(e["detections"]) for e in entries.values())


@pytest.mark.slow
def test_predict_with_two_processes_writes_what_one_does(frcnn_run, tmp_path):
    """Two gloo processes each detect their share of 5 images (Accelerate repeats one to even the
    rounds); the main process writes every image once, as one process does."""
    data, run = frcnn_run
    images = tmp_path / "images"
    images.mkdir()
    for row in json.loads((data / "annotations" / "instances_val.json").read_text())["images"][:5]:
        shutil.copy(data / "val" / row["file_name"], images / row["file_name"])
    written = {}
    for nproc in (1, 2):
        out = tmp_path / f"predict{nproc}"
        check(
            run_recipe(
                "faster_rcnn",
                [
                    "--predict",
                    str(images),
                    "--weights",
                    str(run / "final.safetensors"),
                    "--output_dir",
                    str(out),
                    "--batch_size",
                    "1",
                    *FRCNN,
                ],
                nproc=nproc,
                timeout=300,
            )
        )
        written[nproc] = json.loads((out / "detections.json").read_text())
        assert len(list((out / "predictions").glob("*.png"))) == 5
    assert [e["file"] for e in written[2]] == [e["file"] for e in written[1]] and len(written[1]) == 5
    assert sum(len(e["detections"]) for e in written[1]) > 0
    for one, two in zip(written[1], written[2]):
        assert [d["category_id"] for d in two["detections"]] == [d["category_id"] for d in one["detections"]]
        for a, b in zip(one["detections"], two["detections"]):
            assert b["score"] == pytest.approx(a["score"], abs=1e-4) and b["box"] == pytest.approx(a["box"], abs=0.01)


def test_eval_only_refuses_weights_of_other_classes_and_predict_needs_weights(frcnn_run, capsys):
    _, run = frcnn_run
    frcnn = load_recipe("faster_rcnn")
    line = error_line(
        capsys,
        frcnn.main,
        ["--eval_only", "--weights", str(run / "final.safetensors"), "--data", "digits_det", "--report_to", "none"],
    )
    assert "were trained on classes 0:zero, 3:one, 7:two, 8:three, 12:four" in line, line
    assert "the data has 0:0, 1:1" in line, line
    assert "predict needs --weights" in error_line(capsys, frcnn.main, ["--predict", str(run), "--report_to", "none"])
    detr = load_recipe("detr")
    assert "do not fit" in error_line(
        capsys,
        detr.main,
        [
            "--eval_only",
            "--weights",
            str(run / "final.safetensors"),
            "--data",
            str(frcnn_run[0]),
            "--report_to",
            "none",
        ],
    )


@pytest.mark.configs  # the second tier (-m configs), which CI runs; Faster R-CNN's case is the default suite's
@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, args",
    [
        ("yolo", ["--export", "false", "--num_workers", "0", "--conf_threshold", "0"]),  # 4 steps: scores are low
        ("detr", ["--pretrain_crops_epochs", "0", "--num_workers", "0", "--best_metric", "map_50_11pt"]),
    ],
)
def test_eval_only_and_predict_in_every_detector(recipe, args, tmp_path):
    """A few training steps, then --eval_only (the same metrics as the run's last evaluation, the ids in
    predictions.json) and --predict on a folder (one entry and one picture per image)."""
    data = _user_folder(tmp_path / "data", {"train": 64, "val": 16})
    common = ["--data", str(data), "--report_to", "none", "--plot_images", "1", *args]
    check(run_recipe(recipe, [*common, "--output_dir", str(tmp_path / "run"), "--epochs", "1", "--max_steps", "4"]))
    assert read_metadata(tmp_path / "run" / "final.safetensors")["category_ids"] == list(IDS.values())
    if "--best_metric" in args:  # best.safetensors follows VOC07's 11-point mAP@0.5, logged beside COCO's
        last = _last_eval(tmp_path / "run")
        assert last["best/map_50_11pt"] == last["eval/map_50_11pt"] and (tmp_path / "run" / "best.safetensors").exists()
    weights = ["--weights", str(tmp_path / "run" / "final.safetensors")]
    check(run_recipe(recipe, [*common, *weights, "--eval_only", "--output_dir", str(tmp_path / "eval")]))
    reported, again = _last_eval(tmp_path / "run"), _last_eval(tmp_path / "eval")
    assert {k: again[f"eval/{k}"] for k in METRICS} == {k: reported[f"eval/{k}"] for k in METRICS}
    results = json.loads((tmp_path / "eval" / "predictions.json").read_text())
    assert results and {r["category_id"] for r in results} <= set(NAMES)
    assert _pycocotools(data / "annotations" / "instances_val.json", results) == pytest.approx(
        [reported[f"eval/{k}"] for k in METRICS], abs=1e-12
    )
    check(
        run_recipe(
            recipe,
            [
                *common,
                *weights,
                "--predict",
                str(data / "val"),
                "--predict_score",
                "0",
                "--output_dir",
                str(tmp_path / "predict"),
            ],
        )
    )
    entries = json.loads((tmp_path / "predict" / "detections.json").read_text())
    assert len(entries) == 16 and len(list((tmp_path / "predict" / "predictions").glob("*.png"))) == 16
    assert all(d["category_id"] in NAMES for e in entries for d in e["detections"])


# ---- --predict's label files: what Ultralytics trains on ---------------------------------------------------------
CLASSES = ["cat", "dog", "bird"]  # category ids 3, 7, 12: the label files hold the indices
DETECTED = {  # image -> (boxes XYXY in its pixels, scores, class indices)
    "a.jpg": ([[10.0, 8.0, 30.0, 40.0], [0.0, 0.0, 64.0, 48.0]], [0.9, 0.5], [2, 0]),
    "sub/b.jpg": ([[4.5, 6.0, 20.0, 30.25]], [0.7], [1]),
}


def _predicted(tmp_path: Path, with_scores: bool) -> Path:
    """common.detection.outputs.save_predictions on two photos (one in a sub-folder) and the detections above, as
    a detector's --predict passes them; returns the run folder."""
    from types import SimpleNamespace

    import torch

    from common.detection.outputs import save_predictions
    from common.detection.sources import image_table

    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (40, 40, 40)).save(photos / "a.jpg")
    Image.new("RGB", (80, 60), (40, 40, 40)).save(photos / "sub" / "b.jpg")
    files = [photos / name for name in DETECTED]
    table = image_table(files)
    batch = [
        {"image_id": i, "boxes": torch.tensor(b), "scores": torch.tensor(s), "labels": torch.tensor(c)}
        for i, (b, s, c) in enumerate(DETECTED.values())
    ]
    run = SimpleNamespace(
        dir=tmp_path / ("scored" if with_scores else "run"),
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True),
        begin=lambda: None,
        print=lambda line: None,
        finish=lambda: None,
    )
    run.dir.mkdir()
    meta = {"classes": CLASSES, "category_ids": [3, 7, 12]}
    save_predictions(run, [batch], table, meta, 0.3, photos, with_scores=with_scores)
    return run.dir


def test_predict_label_files_are_training_labels_with_a_data_yaml(tmp_path):
    """labels/<image>.txt rows are `class cx cy w h` with the class index (not the dataset's category id), and
    data.yaml beside them names the classes: with the images put under images/, the YOLO reader reads them back as
    the detections. --predict_scores adds the score as a sixth column."""
    import yaml

    run = _predicted(tmp_path, with_scores=False)
    assert yaml.safe_load((run / "data.yaml").read_text())["names"] == dict(enumerate(CLASSES))
    for name, (boxes, _, classes) in DETECTED.items():
        rows = [line.split() for line in (run / "labels" / name).with_suffix(".txt").read_text().splitlines()]
        assert [len(row) for row in rows] == [5] * len(boxes) and [int(row[0]) for row in rows] == classes
    shutil.copytree(tmp_path / "photos", run / "images")
    back = load_detection(str(run / "data.yaml"), eval_split="val")
    assert back.classes == CLASSES and back.category_ids == [0, 1, 2]
    for row in back.eval:
        boxes, _, classes = DETECTED[str(Path(row["image"]["path"]).relative_to(run / "images"))]
        assert row["objects"]["category"] == classes
        expected = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in boxes]
        np.testing.assert_allclose(row["objects"]["bbox"], expected, atol=1e-3)
    scored = _predicted(tmp_path, with_scores=True)
    rows = [line.split() for line in (scored / "labels" / "a.txt").read_text().splitlines()]
    assert [len(row) for row in rows] == [6, 6] and [float(row[5]) for row in rows] == pytest.approx([0.9, 0.5])
    assert [row[:5] for row in rows] == [line.split() for line in (run / "labels" / "a.txt").read_text().splitlines()]


def test_ultralytics_trains_on_predicts_label_files_and_refuses_scored_ones(tmp_path, monkeypatch):
    """Where Ultralytics is installed (a separate environment: /tmp/ulvenv/bin/python -m pytest ...): its data yaml
    check takes data.yaml, its dataset reads every 5-column label file with the classes and boxes written, and its
    label check refuses the 6-column rows of --predict_scores as training labels."""
    pytest.importorskip("ultralytics")
    import ultralytics.data.utils as utils
    from ultralytics.data.dataset import YOLODataset

    monkeypatch.setattr(utils, "check_font", lambda *a, **k: None)  # a font for plots: a download, offline here
    run = _predicted(tmp_path, with_scores=False)
    shutil.copytree(tmp_path / "photos", run / "images")
    data = utils.check_det_dataset(str(run / "data.yaml"))
    assert data["names"] == dict(enumerate(CLASSES)) and Path(data["train"]) == run / "images"
    dataset = YOLODataset(img_path=data["train"], data=data, imgsz=64, augment=False, cache=False)
    read = {str(Path(label["im_file"]).relative_to(run / "images")): label for label in dataset.labels}
    assert sorted(read) == sorted(DETECTED)
    for name, (boxes, _, classes) in DETECTED.items():
        width, height = Image.open(run / "images" / name).size
        xywhn = [[(x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height]
                 for x0, y0, x1, y1 in boxes]  # fmt: skip
        assert read[name]["cls"].flatten().tolist() == classes
        np.testing.assert_allclose(read[name]["bboxes"], xywhn, atol=1e-5)
    scored = _predicted(tmp_path, with_scores=True)
    for folder, columns in ((run, 5), (scored, 6)):
        shutil.copytree(tmp_path / "photos", folder / "images", dirs_exist_ok=True)
        answer = utils.verify_image_label(
            (str(folder / "images" / "a.jpg"), str(folder / "labels" / "a.txt"), "", False, 3, 0, 0, False)
        )
        im_file, rows, *_, corrupt, message = answer
        if columns == 5:
            assert im_file is not None and corrupt == 0 and rows.shape == (2, 5), message
        else:
            assert im_file is None and corrupt == 1 and "labels require 5 columns, 6 columns detected" in message


def test_yolo_clips_its_boxes_to_the_original_image(monkeypatch):
    """A box reaching past the letterboxed picture (padding, border cells) ends at the image's edges
    once mapped back to the original pixels, as the other two detectors' boxes do."""
    import torch
    from accelerate import Accelerator

    import yolo_model  # where detect and its NMS live, beside the recipe

    class Model(torch.nn.Module):
        def forward(self, images):
            return torch.zeros(len(images), 1, 6)

        def decode(self, raw, height, width):
            return torch.zeros(len(raw), 1, 4), torch.zeros(len(raw), 1, 1)

    box = {
        "boxes": torch.tensor([[-8.0, 10.0, 70.0, 40.0]]),
        "scores": torch.tensor([0.9]),
        "labels": torch.tensor([0]),
    }
    monkeypatch.setattr(yolo_model, "postprocess", lambda *args: [dict(box)])
    loader = [(torch.zeros(1, 3, 64, 64), None, [{"image_id": 1, "size": (64, 64), "orig_size": (32, 48)}])]
    (batch,) = list(yolo_model.detect(Model(), loader, Accelerator(cpu=True), 0.01, 0.45, 100))
    # x scales by 48 / 64, y by 32 / 64: [-6, 5, 52.5, 20] before clipping to 48 x 32
    assert batch[0]["boxes"].tolist() == [[0.0, 5.0, 48.0, 20.0]] and batch[0]["image_id"] == 1


def test_every_detector_drops_boxes_under_one_pixel(monkeypatch):
    """Boxes under 1 px wide or tall in the original image (clipped at its border to a sliver, or collapsed) are no
    detections in any detector's output; the rest keep their scores and labels in order."""
    import torch
    from accelerate import Accelerator

    import detr_model
    import faster_rcnn_model
    import yolo_model

    boxes = torch.tensor([[10.0, 10.0, 30.0, 30.0], [10.0, 10.0, 30.0, 10.02], [10.0, 5.0, 10.5, 20.0]])
    found = {"boxes": boxes, "scores": torch.tensor([0.9, 0.8, 0.7]), "labels": torch.tensor([2, 1, 0])}
    target = {"image_id": 7, "size": (64, 64), "orig_size": (64, 64)}
    accelerator = Accelerator(cpu=True)

    class Yolo(torch.nn.Module):
        def forward(self, images):
            return torch.zeros(len(images), 1, 6)

        def decode(self, raw, height, width):
            return torch.zeros(len(raw), 1, 4), torch.zeros(len(raw), 1, 1)

    monkeypatch.setattr(yolo_model, "postprocess", lambda *args: [dict(found)])
    monkeypatch.setattr(detr_model, "postprocess", lambda outputs, orig: [dict(found)])
    images = torch.zeros(1, 3, 64, 64)
    outputs = {
        "yolo": yolo_model.detect(Yolo(), [(images, None, [target])], accelerator, 0.01, 0.45, 100),
        "detr": detr_model.detect(lambda *a: None, [(images, None, [target])], accelerator),
        "faster_rcnn": faster_rcnn_model.detect(
            lambda x: [{**found, "labels": found["labels"] + 1}], [([images[0]], [target])], accelerator
        ),
    }
    for recipe, batches in outputs.items():
        (detection,) = next(iter(batches))
        assert detection["boxes"].tolist() == [[10.0, 10.0, 30.0, 30.0]], recipe
        assert detection["scores"].tolist() == pytest.approx([0.9]) and detection["labels"].tolist() == [2], recipe
        assert detection["image_id"] == 7, recipe
