"""recipes/detr.py --init_weights and freeze_at: the reference's DETR-R50 (facebookresearch/detr) and
transformers' conversion of it mapped onto the recipe's modules, checked on state dicts written out
from the reference's structure (its names and shapes, seeded random values) against hand-computed
layers; the class head rule (COCO rows kept, other classes a new head); this recipe's own weights;
refused files; and a run through the entry point from a checkpoint in the reference's format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import detr_checkpoint as checkpoint  # the reader beside the recipe
from common import UserError
from conftest import error_line, load_recipe

detr = load_recipe("detr")

# DETR-R50 as the reference trains it (frozen batch norm, the stem and layer1 frozen)
R50 = {
    "model": "resnet50",
    "model_kwargs": {},
    "out_index": -1,
    "pretrained": False,
    "frozen_bn": True,
    "freeze_at": 2,
    "d_model": 256,
    "nheads": 8,
    "enc_layers": 6,
    "dec_layers": 6,
    "dim_feedforward": 2048,
    "dropout": 0.1,
    "num_queries": 100,
}
BN = ("weight", "bias", "running_mean", "running_var")  # the reference's FrozenBatchNorm2d buffers


# ---------------------------------------------------------------------------------------------------
# The reference's state dict, written out from its structure
# ---------------------------------------------------------------------------------------------------
def reference_shapes(
    d: int = 256,
    ff: int = 2048,
    enc: int = 6,
    dec: int = 6,
    queries: int = 100,
    classes: int = 91,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
    widths: tuple[int, ...] = (64, 128, 256, 512),
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the reference's DETR (models/detr.py, transformer.py, backbone.py):
    torchvision's bottleneck resnet under ``backbone.0.body`` (``blocks`` per stage, frozen batch norm: no
    num_batches_tracked, no fc), a post-norm transformer with nn.MultiheadAttention (``in_proj`` = q, k, v
    rows), the decoder's final norm, the class head (``classes`` + no-object) and the 3-layer box MLP."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv_bn(conv: str, bn: str, cout: int, cin: int, k: int) -> None:
        shapes[f"{conv}.weight"] = (cout, cin, k, k)
        shapes.update({f"{bn}.{b}": (cout,) for b in BN})

    def linear(name: str, cout: int, cin: int) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin), (cout,)

    def attention(name: str) -> None:
        shapes[f"{name}.in_proj_weight"], shapes[f"{name}.in_proj_bias"] = (3 * d, d), (3 * d,)
        linear(f"{name}.out_proj", d, d)

    body = "backbone.0.body"
    conv_bn(f"{body}.conv1", f"{body}.bn1", 64, 3, 7)
    cin = 64
    for stage, (n, width) in enumerate(zip(blocks, widths), 1):
        for b in range(n):
            p = f"{body}.layer{stage}.{b}"
            conv_bn(f"{p}.conv1", f"{p}.bn1", width, cin, 1)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
            conv_bn(f"{p}.conv3", f"{p}.bn3", 4 * width, width, 1)
            if b == 0 and (stage > 1 or cin != 4 * width):  # a stride or a width change (torchvision's rule)
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", 4 * width, cin, 1)
            cin = 4 * width
    shapes["input_proj.weight"], shapes["input_proj.bias"] = (d, cin, 1, 1), (d,)
    shapes["query_embed.weight"] = (queries, d)
    for kind, count, attentions, norms in (
        ("encoder", enc, ("self_attn",), 2),
        ("decoder", dec, ("self_attn", "multihead_attn"), 3),
    ):
        for i in range(count):
            p = f"transformer.{kind}.layers.{i}"
            for a in attentions:
                attention(f"{p}.{a}")
            linear(f"{p}.linear1", ff, d)
            linear(f"{p}.linear2", d, ff)
            for j in range(1, norms + 1):
                shapes[f"{p}.norm{j}.weight"], shapes[f"{p}.norm{j}.bias"] = (d,), (d,)
    shapes["transformer.decoder.norm.weight"], shapes["transformer.decoder.norm.bias"] = (d,), (d,)
    linear("class_embed", classes + 1, d)
    for j, cout in enumerate((d, d, 4)):
        linear(f"bbox_embed.layers.{j}", cout, d)
    return shapes


def _value(name: str, shape: tuple[int, ...], gen: torch.Generator, compact: bool) -> torch.Tensor:
    """Seeded values of a sensible scale: matrices 1/sqrt(fan in), norm scales near 1, variances in
    [0.5, 1.5], biases and means small. ``compact``: a strided view (all strides 1) of a storage of
    sum(shape - 1) + 1 values, so that a 41M-parameter file is a few MB."""
    size = sum(s - 1 for s in shape) + 1 if compact else math.prod(shape)
    if name.endswith("running_var"):
        t = torch.rand(size, generator=gen) + 0.5
    elif len(shape) > 1:
        t = torch.randn(size, generator=gen) / math.sqrt(math.prod(shape[1:]))
    elif name.endswith("weight"):
        t = 1 + 0.1 * torch.randn(size, generator=gen)
    else:
        t = 0.1 * torch.randn(size, generator=gen)
    return t.as_strided(shape, (1,) * len(shape)) if compact else t.view(shape)


def reference_state(seed: int = 0, compact: bool = False, **shape_kwargs) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: _value(k, s, gen, compact) for k, s in reference_shapes(**shape_kwargs).items()}


def write_reference_checkpoint(path: Path, **shape_kwargs) -> str:
    """A ``.pth`` as the reference releases them (``{"model": state dict}``), compact values."""
    torch.save({"model": reference_state(compact=True, **shape_kwargs)}, path)
    return str(path)


def transformers_state(ref: dict[str, torch.Tensor], timm_backbone: bool = True) -> dict[str, torch.Tensor]:
    """The reference's tensors under transformers' DetrForObjectDetection names (its conversion script:
    ``model.`` before the base model, q/k/v projections split out of ``in_proj``; the backbone timm's
    resnet, whose names are torchvision's, or with ``timm_backbone=False`` transformers' own ResNet)."""
    layer = {
        "linear1": "fc1",
        "linear2": "fc2",
        "self_attn.out_proj": "self_attn.out_proj",
        "multihead_attn.out_proj": "encoder_attn.out_proj",
    }
    norms = {
        "encoder": {"norm1": "self_attn_layer_norm", "norm2": "final_layer_norm"},
        "decoder": {"norm1": "self_attn_layer_norm", "norm2": "encoder_attn_layer_norm", "norm3": "final_layer_norm"},
    }
    top = {
        "input_proj": "model.input_projection",
        "query_embed": "model.query_position_embeddings",
        "transformer.decoder.norm": "model.decoder.layernorm",
        "class_embed": "class_labels_classifier",
    }
    out = {}
    for k, v in ref.items():
        module, leaf = k.rsplit(".", 1)
        if module.startswith("backbone.0.body."):
            name = module[len("backbone.0.body.") :]
            if not timm_backbone:
                parts = name.split(".")
                if parts[0] in ("conv1", "bn1"):
                    name = "embedder.embedder." + ("convolution" if parts[0] == "conv1" else "normalization")
                else:
                    stage, block, rest = int(parts[0][len("layer") :]) - 1, parts[1], parts[2:]
                    if rest[0] == "downsample":
                        sub = "shortcut." + ("convolution" if rest[1] == "0" else "normalization")
                    else:
                        sub = f"layer.{int(rest[0][-1]) - 1}." + (
                            "convolution" if rest[0].startswith("conv") else "normalization"
                        )
                    name = f"encoder.stages.{stage}.layers.{block}.{sub}"
            out[f"model.backbone.conv_encoder.model.{name}.{leaf}"] = v
        elif module.startswith("transformer.") and ".layers." in module:
            _, kind, _, i, sub = module.split(".", 4)
            base = f"model.{kind}.layers.{i}"
            if leaf.startswith("in_proj_"):
                attn = "self_attn" if sub == "self_attn" else "encoder_attn"
                for part, t in zip("qkv", v.chunk(3)):
                    out[f"{base}.{attn}.{part}_proj.{leaf[len('in_proj_') :]}"] = t
            else:
                out[f"{base}.{norms[kind].get(sub) or layer[sub]}.{leaf}"] = v
        elif module.startswith("bbox_embed."):
            out[f"bbox_predictor.{module[len('bbox_embed.') :]}.{leaf}"] = v
        else:
            out[f"{top[module]}.{leaf}"] = v
    return out


def r50(num_classes: int, **changes) -> torch.nn.Module:
    return detr.create_model(detr.Config(**{**R50, **changes}), num_classes).eval()


# ---------------------------------------------------------------------------------------------------
# Hand-written reference computations
# ---------------------------------------------------------------------------------------------------
def _attention(query, key, value, w_in, b_in, w_out, b_out, heads: int) -> torch.Tensor:
    """nn.MultiheadAttention by hand: [B, N, d] inputs, in_proj rows q, k, v; scaled dot product per head."""
    wq, wk, wv = w_in.chunk(3)
    bq, bk, bv = b_in.chunk(3)
    q, k, v = query @ wq.T + bq, key @ wk.T + bk, value @ wv.T + bv

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, heads, N, d / heads]

    q, k, v = split(q), split(k), split(v)
    weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (weights @ v).transpose(1, 2).flatten(2) @ w_out.T + b_out


def _norm(x, ref, name):
    return F.layer_norm(x, x.shape[-1:], ref[f"{name}.weight"], ref[f"{name}.bias"])


def _ffn(x, ref, p):
    hidden = torch.relu(x @ ref[f"{p}.linear1.weight"].T + ref[f"{p}.linear1.bias"])
    return hidden @ ref[f"{p}.linear2.weight"].T + ref[f"{p}.linear2.bias"]


def _attn(ref, name, query, key, value, heads=8):
    return _attention(
        query,
        key,
        value,
        ref[f"{name}.in_proj_weight"],
        ref[f"{name}.in_proj_bias"],
        ref[f"{name}.out_proj.weight"],
        ref[f"{name}.out_proj.bias"],
        heads,
    )


def reference_encoder_layer(ref, i, src, pos):
    """The reference's post-norm encoder layer: positions on queries and keys, not on values."""
    p = f"transformer.encoder.layers.{i}"
    src = _norm(src + _attn(ref, f"{p}.self_attn", src + pos, src + pos, src), ref, f"{p}.norm1")
    return _norm(src + _ffn(src, ref, p), ref, f"{p}.norm2")


