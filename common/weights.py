"""Weights files: safetensors with one metadata schema for every recipe, their tensors loaded back into
a model (``--weights``), and a config rebuilt from their metadata.

Every weights file a recipe writes has the same metadata schema (all values strings, as
safetensors requires): ``recipe`` (the script's name), ``config`` (the resolved config as JSON:
enough to rebuild the model with the recipe's own ``create_model``), ``classes`` (JSON list of
class names, index = the model's class index) and, from the detectors, ``category_ids`` (JSON list:
the dataset's own id of each class, as its COCO json numbers them), and ``mean`` / ``std`` (JSON lists:
the per-channel normalisation of the inputs the weights were trained on). :func:`read_metadata`
returns them decoded.

A checkpoint folder (``<run>/checkpoints/step_XXXXXXXX``, :func:`common.run_folder.write_checkpoint`) is weights
too: its tensors are the trained model's (Accelerate's ``model.safetensors``, keys as the recipe's own files have
them; a part of it where the recipe's weights are one, such as DINO's backbone), never an EMA (those are pickled
there), and its metadata is the :data:`~common.run_folder.CHECKPOINT_METADATA` file the run writes beside them,
the schema above. A checkpoint written before that file existed still gives its config (the run's
``config.yaml``) but no class names.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from common import UserError
from common.config import RunConfig, parse_config, to_dict
from common.config_help import recipe_file, show
from common.console import counted
from common.guard import NonFiniteLoss
from common.requirements import check_run
from common.run_folder import (
    CHECKPOINT_METADATA,
    checkpoint_metadata,
    checkpoint_tensors,
    finish_command,
    is_checkpoint_folder,
)

C = TypeVar("C", bound=RunConfig)


def save_weights(
    state_dict: dict[str, torch.Tensor],
    path: str | Path,
    cfg: Any,
    classes: Sequence[str] = (),
    recipe: str = "",
    category_ids: Sequence[int] | None = None,
    normalization: tuple[Sequence[float], Sequence[float]] | None = None,
) -> None:
    """Write ``state_dict`` as safetensors with the metadata schema of the module docstring; written
    to a temporary file and renamed, so a kill never leaves half a file. Call on the main process.
    ``normalization``: the per-channel (mean, std) the model's inputs were normalised with (0..1 pixel
    scale), so that whoever starts from these weights feeds them what they were trained on."""
    import safetensors.torch

    path = Path(path)
    tmp = path.with_suffix(".tmp")
    # torch.compile's wrapper prefixes every key with `_orig_mod.`: saved without it, the weights load
    # into the plain model (timm, --init_backbone) whether or not the run compiled
    tensors = {k.replace("_orig_mod.", ""): v.detach().cpu().contiguous() for k, v in state_dict.items()}
    diverged = next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if diverged is not None:  # a diverged model is never anybody's best or final weights
        raise NonFiniteLoss(f"{path.name} not written: its tensor '{diverged}' holds NaN or infinite values")
    meta = weights_metadata(cfg, classes, recipe, category_ids, normalization)
    safetensors.torch.save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def weights_metadata(
    cfg: Any,
    classes: Sequence[str] = (),
    recipe: str = "",
    category_ids: Sequence[int] | None = None,
    normalization: tuple[Sequence[float], Sequence[float]] | None = None,
) -> dict[str, str]:
    """The metadata schema of the module docstring (all values strings), as :func:`save_weights` writes it
    into safetensors and the exports into ONNX files."""
    meta = {"recipe": recipe, "config": json.dumps(to_dict(cfg)), "classes": json.dumps(list(classes))}
    if category_ids is not None:
        meta["category_ids"] = json.dumps([int(i) for i in category_ids])
    if normalization is not None:
        meta["mean"], meta["std"] = (json.dumps([float(v) for v in values]) for values in normalization)
    return meta


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a weights file written by :func:`save_weights`: ``recipe`` (str), ``config``
    (dict), ``classes`` (list), ``category_ids`` (list; the class indices where the file has none) and
    ``mean``, ``std`` (the input normalisation, lists of 3 floats; None where the file does not say);
    an unreadable file is one :class:`UserError`. An exported ONNX file (:mod:`common.artifacts.export`) carries the
    same metadata; a model folder's is that of its ``model.safetensors``. A checkpoint folder's is its
    :data:`~common.run_folder.CHECKPOINT_METADATA` (without it, the run's ``config.yaml`` as ``config``), and it
    adds ``checkpoint``: ``step``, ``run`` (the run folder), ``part`` (the prefix of the trained model's tensors
    the recipe's weights are; '' for all of them) and ``complete`` (whether that file was there)."""
    import safetensors

    path = weights_file(path)
    checkpoint = None
    if is_checkpoint_folder(path):
        meta, checkpoint = checkpoint_metadata(path)
    elif is_onnx(path):
        meta = read_onnx_metadata(path)
    else:
        try:
            with safetensors.safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        except Exception as e:
            raise UserError(f"weights '{path}' could not be read: {type(e).__name__}: {e}") from None
    classes = json.loads(meta.get("classes", "[]"))
    decoded = {
        "recipe": meta.get("recipe", ""),
        "config": json.loads(meta.get("config", "{}")),
        "classes": classes,
        "category_ids": json.loads(meta.get("category_ids", "null")) or list(range(len(classes))),
        "mean": json.loads(meta["mean"]) if "mean" in meta else None,
        "std": json.loads(meta["std"]) if "std" in meta else None,
    }
    return decoded if checkpoint is None else {**decoded, "checkpoint": checkpoint}


