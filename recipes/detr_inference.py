"""What a DETR run ships, beside recipes/detr.py (as timm keeps inference.py apart from train.py): the
trained detector loaded back from the weights a run saved (``--weights`` for ``--eval_only``, ``--predict``
and ``--export``: safetensors, a ``model/`` or checkpoint folder), its detections on photos (``--predict``, also
from an exported ``.onnx``), the export (``model.onnx``: images and padding mask -> every query's box, score
and class; DETR needs no NMS) and the model folder with its card (``<run>/model``, what ``--push_to_hub``
uploads).

recipes/detr.py passes its ``create_model`` in; copy detr.py and its ``detr_*.py`` files together.
(``--init_weights``, the whole detector from a DETR checkpoint to train on, is recipes/detr_checkpoint.py.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from common.artifacts.export import OnnxModel, export_model
from common.artifacts.export_check import Detections, batched_checks
from common.artifacts.model_folder import write_detector_folder
from common.config import to_dict
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, DetectionData, prediction_batches
from common.detection.outputs import check_classes, save_predictions
from common.run import Run
from common.weights import is_onnx, load_state, load_weights, read_metadata, weights_metadata
from detr_data import TransformSettings, data_transforms, detr_collate
from detr_model import Exported, detect


class DetectorSettings(TransformSettings, Protocol):
    """What shipping reads of recipes/detr.py's Config (a dataclass), besides the evaluation's transforms
    (:class:`detr_data.TransformSettings`); the whole Config goes into the files' metadata and model card."""

    model: str  # the timm backbone's name
    pretrained: bool  # cleared here, as init_backbone: the trained weights replace any start
    init_backbone: str
    weights: str  # the saved weights: safetensors, a model/ or checkpoint folder or (predict) an exported .onnx
    predict: str  # an image or a folder of images to detect objects in
    predict_score: float  # detections written and drawn from this score
    predict_scores: bool  # labels/<image>.txt rows end with the score (Ultralytics trains on 5 columns)
    batch_size: int  # images per process; prediction takes twice as many per batch
    num_workers: int  # DataLoader worker processes per process


def trained_model(
    cfg: DetectorSettings, create_model: Callable[..., nn.Module], data: DetectionData | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """The DETR of ``cfg.weights`` (eval mode), built by recipes/detr.py's ``create_model(cfg, num_classes)``
    without any starting weights, and the file's metadata (classes, category ids), which must be those of
    ``data`` when given."""
    state, meta = load_weights(cfg.weights, "detector")
    check_classes(cfg.weights, meta, data)
    plain = dataclasses.replace(cfg, pretrained=False, init_backbone="")
    return load_state(create_model(plain, len(meta["classes"])), state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: DetectorSettings, run: Run, create_model: Callable[..., nn.Module]) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model (or ONNX file) on the images ``cfg.predict``
    names: ``detections.json`` and the pictures in the run folder; returns the counts it logged."""
    if is_onnx(cfg.weights):
        model, meta = OnnxModel(cfg.weights), read_metadata(cfg.weights)
    else:
        model, meta = trained_model(cfg, create_model)
        model = model.to(run.accelerator.device)
    table, batches = prediction_batches(
        run, cfg.predict, data_transforms(cfg, False), detr_collate, 2 * cfg.batch_size, cfg.num_workers
    )
    found = detect(model, batches, run.accelerator)
    return save_predictions(run, found, table, meta, cfg.predict_score, cfg.predict, with_scores=cfg.predict_scores)


def export_files(
    model: nn.Module, cfg: DetectorSettings, meta: dict[str, Any], folder: Path, recipe: str
) -> dict[str, float]:
    """``model.onnx`` in ``folder``: images [B, 3, H, W] (shorter side resized to the last of ``scales``,
    normalised with the ImageNet mean and std, padded right and bottom) and mask [B, H, W] (True on the
    padding) -> boxes [B, Q, 4] XYXY in each unpadded image's pixels, scores [B, Q], labels [B, Q]; any
    batch and size. Checked against eager on pictures of common.artifacts.export_check.CHECK_SIZES, alone and in one
    padded batch: every query's box, score and class. ``meta``: the weights' metadata (classes, category ids).
    The writer that common.artifacts.export.export calls."""
    saved = weights_metadata(cfg, meta["classes"], recipe, meta["category_ids"], (IMAGENET_MEAN, IMAGENET_STD))
    saved["preprocessing"] = json.dumps(
        {"shorter_side": cfg.scales[-1], "max_size": cfg.max_size, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    )
    images = torch.randn(2, 3, cfg.scales[-1], cfg.scales[-1] + 32, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, *images.shape[-2:], dtype=torch.bool)
    mask[1, :, -32:] = True  # the second image is narrower
    spatial = {"images": {0: "batch", 2: "height", 3: "width"}, "mask": {0: "batch", 1: "height", 2: "width"}}
    names = ["boxes", "scores", "labels"]
    checks = batched_checks(data_transforms(cfg, False), detr_collate, ["images", "mask"])
    read = Detections(lambda out: list(zip(*out)))  # every query: DETR has no threshold and no NMS
    example = {"images": images, "mask": mask}
    return export_model(Exported(model), example, names, folder, saved, spatial, checks=checks, detections=read)


def write_model_folder(
    run: Run, cfg: DetectorSettings, classes: Sequence[str], sizes: tuple[int, int], results: dict[str, float]
) -> None:
    """``<run>/model``: the kept weights (best, else final) with ``config.json`` and a model card giving the
    training and evaluation sets' ``sizes`` (images) and the run's ``results``; ``--weights <run>/model``
    loads it and ``--push_to_hub`` uploads it (common.artifacts.model_folder.write_detector_folder)."""
    write_detector_folder(run, to_dict(cfg), classes, sizes, results)
