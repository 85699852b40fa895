"""Models and weights shared by the recipes: timm models by name, SyncBatchNorm, safetensors weights.

Every weights file a recipe writes has the same metadata schema (all values strings, as
safetensors requires): ``recipe`` (the script's name), ``config`` (the resolved config as JSON:
enough to rebuild the model with the recipe's own ``create_model``), ``classes`` (JSON list of
class names, index = the model's class index) and, from the detectors, ``category_ids`` (JSON list:
the dataset's own id of each class, as its COCO json numbers them). :func:`read_metadata` returns
them decoded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from common import UserError
from common.config import to_dict


def create_timm_model(name: str, optional: dict[str, Any] | None = None, also: str = "", **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, **optional, **kwargs)``; where the model family does not take the
    ``optional`` arguments (``img_size`` for a convnet, say), again without them. An unknown name is
    one :class:`UserError` line instead of timm's traceback (``also`` names what else the recipe
    accepts)."""
    import timm

    try:
        if optional:
            try:
                return timm.create_model(name, **optional, **kwargs)
            except TypeError:
                pass
        return timm.create_model(name, **kwargs)
    except RuntimeError as e:
        if "nknown model" in str(e) or "nvalid model" in str(e):
            raise UserError(f"unknown timm model '{name}'; see timm.list_models(){also}") from None
        raise


def sync_batchnorm(model: nn.Module, accelerator: Any) -> nn.Module:
    """With several CUDA processes, batch norm statistics over the global batch (SyncBatchNorm);
    otherwise the model unchanged. Frozen batch norm layers are not BatchNorm and stay as they are."""
    if accelerator.num_processes > 1 and accelerator.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def freeze_stages(body: nn.Module, freeze_at: int) -> None:
    """Freeze a timm features_only backbone's modules up to and including the one that gives
    feature level ``freeze_at - 1`` of all its levels (level 0 is the stem of a resnet; Detectron2's
    convention: 2 = the stem and the first stage): their weights get no gradient and stay out of the
    optimizer (their batch norm statistics still move unless the batch norm is frozen too)."""
    if freeze_at <= 0:
        return
    levels = body.feature_info.info  # every level, not only out_indices
    if freeze_at > len(levels):
        raise UserError(f"freeze_at {freeze_at}: model has only {len(levels)} stages")
    last = levels[freeze_at - 1]["module"].split(".")[0]
    for name, child in body.named_children():
        for p in child.parameters():
            p.requires_grad_(False)
        if name == last:
            return


def save_weights(state_dict: dict[str, torch.Tensor], path: str | Path, cfg: Any, classes: Sequence[str] = (),
                 recipe: str = "", category_ids: Sequence[int] | None = None) -> None:
    """Write ``state_dict`` as safetensors with the metadata schema of the module docstring; written
    to a temporary file and renamed, so a kill never leaves half a file. Call on the main process."""
    import safetensors.torch

    path = Path(path)
    tmp = path.with_suffix(".tmp")
    # torch.compile's wrapper prefixes every key with `_orig_mod.`: saved without it, the weights load
    # into the plain model (timm, --init_weights) whether or not the run compiled
    tensors = {k.replace("_orig_mod.", ""): v.detach().cpu().contiguous() for k, v in state_dict.items()}
    meta = {"recipe": recipe, "config": json.dumps(to_dict(cfg)), "classes": json.dumps(list(classes))}
    if category_ids is not None:
        meta["category_ids"] = json.dumps([int(i) for i in category_ids])
    safetensors.torch.save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a weights file written by :func:`save_weights`: ``recipe`` (str), ``config``
    (dict), ``classes`` (list) and ``category_ids`` (list; the class indices where the file has none);
    an unreadable file is one :class:`UserError`."""
    import safetensors

    try:
        with safetensors.safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise UserError(f"weights '{path}' could not be read: {type(e).__name__}: {e}") from None
    classes = json.loads(meta.get("classes", "[]"))
    return {"recipe": meta.get("recipe", ""), "config": json.loads(meta.get("config", "{}")), "classes": classes,
            "category_ids": json.loads(meta.get("category_ids", "null")) or list(range(len(classes)))}


def load_weights(path: str | Path, model_of: str = "", tensors: Sequence[str] = ()
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (CPU) and metadata (:func:`read_metadata`) of a weights file, for ``--eval_only`` and
    ``--predict``; a missing or unreadable file is one :class:`UserError`. With ``model_of`` (what the
    recipe trains, for the message), the file must be one: class names, and the ``tensors`` named."""
    import safetensors.torch

    if not Path(path).is_file():
        raise UserError(f"weights '{path}' does not exist")
    meta = read_metadata(path)
    state = safetensors.torch.load_file(str(path))
    if model_of and (not meta["classes"] or any(k not in state for k in tensors)):
        lacking = "class names" + "".join(f" or '{k}'" for k in tensors)
        raise UserError(f"weights '{path}' carry no {lacking}: not a {model_of}'s weights file")
    return state, meta


def config_with_weights(cls: type, argv: Sequence[str] | None, fields: Sequence[str]) -> Any:
    """Parse ``cls`` from ``argv`` (:func:`common.config.parse_config`); when it names ``--weights``, the
    ``fields`` that define the model (name, size, classes...) default to the values saved in that file's
    metadata, so ``--eval_only --weights W`` rebuilds the trained model without repeating its flags.
    A config file and flags still override them. ``eval_only`` or ``predict`` without ``weights`` is
    one :class:`UserError`."""
    from common.config import parse_config

    cfg = parse_config(cls, argv)
    if (getattr(cfg, "eval_only", False) or getattr(cfg, "predict", "")) and not getattr(cfg, "weights", ""):
        mode = "eval_only" if getattr(cfg, "eval_only", False) else "predict"
        raise UserError(f"{mode} needs --weights (a weights file this recipe saved)")
    if not getattr(cfg, "weights", ""):
        return cfg
    if not Path(cfg.weights).is_file():
        raise UserError(f"weights '{cfg.weights}' does not exist")
    saved = read_metadata(cfg.weights)["config"]
    return parse_config(cls, argv, base={k: saved[k] for k in fields if k in saved})


def load_state(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path, recipe: str = "") -> nn.Module:
    """``model`` with ``state`` loaded strictly (the tensors of the weights file ``path``, saved by
    ``recipe``); weights of another architecture or size are one :class:`UserError` naming the first
    difference."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = " ".join(line.strip() for line in str(e).splitlines()[1:3])
        by = f" (saved by {recipe})" if recipe else ""
        raise UserError(f"weights '{path}'{by} do not fit this model: {detail[:300]}") from None
    return model


@torch.no_grad()
def average_bn_statistics(model: nn.Module, accelerator: Any) -> None:
    """Average every batch-norm layer's running mean and variance over the processes, in place (timm's
    ``distribute_bn`` "reduce"): each process's statistics have seen only its own batches, and a model
    EMA's buffers follow each process's own model. Call on every process before evaluating; one process
    or SyncBatchNorm (statistics already global): nothing to do."""
    if accelerator.num_processes == 1:
        return
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm) \
                and m.track_running_stats:
            for buf in (m.running_mean, m.running_var):
                buf.copy_(accelerator.reduce(buf, reduction="mean"))
