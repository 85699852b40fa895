"""DETR's checkpoint reader for ``recipes/detr.py --init_weights``: the reference's COCO-trained
detector (facebookresearch/detr's ``.pth``), transformers' conversion of it (``facebook/detr-resnet-50``
safetensors) or detr.py's own weights, renamed onto detr.py's modules; the class head kept for the
data's COCO classes or replaced. Beside the recipe as one concern of its own (a copy of detr.py takes its
siblings detr_model.py, detr_pretrain.py and this file)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors
import torch

from common import UserError

if TYPE_CHECKING:
    from torch import nn


# ============================================================================================
# Starting from a trained DETR (--init_weights): the reference's COCO checkpoint, transformers'
# conversion of it, or this recipe's own weights, renamed onto this model's modules
# ============================================================================================
# COCO's 80 object categories: ids 1..90 with ten unused, names in id order (instances_*.json). The
# reference's class head has a row for every id 0..90 and no-object last (row 91).
COCO_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
COCO_NAMES = [
    n.replace("_", " ")
    for n in (
        "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant stop_sign "
        "parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe backpack umbrella handbag tie "
        "suitcase frisbee "
        "skis snowboard sports_ball kite baseball_bat baseball_glove skateboard surfboard tennis_racket bottle "
        "wine_glass cup fork knife spoon bowl banana apple sandwich orange broccoli carrot hot_dog pizza donut cake "
        "chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard cell_phone microwave oven "
        "toaster sink refrigerator book clock vase scissors teddy_bear hair_drier toothbrush"
    ).split()
]
DETR_R50 = (
    "the model fields must be the checkpoint's; DETR-R50: model resnet50, out_index -1, d_model 256, "
    "enc_layers 6, dec_layers 6, nheads 8, dim_feedforward 2048, num_queries 100"
)


def read_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a weights file and its safetensors metadata ({} for a torch file). Safetensors is
    recognised by its header (an 8-byte length, then JSON), whatever the name. A torch file (``.pth``,
    ``.bin``) is read with ``weights_only=True``: tensors and plain containers, never a pickled object
    (unpickling can run code); a state dict, or a dict holding one under ``model`` (the reference's)."""
    if not Path(path).is_file():
        raise UserError(f"init_weights '{path}' does not exist")
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        try:
            with safetensors.safe_open(path, "pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except Exception as e:
            raise UserError(
                f"init_weights '{path}' could not be read as safetensors: {type(e).__name__}: {e}"
            ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError names the first global that is not a tensor's
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = (
            f"it holds a pickled Python object ({found[1]})" if found else f"{type(e).__name__}: {str(e).strip()[:120]}"
        )
        raise UserError(
            f"init_weights '{path}' is neither safetensors nor a weights-only torch file: {why}; only "
            "tensors are read, never pickled objects: save the state dict alone (or use safetensors)"
        ) from None
    state = obj.get("model", obj) if isinstance(obj, dict) else obj
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"init_weights '{path}' holds no state dict (names -> tensors) at its top or under 'model'")
    return dict(state), {}


def _transformers_to_reference(key: str) -> str:
    """A transformers ``DetrForObjectDetection`` name -> the reference's (facebookresearch/detr)."""
    for old, new in (
        ("model.backbone.conv_encoder.model.", "backbone.0.body."),
        ("model.input_projection.", "input_proj."),
        ("model.query_position_embeddings.", "query_embed."),
        ("model.encoder.layers.", "transformer.encoder.layers."),
        ("model.decoder.layers.", "transformer.decoder.layers."),
        ("model.decoder.layernorm.", "transformer.decoder.norm."),
        ("class_labels_classifier.", "class_embed."),
        ("bbox_predictor.", "bbox_embed."),
    ):
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    if key.startswith("transformer."):
        last_norm = ".norm3." if key.startswith("transformer.decoder.") else ".norm2."
        for old, new in (
            (".self_attn_layer_norm.", ".norm1."),
            (".encoder_attn_layer_norm.", ".norm2."),
            (".final_layer_norm.", last_norm),
            (".encoder_attn.", ".multihead_attn."),
            (".fc1.", ".linear1."),
            (".fc2.", ".linear2."),
        ):
            key = key.replace(old, new)
    elif key.startswith("backbone.0.body."):  # timm's resnet has torchvision's names; transformers' own ResNet
        key = key.replace("embedder.embedder.convolution.", "conv1.")
        key = key.replace("embedder.embedder.normalization.", "bn1.")
        key = re.sub(r"encoder\.stages\.(\d+)\.layers\.", lambda m: f"layer{int(m[1]) + 1}.", key)
        key = key.replace("shortcut.convolution.", "downsample.0.").replace("shortcut.normalization.", "downsample.1.")
        key = re.sub(
            r"\.layer\.(\d)\.(convolution|normalization)\.",
            lambda m: f".{'conv' if m[2] == 'convolution' else 'bn'}{int(m[1]) + 1}.",
            key,
        )
    return key


def _reference_to_recipe(key: str) -> str:
    """A reference (facebookresearch/detr) name -> this recipe's (the backbone: timm's resnet50 has the
    module names of torchvision's, which the reference uses)."""
    key = re.sub(r"^backbone\.0\.body\.", "backbone.", key)
    key = re.sub(r"^transformer\.(encoder|decoder)\.layers\.", r"\1.", key)
    key = re.sub(r"^transformer\.decoder\.norm\.", "decoder_norm.", key)
    key = re.sub(r"^bbox_embed\.layers\.(\d+)\.", lambda m: f"bbox_embed.{2 * int(m[1])}.", key)  # ReLUs between
    if key.startswith(("encoder.", "decoder.")):
        for old, new in ((".linear1.", ".ff.0."), (".linear2.", ".ff.3."), (".multihead_attn.", ".cross_attn.")):
            key = key.replace(old, new)
    return key


def to_recipe_names(state: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[str, torch.Tensor]], str]:
    """A DETR state dict in any of the three namings -> ``{this model's name: (the file's name, tensor)}``
    and the naming found: ``facebookresearch/detr``, ``transformers`` (its separate q/k/v projections
    concatenated into nn.MultiheadAttention's ``in_proj``, rows q, k, v) or ``detr.py`` (as it is)."""
    if all(k.startswith("module.") for k in state):  # saved from a DistributedDataParallel wrapper
        state = {k[len("module.") :]: v for k, v in state.items()}
    named = {k: (k, v) for k, v in state.items()}
    if any(k.startswith(("model.backbone.conv_encoder.", "class_labels_classifier.")) for k in state):
        source = "transformers"
        named = {_transformers_to_reference(k): sv for k, sv in named.items()}
        merged, parts = {}, {}
        for k, sv in named.items():
            qkv = re.fullmatch(r"(.+)\.([qkv])_proj\.(weight|bias)", k)
            if qkv:
                parts.setdefault((qkv[1], qkv[3]), {})[qkv[2]] = sv
            else:
                merged[k] = sv
        for (prefix, kind), p in parts.items():
            if len(p) == 3:
                merged[f"{prefix}.in_proj_{kind}"] = (f"{p['q'][0]} (+ k, v)", torch.cat([p[c][1] for c in "qkv"]))
            else:  # incomplete: reported as tensors the model lacks
                merged.update({sv[0]: sv for sv in p.values()})
        named = merged
    elif any(k.startswith(("transformer.", "backbone.0.body.")) for k in state):
        source = "facebookresearch/detr"
    elif "class_embed.weight" in state and any(k.startswith("encoder.") or k.startswith("decoder.") for k in state):
        return named, "detr.py"
    else:
        raise UserError(
            f"the init_weights file is not a DETR checkpoint (names like {list(state)[:3]}); expected "
            "the reference's .pth, transformers' DetrForObjectDetection or this recipe's safetensors"
        )
    return {_reference_to_recipe(k): sv for k, sv in named.items()}, source


