"""What a DINO run ships, beside recipes/dino.py (as timm keeps inference.py apart from train.py): the
teacher backbone, loaded back from the ``teacher_backbone.safetensors`` a run saved (``--weights`` for
``--export``, ``--eval_only`` and ``--predict``), as a timm model folder with its card (``<run>/model``), as
ONNX (``model.onnx``: images -> the features the kNN evaluation compares), and ``--predict``: those features
for a user's own images.

recipes/dino.py builds the backbone from its Config and passes it here; copy dino.py and its ``dino_*.py``
files together.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from common import RunStopped, UserError
from common.artifacts.export import OnnxModel, export_model
from common.artifacts.export_check import image_batches
from common.artifacts.model_folder import model_card, write_timm_folder
from common.checkpoints import partial_stop
from common.config import to_dict
from common.data.images import decode_image, image_files, readable_images
from common.weights import is_onnx, load_weights, mismatch, saved_by, weights_metadata


class BackboneSettings(Protocol):
    """What shipping reads of recipes/dino.py's Config; the whole Config goes into the files' metadata."""

    model: str  # the timm model name
    global_size: int  # the input side, px
    knn_resize: int  # the evaluation's shorter side before its centre crop (0: global_size)
    predict: str  # --predict: an image file or a folder of images
    weights: str  # the teacher backbone's file: safetensors, a model folder, a checkpoint (the student's) or model.onnx


def load_teacher_backbone(backbone: nn.Module, path: str, model: str) -> nn.Module:
    """``backbone`` with the teacher backbone this recipe saved at ``path`` (teacher_backbone.safetensors), or the
    student's of a checkpoint folder (its teacher, an EMA, is pickled there), every key and shape matching, or one
    :class:`UserError` naming the first difference."""
    state, _ = load_weights(path, part="backbone.")
    problem = mismatch(state, backbone.state_dict())
    if problem:
        raise UserError(f"weights '{path}'{saved_by(path)} do not fit model '{model}': {problem}")
    backbone.load_state_dict(state)
    return backbone


def crop_pct_for(size: int, resize: int = 0) -> float:
    """timm's ``crop_pct`` for a shorter side of ``resize`` before a centre crop of ``size`` (0: ``size``): timm
    resizes to ``floor(size / crop_pct)``, and ``size / resize`` in floating point can come back a pixel short
    (224 / (224 / 400) is 399.99...), so the ratio is nudged by half a pixel where it would."""
    resize = resize or size
    exact = size / resize
    return exact if math.floor(size / exact) == resize else size / (resize + 0.5)


def backbone_data_config(cfg: BackboneSettings) -> dict[str, Any]:
    """The backbone's input as timm describes it: the kNN evaluation's resize, crop and normalisation."""
    size = (3, cfg.global_size, cfg.global_size)
    return {
        "input_size": size,
        "interpolation": "bicubic",
        "crop_pct": crop_pct_for(cfg.global_size, cfg.knn_resize),
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
    }


def export_files(backbone: nn.Module, cfg: BackboneSettings, folder: Path, recipe: str) -> dict[str, float]:
    """``model.onnx`` (and ``model.pt2``) in ``folder``: images [B, 3, S, S] (S = global_size, normalised as
    :func:`backbone_data_config` says) -> the pooled features [B, D] the kNN evaluation compares. Checked
    against eager on batches of one and several, to 1e-3 of the features' scale. The writer that
    :func:`common.artifacts.export.export` calls."""
    meta = weights_metadata(cfg, recipe=recipe, normalization=(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD))
    meta["preprocessing"] = json.dumps(backbone_data_config(cfg))
    example = torch.randn(2, 3, cfg.global_size, cfg.global_size, generator=torch.Generator().manual_seed(0))
    checks = image_batches(cfg.global_size, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    return export_model(copy.deepcopy(backbone), {"images": example}, ["features"], folder, meta, checks=checks)


def write_model_folder(
    backbone: nn.Module,
    cfg: BackboneSettings,
    folder: Path,
    recipe: str,
    sizes: tuple[int, int],
    results: Mapping[str, float],
) -> str:
    """``folder`` (``<run>/model``): the teacher backbone as a timm model folder (``config.json`` with the
    kNN evaluation's preprocessing, ``model.safetensors``) and a model card giving the training and kNN
    sets' ``sizes`` (images) and the run's ``results``. Returns the line that tells the user."""
    data_cfg = backbone_data_config(cfg)
    card = model_card(recipe, cfg.model, to_dict(cfg), [], sizes, results, data_cfg, "backbone")
    meta = weights_metadata(cfg, recipe=recipe, normalization=(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD))
    write_timm_folder(copy.deepcopy(backbone), folder, [], data_cfg, card, meta)
    return "model/: the teacher backbone as a timm folder, timm.create_model('local-dir:<run>/model', pretrained=True)"


def _save_features(stem: Path, features: list[torch.Tensor], files: list[Path]) -> np.ndarray:
    """``stem``.npy (float32 [N, D]) and ``stem``.csv (row, path) of ``features`` (batches) of ``files``."""
    array = torch.cat(features).numpy() if features else np.zeros((0, 0), np.float32)
    np.save(stem.with_name(stem.name + ".npy"), array)
    rows = "".join(f"{i},{f}\n" for i, f in enumerate(files))
    stem.with_name(stem.name + ".csv").write_text("row,path\n" + rows)
    return array


@torch.no_grad()
def predict(backbone: nn.Module, cfg: BackboneSettings, run: Any, transform: Any) -> dict[str, float]:
    """``--predict PATH --weights W``: the teacher backbone's features of every image under ``cfg.predict``
    (``transform``: the kNN evaluation's resize, crop and normalisation), as the kNN evaluation and the ONNX
    file compute them: ``features.npy`` (float32 [N, D], in the order of) ``features.csv`` (row, path) in
    the run folder. With ONNX weights the file computes them (ONNX Runtime, CPU)."""
    files, skipped = readable_images(image_files(cfg.predict))
    accelerator = run.accelerator
    if is_onnx(cfg.weights):
        onnx_model = OnnxModel(cfg.weights)
        model = lambda images: onnx_model(images)[0].to(images.device)  # noqa: E731
    else:
        model = backbone.to(accelerator.device).eval()
    run.begin()
    if skipped:
        run.print(skipped)
    if accelerator.is_main_process:  # a handful of files: one process reads them all
        features = []
        try:  # a stop signal between two batches: the features so far, named as partial
            for start in run.progress(range(0, len(files), 64), "predict", len(files), shared=False):
                batch = files[start : start + 64]
                images = torch.stack([transform(decode_image({"path": str(f)}, str(f))) for f in batch])
                with accelerator.autocast():
                    features.append(model(images.to(accelerator.device)).float().cpu())
        except RunStopped as stop:
            done = sum(len(f) for f in features)
            _save_features(run.dir / "features.partial", features, files[:done])
            raise partial_stop(stop, done, len(files), run.dir / "features.partial.npy") from None
        array = _save_features(run.dir / "features", features, files)
        run.print(
            f"{len(files)} images, {array.shape[1]} features each: {run.dir / 'features.npy'} (rows: features.csv)"
        )
    run.finish()
    return {"images": float(len(files))}
