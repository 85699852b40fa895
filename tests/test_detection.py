"""common/detection/data, detection_sources, boxes, coco_eval and plots: COCO-json and hub sources,
the dataset and collate, box helpers, COCO evaluation, drawing."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from common import UserError
from common.data.builtin import DETECTION
from common.data.images import decode_image
from common.detection.boxes import areas, rescale_boxes
from common.detection.coco_eval import CocoEvaluator
from common.detection.data import DetectionDataset, collate, load_detection
from common.detection.figures import class_colour, draw_detections, save_detections, wandb_boxes
from common.detection.forms import detection_form
from common.detection.sources import features
from conftest import ROOT, bright_rectangle, detection_table, free_port, load_recipe, recipe_env


@pytest.fixture(scope="module")
def digits_det():
    """The built-in scenes from the default cache (tests/test_builtin.py covers how they are made)."""
    return SimpleNamespace(folder=DETECTION["digits_det"](), data=load_detection("digits_det"))


def _xyxy(bbox) -> np.ndarray:
    b = np.asarray(bbox, np.float64).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], 1)


# The least box-aware transform a recipe could use: a float image in 0..1, boxes clamped, boxes under
# 1 px dropped with their labels (every recipe's transforms end so; recipes' own tests cover theirs).
_plain = v2.Compose(
    [
        v2.ToImage(),
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=1.0),
        v2.ToDtype(torch.float32, scale=True),
    ]
)
# A random one: flip and photometric noise, seeded per sample by DetectionDataset.
_random = v2.Compose(
    [
        v2.ToImage(),
        v2.RandomHorizontalFlip(0.5),
        v2.RandomPhotometricDistort(p=1.0),
        v2.ToDtype(torch.float32, scale=True),
    ]
)


# Sources: a COCO-json folder (two layouts) and a hub-schema dataset give the same rows
# --------------------------------------------------------------------------------------------
CLASSES = ["bird", "cat", "dog"]
CATEGORY_IDS = [1, 3, 7]  # non-contiguous COCO ids: the class index is the id's rank


def _scenes() -> dict[str, list[dict]]:
    """Two small splits: image_id, pixels (h, w, 3), objects (COCO boxes, class index, area)."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, ids in (("train", [4, 5, 6]), ("val", [10, 11])):
        rows = []
        for image_id in ids:
            w, h = int(rng.integers(30, 60)), int(rng.integers(30, 60))
            count = 0 if image_id == 11 else 2  # an image without objects: a negative, kept
            boxes = [[float(rng.integers(0, w // 2)), float(rng.integers(0, h // 2)), 10.5, 12.0] for _ in range(count)]
            rows.append(
                {
                    "image_id": image_id,
                    "pixels": rng.integers(0, 255, (h, w, 3), dtype=np.uint8),
                    "bbox": boxes,
                    "category": rng.integers(0, 3, count).tolist(),
                    "area": [100.0] * count,
                }
            )
        splits[split] = rows
    return splits


def _coco_json(rows: list[dict], extra: list[dict] = ()) -> dict:
    annotations = [
        {
            "id": 100 * r["image_id"] + k,
            "image_id": r["image_id"],
            "bbox": box,
            "area": area,
            "category_id": CATEGORY_IDS[c],
            "iscrowd": 0,
        }
        for r in rows
        for k, (box, c, area) in enumerate(zip(r["bbox"], r["category"], r["area"]))
    ]
    return {
        "images": [
            {
                "id": r["image_id"],
                "file_name": f"{r['image_id']}.png",
                "width": r["pixels"].shape[1],
                "height": r["pixels"].shape[0],
            }
            for r in rows
        ],
        "annotations": annotations + list(extra),
        "categories": [{"id": i, "name": n} for i, n in sorted(zip([7, 1, 3], ["dog", "bird", "cat"]))],
    }


def _write_coco(root: Path, layout: str, splits: dict[str, list[dict]]) -> Path:
    for split, rows in splits.items():
        if layout == "coco":  # annotations/instances_<split>.json, images in <split>/
            folder, json_path = root / split, root / "annotations" / f"instances_{split}.json"
        else:  # Roboflow: <split>/_annotations.coco.json beside the images, 'valid' for val
            folder = root / ("valid" if split == "val" else split)
            json_path = folder / "_annotations.coco.json"
        folder.mkdir(parents=True, exist_ok=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        for r in rows:
            Image.fromarray(r["pixels"]).save(folder / f"{r['image_id']}.png")
        json_path.write_text(json.dumps(_coco_json(rows)))
    return root


def _hubdetection_table(splits: dict[str, list[dict]]):
    """The cppe-5 schema: image_id, image, width, height, objects{id, area, bbox, category: ClassLabel}."""
    import datasets

    features = datasets.Features(
        {
            "image_id": datasets.Value("int64"),
            "image": datasets.Image(),
            "width": datasets.Value("int32"),
            "height": datasets.Value("int32"),
            "objects": {
                "id": datasets.Sequence(datasets.Value("int64")),
                "area": datasets.Sequence(datasets.Value("float64")),
                "bbox": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
                "category": datasets.Sequence(datasets.ClassLabel(names=CLASSES)),
            },
        }
    )
    out = {}
    for split, rows in splits.items():
        out["validation" if split == "val" else split] = datasets.Dataset.from_dict(
            {
                "image_id": [r["image_id"] for r in rows],
                "image": [Image.fromarray(r["pixels"]) for r in rows],
                "width": [r["pixels"].shape[1] for r in rows],
                "height": [r["pixels"].shape[0] for r in rows],
                "objects": [
                    {"id": list(range(len(r["bbox"]))), "area": r["area"], "bbox": r["bbox"], "category": r["category"]}
                    for r in rows
                ],
            },
            features=features,
        )
    return datasets.DatasetDict(out)


def _rows(ds) -> list[tuple]:
    return [
        (r["image_id"], r["width"], r["height"], r["objects"], np.asarray(decode_image(r["image"], "")).tobytes())
        for r in ds
    ]


def test_coco_folders_and_hub_dataset_load_to_the_same_rows(tmp_path):
    splits = _scenes()
    hub = _hubdetection_table(splits)
    hub.save_to_disk(str(tmp_path / "saved"))
    repo = tmp_path / "repo" / "data"  # a local copy of a hub repository: parquet files
    repo.mkdir(parents=True)
    for split, ds in hub.items():
        ds.to_parquet(str(repo / f"{split}-00000-of-00001.parquet"))
    sources = {
        "coco": _write_coco(tmp_path / "coco", "coco", splits),
        "roboflow": _write_coco(tmp_path / "roboflow", "roboflow", splits),
        "saved": tmp_path / "saved",
        "repo": tmp_path / "repo",
    }
    loaded = {name: load_detection(str(path)) for name, path in sources.items()}
    expected = [
        (
            r["image_id"],
            r["pixels"].shape[1],
            r["pixels"].shape[0],
            {"bbox": r["bbox"], "category": r["category"], "area": r["area"], "iscrowd": [0] * len(r["bbox"])},
            r["pixels"].tobytes(),
        )
        for r in splits["train"]
    ]
    for name, data in loaded.items():
        assert data.classes == CLASSES, name
        assert data.train.features == features() == data.eval.features, name
        assert _rows(data.train) == expected, name  # eval split found: validation, val or valid
        assert _rows(data.eval) == _rows(loaded["coco"].eval), name
    assert list(loaded["coco"].eval["image_id"]) == [10, 11]


def test_shipped_coco_configs_read_a_folder_of_train_and_val(tmp_path):
    """The README's example: a COCO config names COCO's train2017 / val2017, the user's folder (or a
    Roboflow export) has train / val (valid): the same splits are read, with or without the year."""
    from common.config import parse_config
    from common.data.folders import same_split

    splits = _scenes()
    for layout in ("coco", "roboflow"):
        folder = _write_coco(tmp_path / layout, layout, splits)
        for recipe, config in (("faster_rcnn", "coco_r50_fpn_26ep"), ("detr", "coco_r50")):
            cfg = parse_config(
                load_recipe(recipe).Config, ["--config", str(ROOT / "configs" / recipe / f"{config}.yaml")]
            )
            assert (cfg.train_split, cfg.eval_split) == ("train2017", "val2017")
            data = load_detection(str(folder), cfg.train_split, cfg.eval_split)
            assert list(data.train["image_id"]) == [4, 5, 6] and list(data.eval["image_id"]) == [10, 11], layout
    assert same_split("val", ["train2017", "val2017"]) == "val2017"  # and the other way round
    assert same_split("val2017", ["train", "val", "valid"]) == "val2017"  # two candidates: the error lists them


def test_every_source_keeps_the_datasets_category_ids(tmp_path):
    """COCO: the json's ids by rank; a ClassLabel: its index; plain integer categories (a hub table
    without a ClassLabel, say 0, 3, 7): the distinct values of both splits, renumbered 0..C-1."""
    import datasets

    splits = _scenes()
    splits["train"][0]["category"], splits["train"][1]["category"] = [0, 1], [2, 2]  # every class present
    assert load_detection(str(_write_coco(tmp_path / "coco", "coco", splits))).category_ids == CATEGORY_IDS
    hub = _hubdetection_table(splits)
    hub.save_to_disk(str(tmp_path / "labels"))
    assert load_detection(str(tmp_path / "labels")).category_ids == [0, 1, 2]
    raw = {
        name: ds.cast_column(
            "objects", {**ds.features["objects"], "category": datasets.Sequence(datasets.Value("int64"))}
        ).map(
            lambda row: {"objects": {**row["objects"], "category": [[0, 3, 7][c] for c in row["objects"]["category"]]}}
        )
        for name, ds in hub.items()
    }
    datasets.DatasetDict(raw).save_to_disk(str(tmp_path / "raw"))
    data = load_detection(str(tmp_path / "raw"))
    assert data.classes == ["0", "3", "7"] and data.category_ids == [0, 3, 7]
    assert [o["category"] for o in data.train["objects"]] == [r["category"] for r in splits["train"]]


@pytest.mark.parametrize(
    "convert, message",
    [
        (lambda b, w, h: [b[0] / w, b[1] / h, b[2] / w, b[3] / h], "look normalised"),
        (lambda b, w, h: [b[0], b[1], b[0] + b[2], b[1] + b[3]], "look like corner boxes"),
    ],
)
def test_boxes_that_are_not_coco_pixels_are_one_clear_error(tmp_path, convert, message):
    """Normalised or [x0, y0, x1, y1] boxes in a hub table (or a COCO json) are refused, naming the data."""
    rng = np.random.default_rng(1)
    rows = []
    for image_id in range(12):
        w, h = 64, 48
        boxes = [[float(rng.integers(10, 40)), float(rng.integers(10, 30)), 20.0, 16.0] for _ in range(2)]
        rows.append(
            {
                "image_id": image_id,
                "pixels": rng.integers(0, 255, (h, w, 3), dtype=np.uint8),
                "area": [320.0] * 2,
                "bbox": [convert(b, w, h) for b in boxes],
                "category": [0, 1],
            }
        )
    _hubdetection_table({"train": rows[:8], "val": rows[8:]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(UserError, match=f"boxes of split 'train' of '{tmp_path / 'saved'}'.*{message}"):
        load_detection(str(tmp_path / "saved"))
    coco = _write_coco(tmp_path / "coco", "coco", {"train": rows[:8], "val": rows[8:]})
    with pytest.raises(UserError, match=f"instances_train.json'.*{message}"):
        load_detection(str(coco))


def test_crowd_regions_are_kept_for_evaluation_but_never_targets(tmp_path):
    splits = _scenes()
    crowd = {"id": 999, "image_id": 4, "bbox": [1.0, 1.0, 20.0, 20.0], "area": 300.0, "category_id": 3, "iscrowd": 1}
    _write_coco(tmp_path, "coco", splits)
    (tmp_path / "annotations" / "instances_train.json").write_text(json.dumps(_coco_json(splits["train"], [crowd])))
    data = load_detection(str(tmp_path))
    row = data.train[0]
    assert row["objects"]["iscrowd"] == [0, 0, 1] and row["objects"]["area"][2] == 300.0
    _, target = DetectionDataset(data.train, _plain)[0]
    assert len(target["boxes"]) == 2 and target["dropped"] == 0


def test_eval_split_carved_when_missing(tmp_path):
    splits = _scenes()
    _write_coco(tmp_path, "coco", {"train": splits["train"] + splits["val"]})
    data = load_detection(str(tmp_path), eval_fraction=0.4, seed=1)
    assert len(data.train) == 3 and len(data.eval) == 2
    assert sorted([*data.train["image_id"], *data.eval["image_id"]]) == [4, 5, 6, 10, 11]


def test_a_folder_in_no_form_names_every_forms_evidence_it_holds(tmp_path):
    """One line naming every form the folder holds evidence of, with counts and where (images, .xml annotations,
    .json files, YOLO label files), and what each of those forms still needs."""

    def refused(root: Path) -> str:
        assert detection_form(root) == ""
        with pytest.raises(UserError) as error:
            load_detection(str(root))
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"'{root}' is in no detection form: found ")
        return message

    mixed = tmp_path / "mixed"  # json and xml, neither in a form's place
    for name in ("a", "b", "c"):
        _save(mixed / "photos" / f"{name}.jpg")
    for name in ("a", "b"):
        (mixed / "voc_xml").mkdir(parents=True, exist_ok=True)
        (mixed / "voc_xml" / f"{name}.xml").write_text("<annotation></annotation>")
    (mixed / "export").mkdir()
    (mixed / "export" / "coco.json").write_text("{}")
    assert refused(mixed) == (
        f"'{mixed}' is in no detection form: found 3 images (photos/ (3)), 2 .xml annotations (voc_xml/ (2)) and "
        "1 .json file (export/coco.json); Pascal VOC needs Annotations/<id>.xml beside JPEGImages/<id>.jpg (or "
        "annotations/ beside images/) in one folder (docs/data.md#pascal-voc); COCO json needs "
        "annotations/instances_<split>.json or <split>/_annotations.coco.json (docs/data.md#coco-json)"
    )
    keypoints = tmp_path / "keypoints"  # an annotations/ folder, but no instances_<split>.json: no COCO folder
    _save(keypoints / "train" / "a.jpg")
    (keypoints / "annotations").mkdir()
    (keypoints / "annotations" / "person_keypoints_train.json").write_text("{}")
    message = refused(keypoints)
    assert "found 1 image (train/ (1)) and 1 .json file (annotations/person_keypoints_train.json); " in message
    assert message.endswith("COCO json needs annotations/instances_<split>.json or <split>/_annotations.coco.json "
                            "(docs/data.md#coco-json)")  # fmt: skip
    labels = tmp_path / "labels"  # YOLO label files and .xml together: both named
    _save(labels / "images" / "a.jpg")
    (labels / "labels").mkdir()
    (labels / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (labels / "xml").mkdir()
    (labels / "xml" / "a.xml").write_text("<annotation></annotation>")
    message = refused(labels)
    assert "found 1 image (images/ (1)), 1 YOLO label file (labels/ (1)) and 1 .xml annotation (xml/ (1)); " in message
    assert "YOLO txt needs a data.yaml" in message and "Pascal VOC needs" in message and "COCO" not in message
    with pytest.raises(UserError, match="is in no detection form: found no images in it"):
        load_detection(str(tmp_path / "labels" / "labels"))


def _save(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (90, 90, 90)).save(path)


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="detection dataset 'no_such_detection_set' could not be loaded"):
        load_detection("no_such_detection_set")
    splits = _scenes()
    coco = _write_coco(tmp_path / "coco", "coco", splits)
    (coco / "annotations" / "instances_train.json").unlink()  # annotations missing for the training split
    with pytest.raises(UserError, match=r"COCO folder .* has no split 'train'; it has \['val'\]"):
        load_detection(str(coco))
    with pytest.raises(UserError, match=r"has no split 'test'"):
        load_detection(str(coco), train_split="val", eval_split="test")
    images_only = tmp_path / "images_only" / "train"  # images, no annotation json at all
    images_only.mkdir(parents=True)
    Image.fromarray(splits["train"][0]["pixels"]).save(images_only / "a.png")
    with pytest.raises(UserError, match="is in no detection form: found 1 image .*no annotations.*COCO json"):
        load_detection(str(images_only.parent))
    empty = _write_coco(tmp_path / "empty", "coco", {"train": splits["train"], "val": []})
    with pytest.raises(UserError, match="the evaluation split of .* is empty"):
        load_detection(str(empty))
    unknown = _write_coco(tmp_path / "unknown", "coco", splits)
    extra = {"id": 1, "image_id": 4, "bbox": [0, 0, 1, 1], "category_id": 2, "iscrowd": 0}
    (unknown / "annotations" / "instances_train.json").write_text(json.dumps(_coco_json(splits["train"], [extra])))
    with pytest.raises(UserError, match="category_id 2, which is not in its 'categories'"):
        load_detection(str(unknown))
    with pytest.raises(UserError, match=r"cannot read image '.*broken\.png'"):
        bad = tmp_path / "broken.png"
        bad.write_bytes(b"not a png")
        DetectionDataset(detection_table([{"path": str(bad), "bytes": None}], [[]]), _plain)[0]


# --------------------------------------------------------------------------------------------
# Dataset, collate, box helpers
# --------------------------------------------------------------------------------------------
def test_degenerate_boxes_are_dropped_and_counted():
    boxes = [
        [10.0, 10.0, 20.0, 15.0],  # kept
        [30.0, 10.0, 0.0, 10.0],  # zero width
        [100.0, 100.0, 5.0, 5.0],  # outside the 80x60 image
        [40.0, 40.0, 0.5, 0.5],  # under 1 px
        [5.0, 5.0, 30.0, 30.0],
    ]  # crowd: not a target, not counted as dropped
    ds = DetectionDataset(detection_table([bright_rectangle()], [boxes], [[0, 1, 2, 1, 2]], [[0, 0, 0, 0, 1]]), _plain)
    _, target = ds[0]
    assert target["boxes"].tolist() == [[10.0, 10.0, 30.0, 25.0]] and target["labels"].tolist() == [0]
    assert target["dropped"] == 3 and target["size"] == (60, 80) and target["orig_size"] == (60, 80)
    _, target = DetectionDataset(detection_table([bright_rectangle()], [[]]), _plain)[0]  # a negative
    assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,) and target["dropped"] == 0


def test_same_epoch_and_index_same_sample(digits_det):
    ds = DetectionDataset(digits_det.data.train.select(range(8)), _random, seed=3)
    a, b, c = ds[(2, 5)], ds[(2, 5)], ds[(3, 5)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["boxes"], b[1]["boxes"])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(ds[5][0], ds[(0, 5)][0])  # a plain index is epoch 0
    state = torch.random.get_rng_state()
    ds[(1, 1)]
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's stream is untouched


def test_workers_give_the_same_batches(digits_det):
    ds = DetectionDataset(digits_det.data.train.select(range(8)), _random, seed=0)
    batches = [[(1, i) for i in range(4)], [(1, i) for i in range(4, 8)]]
    results = [
        list(torch.utils.data.DataLoader(ds, batch_sampler=batches, collate_fn=collate, num_workers=n)) for n in (0, 2)
    ]
    for (x0, m0, t0), (x1, m1, t1) in zip(*results):
        assert torch.equal(x0, x1) and torch.equal(m0, m1)
        assert all(torch.equal(a["boxes"], b["boxes"]) and a["image_id"] == b["image_id"] for a, b in zip(t0, t1))


def test_collate_pads_bottom_right_and_masks_padding():
    a, b = torch.ones(3, 5, 7), 2 * torch.ones(3, 6, 4)
    images, mask, targets = collate([(a, {"size": (5, 6), "image_id": 1}), (b, {"image_id": 2})])
    assert images.shape == (2, 3, 6, 7) and mask.shape == (2, 6, 7) and [t["image_id"] for t in targets] == [1, 2]
    assert torch.equal(images[0, :, :5], a) and (images[0, :, 5:] == 0).all()
    assert torch.equal(images[1, :, :, :4], b) and (images[1, :, :, 4:] == 0).all()
    expected = torch.ones(2, 6, 7, dtype=torch.bool)
    expected[0, :5, :6] = False  # the transform's own padding (column 6) counts as padding too
    expected[1, :6, :4] = False
    assert torch.equal(mask, expected)


def test_box_helpers_by_hand():
    boxes = torch.tensor([[0.0, 0.0, 4.0, 3.0], [5.0, 5.0, 4.0, 9.0], [1.0, 2.0, 1.5, 2.5]])
    assert areas(boxes).tolist() == [12.0, 0.0, 0.25]  # a box with a negative side has area 0
    # the picture (48, 64) of a padded 64 x 64 input, from an original of (60, 80): x 1.25 on both axes
    assert rescale_boxes(boxes[:1], (48, 64), (60, 80)).tolist() == [[0.0, 0.0, 5.0, 3.75]]


# --------------------------------------------------------------------------------------------
# COCO evaluation
# --------------------------------------------------------------------------------------------
def _predictions(ds, seed: int = 0) -> list[dict]:
    """Random-ish detections: jittered ground truth (some relabelled, some missed) plus false positives."""
    rng = np.random.default_rng(seed)
    out = []
    for row in ds:
        gt = _xyxy(row["objects"]["bbox"])
        keep = rng.random(len(gt)) > 0.15
        boxes = gt[keep] + rng.normal(0, 2.0, (int(keep.sum()), 4))
        labels = np.asarray(row["objects"]["category"])[keep]
        labels = np.where(rng.random(len(labels)) < 0.1, rng.integers(0, 10, len(labels)), labels)
        extra = int(rng.integers(0, 4))
        corner = rng.uniform(0, 70, (extra, 2))
        boxes = np.concatenate([boxes, np.concatenate([corner, corner + rng.uniform(8, 30, (extra, 2))], 1)])
        labels = np.concatenate([labels, rng.integers(0, 10, extra)])
        out.append(
            {
                "image_id": row["image_id"],
                "boxes": torch.tensor(boxes, dtype=torch.float32),
                "scores": torch.tensor(rng.random(len(boxes)), dtype=torch.float32),
                "labels": torch.tensor(labels, dtype=torch.int64),
            }
        )
    return out


def _pycocotools(gt_json: dict, predictions: list[dict]) -> list[float]:
    """pycocotools run directly: COCO, loadRes, COCOeval on the same json."""
    import contextlib

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    results = []
    for p in predictions:
        b = p["boxes"].double()
        for (x0, y0, x1, y1), s, c in zip(b.tolist(), p["scores"].double().tolist(), p["labels"].tolist()):
            results.append(
                {"image_id": p["image_id"], "bbox": [x0, y0, x1 - x0, y1 - y0], "score": s, "category_id": c}
            )
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = gt_json
        gt.createIndex()
        evaluation = COCOeval(gt, gt.loadRes(results), iouType="bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return evaluation.stats[:6].tolist()


@pytest.fixture(scope="module")
def val_subset(digits_det):
    ds = digits_det.data.eval.select(range(120))
    gt = json.loads((digits_det.folder / "annotations" / "instances_val.json").read_text())
    ids = set(ds["image_id"])
    gt = {
        "images": [i for i in gt["images"] if i["id"] in ids],
        "categories": gt["categories"],
        "annotations": [a for a in gt["annotations"] if a["image_id"] in ids],
    }
    return SimpleNamespace(ds=ds, gt=gt, predictions=_predictions(ds))


def _evaluate(ds, batches: list[list[dict]], classes=None) -> dict[str, float]:
    return CocoEvaluator(ds, classes).evaluate(iter(batches))


def test_evaluator_equals_pycocotools_whatever_the_batching(val_subset):
    ds, predictions = val_subset.ds, val_subset.predictions
    metrics = _evaluate(ds, [predictions])
    assert list(metrics) == ["map", "map_50", "map_75", "map_small", "map_medium", "map_large", "map_50_11pt"]
    assert list(metrics.values())[:6] == _pycocotools(val_subset.gt, predictions)  # all six, exactly
    assert 0.2 < metrics["map_50"] < 0.95 and metrics["map_large"] == -1  # no large digits in 96 px scenes
    shuffled = [predictions[i] for i in np.random.default_rng(1).permutation(len(predictions))]
    padded = predictions + predictions[:5]  # Accelerate repeats the first samples to fill the last batch
    for batches in (
        [[p] for p in predictions],
        [shuffled[i : i + 4] for i in range(0, len(shuffled), 4)],
        [padded[i : i + 7] for i in range(0, len(padded), 7)],
    ):
        assert _evaluate(ds, batches) == metrics


def test_evaluator_perfect_and_empty_predictions(val_subset):
    perfect = [
        {
            "image_id": row["image_id"],
            "boxes": torch.tensor(_xyxy(row["objects"]["bbox"])),
            "scores": torch.ones(len(row["objects"]["bbox"])),
            "labels": torch.tensor(row["objects"]["category"]),
        }
        for row in val_subset.ds
    ]
    metrics = _evaluate(val_subset.ds, [perfect], [str(i) for i in range(10)])
    assert metrics == {
        "map": 1.0,
        "map_50": 1.0,
        "map_75": 1.0,
        "map_small": 1.0,
        "map_medium": 1.0,
        "map_large": -1.0,
        "map_50_11pt": 1.0,
    }
    evaluator = CocoEvaluator(val_subset.ds)
    assert evaluator.evaluate([]) == {**{k: 0.0 for k in metrics}, "map_large": -1.0}  # -1: no large ground truth
    with pytest.raises(ValueError, match="image_id 123456"):
        evaluator.evaluate([[{**perfect[0], "image_id": 123456}]])


def test_evaluator_keeps_nothing_between_calls(val_subset):
    """Each call scores only its own predictions: the first predictions per image win within one call
    (Accelerate's padding repeats), never across calls, so no reset can be forgotten."""
    perfect = [
        {
            "image_id": row["image_id"],
            "boxes": torch.tensor(_xyxy(row["objects"]["bbox"])),
            "scores": torch.ones(len(row["objects"]["bbox"])),
            "labels": torch.tensor(row["objects"]["category"]),
        }
        for row in val_subset.ds
    ]
    evaluator = CocoEvaluator(val_subset.ds)
    state = dict(vars(evaluator))
    assert evaluator.evaluate(iter([perfect]))["map"] == 1.0
    assert vars(evaluator) == state  # the same ground truth objects, nothing added
    fresh = _evaluate(val_subset.ds, [val_subset.predictions])
    assert evaluator.evaluate(batch for batch in [val_subset.predictions]) == fresh and fresh["map"] < 1.0
    assert evaluator.evaluate([])["map"] == 0.0


def test_evaluator_treats_crowd_and_area_as_coco_does(tmp_path):
    splits = _scenes()
    crowd = {"id": 999, "image_id": 10, "bbox": [1.0, 1.0, 20.0, 20.0], "area": 50.0, "category_id": 3, "iscrowd": 1}
    _write_coco(tmp_path, "coco", splits)
    gt_json = _coco_json(splits["val"], [crowd])
    gt_json["annotations"][0]["area"] = 2000.0  # a mask area, not w * h: makes this 10.5 x 12 box "medium"
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps(gt_json))
    data = load_detection(str(tmp_path))
    rows = {r["image_id"]: r for r in data.eval}
    gt = _xyxy(rows[10]["objects"]["bbox"])
    # two detections of the ground truth and two on the crowd region (class 1, 'cat'): COCO ignores the latter
    predictions = [
        {
            "image_id": 10,
            "boxes": torch.tensor(np.concatenate([gt[:2] + 0.5, [[1, 1, 21, 21], [2, 2, 20, 19]]])),
            "scores": torch.tensor([0.9, 0.6, 0.8, 0.7]),
            "labels": torch.tensor(rows[10]["objects"]["category"][:2] + [1, 1]),
        },
        {
            "image_id": 11,
            "boxes": torch.tensor([[3.0, 3.0, 12.0, 15.0]]),
            "scores": torch.tensor([0.95]),
            "labels": torch.tensor([0]),
        },
    ]
    # pycocotools on the original json, with its COCO category ids
    direct = [{**p, "labels": torch.tensor([CATEGORY_IDS[int(c)] for c in p["labels"]])} for p in predictions]
    assert list(_evaluate(data.eval, [predictions], data.classes).values())[:6] == _pycocotools(gt_json, direct)


def _voc07_devkit(ds, predictions: list[dict], num_classes: int) -> float:
    """Pascal VOC 2007's AP@0.5 written as its devkit's voc_eval.py (use_07_metric=True) computes it: per
    class, every detection by descending score, each matched to the box it overlaps most (IoU > 0.5,
    strictly: a hit if that box is not yet taken and not difficult, ignored if difficult, else a false
    positive), then the mean over t in np.arange(0, 1.1, 0.1) of the best precision at recall >= t.
    Difficult = crowd here."""
    aps = []
    for c in range(num_classes):
        gt = {
            row["image_id"]: (
                _xyxy(row["objects"]["bbox"])[np.array(row["objects"]["category"]) == c],
                np.array(row["objects"]["iscrowd"], bool)[np.array(row["objects"]["category"]) == c],
            )
            for row in ds
        }
        positives = sum(int((~hard).sum()) for _, hard in gt.values())
        if not positives:
            continue
        found = sorted(
            (
                (float(s), p["image_id"], np.asarray(b, np.float64))
                for p in predictions
                for b, s, label in zip(p["boxes"].tolist(), p["scores"].tolist(), p["labels"].tolist())
                if label == c
            ),
            key=lambda d: -d[0],
        )
        taken = {image_id: np.zeros(len(boxes), bool) for image_id, (boxes, _) in gt.items()}
        tp, fp = [], []
        for _, image_id, box in found:
            boxes, hard = gt[image_id]
            if len(boxes):
                inter = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None) * np.clip(
                    np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None
                )
                iou = inter / (
                    (box[2] - box[0]) * (box[3] - box[1])
                    + (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
                    - inter
                )
                j = int(iou.argmax())
                if iou[j] > 0.5:
                    if hard[j]:
                        continue
                    tp.append(not taken[image_id][j]), fp.append(bool(taken[image_id][j]))
                    taken[image_id][j] = True
                    continue
            tp.append(False), fp.append(True)
        tp, fp = np.cumsum(tp), np.cumsum(fp)
        recall, precision = tp / positives, tp / np.maximum(tp + fp, 1e-12)
        aps.append(
            np.mean([precision[recall >= t].max() if (recall >= t).any() else 0.0 for t in np.arange(0.0, 1.1, 0.1)])
        )
    return float(np.mean(aps))


def test_evaluator_gives_voc07s_11_point_ap50_with_difficult_boxes_ignored(val_subset):
    """map_50_11pt: by hand on one image with a difficult box (a crowd region, as MMDetection's VOC
    converter writes it), and equal to the VOC devkit's computation on real predictions."""
    boxes = [[0, 0, 10, 10], [20, 0, 10, 10], [40, 0, 10, 10], [60, 0, 10, 10], [0, 40, 30, 30]]
    ds = detection_table([Image.new("RGB", (100, 100))], [boxes], crowd=[[0, 0, 0, 0, 1]])
    hit = [[x, y, x + w, y + h] for x, y, w, h in boxes]
    # scores 0.9 .. 0.4: a hit, a miss, the difficult box (ignored), a hit, a second detection of a taken
    # box (false), a hit; the fourth box is never found. Recall 1/4, 1/4, 2/4, 2/4, 3/4 at precision
    # 1, 1/2, 2/3, 2/4, 3/5: the best precision at recall >= 0, .1, .2 is 1, at .3 .. .5 2/3, at .6 .. .7
    # 3/5, at .8 .. 1 nothing (0)
    found = [hit[0], [80, 80, 90, 90], [1, 41, 29, 69], hit[1], [0.5, 0, 10, 10], hit[2]]
    prediction = {
        "image_id": 1,
        "boxes": torch.tensor(found, dtype=torch.float32),
        "scores": torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4]),
        "labels": torch.zeros(6, dtype=torch.int64),
    }
    metrics = _evaluate(ds, [[prediction]])
    expected = (3 * 1 + 3 * 2 / 3 + 2 * 3 / 5 + 3 * 0) / 11
    assert metrics["map_50_11pt"] == pytest.approx(expected, abs=1e-12)
    assert _voc07_devkit(ds, [prediction], 1) == pytest.approx(expected, abs=1e-12)
    assert metrics["map_50"] != pytest.approx(expected, abs=1e-3)  # COCO's 101 points give another number
    real = _evaluate(val_subset.ds, [val_subset.predictions])["map_50_11pt"]
    assert real == pytest.approx(_voc07_devkit(val_subset.ds, val_subset.predictions, 10), abs=1e-6)
    assert real != pytest.approx(_evaluate(val_subset.ds, [val_subset.predictions])["map_50"], abs=1e-3)
    assert _evaluate(ds, [])["map_50_11pt"] == 0.0
    assert _evaluate(detection_table([Image.new("RGB", (100, 100))], [[]]), [])["map_50_11pt"] == -1.0


def test_voc07_metric_is_the_devkits_at_exact_recalls_and_beside_difficult_boxes():
    """Where COCOeval's matching and thresholds read high: a recall of exactly 0.3 or 0.6 does not reach
    the devkit's thresholds (np.arange gives 0.30000000000000004 and 0.6000000000000001); a detection
    inside a large difficult box but at IoU <= 0.5 with it is a false positive for the devkit (COCOeval
    ignores it, measuring a crowd region's overlap by the detection's own area); IoU exactly 0.5 is a miss."""
    image = [Image.new("RGB", (400, 100))]
    ten = [[40 * i, 0, 30, 30] for i in range(10)]
    hits = [[x, y, x + w, y + h] for x, y, w, h in ten]

    def voc07(boxes, crowd, found) -> tuple[float, float]:
        ds = detection_table(image, [boxes], crowd=[crowd])
        prediction = {
            "image_id": 1,
            "boxes": torch.tensor(found, dtype=torch.float32).reshape(-1, 4),
            "scores": torch.linspace(0.9, 0.1, len(found)),
            "labels": torch.zeros(len(found), dtype=torch.int64),
        }
        return _evaluate(ds, [[prediction]])["map_50_11pt"], _voc07_devkit(ds, [prediction], 1)

    # 3 of 10 found, nothing else: precision 1 up to recall 0.3 exactly, which misses the 4th point
    assert voc07(ten, [0] * 10, hits[:3]) == pytest.approx((3 / 11, 3 / 11), abs=1e-12)
    # 6 of 10: the 7th point (0.6000000000000001) is missed too
    assert voc07(ten, [0] * 10, hits[:6]) == pytest.approx((6 / 11, 6 / 11), abs=1e-12)
    # one plain box, one large difficult box; a small detection inside the difficult one first (IoU 0.04: a
    # false positive), then the plain box found: precision 1/2 at every recall
    boxes, crowd = [[0, 0, 30, 30], [100, 0, 100, 100]], [0, 1]
    assert voc07(boxes, crowd, [[110, 10, 130, 30], [0, 0, 30, 30]]) == pytest.approx((0.5, 0.5), abs=1e-12)
    # a detection at IoU exactly 0.5 (half the box's width, inside it) is not a hit
    assert voc07([[0, 0, 40, 40]], [0], [[0, 0, 20, 40]]) == pytest.approx((0.0, 0.0), abs=1e-12)


def test_voc07_metric_equals_the_devkit_on_random_cases_with_difficult_boxes():
    """Random images, boxes (a third difficult), classes and detections near the boxes: the evaluator's
    map_50_11pt equals the devkit-style computation to 1e-6."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        images, boxes, crowd, labels, predictions = [], [], [], [], []
        for image_id in range(1, 9):
            n = int(rng.integers(0, 6))
            xy = rng.uniform(0, 150, (n, 2))
            wh = rng.uniform(10, 60, (n, 2))
            images.append(Image.new("RGB", (220, 220)))
            boxes.append(np.concatenate([xy, wh], 1).round(1).tolist())
            crowd.append((rng.random(n) < 0.3).astype(int).tolist())
            labels.append(rng.integers(0, 3, n).tolist())
            jitter = rng.normal(0, 6, (n, 4))
            found = np.concatenate([xy, xy + wh], 1) + jitter
            extra = rng.uniform(0, 180, (int(rng.integers(0, 4)), 2))
            found = np.concatenate([found, np.concatenate([extra, extra + 30], 1)])
            found_labels = np.concatenate([np.asarray(labels[-1], np.int64), rng.integers(0, 3, len(extra))])
            flip = rng.random(len(found_labels)) < 0.15  # some detections name the wrong class
            found_labels[flip] = rng.integers(0, 3, int(flip.sum()))
            predictions.append(
                {
                    "image_id": image_id,
                    "boxes": torch.tensor(found, dtype=torch.float32).reshape(-1, 4),
                    "scores": torch.tensor(rng.uniform(0.05, 1, len(found)), dtype=torch.float32),
                    "labels": torch.as_tensor(found_labels, dtype=torch.int64),
                }
            )
        ds = detection_table(images, boxes, categories=labels, crowd=crowd)
        got = CocoEvaluator(ds, ["a", "b", "c"]).evaluate(iter([predictions]))["map_50_11pt"]
        assert got == pytest.approx(_voc07_devkit(ds, predictions, 3), abs=1e-6)


_TWO_PROCESS_SCRIPT = """
import json, sys
import torch
from accelerate import Accelerator
from common.detection.coco_eval import CocoEvaluator
from common.detection.data import load_detection

accelerator = Accelerator(cpu=True)
data = load_detection("digits_det")
evaluator = CocoEvaluator(data.eval.select(range(120)), data.classes)
shard = json.loads(open(sys.argv[1]).read())[accelerator.process_index]
batches = ([{"image_id": p["image_id"], "boxes": torch.tensor(p["boxes"]), "scores": torch.tensor(p["scores"]),
             "labels": torch.tensor(p["labels"])} for p in shard[start:start + 3]] for start in range(0, len(shard), 3))
metrics = evaluator.evaluate(batches, accelerator)
with open(sys.argv[2] + f"/{accelerator.process_index}.json", "w") as f:
    json.dump(metrics, f)
accelerator.end_training()
"""


def test_two_processes_give_the_one_process_metrics(val_subset, tmp_path):
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo backend not available")
    plain = [
        {
            "image_id": p["image_id"],
            "boxes": p["boxes"].tolist(),
            "scores": p["scores"].tolist(),
            "labels": p["labels"].tolist(),
        }
        for p in val_subset.predictions
    ]
    # Uneven shards; rank 1 ends with a repeat of the first image, as Accelerate pads the last batch.
    shards = [plain[:70], plain[70:] + plain[:1]]
    (tmp_path / "predictions.json").write_text(json.dumps(shards))
    (tmp_path / "script.py").write_text(_TWO_PROCESS_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(tmp_path / "script.py"),
        str(tmp_path / "predictions.json"),
        str(tmp_path),
    ]
    proc = subprocess.run(
        command, cwd=ROOT, env=recipe_env(2, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _evaluate(val_subset.ds, [val_subset.predictions])
    for rank in (0, 1):  # every process gets the same numbers
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == expected


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------
def test_draw_detections_and_wandb_boxes():
    image = bright_rectangle(80, 60)
    gt, labels = torch.tensor([[20.0, 10.0, 45.0, 30.0]]), torch.tensor([1])
    pred, pred_labels, scores = (
        torch.tensor([[21.0, 11.0, 44.0, 29.0], [0.0, 0.0, 5.0, 5.0]]),
        torch.tensor([1, 2]),
        torch.tensor([0.9, 0.1]),
    )
    drawn = draw_detections(image, gt, labels, pred, pred_labels, scores, CLASSES)
    # enlarged 6x (a whole factor up to 512 px), with the same margin on every side for edge labels
    assert drawn.width - drawn.height == (80 - 60) * 6 and 480 < drawn.width < 560
    pixels = np.asarray(drawn).reshape(-1, 3)
    assert ((pixels == class_colour(1)).all(1)).any()  # the prediction, in its class's colour
    assert not ((pixels == class_colour(2)).all(1)).any()  # the 0.1 score is under the threshold
    # the same picture from a uint8 tensor and from a float one in 0..1
    as_uint8 = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    for same in (as_uint8, as_uint8.float() / 255):
        assert np.array_equal(
            np.asarray(draw_detections(same, gt, labels, pred, pred_labels, scores, CLASSES)), np.asarray(drawn)
        )
    boxes = wandb_boxes(gt, labels, pred, pred_labels, scores, CLASSES)
    assert boxes["ground_truth"]["class_labels"] == {0: "bird", 1: "cat", 2: "dog"}
    assert boxes["ground_truth"]["box_data"][0]["position"] == {"minX": 20.0, "minY": 10.0, "maxX": 45.0, "maxY": 30.0}
    assert len(boxes["predictions"]["box_data"]) == 1  # the 0.1 score is under the threshold
    assert boxes["predictions"]["box_data"][0]["scores"] == {"score": pytest.approx(0.9)}


def test_save_detections_writes_one_png_and_logs_plain_images_with_boxes(tmp_path):
    images = [
        torch.from_numpy(np.array(bright_rectangle(80, 60))).permute(2, 0, 1),
        torch.from_numpy(np.array(bright_rectangle(50, 70))).permute(2, 0, 1),
    ]
    targets = [
        {"boxes": torch.tensor([[20.0, 10.0, 45.0, 30.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)},
    ]
    predictions = [
        {"boxes": torch.tensor([[21.0, 11.0, 44.0, 29.0]]), "labels": torch.tensor([1]), "scores": torch.tensor([0.9])},
        {"boxes": torch.tensor([[1.0, 2.0, 30.0, 40.0]]), "labels": torch.tensor([2]), "scores": torch.tensor([0.8])},
    ]

    class Run:  # stands in for a wandb run: records what is logged
        logged: list = []

        def log(self, values, step):
            self.logged.append((values, step))

    path = tmp_path / "plots.png"
    picture = save_detections(images, targets, predictions, CLASSES, path, wandb_run=Run(), step=7)
    # both pictures (x6 and x7: a whole factor up to 512 px) in two cells of the wider one's width, a legend below
    assert Image.open(path).size == picture.size and 2 * 80 * 6 < picture.width < 2 * 80 * 6 + 120
    ((values, step),) = Run.logged
    assert step == 7 and len(values["detections"]) == 2
    first = values["detections"][0]
    assert first.image.size == (80, 60)  # the plain image at its own size: boxes in its pixels
    # wandb keeps the box list in a private attribute; the positions are the target's, unscaled
    assert first._boxes["ground_truth"]._val[0]["position"] == {"minX": 20.0, "minY": 10.0, "maxX": 45.0, "maxY": 30.0}


@pytest.mark.parametrize("recipe", ["yolo", "detr", "faster_rcnn"])
def test_each_detector_evaluates_the_mean_of_the_processes_bn_statistics(recipe):
    """A detector's evaluate(), with 2 processes, detects with every BatchNorm's running statistics averaged
    over the processes (each process's saw only its own batches), so 2 processes score as 1 on the same
    weights. Here the other process holds statistics 2 above this one's: the evaluation must see 1 above."""
    module = load_recipe(recipe)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).train()
    model[1].running_mean.fill_(3.0)
    model[1].running_var.fill_(5.0)
    accelerator = SimpleNamespace(num_processes=2, reduce=lambda t, reduction: t + 1 if reduction == "mean" else None)
    seen = {}

    class Evaluator:  # what evaluate() hands the detections to: here, where the statistics stand then
        def evaluate(self, detections, accelerator, details):
            seen.update(mean=model[1].running_mean.clone(), var=model[1].running_var.clone(), eval=not model.training)
            return {}, None

    args = (model, [], Evaluator(), accelerator) + (
        (SimpleNamespace(conf_threshold=0.01, nms_iou=0.45, max_detections=100),) if recipe == "yolo" else ()
    )
    module.evaluate(*args)
    assert seen["eval"] and model.training  # back to training after
    assert torch.equal(seen["mean"], torch.full((4,), 4.0)) and torch.equal(seen["var"], torch.full((4,), 6.0))
