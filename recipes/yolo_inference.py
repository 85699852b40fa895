"""What a YOLO run ships, beside recipes/yolo.py (as timm keeps inference.py apart from train.py): the
trained detector loaded back from the weights a run saved (``--weights`` for ``--eval_only``, ``--predict``
and ``--export``: safetensors, a ``model/`` or checkpoint folder), its detections on photos (``--predict``, also
from an exported ``.onnx``), the export (``model.onnx`` and ``model.pt2``: images -> boxes and class scores,
NMS outside the graph) and the model folder with its card (``<run>/model``, what ``--push_to_hub`` uploads).

recipes/yolo.py passes its ``create_model`` in; copy yolo.py and its ``yolo_*.py`` files together.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from common.artifacts.export import OnnxModel, export_model
from common.artifacts.export_check import Detections, batched_checks
from common.artifacts.model_folder import write_detector_folder
from common.config import to_dict
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, collate, prediction_batches
from common.detection.outputs import check_classes, save_predictions
from common.run import Run
from common.weights import is_onnx, load_state, load_weights, read_metadata, weights_metadata
from yolo_data import detection_transforms
from yolo_free import YOLOFree
from yolo_model import Exported, YOLOv3, detect, postprocess

Detector = YOLOv3 | YOLOFree  # the anchor head (recipes/yolo_model.py) or the anchor-free one (yolo_free.py)


class DetectorSettings(Protocol):
    """What shipping reads of recipes/yolo.py's Config (a dataclass); the whole Config goes into the files'
    metadata and model card."""

    model: str  # the timm backbone's name
    head: str  # anchor (YOLOv3's, whose anchors are in the weights) or free
    pretrained: bool  # cleared here, as init_backbone: the trained weights replace any start
    init_backbone: str
    weights: str  # the saved weights: safetensors, a model/ or checkpoint folder or (predict) an exported .onnx
    img_size: int  # the evaluation's input side, px (letterboxed or stretched to it: augment)
    augment: str  # the training preset, whose evaluation transform prediction and export use
    conf_threshold: float  # scores below are dropped before NMS
    nms_iou: float  # NMS IoU
    max_detections: int  # detections kept per image after NMS
    predict: str  # an image or a folder of images to detect objects in
    predict_score: float  # detections written and drawn from this score
    predict_scores: bool  # labels/<image>.txt rows end with the score (Ultralytics trains on 5 columns)
    batch_size: int  # images per process; prediction takes twice as many per batch
    num_workers: int  # DataLoader worker processes per process


def trained_model(
    cfg: DetectorSettings, create_model: Callable[..., Detector], data: Any = None
) -> tuple[Detector, dict[str, Any]]:
    """The YOLO of ``cfg.weights`` (eval mode), built by recipes/yolo.py's ``create_model(cfg, num_classes,
    anchors)`` without any starting weights, and the file's metadata (classes, category ids), which must be
    those of ``data`` (common.detection.data.DetectionData) when given."""
    state, meta = load_weights(cfg.weights, "YOLO", tensors=["anchors"] if cfg.head == "anchor" else [])
    check_classes(cfg.weights, meta, data)
    anchors = None  # stored large-stride level first; create_model takes them small first
    if cfg.head == "anchor":
        anchors = state["anchors"].flip(0).reshape(-1, 2)
    model = create_model(dataclasses.replace(cfg, pretrained=False, init_backbone=""), len(meta["classes"]), anchors)
    return load_state(model, state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: DetectorSettings, run: Run, create_model: Callable[..., Detector]) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model (or ONNX file) on the images ``cfg.predict``
    names: ``detections.json`` and the pictures in the run folder; returns the counts it logged."""
    if is_onnx(cfg.weights):
        model, meta = OnnxModel(cfg.weights), read_metadata(cfg.weights)
    else:
        model, meta = trained_model(cfg, create_model)
        model = model.to(run.accelerator.device)
    transform = detection_transforms(False, cfg.img_size, preset=cfg.augment)  # as the evaluation saw images
    table, batches = prediction_batches(run, cfg.predict, transform, collate, 2 * cfg.batch_size, cfg.num_workers)
    found = detect(model, batches, run.accelerator, cfg.conf_threshold, cfg.nms_iou, cfg.max_detections)
    threshold = ("conf_threshold", cfg.conf_threshold)
    return save_predictions(
        run, found, table, meta, cfg.predict_score, cfg.predict, threshold, with_scores=cfg.predict_scores
    )


def export_files(
    model: Detector, cfg: DetectorSettings, meta: dict[str, Any], folder: Path, recipe: str
) -> dict[str, float]:
    """``model.onnx`` (and ``model.pt2``) in ``folder``: images [B, 3, S, S] (letterboxed to img_size,
    0..1, normalised with the ImageNet mean and std) -> boxes [B, N, 4] XYXY in those pixels and
    class scores [B, N, C]; NMS (``postprocess``) follows outside the graph. Checked against eager on
    pictures of common.artifacts.export_check.CHECK_SIZES letterboxed, alone and in one batch: the detections after
    NMS. ``meta``: the weights' metadata (classes, category ids). The writer that
    common.artifacts.export.export calls."""
    saved = weights_metadata(cfg, meta["classes"], recipe, meta["category_ids"], (IMAGENET_MEAN, IMAGENET_STD))
    saved["preprocessing"] = json.dumps({"letterbox": cfg.img_size, "mean": IMAGENET_MEAN, "std": IMAGENET_STD})
    example = torch.rand(2, 3, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(0))
    checks = batched_checks(detection_transforms(False, cfg.img_size, preset=cfg.augment), collate, ["images"])
    read = Detections(
        lambda out: [
            (d["boxes"], d["scores"], d["labels"])
            for d in postprocess(*out, cfg.conf_threshold, cfg.nms_iou, cfg.max_detections)
        ],
        cfg.conf_threshold,
        cfg.max_detections,
    )
    names, every = ["boxes", "scores"], {"scores": "probability"}  # and every raw score, with or without a box
    return export_model(Exported(model), {"images": example}, names, folder, saved, None, False, checks, every, read)


def write_model_folder(
    run: Run, cfg: DetectorSettings, classes: Sequence[str], sizes: tuple[int, int], results: dict[str, float]
) -> None:
    """``<run>/model``: the kept weights (best, else final) with ``config.json`` and a model card giving the
    training and evaluation sets' ``sizes`` (images) and the run's ``results``; ``--weights <run>/model``
    loads it and ``--push_to_hub`` uploads it (common.artifacts.model_folder.write_detector_folder)."""
    write_detector_folder(run, to_dict(cfg), classes, sizes, results)