def reference_decoder_layer(ref, i, tgt, memory, pos, query_pos):
    p = f"transformer.decoder.layers.{i}"
    tgt = _norm(tgt + _attn(ref, f"{p}.self_attn", tgt + query_pos, tgt + query_pos, tgt), ref, f"{p}.norm1")
    tgt = _norm(tgt + _attn(ref, f"{p}.multihead_attn", tgt + query_pos, memory + pos, memory), ref, f"{p}.norm2")
    return _norm(tgt + _ffn(tgt, ref, p), ref, f"{p}.norm3")


@pytest.fixture(scope="module")
def reference():
    return reference_state(seed=0)


# ---------------------------------------------------------------------------------------------------
# The mapping
# ---------------------------------------------------------------------------------------------------
def test_reference_names_load_strictly_and_compute_as_the_reference(reference):
    """Every tensor of the reference's DETR-R50 lands in the recipe's model (strict: nothing missing or
    left over), and the layers compute what the reference's do with those tensors: the backbone as
    torchvision's resnet50, an encoder and a decoder layer as hand-written post-norm layers, the heads
    as ``hs @ W.T + b``."""
    import torchvision

    named, source = checkpoint.to_recipe_names(reference)
    assert source == "facebookresearch/detr" and len(named) == len(reference) == 458
    model = r50(91)
    model.load_state_dict({k: t for k, (_, t) in named.items()}, strict=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # backbone: torchvision's resnet50 (the reference's body) with the same tensors, up to layer4
        tv = torchvision.models.resnet50(norm_layer=torchvision.ops.FrozenBatchNorm2d).eval()
        body = {k[len("backbone.0.body.") :]: v for k, v in reference.items() if k.startswith("backbone.0.body.")}
        assert set(tv.state_dict()) - set(body) == {"fc.weight", "fc.bias"}
        tv.load_state_dict(body, strict=False)
        x = torch.randn(1, 3, 64, 96, generator=gen)
        expected = x
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"):
            expected = getattr(tv, name)(expected)
        torch.testing.assert_close(model.backbone(x)[-1], expected, rtol=1e-4, atol=1e-4)
        # one encoder layer and one decoder layer, [B, N, d] with positions
        src, pos = torch.randn(2, 12, 256, generator=gen), torch.randn(2, 12, 256, generator=gen)
        torch.testing.assert_close(
            model.encoder[3](src, pos, None), reference_encoder_layer(reference, 3, src, pos), rtol=1e-4, atol=1e-4
        )
        tgt, query_pos = torch.randn(2, 5, 256, generator=gen), torch.randn(2, 5, 256, generator=gen)
        torch.testing.assert_close(
            model.decoder[4](tgt, src, pos, query_pos, None),
            reference_decoder_layer(reference, 4, tgt, src, pos, query_pos),
            rtol=1e-4,
            atol=1e-4,
        )
        # the heads on a fixed decoder output, the decoder's final norm, the projection and the queries
        hs = torch.randn(2, 5, 256, generator=gen)
        torch.testing.assert_close(
            model.class_embed(hs), hs @ reference["class_embed.weight"].T + reference["class_embed.bias"]
        )
        box = hs
        for j in range(3):
            box = box @ reference[f"bbox_embed.layers.{j}.weight"].T + reference[f"bbox_embed.layers.{j}.bias"]
            box = torch.relu(box) if j < 2 else box
        torch.testing.assert_close(model.bbox_embed(hs), box)
        torch.testing.assert_close(model.decoder_norm(hs), _norm(hs, reference, "transformer.decoder.norm"))
        assert torch.equal(model.input_proj.weight, reference["input_proj.weight"])
        assert torch.equal(model.query_embed.weight, reference["query_embed.weight"])


@pytest.mark.parametrize("timm_backbone", [True, False], ids=["timm", "no_timm"])
def test_transformers_names_give_the_same_tensors(reference, timm_backbone):
    """facebook/detr-resnet-50's naming (the main revision's timm backbone, and transformers' own ResNet
    of the ``no_timm`` revision): the same tensor for every model name as from the reference, the
    q/k/v projections concatenated back into ``in_proj``."""
    hf = transformers_state(reference, timm_backbone)
    assert "model.encoder.layers.0.self_attn.q_proj.weight" in hf and "class_labels_classifier.weight" in hf
    named, source = checkpoint.to_recipe_names(hf)
    expected, _ = checkpoint.to_recipe_names(reference)
    assert source == "transformers" and set(named) == set(expected)
    for k, (_, t) in expected.items():
        assert torch.equal(named[k][1], t), k


def test_coco_classes_keep_their_rows_and_other_classes_get_a_new_head(tmp_path, reference):
    """The reference's head is indexed by COCO category id (92 rows, no-object last): COCO's 80 classes
    (contiguous 0..79 sorted by id) keep the rows of their ids and no-object, in that order; a subset in
    any order keeps its own rows; 3 other classes get the model's new 4-way head and everything else."""
    path = write_reference_checkpoint(tmp_path / "detr-r50.pth")
    ref = torch.load(path, weights_only=True)["model"]
    w, b = ref["class_embed.weight"], ref["class_embed.bias"]
    model = r50(80)
    line = checkpoint.load_init_weights(model, path, checkpoint.COCO_NAMES, checkpoint.COCO_IDS)
    assert "rows of the 80 classes" in line and "facebookresearch/detr" in line
    rows = checkpoint.COCO_IDS + [91]
    assert torch.equal(model.class_embed.weight, w[rows]) and torch.equal(model.class_embed.bias, b[rows])
    assert rows[:3] == [1, 2, 3] and rows[-2:] == [90, 91] and len(rows) == 81

    model = r50(3)
    checkpoint.load_init_weights(
        model, path, ["Dog", "traffic_light", "person"], [18, 10, 1]
    )  # names as datasets spell them
    assert torch.equal(model.class_embed.weight, w[[18, 10, 1, 91]])

    model = r50(3)
    fresh = {k: v.clone() for k, v in model.class_embed.state_dict().items()}
    line = checkpoint.load_init_weights(model, path, ["Coverall", "Face_Shield", "Gloves"], [0, 1, 2])
    assert "new class head" in line and model.class_embed.weight.shape == (4, 256)
    assert all(torch.equal(model.class_embed.state_dict()[k], v) for k, v in fresh.items())
    assert torch.equal(model.bbox_embed[4].weight, ref["bbox_embed.layers.2.weight"])
    assert torch.equal(model.encoder[5].ff[3].bias, ref["transformer.encoder.layers.5.linear2.bias"])
    assert torch.equal(model.backbone.layer4[2].bn3.running_var, ref["backbone.0.body.layer4.2.bn3.running_var"])
    # COCO ids with other names (a stand-in dataset), or COCO names with other ids, are not COCO
    assert checkpoint.coco_rows(["thing_1", "thing_2"], [1, 2]) is None
    assert checkpoint.coco_rows(["person", "bicycle"], [0, 1]) is None


def test_own_weights_keep_their_head_for_their_classes(tmp_path):
    """A safetensors file this recipe saved (its own names): everything loads; the head stays when the
    file's classes are the data's, and is new otherwise."""
    from common.weights import save_weights

    cfg = detr.Config()
    torch.manual_seed(0)
    saved = detr.create_model(cfg, 3)
    save_weights(saved.state_dict(), tmp_path / "w.safetensors", cfg, ["a", "b", "c"], "detr")
    torch.manual_seed(1)
    model = detr.create_model(cfg, 3)
    checkpoint.load_init_weights(model, str(tmp_path / "w.safetensors"), ["a", "b", "c"], [0, 1, 2])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.state_dict().items())
    model = detr.create_model(cfg, 2)
    head = model.class_embed.weight.clone()
    line = checkpoint.load_init_weights(model, str(tmp_path / "w.safetensors"), ["a", "x"], [0, 1])
    assert "new class head" in line and torch.equal(model.class_embed.weight, head)
    assert torch.equal(model.decoder[2].cross_attn.in_proj_weight, saved.decoder[2].cross_attn.in_proj_weight)


