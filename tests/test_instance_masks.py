"""Instance masks (issue 51) below the recipe: the schema's masks decoded as pycocotools decodes them, targets whose
masks move with the pixels, the mask evaluation equal to pycocotools' own ``COCOeval(iouType="segm")`` on the
written results, predicted masks pasted as torchvision pastes them, and the label files' segment rows."""

from __future__ import annotations

import contextlib
import io
import json

import datasets
import numpy as np
import pytest
import torch
from pycocotools import mask as coco_mask
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from common.data.builtin.shapes_seg import SEG_CLASSES, shapes_seg_folder
from common.detection.coco_eval import MASK_METRICS, CocoEvaluator
from common.detection.data import DetectionDataset
from common.detection.masks import mask_of, masks_of, polygons_of, rle_of, segment_lines
from common.detection.sources import features
from faster_rcnn_data import data_transforms, list_collate
from faster_rcnn_model import pasted_masks

IMAGES = 24  # of shapes_seg's val split


@pytest.fixture(scope="module")
def shapes() -> tuple[dict, datasets.Dataset]:
    """The first IMAGES of shapes_seg's val json (category ids 1..4) and the same as a normalised split with masks,
    written here from the json (independent of the readers)."""
    root = shapes_seg_folder()
    coco = json.loads((root / "annotations" / "instances_val.json").read_text())
    coco["images"] = coco["images"][:IMAGES]
    ids = {im["id"] for im in coco["images"]}
    coco["annotations"] = [a for a in coco["annotations"] if a["image_id"] in ids]
    rows = {i: {"bbox": [], "category": [], "area": [], "iscrowd": [], "segmentation": []} for i in ids}
    for a in coco["annotations"]:
        objects = rows[a["image_id"]]
        objects["bbox"].append(a["bbox"])
        objects["category"].append(a["category_id"] - 1)
        objects["area"].append(a["area"])
        objects["iscrowd"].append(0)
        objects["segmentation"].append(json.dumps(a["segmentation"]))
    table = {
        "image": [{"path": str(root / "val" / im["file_name"]), "bytes": None} for im in coco["images"]],
        "image_id": [im["id"] for im in coco["images"]],
        "width": [im["width"] for im in coco["images"]],
        "height": [im["height"] for im in coco["images"]],
        "objects": [rows[im["id"]] for im in coco["images"]],
    }
    return coco, datasets.Dataset.from_dict(table, features=features(masks=True))


def _gt(coco: dict) -> COCO:
    gt = COCO()
    gt.dataset = json.loads(json.dumps(coco))
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt


def test_a_schema_mask_is_pycocotools_mask_of_the_same_annotation(shapes):
    """Polygons, compressed and uncompressed RLE (a crowd region's form) decode to pycocotools' annToMask."""
    coco, _ = shapes
    gt = _gt(coco)
    for a in coco["annotations"][:10]:
        ours = mask_of(json.dumps(a["segmentation"]), 96, 96)
        assert np.array_equal(ours, gt.annToMask(a)) and ours.sum() == pytest.approx(a["area"])
    a = coco["annotations"][0]
    full = gt.annToMask(a)
    compressed = rle_of(full)
    uncompressed = {"size": [96, 96], "counts": _uncompressed(full)}
    assert np.array_equal(mask_of(json.dumps(compressed), 96, 96), full)
    assert np.array_equal(mask_of(json.dumps(uncompressed), 96, 96), full)
    assert mask_of("", 96, 96).sum() == 0


