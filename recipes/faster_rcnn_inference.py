"""What a Faster R-CNN run ships, beside recipes/faster_rcnn.py (as timm keeps inference.py apart from train.py):
the trained detector loaded back from the weights a run saved (``--weights`` for ``--eval_only``, ``--predict``
and ``--export``: safetensors, a ``model/`` or checkpoint folder), its detections on photos (``--predict``, also from
an exported ``.onnx``), the export (``model.onnx``: one image -> boxes, scores, labels, the resize and NMS inside
the graph) and the model folder with its card (``<run>/model``, what ``--push_to_hub`` uploads).

Copy faster_rcnn.py and its ``faster_rcnn_*.py`` files together.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from common.artifacts.export import OnnxModel, export_model
from common.artifacts.export_check import Detections, photos
from common.artifacts.model_folder import write_detector_folder
from common.config import to_dict
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, prediction_batches
from common.detection.outputs import check_classes, save_predictions
from common.run import Run
from common.weights import is_onnx, load_state, load_weights, read_metadata, weights_metadata
from faster_rcnn_data import data_transforms, list_collate
from faster_rcnn_model import Exported, ModelSettings, TwoStageDetector, create_model, detect


class ShippingSettings(ModelSettings, Protocol):
    """What shipping reads of recipes/faster_rcnn.py's Config (a dataclass) besides the model's fields; the whole
    Config goes into the files' metadata and model card."""

    weights: str  # the saved weights: safetensors, a model/ or checkpoint folder or (predict) an exported .onnx
    predict: str  # an image or a folder of images to detect objects in
    predict_score: float  # detections written and drawn from this score
    predict_scores: bool  # labels/<image>.txt rows end with the score (Ultralytics trains on 5 columns)
    predict_mask_pngs: bool  # with masks: each image's masks as one PNG under masks/
    num_workers: int  # DataLoader worker processes per process


def trained_model(cfg: ShippingSettings, data: Any = None) -> tuple[TwoStageDetector, dict[str, Any]]:
    """The detector of ``cfg.weights`` (eval mode), built without any starting weights, and the file's metadata
    (classes, category ids), which must be those of ``data`` (common.detection.data.DetectionData) when given."""
    state, meta = load_weights(cfg.weights, "detector")
    check_classes(cfg.weights, meta, data)
    plain = dataclasses.replace(cfg, pretrained=False, pretrained_backbone=False, init_backbone="")
    model = create_model(plain, len(meta["classes"]))
    return load_state(model, state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: ShippingSettings, run: Run) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model (or ONNX file) on the images ``cfg.predict``
    names: ``detections.json`` and the pictures in the run folder; returns the counts it logged."""
    if is_onnx(cfg.weights):
        model, meta = OnnxModel(cfg.weights), read_metadata(cfg.weights)
    else:
        model, meta = trained_model(cfg)
        model = model.to(run.accelerator.device)
    # one image at a time, as the ONNX file takes them: a batch pads its images to its largest, which
    # changes the features near their borders, so batched detections depend on an image's companions
    table, batches = prediction_batches(
        run, cfg.predict, data_transforms(False, 0.0, False), list_collate, 1, cfg.num_workers
    )
    found = detect(model, batches, run.accelerator)
    threshold = ("box_score_thresh", cfg.box_score_thresh)
    return save_predictions(
        run,
        found,
        table,
        meta,
        cfg.predict_score,
        cfg.predict,
        threshold,
        with_scores=cfg.predict_scores,
        mask_pngs=cfg.predict_mask_pngs,
    )


def export_files(
    model: TwoStageDetector,
    cfg: ShippingSettings,
    meta: dict[str, Any],
    folder: Path,
    recipe: str,
    image: torch.Tensor | None = None,
) -> dict[str, float]:
    """``model.onnx`` in ``folder`` (TorchScript exporter: NMS has outputs of data-dependent size, which
    torch.export cannot trace): one image [3, H, W] in 0..1, any size -> boxes [K, 4] XYXY in its pixels,
    scores [K], labels [K]; checked against eager (detections above box_score_thresh) on ``image`` (default:
    a synthetic picture) resized to each of
    common.artifacts.export_check.CHECK_SIZES (upscaled small ones, large ones, odd
    aspect ratios). ``meta``: the weights' metadata (classes, category ids). The writer that
    common.artifacts.export.export calls."""
    saved = weights_metadata(cfg, meta["classes"], recipe, meta["category_ids"], (IMAGENET_MEAN, IMAGENET_STD))
    saved["preprocessing"] = json.dumps({"inside the graph": "resize (min_size, max_size), ImageNet mean and std"})
    checks = [{"image": picture} for picture in photos(image)]
    if image is None:  # traced at the size the graph resizes to (a trace follows the example's branches)
        image = torch.rand(3, cfg.min_size[-1], cfg.min_size[-1] * 4 // 3, generator=torch.Generator().manual_seed(0))
    names, spatial = ["boxes", "scores", "labels"], {"image": {1: "height", 2: "width"}}
    names += ["mask_probs"] if model.masks else []  # [K, 28, 28] over each box, pasted outside the graph
    read = Detections(lambda out: [tuple(out)], cfg.box_score_thresh, cfg.box_detections_per_img)
    return export_model(Exported(model), {"image": image}, names, folder, saved, spatial, True, checks, detections=read)


def write_model_folder(
    run: Run, cfg: ShippingSettings, classes: Sequence[str], sizes: tuple[int, int], results: dict[str, float]
) -> None:
    """``<run>/model``: the kept weights (best, else final) with ``config.json`` and a model card giving the
    training and evaluation sets' ``sizes`` (images) and the run's ``results``; ``--weights <run>/model``
    loads it and ``--push_to_hub`` uploads it (common.artifacts.model_folder.write_detector_folder)."""
    write_detector_folder(run, to_dict(cfg), classes, sizes, results)