def coco_rows(classes: list[str], category_ids: list[int], no_object: int = 91) -> list[int] | None:
    """The rows of a COCO-trained class head that give ``classes`` (then no-object, row ``no_object``)
    when every class is a COCO category, its id and its name both (names compared ignoring case, ``_``
    and ``-``); None otherwise."""
    coco = dict(zip(COCO_IDS, COCO_NAMES))
    names = [str(n).lower().replace("_", " ").replace("-", " ").strip() for n in classes]
    ids = [int(i) for i in category_ids]
    if not names or len(ids) != len(names) or any(coco.get(i) != n or i >= no_object for i, n in zip(ids, names)):
        return None
    return ids + [no_object]


def load_init_weights(model: nn.Module, path: str, classes: list[str], category_ids: list[int]) -> str:
    """Load a DETR checkpoint (:func:`read_checkpoint`, :func:`to_recipe_names`) into ``model``, every
    tensor with its shape (the first difference, or tensors one side lacks, is one UserError). The class
    head: a COCO-trained one keeps the rows of the data's classes when they are COCO categories
    (:func:`coco_rows`), this recipe's own keeps its rows when the file's classes are the data's;
    otherwise the model's new head stays. Batch norm's ``num_batches_tracked`` (the reference has none)
    stays the model's. Returns a line saying what was loaded."""
    state, meta = read_checkpoint(path)
    named, source = to_recipe_names(state)
    own = model.state_dict()
    named = {k: sv for k, sv in named.items() if k in own or not k.endswith("num_batches_tracked")}
    unexpected = [src for k, (src, _) in named.items() if k not in own]
    missing = [k for k in own if k not in named and not k.endswith("num_batches_tracked")]
    if unexpected or missing:
        raise UserError(
            f"init_weights '{path}' ({source}) does not fit the model: {len(unexpected)} tensors of the "
            f"file are not in the model {unexpected[:3]}, {len(missing)} of the model are not in the "
            f"file {missing[:3]}; {DETR_R50}"
        )
    head_rows = len(named["class_embed.weight"][1])
    if source == "detr.py":  # its own classes (save_weights' metadata) or none
        saved = json.loads(meta.get("classes", "null"))
        rows = list(range(head_rows)) if saved in (None, list(classes)) and head_rows == len(classes) + 1 else None
    else:
        rows = coco_rows(classes, category_ids, head_rows - 1)
    if rows is None:
        named.update({k: (k, own[k]) for k in ("class_embed.weight", "class_embed.bias")})
        head = f"a new class head for the {len(classes)} classes (they are not the checkpoint's)"
    else:
        index = torch.tensor(rows)
        named.update({k: (src, t[index]) for k, (src, t) in named.items() if k.startswith("class_embed.")})
        head = f"the class head's rows of the {len(classes)} classes and no-object"
    for k, t in own.items():
        if k in named and named[k][1].shape != t.shape:
            src, v = named[k]
            raise UserError(
                f"init_weights '{path}' ({source}) does not fit the model: {src} is {list(v.shape)} in "
                f"the file, {k} is {list(t.shape)} in the model; {DETR_R50}"
            )
    model.load_state_dict({k: named[k][1] if k in named else t for k, t in own.items()})
    return f"init_weights: {len(named)} tensors from the {source} checkpoint '{path}', with {head}"