def _uncompressed(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE counts of a mask (column-major runs, starting with zeros)."""
    flat = mask.flatten(order="F")
    changes = np.flatnonzero(np.diff(np.concatenate([[0], flat, [1 - flat[-1]]])))
    return np.diff(np.concatenate([[0], changes])).tolist()


def test_polygons_are_rasterised_where_the_pixels_were_decoded_reduced(shapes):
    """A photo decoded at half size gets its masks at that size: the polygon scaled, then rasterised there."""
    coco, _ = shapes
    a = coco["annotations"][1]
    half = masks_of([json.dumps(a["segmentation"])], 96, 96, out=(48, 48))[0]
    full = mask_of(json.dumps(a["segmentation"]), 96, 96)
    assert half.shape == (48, 48) and abs(int(half.sum()) * 4 - int(full.sum())) <= 0.15 * full.sum()


def test_targets_masks_move_with_the_pixels_and_boxes(shapes):
    """Training targets (flipped): every mask lies in its box, and its pixels are the shape's colour."""
    _, table = shapes
    plain = DetectionDataset(table, data_transforms(False, 0.0, False), masks=True)
    flipped = DetectionDataset(table, data_transforms(True, 1.0, False), masks=True)
    for i in range(6):
        (image, t), (image_f, t_f) = plain[i], flipped[i]
        assert t["masks"].shape == (len(t["boxes"]), 96, 96) and t["masks"].dtype == torch.uint8
        assert torch.equal(t_f["masks"], t["masks"].flip(-1)) and torch.equal(image_f, image.flip(-1))
        for mask, box in zip(t_f["masks"], t_f["boxes"]):
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert xs.min() >= box[0] - 1 and xs.max() <= box[2] and ys.min() >= box[1] - 1 and ys.max() <= box[3]
    images, targets = list_collate([plain[0], plain[1]])
    assert type(targets[0]["masks"]) is torch.Tensor and targets[0]["labels"].min() >= 1


def _perturbed_results(coco: dict, rng: np.random.Generator, as_boxes: bool = False) -> list[dict]:
    """Predictions from the ground truth: each object found with a score, some missed, some with the wrong class,
    their masks the true ones shifted by a pixel or so (or, ``as_boxes``, their boxes filled)."""
    out = []
    for a in coco["annotations"]:
        if rng.random() < 0.15:
            continue
        mask = mask_of(json.dumps(a["segmentation"]), 96, 96)
        if as_boxes:
            x, y, w, h = (round(v) for v in a["bbox"])
            mask = np.zeros_like(mask)
            mask[y : y + h, x : x + w] = 1
        mask = np.roll(mask, tuple(rng.integers(-1, 2, 2)), (0, 1))
        category = a["category_id"] if rng.random() < 0.85 else int(rng.integers(1, 5))
        out.append(
            {
                "image_id": a["image_id"],
                "category_id": category,
                "bbox": [v + float(rng.normal(0, 1)) for v in a["bbox"]],
                "score": float(rng.random()),
                "segmentation": rle_of(mask),
            }
        )
    return out


def test_mask_map_equals_pycocotools_segm_on_the_written_results_and_masks_beat_boxes(shapes):
    """The evaluator's mask metrics are COCOeval(iouType="segm")'s on the results it writes (coco_results, what
    predictions.json holds, loaded by loadRes against the original json); box-shaped masks score lower."""
    coco, table = shapes
    rng = np.random.default_rng(0)
    evaluator = CocoEvaluator(table, list(SEG_CLASSES), masks=True)
    scores = {}
    for as_boxes in (False, True):
        results = _perturbed_results(coco, rng, as_boxes)
        per_image: dict[int, dict] = {}
        for r in results:
            p = per_image.setdefault(r["image_id"], {"image_id": r["image_id"], "boxes": [], "scores": [],
                                                     "labels": [], "masks": []})  # fmt: skip
            x, y, w, h = r["bbox"]
            p["boxes"].append([x, y, x + w, y + h])
            p["scores"].append(r["score"])
            p["labels"].append(r["category_id"] - 1)
            p["masks"].append(r["segmentation"])
        batch = [{**p, "boxes": torch.tensor(p["boxes"]), "scores": torch.tensor(p["scores"]),
                  "labels": torch.tensor(p["labels"])} for p in per_image.values()]  # fmt: skip
        metrics, details = evaluator.evaluate([batch], details=True)
        written = json.loads(json.dumps(details.coco_results([1, 2, 3, 4])))  # as predictions.json holds them
        gt = _gt(coco)
        with contextlib.redirect_stdout(io.StringIO()):
            reference = COCOeval(gt, gt.loadRes(written), iouType="segm")
            reference.evaluate()
            reference.accumulate()
            reference.summarize()
        assert [metrics[k] for k in MASK_METRICS] == pytest.approx(list(reference.stats[:6]), abs=1e-12)
        assert details.mask_ap50 is not None and np.isfinite(details.mask_ap50).all()
        scores[as_boxes] = metrics["mask_map_50"], metrics["mask_map"]
    print(scores)
    (true_50, true_all), (box_50, box_all) = scores[False], scores[True]
    assert true_50 > 0.6 and true_50 > box_50 + 0.2 and true_all > box_all + 0.2, scores


def test_pasted_masks_are_torchvisions_pasted_masks():
    """Pasted in chunks and kept as RLE, the masks are torchvision's paste_masks_in_image cut at 0.5."""
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    torch.manual_seed(0)
    probs = torch.rand(7, 28, 28)
    boxes = torch.tensor([[5.0, 6.0, 40.0, 30.0], [0, 0, 80, 60], [70, 50, 79, 59]] * 2 + [[10, 10, 11, 11]])
    ours = pasted_masks(probs, boxes, (60, 80))
    reference = paste_masks_in_image(probs[:, None], boxes, (60, 80))[:, 0] > 0.5
    assert len(ours) == 7
    for rle, mask in zip(ours, reference):
        assert rle["size"] == [60, 80] and np.array_equal(mask_of(json.dumps(rle), 60, 80), mask.numpy())


def test_segment_rows_are_the_masks_outlines_normalised():
    """An L-shaped mask's segment row, rasterised back, is the mask (IoU >= 0.9); an empty mask gives its box."""
    mask = np.zeros((50, 100), np.uint8)
    mask[10:40, 20:30] = 1
    mask[30:40, 20:70] = 1
    line = segment_lines([rle_of(mask), rle_of(np.zeros_like(mask))], [[20, 10, 70, 40], [1, 2, 3, 4]], [3, 0])
    first, second = (row.split() for row in line.splitlines())
    assert first[0] == "3" and len(first) % 2 == 1 and len(first) >= 7
    xy = np.array(first[1:], np.float64).reshape(-1, 2) * [100, 50]
    back = coco_mask.decode(coco_mask.frPyObjects([xy.reshape(-1).tolist()], 50, 100))[..., 0]
    inter, union = np.logical_and(back, mask).sum(), np.logical_or(back, mask).sum()
    assert inter / union >= 0.9
    assert second == ["0", "0.01", "0.04", "0.03", "0.04", "0.03", "0.08", "0.01", "0.08"]
    assert len(polygons_of(mask)) == 1
    # two pieces, one with a hole: one row, which rasterises back to exactly the mask
    mask = np.zeros((50, 60), np.uint8)
    mask[5:20, 5:20] = 1
    mask[30:45, 30:55] = 1
    mask[35:40, 35:40] = 0
    (row,) = (r.split() for r in segment_lines([rle_of(mask)], [[5, 5, 55, 45]], [1]).splitlines())
    xy = np.array(row[1:], np.float64).reshape(-1, 2) * [60, 50]
    assert len(polygons_of(mask)) == 3
    assert np.array_equal(coco_mask.decode(coco_mask.frPyObjects([xy.reshape(-1).tolist()], 50, 60))[..., 0], mask)
