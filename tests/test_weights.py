"""common/weights.py: weights that do not fit (another size, another recipe) are one line naming the first
difference and where the file comes from, in every recipe that loads a file."""

from __future__ import annotations

import pytest
import timm
import torch

from common import UserError
from common.config_help import show
from common.weights import config_with_weights, load_backbone, load_state, mismatch, save_weights

_loaded: dict = {}


def recipe(name: str):
    if name not in _loaded:
        from conftest import load_recipe

        _loaded[name] = load_recipe(name)
    return _loaded[name]


def test_mismatch_names_the_first_difference():
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)}
    assert mismatch(dict(own), own) == ""
    assert mismatch({"a": torch.zeros(3, 3), "b": torch.zeros(5), "c": torch.zeros(1)}, own) == (
        "'a' is [3, 3] in the file, [2, 3] in the model (and 1 more)"
    )
    assert mismatch({"a": torch.zeros(2, 3)}, own) == "the file lacks 'b' (and 1 more)"
    assert mismatch({**own, "d": torch.zeros(1)}, own) == "the model has no 'd'"


@pytest.fixture(scope="module")
def small_dino_backbone(tmp_path_factory):
    """A ViT backbone as dino.py saves it, half as wide as timm's test_vit."""
    path = tmp_path_factory.mktemp("dino") / "teacher_backbone.safetensors"
    backbone = timm.create_model("test_vit", num_classes=0, embed_dim=32)
    cfg = recipe("dino").Config(model="test_vit", model_kwargs={"embed_dim": 32})
    save_weights(backbone.state_dict(), path, cfg, recipe="dino")
    return path


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def test_init_backbone_of_another_size_is_one_line(small_dino_backbone):
    """Issue 28: the classifier's --init_backbone with a DINO backbone of another width (a 59-line size mismatch)."""
    model = timm.create_model("test_vit", num_classes=10)
    with pytest.raises(UserError) as e:
        load_backbone(model, str(small_dino_backbone))
    assert _one_line(e) == (
        f"init_backbone '{small_dino_backbone}' (saved by dino.py for model test_vit {{embed_dim: 32}}) does not fit "
        "model 'test_vit': 'cls_token' is [1, 1, 32] in the file, [1, 1, 64] in the model (and 77 more)"
    )


def test_dino_and_detr_backbones_of_another_size_are_one_line(small_dino_backbone):
    with pytest.raises(UserError) as e:
        recipe("dino").load_teacher_backbone(
            timm.create_model("test_vit", num_classes=0), str(small_dino_backbone), "test_vit"
        )
    assert "(saved by dino.py for model test_vit {embed_dim: 32}) do not fit model 'test_vit'" in _one_line(e)
    assert "'cls_token' is [1, 1, 32] in the file, [1, 1, 64] in the model" in str(e.value)
    detr = recipe("detr")
    backbone = timm.create_model("resnet10t", features_only=True, out_indices=(3,))
    with pytest.raises(UserError) as e:
        detr.load_backbone(backbone, str(small_dino_backbone))
    assert "does not fit the backbone: the file lacks 'conv1.0.weight' (and " in _one_line(e)


def test_load_state_names_the_first_difference(tmp_path):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UserError) as e:
        load_state(model, {"weight": torch.zeros(4, 3), "bias": torch.zeros(2)}, "w.safetensors", "yolo")
    assert _one_line(e) == (
        "weights 'w.safetensors' (saved by yolo.py) do not fit this model: "
        "'weight' is [4, 3] in the file, [2, 3] in the model"
    )


