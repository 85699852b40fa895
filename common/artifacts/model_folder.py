"""A trained timm model as a folder people already know how to load: ``config.json`` in timm's format
(architecture, classes, the preprocessing the model was evaluated with), ``model.safetensors`` and a
``README.md`` model card. ``timm.create_model("local-dir:<folder>", pretrained=True)`` builds it with its
weights, and ``timm.data.resolve_data_config(model=...)`` gives back its preprocessing; the same folder
is what the Hugging Face hub serves for ``hf-hub:`` names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from common.console import counted

#: The keys of a timm data config that describe an evaluation's input.
DATA_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")
#: What timm's pretrained entry says of the weights it describes (their tag, licence, source, paper...).
SOURCE_KEYS = ("tag", "license", "origin_url", "paper_ids", "paper_name", "notes", "hf_hub_id", "url", "source")


def write_timm_folder(
    model: nn.Module,
    folder: Path,
    classes: Sequence[str],
    data_config: Mapping[str, Any],
    card: str,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model`` (a plain timm model, its current weights) to ``folder`` with timm's own writer
    (:func:`timm.models.save_for_hf`: the factory's arguments, ``model_kwargs`` included, go into
    ``config.json``), ``classes`` as its ``label_names``, ``data_config`` (timm's keys: input size,
    interpolation, crop_pct, mean, std) as its preprocessing, and ``card`` as ``README.md``. ``metadata``
    (the recipe's weights metadata, :func:`common.weights.weights_metadata`) goes into
    ``model.safetensors``, so that the folder is also the recipe's ``--weights``."""
    import safetensors.torch
    from timm.models import save_for_hf

    folder = Path(folder)
    data = {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items() if k in DATA_KEYS}
    # save_for_hf's data_config keyword exists only from timm 1.0.31: the preprocessing goes in below instead
    save_for_hf(model, str(folder), model_config={"label_names": list(classes)}, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_cfg"] = with_preprocessing(config["pretrained_cfg"], data)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if metadata:
        weights = folder / "model.safetensors"
        tensors = safetensors.torch.load_file(str(weights))
        safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt", **metadata})
    (folder / "README.md").write_text(card)
    return folder


def with_preprocessing(pretrained_cfg: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``pretrained_cfg`` (a timm ``config.json``'s entry) describing these weights: ``data`` (timm data-config
    keys, :data:`DATA_KEYS`) as its preprocessing, the test-time size and crop the architecture's default
    entry recommends dropped (the weights were evaluated as ``data`` says), its pooling size dropped when the
    input size differs from the default's, and the default entry's source keys (tag, licence, paper...)
    dropped: they describe other weights. The keys and values are those timm's own writer gives from 1.0.31
    (``save_for_hf(..., data_config=...)``)."""
    cfg = {k: v for k, v in pretrained_cfg.items() if k not in SOURCE_KEYS}
    default_size = list(cfg.get("input_size") or [])
    cfg.update(data)
    if "input_size" in data:
        for key in ("test_input_size", "test_pool_size"):
            cfg.pop(key, None)
        if list(data["input_size"])[1:] != default_size[1:]:
            cfg["pool_size"] = None
    if "crop_pct" in data:
        cfg.pop("test_crop_pct", None)
    return cfg


def write_detector_folder(
    run: Any,
    config: Mapping[str, Any],
    classes: Sequence[str],
    data_sizes: tuple[int, int],
    metrics: Mapping[str, float],
) -> Path:
    """A detector run's model folder ``<run>/model`` (``run``: :class:`common.run.Run`, main process):
    ``model.safetensors`` (a copy of the kept weights, :func:`common.weights.kept_weights`, their metadata
    included), ``config.json`` (that metadata: recipe, config, classes, category ids, input normalisation)
    and a model card (:func:`model_card`) as ``README.md``; the recipe's ``--weights <folder>`` loads it."""
    import shutil

    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from common.weights import kept_weights, read_metadata

    weights, folder = kept_weights(run.dir), run.dir / "model"
    meta = read_metadata(weights)
    normalised = {"mean": meta["mean"] or IMAGENET_DEFAULT_MEAN, "std": meta["std"] or IMAGENET_DEFAULT_STD}
    card = model_card(run.recipe, config["model"], config, classes, data_sizes, metrics, normalised, "detector")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(weights, folder / "model.safetensors.tmp")
    (folder / "model.safetensors.tmp").replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    (folder / "README.md").write_text(card)
    run.print(f"model/: {weights.name} with config.json and a model card (--weights {folder} loads it)")
    return folder


def model_card(
    recipe: str,
    architecture: str,
    config: Mapping[str, Any],
    classes: Sequence[str],
    data_sizes: tuple[int, int],
    metrics: Mapping[str, float],
    data_config: Mapping[str, Any],
    task: str = "classifier",
) -> str:
    """A model card (markdown): what was trained on what data, its evaluation, how to load it with its
    preprocessing, what it does not promise, the command that reproduces it and the full config.
    ``metrics``: the evaluation to report (``name -> value``, percentages as the recipe logs them);
    ``task``: ``classifier`` (a timm folder with a head), ``backbone`` (a timm folder of features, from
    self-supervised training) or ``detector`` (a folder the recipe's ``--weights`` loads)."""
    train, evaluation = data_sizes
    data = config.get("data", "?")
    rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())
    shown = ", ".join(map(str, classes[:20])) + (f", ... ({len(classes)} in all)" if len(classes) > 20 else "")
    library = "timm" if task in ("classifier", "backbone") else "pytorch"
    what = {
        "classifier": f"A `{architecture}` image classifier",
        "backbone": f"A `{architecture}` backbone, self-supervised without labels (DINO),",
        "detector": f"An object detector on a `{architecture}` backbone",
    }[task]
    labelled = f", {counted(len(classes), 'class', 'classes')} ({shown})" if classes else ""
    tag = {"classifier": "image-classification", "backbone": "image-feature-extraction"}.get(task, "object-detection")
    return f"""---
library_name: {library}
tags: [{tag}, cv-recipes]
---

# {architecture}, trained on {data}

{what} trained with cv-recipes' `recipes/{recipe}.py` on `{data}`: {train:,} training images, evaluated on
{evaluation:,} held-out images{labelled}.

## Evaluation (held-out split)

| metric | value |
|---|---|
{rows}

## Use

{_use(task, recipe, data_config)}

## What it does not promise

Its scores are those of the held-out split above, drawn like its training images; images of another
kind (other cameras, sizes, subjects, classes it never saw) may score far lower. No robustness, fairness or
calibration was measured.

## Reproduce

From a cv-recipes checkout, with the run's saved config (`config.yaml` beside this folder; the new run
goes to a folder beside that one):

```bash
accelerate launch recipes/{recipe}.py --config {config.get("output_dir") or f"runs/{recipe}/<run>"}/config.yaml
```

<details><summary>The full config</summary>

```yaml
{yaml.safe_dump(json.loads(json.dumps(dict(config))), sort_keys=False).strip()}
```

</details>
"""


def _use(task: str, recipe: str, data_config: Mapping[str, Any]) -> str:
    """The card's "Use" section: loading the folder and feeding it what it was evaluated on."""
    if task == "detector":
        return f"""With cv-recipes (boxes in each image's pixels, `detections.json` and pictures):

```bash
accelerate launch recipes/{recipe}.py --predict path/to/images --weights path/to/this/folder
```

Without it: `--export --weights path/to/this/folder` writes `model.onnx`; its metadata names its input,
outputs and preprocessing (mean {_rounded(data_config["mean"])}, std {_rounded(data_config["std"])})."""
    size = data_config["input_size"][-1]
    head = (
        'print(model.pretrained_cfg["label_names"][model(x).argmax()])'
        if task == "classifier"
        else "features = model(x)  # [1, D]: the pooled features the kNN evaluation compared"
    )
    return f"""```python
import timm, torch
from PIL import Image, ImageOps

model = timm.create_model("local-dir:path/to/this/folder", pretrained=True).eval()  # or "hf-hub:org/name"
transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
with torch.no_grad():
    x = transform(ImageOps.exif_transpose(Image.open("photo.jpg")).convert("RGB"))[None]  # as viewers show it
    {head}
```

The preprocessing in `config.json` is the one it was evaluated with: resize to {size} / crop_pct
({data_config["crop_pct"]}), centre crop {size} px, `{data_config["interpolation"]}` interpolation, mean
{_rounded(data_config["mean"])}, std {_rounded(data_config["std"])}."""


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(float(v), 4) for v in values]
