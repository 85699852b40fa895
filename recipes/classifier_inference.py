"""What a classifier run ships, beside recipes/classifier.py (as timm keeps inference.py apart from
train.py): the trained model loaded back from its weights (``--weights``, for ``--eval_only``, ``--predict``
and ``--export``), the top-5 classes of new images (``predictions.csv``), the ONNX export (images -> logits)
and the timm model folder with its card (``<run>/model``, which ``--push_to_hub`` uploads at the end).

recipes/classifier.py passes its ``create_model`` in; copy classifier.py and its ``classifier_*.py`` files
together.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from classifier_model import create_transforms, data_config
from common import RunStopped
from common.artifacts.export import OnnxModel, export_model
from common.artifacts.export_check import image_batches
from common.artifacts.figures import format_table, save_table_csv
from common.artifacts.model_folder import model_card, write_timm_folder
from common.checkpoints import partial_stop
from common.config import to_dict
from common.data.images import decode_image, image_files, readable_images
from common.run import Run
from common.weights import is_onnx, load_state, load_weights, read_metadata, weights_metadata

#: What ``--weights`` restores from the file's saved config (flags still override them).
MODEL_FIELDS = (
    "model",
    "model_kwargs",
    "img_size",
    "crop_pct",
    "interpolation",
    "mean",
    "std",
    "linear_probe",
    "probe_blocks",
    "probe_avgpool",
)

#: recipes/classifier.py's ``create_model(cfg, num_classes)``: the run's model, its weights as made.
CreateModel = Callable[[Any, int], torch.nn.Module]


def trained_model(cfg: Any, create_model: CreateModel) -> tuple[torch.nn.Module, list[str]]:
    """The model of ``cfg.weights`` (recipes/classifier.py's Config) and its class names (the file's
    metadata); of an ONNX file, the architecture alone (its data config), the file running the weights."""
    if is_onnx(cfg.weights):
        classes = read_metadata(cfg.weights)["classes"]
        return create_model(dataclasses.replace(cfg, pretrained=False, init_backbone=""), len(classes)), classes
    state, meta = load_weights(cfg.weights, "classifier")
    model = create_model(dataclasses.replace(cfg, pretrained=False, init_backbone=""), len(meta["classes"]))
    return load_state(model, state, cfg.weights, meta["recipe"]), meta["classes"]


@torch.no_grad()
def predict(cfg: Any, run: Run, create_model: CreateModel) -> dict[str, float]:
    """``predictions.csv`` in the run folder: per image of ``cfg.predict`` its path and the top-5 class names
    and probabilities; from ONNX weights, the file runs the model (ONNX Runtime, CPU)."""
    files, skipped = readable_images(image_files(cfg.predict))
    model, classes = trained_model(cfg, create_model)
    _, eval_tf = create_transforms(cfg, model)
    accelerator = run.accelerator
    model = model.to(accelerator.device).eval()
    if is_onnx(cfg.weights):
        onnx_model = OnnxModel(cfg.weights)
        model = lambda images: onnx_model(images)[0].to(images.device)  # noqa: E731
    run.begin()
    if skipped:
        run.print(skipped)
    rows, k = [], min(5, len(classes))
    if accelerator.is_main_process:  # a handful of files: one process reads them all
        try:  # a stop signal between two batches: the rows so far, named as partial
            for start in run.progress(range(0, len(files), 64), "predict", len(files), shared=False):
                batch = files[start : start + 64]
                images = torch.stack([eval_tf(decode_image({"path": str(f)}, str(f))) for f in batch])
                with accelerator.autocast():
                    logits = model(images.to(accelerator.device))
                probs, index = logits.float().softmax(dim=1).topk(k, dim=1)
                for f, p, i in zip(batch, probs.tolist(), index.tolist()):
                    row = {"path": str(f)}
                    for rank, (pi, ii) in enumerate(zip(p, i), 1):
                        row.update({f"class_{rank}": classes[ii], f"prob_{rank}": round(pi, 6)})
                    rows.append(row)
        except RunStopped as stop:
            save_table_csv(rows, run.dir / "predictions.partial.csv")
            raise partial_stop(stop, len(rows), len(files), run.dir / "predictions.partial.csv") from None
        save_table_csv(rows, run.dir / "predictions.csv")
        run.print(format_table(rows[:10], ["path", "class_1", "prob_1", "class_2", "prob_2"]))
        run.print(f"{len(rows)} predictions: {run.dir / 'predictions.csv'}")
    run.finish()
    return {"images": float(len(files))}


def export_files(model: torch.nn.Module, cfg: Any, classes: list[str], folder: Path, recipe: str) -> dict[str, float]:
    """``model.onnx`` (and ``model.pt2``) in ``folder``: images [B, 3, S, S], preprocessed as the metadata's
    ``preprocessing`` (timm's data config) says, -> logits [B, C]; checked against eager (common/artifacts/export.py) on
    batches of one and several, to 1e-3 of the logits' scale. The writer that :func:`common.artifacts.export.export`
    calls."""
    data_cfg = data_config(cfg, model)
    size = data_cfg["input_size"][-1]
    meta = weights_metadata(cfg, classes, recipe, normalization=(data_cfg["mean"], data_cfg["std"]))
    meta["preprocessing"] = json.dumps(data_cfg)
    example = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    checks = image_batches(size, data_cfg["mean"], data_cfg["std"])
    return export_model(model, {"images": example}, ["logits"], folder, meta, checks=checks)


def write_model_folder(
    model: torch.nn.Module,
    cfg: Any,
    classes: list[str],
    data_cfg: Mapping[str, Any],
    folder: Path,
    recipe: str,
    sizes: tuple[int, int],
    results: Mapping[str, float],
) -> str:
    """``folder`` (``<run>/model``): ``model`` (a plain timm model with the kept weights) as a timm model folder
    (``config.json`` with ``data_cfg``, the preprocessing it was evaluated with, and the class names;
    ``model.safetensors``) and a model card giving the training and evaluation sets' ``sizes`` (images) and the
    run's best ``results``. Returns the line that tells the user."""
    card = model_card(recipe, cfg.model, to_dict(cfg), classes, sizes, results, data_cfg)
    meta = weights_metadata(cfg, classes, recipe, normalization=(data_cfg["mean"], data_cfg["std"]))
    write_timm_folder(model, folder, classes, data_cfg, card, meta)
    return "model/: the best weights as a timm folder, timm.create_model('local-dir:<run>/model', pretrained=True)"
