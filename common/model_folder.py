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

#: The keys of a timm data config that describe an evaluation's input.
DATA_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")
#: What timm's pretrained entry says of the weights it describes (their tag, licence, source, paper...).
SOURCE_KEYS = ("tag", "license", "origin_url", "paper_ids", "paper_name", "notes", "hf_hub_id", "url", "source")


def write_timm_folder(
    model: nn.Module, folder: Path, classes: Sequence[str], data_config: Mapping[str, Any], card: str
) -> Path:
    """Write ``model`` (a plain timm model, its current weights) to ``folder`` with timm's own writer
    (:func:`timm.models.save_for_hf`: the factory's arguments, ``model_kwargs`` included, go into
    ``config.json``), ``classes`` as its ``label_names``, ``data_config`` (timm's keys: input size,
    interpolation, crop_pct, mean, std) as its preprocessing, and ``card`` as ``README.md``."""
    from timm.models import save_for_hf

    folder = Path(folder)
    data = {k: (list(v) if isinstance(v, tuple) else v) for k, v in data_config.items() if k in DATA_KEYS}
    save_for_hf(
        model, str(folder), model_config={"label_names": list(classes)}, safe_serialization=True, data_config=data
    )
    # timm copies the architecture's default pretrained entry (tag, license, paper...): not these weights'
    config = json.loads((folder / "config.json").read_text())
    for key in SOURCE_KEYS:
        config["pretrained_cfg"].pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(card)
    return folder


def model_card(
    recipe: str,
    architecture: str,
    config: Mapping[str, Any],
    classes: Sequence[str],
    data_sizes: tuple[int, int],
    metrics: Mapping[str, float],
    data_config: Mapping[str, Any],
) -> str:
    """A model card (markdown): what was trained on what data, its evaluation, how to load it with its
    preprocessing, what it does not promise, the command that reproduces it and the full config.
    ``metrics``: the evaluation to report (``name -> value``, percentages as the recipe logs them)."""
    train, evaluation = data_sizes
    size = data_config["input_size"][-1]
    rows = "\n".join(f"| {k} | {v:.2f} |" for k, v in metrics.items())
    shown = ", ".join(classes[:20]) + (f", ... ({len(classes)} in all)" if len(classes) > 20 else "")
    return f"""---
library_name: timm
tags: [image-classification, timm, cv-recipes]
---

# {architecture}, trained on {config.get("data", "?")}

A `{architecture}` image classifier trained with cv-recipes' `recipes/{recipe}.py` on `{config.get("data", "?")}`:
{train:,} training images, evaluated on {evaluation:,} held-out images, {len(classes)} classes ({shown}).

## Evaluation (held-out split, {size} px)

| metric | value |
|---|---|
{rows}

## Use

```python
import timm, torch
from PIL import Image

model = timm.create_model("local-dir:path/to/this/folder", pretrained=True).eval()  # or "hf-hub:org/name"
transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
with torch.no_grad():
    probabilities = model(transform(Image.open("photo.jpg").convert("RGB"))[None]).softmax(-1)
print(model.pretrained_cfg["label_names"][probabilities.argmax()])
```

The preprocessing in `config.json` is the one it was evaluated with: resize to {size} / crop_pct
({data_config["crop_pct"]}), centre crop {size} px, `{data_config["interpolation"]}` interpolation, mean
{_rounded(data_config["mean"])}, std {_rounded(data_config["std"])}.

## What it does not promise

Its accuracy is that of the held-out split above, drawn like its training images; images of another
kind (other cameras, sizes, subjects, classes it never saw) may score far lower, and it always answers
with one of its {len(classes)} classes. No robustness, fairness or calibration was measured.

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


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(float(v), 4) for v in values]