def weights_file(path: str | Path) -> Path:
    """The weights ``--weights`` names: the path itself (a file, or a checkpoint folder), or the
    ``model.safetensors`` of a model folder (``<run>/model``)."""
    path = Path(path)
    if is_checkpoint_folder(path):
        return path
    return path / "model.safetensors" if path.is_dir() and (path / "model.safetensors").is_file() else path


def kept_weights(run_dir: str | Path) -> Path:
    """The weights a run keeps for use (export, model folder): ``best.safetensors`` (the best evaluation),
    else ``final.safetensors``."""
    best = Path(run_dir) / "best.safetensors"
    return best if best.is_file() else Path(run_dir) / "final.safetensors"


def load_weights(
    path: str | Path, model_of: str = "", tensors: Sequence[str] = (), part: str = ""
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (CPU) and metadata (:func:`read_metadata`) of a weights file or checkpoint folder, for
    ``--eval_only``, ``--predict`` and ``--export``; a missing or unreadable file is one :class:`UserError`. With
    ``model_of`` (what the recipe trains, for the message), the file must be one: class names, and the ``tensors``
    named. ``part``: of a checkpoint whose metadata does not say, the prefix of the trained model's tensors that
    the recipe's weights are (DINO's ``backbone.``)."""
    import safetensors.torch

    path = weights_file(path)
    if not path.is_file() and not is_checkpoint_folder(path):
        raise UserError(f"weights '{path}' does not exist")
    if is_onnx(path):
        raise UserError(f"weights '{path}' are an ONNX export: --predict runs them; this needs the safetensors file")
    meta = read_metadata(path)
    if "checkpoint" in meta:  # the trained model's tensors (a part of them, where the recipe keeps one)
        checkpoint = meta["checkpoint"]
        state = checkpoint_tensors(path, checkpoint["part"] or part)
        if model_of and not meta["classes"] and not checkpoint["complete"]:
            raise UserError(
                f"checkpoint '{path}' has no {CHECKPOINT_METADATA} (written before checkpoints kept it): the class "
                f"names a {model_of} needs are unknown; its weights files come from finishing the run: "
                f"{finish_command(Path(checkpoint['run']), meta['recipe'])}"
            )
    else:
        state = safetensors.torch.load_file(str(path))
    if model_of and (not meta["classes"] or any(k not in state for k in tensors)):
        lacking = "class names" + "".join(f" or '{k}'" for k in tensors)
        raise UserError(f"weights '{path}' carry no {lacking}: not a {model_of}'s weights file")
    return state, meta


#: What ``--eval_only`` also takes from the weights' saved config: the data they were evaluated on and its
#: batch size, so evaluating the trained model needs only ``--weights`` (flags still override them).
EVALUATION_FIELDS = ("data", "train_split", "eval_split", "image_column", "label_column", "knn_data", "batch_size")


def config_with_weights(
    cls: type[C], argv: Sequence[str] | None, fields: Sequence[str], older: Mapping[str, Any] | None = None
) -> C:
    """Parse ``cls`` from ``argv`` (:func:`common.config.parse_config`); when it names ``--weights``, the
    ``fields`` that define the model (name, size, classes...) default to the values saved in that file's
    metadata, so ``--eval_only --weights W`` rebuilds the trained model without repeating its flags (and
    with ``eval_only`` the :data:`EVALUATION_FIELDS` too).
    ``older``: the values of ``fields`` added since weights were first saved, for files whose config lacks them
    (what those files were trained with). A config file and flags still override them. ``eval_only`` or
    ``predict`` without ``weights``, and weights another recipe saved (their config has fields ``cls`` lacks), are
    one :class:`UserError`."""
    cfg = parse_config(cls, argv)
    check_run(cfg, recipe_file(cls).stem)  # the packages this run uses (its tracker, ONNX), before any is imported
    if (cfg.eval_only or cfg.predict) and not cfg.weights:
        mode = "eval_only" if cfg.eval_only else "predict"
        raise UserError(f"{mode} needs --weights (a weights file this recipe saved)")
    if not cfg.weights:
        return cfg
    if not weights_file(cfg.weights).is_file() and not is_checkpoint_folder(cfg.weights):
        raise UserError(f"weights '{cfg.weights}' does not exist")
    cfg = dataclasses.replace(cfg, weights=str(weights_file(cfg.weights)))
    meta = read_metadata(cfg.weights)
    this = recipe_file(cls).stem
    known = {f.name for f in dataclasses.fields(cls)}
    if meta["recipe"] not in ("", this) and any(k not in known for k in meta["config"]):  # not a renamed copy's
        raise UserError(
            f"weights '{cfg.weights}' were saved by {meta['recipe']}.py and do not fit {this}.py, which needs its own"
        )
    saved = {**(older or {}), **meta["config"]}
    restored = [*fields, *EVALUATION_FIELDS] if cfg.eval_only else list(fields)
    parsed = parse_config(cls, argv, base={k: saved[k] for k in restored if k in saved})
    return dataclasses.replace(parsed, weights=cfg.weights)  # a model folder's file


def saved_by(path: str | Path) -> str:
    """Where a weights file comes from, for a message: `` (saved by dino.py for model resnet10t {channels:
    [32, 64, 128, 256]})``, or '' where its metadata does not say."""
    said = _said(read_metadata(path))
    return f" (saved{said})" if said else ""


def _said(meta: dict[str, Any]) -> str:
    """`` by dino.py for model resnet10t {...}`` from the decoded metadata ``meta``: what it says of its origin."""
    recipe, model, kwargs = meta["recipe"], meta["config"].get("model", ""), meta["config"].get("model_kwargs")
    model += f" {show(kwargs)}" if model and kwargs else ""
    return (f" by {recipe}.py" if recipe else "") + (f" for model {model}" if model else "")


def mismatch(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    """Why the tensors ``state`` (a file's) do not load into the state dict ``own`` (a model's), in one phrase
    naming the first difference: a tensor of another shape, else one the file lacks, else one the model lacks;
    '' when they fit."""
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    lacking = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    if wrong:
        k = wrong[0]
        first, count = f"'{k}' is {list(state[k].shape)} in the file, {list(own[k].shape)} in the model", len(wrong)
    elif lacking:
        first, count = f"the file lacks '{lacking[0]}'", len(lacking)
    elif extra:
        first, count = f"the model has no '{extra[0]}'", len(extra)
    else:
        return ""
    return first + (f" (and {count - 1} more)" if count > 1 else "")


def load_state(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path, recipe: str = "") -> nn.Module:
    """``model`` with ``state`` loaded strictly (the tensors of the weights file ``path``, saved by
    ``recipe``); weights of another architecture or size are one :class:`UserError` naming the first
    difference."""
    problem = mismatch(state, model.state_dict())
    if problem:
        by = f" (saved by {recipe}.py)" if recipe else ""
        raise UserError(f"weights '{path}'{by} do not fit this model: {problem}")
    model.load_state_dict(state)
    return model


def load_backbone(model: nn.Module, path: str | Path) -> str:
    """``--init_backbone`` (the classifier's and the detectors'): ``model`` from a safetensors file of the same
    timm model (DINO's ``teacher_backbone.safetensors``, a classifier's ``best.safetensors``, one saved from
    ``timm.create_model``). ``model`` is a whole timm classifier or a detector's timm ``features_only``
    backbone. The model family's checkpoint filter (timm's ``checkpoint_filter_fn``, which resizes a ViT's
    position embeddings) runs first. Keys under ``backbone.`` (a detector's own file) or ``model.`` /
    ``module.`` (a wrapped model's) are found too, and so are the plain model's names of the modules a
    ``features_only`` model flattens. A classifier's head (timm's ``pretrained_cfg["classifier"]``) starts new
    where the file has none or one of another shape; every other tensor the model has must be in the file
    with its shape, or one :class:`UserError` names the first that is not. A whole model also refuses the
    file's tensors it has no place for (a larger model's); a ``features_only`` backbone ignores them (stages
    it does not read, a head), and the detector's own layers stay as they were made. Returns the start
    banner's line."""
    import safetensors.torch

    if not Path(path).is_file():
        raise UserError(f"init_backbone '{path}' does not exist")
    state = safetensors.torch.load_file(str(path))
    filter_fn = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    if filter_fn is not None:  # a whole timm model's family; timm's features_only wrappers have none
        try:
            state = filter_fn(state, model)
        except (KeyError, RuntimeError, ValueError, TypeError, AttributeError):
            # a filter written for the family's original release layout: a timm state dict is used as it is,
            # and what does not fit is named key by key below
            state = safetensors.torch.load_file(str(path))
    own = model.state_dict()
    for prefix in ("backbone.", "model.", "module."):
        if not any(k in state for k in own):
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)} or state
    if hasattr(model, "get_classifier"):  # a whole timm model (features_only wrappers have no head)
        head = model.pretrained_cfg.get("classifier", "")
        heads = (head,) if isinstance(head, str) else tuple(head)
        # the file's head, where it does not fit, is left out: the model's starts new
        state = {
            k: v for k, v in state.items() if not (k.startswith(heads) and (k not in own or own[k].shape != v.shape))
        }
        problem = mismatch(state, {k: v for k, v in own.items() if k in state or not k.startswith(heads)})
        if problem:
            name = model.pretrained_cfg.get("architecture") or type(model).__name__
            raise UserError(f"init_backbone '{path}'{saved_by(path)} does not fit model '{name}': {problem}")
        model.load_state_dict(state, strict=False)
        new = [k for k in own if k not in state]
        what_new = ", ".join(sorted({k.rsplit(".", 1)[0] for k in new}))
        return loaded_line("init_backbone", path, len(state), len(new), what_new)
    # a features_only model flattens its first level of nested modules: `stem.conv1` is `stem_conv1` there
    flat = {k: k if k in state else k.replace("_", ".", 1) for k in own}
    state = {k: state[f] for k, f in flat.items() if f in state}
    problem = mismatch(state, own)
    if problem:
        raise UserError(f"init_backbone '{path}'{saved_by(path)} does not fit the backbone: {problem}")
    model.load_state_dict(state)
    return loaded_line("init_backbone", path, len(state), 0, "") + "; the detector's own layers start new"


