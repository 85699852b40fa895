"""Every detector's exported ONNX file detects what its eager model detects on photos of the six sizes of
common.artifacts.export_check.CHECK_SIZES, from 60 x 45 to 1000 x 750 (small ones the graph upscales, large ones, a tall
and a wide one), through the recipe's own prediction path: the same detections above the model's score
floor, boxes within 0.5 px in the original photo's pixels, scores within 1e-3. One export per detector,
of its demo model (random weights; YOLO's output layers scaled so that it detects). Faster R-CNN with
torchvision's own resize, whose graph rounds the resized size apart from eager on some sizes, is refused
at export naming the photo that showed it."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from common import UserError
from common.artifacts.export import OnnxModel
from common.artifacts.export_check import CHECK_SIZES, photos, prepared
from conftest import load_recipe

META = {"classes": [str(d) for d in range(10)], "category_ids": list(range(10))}
ANCHORS = torch.tensor(
    [[10.0, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
)


def _demo(name: str):
    """The recipe, its demo config and its model with seeded random weights (yolo_anchor: YOLO's anchor head)."""
    recipe = load_recipe(name.removesuffix("_anchor"))
    cfg = recipe.Config(head="anchor") if name == "yolo_anchor" else recipe.Config()
    torch.manual_seed(0)
    if name.startswith("yolo"):  # its output layers start near zero with low class priors: made to follow the image
        model = recipe.create_model(cfg, 10, ANCHORS if cfg.head == "anchor" else None).eval()
        # the anchor head's 3 anchors x (4 + 1 + 10 classes); the free head's 10 classes and 4 x 16 distance bins
        if cfg.head == "anchor":
            outputs = [m[-1] for m in model.outputs]
        else:
            outputs = [m[-1] for m in [*model.cls_branches, *model.box_branches]]
        with torch.no_grad():
            for conv in outputs:
                conv.weight.mul_(3000.0 if conv.out_channels != 64 else 30.0), conv.bias.zero_()
        return recipe, cfg, model
    return recipe, cfg, recipe.create_model(cfg, 10).eval()


def _detect(recipe, name: str, cfg, model, accelerator) -> list[dict]:
    """Per photo of CHECK_SIZES, alone: the recipe's detect() (boxes in the photo's own pixels)."""
    if name == "faster_rcnn":
        transform, collate = recipe.data_transforms(False, 0.0, False), recipe.list_collate
    elif name.startswith("yolo"):
        transform, collate = recipe.detection_transforms(False, cfg.img_size, preset=cfg.augment), recipe.collate
    else:
        transform, collate = recipe.data_transforms(cfg, False), recipe.detr_collate
    found = []
    for k, (image, target) in enumerate(prepared(transform, photos())):
        target.update(image_id=k, orig_size=CHECK_SIZES[k])
        batches = [collate([(image, target)])]
        args = (cfg.conf_threshold, cfg.nms_iou, cfg.max_detections) if name.startswith("yolo") else ()
        found += [d for batch in recipe.detect(model, batches, accelerator, *args) for d in batch]
    return found


@pytest.mark.parametrize("name", ["faster_rcnn", "yolo", "yolo_anchor", "detr"])
def test_the_onnx_file_detects_what_eager_detects_on_six_photo_sizes(name, tmp_path):
    recipe, cfg, model = _demo(name)
    diffs = recipe.export_files(model, cfg, META, tmp_path, name.removesuffix("_anchor"))
    assert diffs["export/inputs"] >= 7 and diffs["export/onnx_boxes_px"] <= 0.5 and diffs["export/onnx_scores"] <= 1e-3
    accelerator = Accelerator(cpu=True)
    eager = _detect(recipe, name, cfg, model, accelerator)
    onnx = _detect(recipe, name, cfg, OnnxModel(tmp_path / "model.onnx"), accelerator)
    floor, limit = {
        "faster_rcnn": lambda: (cfg.box_score_thresh, cfg.box_detections_per_img),
        "yolo": lambda: (cfg.conf_threshold, cfg.max_detections),
        "yolo_anchor": lambda: (cfg.conf_threshold, cfg.max_detections),
        "detr": lambda: (0.0, 0),
    }[name]()
    for size, e, o in zip(CHECK_SIZES, eager, onnx):
        # compared above the lowest score read, with 1e-3 of room for a tie at it (the floor, or the last
        # score kept where the image reached the detection limit)
        low = max([floor] + [float(d["scores"].min()) for d in (e, o) if limit and len(d["scores"]) >= limit])
        keep = [d["scores"] > low + 1e-3 for d in (e, o)]
        (eb, es, el), (ob, os_, ol) = ((d[k][m] for k in ("boxes", "scores", "labels")) for d, m in zip((e, o), keep))
        assert len(es) > 0 and len(es) == len(os_), (size, len(es), len(os_))
        for box, score, label in zip(eb, es, el):
            gap = (ob - box).abs().amax(1).masked_fill(ol != label, float("inf"))
            j = int(gap.argmin())
            assert gap[j] <= 0.5 and abs(float(os_[j] - score)) <= 1e-3, (size, float(gap[j]), float(os_[j] - score))


def test_faster_rcnn_with_torchvisions_resize_is_refused_on_the_photo_that_shows_it(tmp_path):
    recipe, cfg, model = _demo("faster_rcnn")
    plain = model.transform
    model.transform = GeneralizedRCNNTransform(plain.min_size, plain.max_size, plain.image_mean, plain.image_std)
    with pytest.raises(
        UserError, match=r"^export refused: model\.onnx on image \[3, 183, 245\]: .+; nothing was written$"
    ):
        recipe.export_files(model, cfg, META, tmp_path, "faster_rcnn")
    assert list(tmp_path.iterdir()) == []