def test_weights_of_another_recipe_are_refused_before_anything_is_built(tmp_path):
    """Issue 28: a classifier's weights given to faster_rcnn.py were a ~400-character list of missing keys."""
    path = tmp_path / "best.safetensors"
    classifier = recipe("classifier")
    save_weights({"w": torch.zeros(1)}, path, classifier.Config(), ["a", "b"], recipe="classifier")
    frcnn = recipe("faster_rcnn")
    with pytest.raises(UserError) as e:
        config_with_weights(frcnn.Config, ["--eval_only", "--weights", str(path)], frcnn.MODEL_FIELDS)
    assert _one_line(e) == (
        f"weights '{path}' were saved by classifier.py and do not fit faster_rcnn.py, which needs its own"
    )
    # a copy of classifier.py under another name saves weights of the same config: those load
    save_weights({"w": torch.zeros(1)}, path, classifier.Config(img_size=48), ["a", "b"], recipe="my_classifier")
    cfg = config_with_weights(classifier.Config, ["--eval_only", "--weights", str(path)], classifier.MODEL_FIELDS)
    assert cfg.img_size == 48


def test_another_recipes_weights_through_main_are_one_error_line(tmp_path, capsys):
    from conftest import error_line

    path = tmp_path / "teacher_backbone.safetensors"
    save_weights({"w": torch.zeros(1)}, path, recipe("dino").Config(), recipe="dino")
    line = error_line(
        capsys, recipe("classifier").main, ["--eval_only", "--weights", str(path), "--output_dir", str(tmp_path / "x")]
    )
    assert line == f"error: weights '{path}' were saved by dino.py and do not fit classifier.py, which needs its own"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("detector", ["yolo", "detr", "faster_rcnn"])
def test_each_detector_starts_from_a_dino_or_classifier_backbone(detector, tmp_path):
    """--init_backbone: a DINO teacher backbone (no head) or a classifier (with one) of the detector's own
    timm model gives every backbone tensor; the detector's own layers stay new; another model's backbone
    is one line naming the first difference."""
    from common.config import parse_config

    module = recipe(detector)
    default = module.Config()
    for kind, classes in (("dino", 0), ("classifier", 10)):
        torch.manual_seed(1)
        source = timm.create_model(default.model, num_classes=classes, **default.model_kwargs)
        path = tmp_path / f"{kind}.safetensors"
        saved_cfg = recipe(kind).Config(model=default.model, model_kwargs=default.model_kwargs)
        save_weights(source.state_dict(), path, saved_cfg, recipe=kind)
        cfg = parse_config(module.Config, ["--init_backbone", str(path)])
        anchors, notes = torch.tensor([[8.0, 8.0]] * 9), []
        if detector == "detr":
            model = module.create_model(cfg, 3, module.create_backbone(cfg, notes))
        else:
            model = module.create_model(cfg, 3, *([anchors] if detector == "yolo" else []), notes)
        body = {"yolo": lambda m: m.backbone, "detr": lambda m: m.backbone, "faster_rcnn": lambda m: m.backbone.body}
        loaded = body[detector](model).state_dict()
        expected = source.state_dict()
        named = {k: k if k in expected else k.replace("_", ".", 1) for k in loaded}  # features_only's flat names
        assert loaded and all(torch.equal(v, expected[named[k]]) for k, v in loaded.items()), kind
        assert notes == [  # the start banner's line: the file, who saved it, what it filled
            f"init_backbone '{path}' (saved by {kind}.py for model {default.model}"
            f"{' ' + show(default.model_kwargs) if default.model_kwargs else ''}): {len(loaded)} tensors loaded; "
            "the detector's own layers start new"
        ], notes
    other = timm.create_model("test_vit" if detector == "yolo" else "resnet10t", num_classes=0)  # another model
    save_weights(other.state_dict(), tmp_path / "other.safetensors", default, recipe="dino")
    cfg = parse_config(module.Config, ["--init_backbone", str(tmp_path / "other.safetensors")])
    with pytest.raises(UserError) as e:
        module.create_model(cfg, 3, torch.tensor([[8.0, 8.0]] * 9)) if detector == "yolo" else module.create_model(
            cfg, 3
        )
    assert "\n" not in str(e.value) and "does not fit the backbone: " in str(e.value)