def test_freeze_at_freezes_the_stem_and_layer1():
    model = r50(3)
    trainable = {n.split(".")[1] for n, p in model.named_parameters() if n.startswith("backbone.") and p.requires_grad}
    assert trainable == {"layer2", "layer3", "layer4"}
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("backbone."))


# ---------------------------------------------------------------------------------------------------
# Refused files: one line each
# ---------------------------------------------------------------------------------------------------
class _Opener:
    """Pickles as a call to ``open(path, "w")``: loading it with full unpickling would create the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_pickled_objects_are_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": {"class_embed.weight": torch.zeros(2, 2)}, "args": _Opener(str(marker))}, path)
    with pytest.raises(UserError) as e:
        checkpoint.read_checkpoint(str(path))
    assert "pickled Python object (io.open)" in _one_line(e) and not marker.exists()


def test_shape_and_layer_mismatches_name_the_first_difference(tmp_path):
    path = write_reference_checkpoint(tmp_path / "detr-r50.pth")
    with pytest.raises(UserError) as e:
        checkpoint.load_init_weights(r50(3, dim_feedforward=1024), path, ["a", "b", "c"], [0, 1, 2])
    assert (
        "transformer.encoder.layers.0.linear1.weight is [2048, 256] in the file, encoder.0.ff.0.weight is "
        "[1024, 256] in the model"
    ) in _one_line(e)
    with pytest.raises(UserError) as e:
        checkpoint.load_init_weights(r50(3, enc_layers=5), path, ["a", "b", "c"], [0, 1, 2])
    assert "transformer.encoder.layers.5." in _one_line(e) and "DETR-R50" in str(e.value)
    with pytest.raises(UserError) as e:
        checkpoint.load_init_weights(r50(3), str(tmp_path / "nowhere.pth"), ["a"], [0])
    assert "does not exist" in _one_line(e)


# ---------------------------------------------------------------------------------------------------
# Through the entry point
# ---------------------------------------------------------------------------------------------------
# A small model in the reference's exact naming: timm's resnet50 with one block per stage at a quarter
# of the widths, a 2 + 2-layer transformer of width 64; its checkpoint has the COCO head
SMALL = {
    "model": "resnet50",
    "out_index": -1,
    "d_model": 64,
    "nheads": 8,
    "enc_layers": 2,
    "dec_layers": 2,
    "dim_feedforward": 128,
    "num_queries": 10,
    "frozen_bn": True,
    "freeze_at": 2,
}
SMALL_SHAPES = {
    "d": 64,
    "ff": 128,
    "enc": 2,
    "dec": 2,
    "queries": 10,
    "blocks": (1, 1, 1, 1),
    "widths": (16, 32, 64, 128),
}


def _flags(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


@pytest.fixture
def coco_folder(tmp_path) -> Path:
    """A COCO-json folder with COCO's 80 categories (ids and names): 2 training images, 1 validation."""
    folder = tmp_path / "coco"
    (folder / "annotations").mkdir(parents=True)
    categories = [{"id": i, "name": n} for i, n in zip(checkpoint.COCO_IDS, checkpoint.COCO_NAMES)]
    for split, n in (("train", 2), ("val", 1)):
        (folder / split).mkdir()
        images = [{"id": k + 1, "file_name": f"{k}.png", "width": 64, "height": 64} for k in range(n)]
        for k in range(n):
            pixels = torch.full((64, 64, 3), 40, dtype=torch.uint8)
            pixels[10:40, 20:50] = 220
            Image.fromarray(pixels.numpy()).save(folder / split / f"{k}.png")
        annotations = [
            {"id": k + 1, "image_id": k + 1, "bbox": [20, 10, 30, 30], "area": 900, "iscrowd": 0, "category_id": 18}
            for k in range(n)
        ]
        (folder / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories})
        )
    return folder