def weights_line(path: str | Path) -> str:
    """The line that names the weights ``--eval_only``, ``--predict`` or ``--export`` run: the file, who saved
    it, and its tensor count (all of them load, or the model refuses the file); of a checkpoint, its step and
    run, and that the trained model's weights are what it gives (an EMA there is pickled, never loaded)."""
    import safetensors

    path = weights_file(path)
    if is_checkpoint_folder(path):
        meta = read_metadata(path)
        checkpoint, said = meta["checkpoint"], _said(meta)
        what = f"the trained model's {checkpoint['part'].rstrip('.')}" if checkpoint["part"] else "the trained model"
        count = len(checkpoint_tensors(path, checkpoint["part"], keys_only=True))
        origin = f"checkpoint at step {checkpoint['step']} of {checkpoint['run']}" + (f", saved{said}" if said else "")
        return f"weights '{path}' ({origin}: {what}, not an EMA): {counted(count, 'tensor')} loaded"
    if is_onnx(path):
        return f"weights '{path}'{saved_by(path)}: an ONNX file, run by ONNX Runtime"
    with safetensors.safe_open(str(path), "pt") as f:
        return loaded_line("weights", path, len(list(f.keys())), 0, "")


def loaded_line(field: str, path: str | Path, loaded: int, new: int, what_new: str) -> str:
    """The start banner's line for a weights file a run starts from: the flag, the file and who saved it,
    the model's tensors it filled and how many start new (``what_new`` names them)."""
    line = f"{field} '{path}'{saved_by(path)}: {counted(loaded, 'tensor')} loaded"
    return line + (f", {new} new ({what_new})" if new else "")


def is_onnx(path: str | Path) -> bool:
    """Whether ``path`` names an ONNX file (by its suffix), as ``--weights`` may."""
    return Path(path).suffix.lower() == ".onnx"


def read_onnx_metadata(path: str | Path) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file (strings); an unreadable file is one :class:`UserError`."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise UserError(f"weights '{path}' could not be read as ONNX: {type(e).__name__}: {e}") from None
    return {p.key: p.value for p in proto.metadata_props}