def test_entry_point_starts_from_a_reference_checkpoint(tmp_path, coco_folder):
    """``--init_weights`` a .pth in the reference's format: the backbone pre-training is skipped, the COCO
    head's rows are kept, and one step later the frozen stem and layer1 are bit-identical to the file
    while the trained stages moved by about one learning-rate step."""
    import safetensors.torch

    path = write_reference_checkpoint(tmp_path / "detr.pth", **SMALL_SHAPES)
    ref = torch.load(path, weights_only=True)["model"]
    run = tmp_path / "run"
    detr.main(
        [
            "--data",
            str(coco_folder),
            "--init_weights",
            path,
            *_flags(SMALL),
            "--model_kwargs",
            "{layers: [1, 1, 1, 1], channels: [16, 32, 64, 128]}",
            "--scales",
            "64",
            "--max_size",
            "64",
            "--batch_size",
            "2",
            "--max_steps",
            "1",
            "--lr",
            "1e-4",
            "--lr_backbone",
            "1e-5",
            "--warmup_epochs",
            "0",
            "--num_workers",
            "0",
            "--report_to",
            "none",
            "--plot_images",
            "0",
            "--output_dir",
            str(run),
        ]
    )
    final = safetensors.torch.load_file(run / "final.safetensors")
    rows = checkpoint.COCO_IDS + [91]
    torch.testing.assert_close(final["class_embed.weight"], ref["class_embed.weight"][rows], rtol=0, atol=2e-4)
    assert not torch.allclose(final["class_embed.weight"], ref["class_embed.weight"][:81], atol=1e-2)
    for frozen in ("conv1.weight", "layer1.0.conv2.weight", "layer1.0.conv3.weight"):
        assert torch.equal(final[f"backbone.{frozen}"], ref[f"backbone.0.body.{frozen}"]), frozen
    moved = final["backbone.layer2.0.conv2.weight"] - ref["backbone.0.body.layer2.0.conv2.weight"]
    assert 0 < moved.abs().max() < 2e-5
    torch.testing.assert_close(
        final["encoder.1.self_attn.in_proj_weight"],
        ref["transformer.encoder.layers.1.self_attn.in_proj_weight"],
        rtol=0,
        atol=2e-4,
    )


def test_entry_point_refuses_a_pickled_checkpoint_with_one_line(tmp_path, capsys, coco_folder):
    path = tmp_path / "evil.pth"
    torch.save({"model": {}, "args": _Opener(str(tmp_path / "ran"))}, path)
    err = error_line(
        capsys,
        detr.main,
        [
            "--data",
            str(coco_folder),
            "--init_weights",
            str(path),
            "--scales",
            "64",
            "--max_size",
            "64",
            "--batch_size",
            "2",
            "--num_workers",
            "0",
            "--report_to",
            "none",
            "--output_dir",
            str(tmp_path / "run"),
        ],
    )
    assert "pickled Python object" in err and not (tmp_path / "ran").exists()
