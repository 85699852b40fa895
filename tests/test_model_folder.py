"""common/artifacts/model_folder.py's timm folder with every timm from the floor (requirements.txt) up: the
preprocessing goes into config.json without save_for_hf's data_config keyword, which older timm lacks."""

import inspect
import json

import pytest
import timm
import timm.models
import torch

from common.artifacts import model_folder

#: An evaluation's preprocessing that differs from test_vit's default entry in every key.
DATA = {
    "input_size": (3, 48, 48),
    "interpolation": "bilinear",
    "crop_pct": 0.8,
    "crop_mode": "center",
    "mean": (0.25, 0.5, 0.75),
    "std": (0.2, 0.3, 0.4),
}


def _without_data_config(monkeypatch) -> list[dict]:
    """Replace timm's save_for_hf with one that, like timm < 1.0.31's, takes no data_config; its calls' keywords."""
    real, calls = timm.models.save_for_hf, []

    def old_save_for_hf(model, save_directory, model_config=None, model_args=None, safe_serialization=False):
        calls.append({"model_config": model_config, "safe_serialization": safe_serialization})
        return real(model, save_directory, model_config=model_config, safe_serialization=safe_serialization)

    monkeypatch.setattr(timm.models, "save_for_hf", old_save_for_hf)
    return calls


def test_the_folder_has_its_preprocessing_without_save_for_hf_data_config(tmp_path, monkeypatch):
    """With a save_for_hf that rejects data_config, the folder still loads in timm with the weights, the
    class names and the evaluation's preprocessing, and none of the default entry's source keys."""
    calls = _without_data_config(monkeypatch)
    model = timm.create_model("test_vit", num_classes=3, img_size=48).eval()
    folder = model_folder.write_timm_folder(model, tmp_path / "model", ["a", "b", "c"], DATA, "# card\n")
    assert len(calls) == 1
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    images = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))
    assert loaded.pretrained_cfg["label_names"] == ["a", "b", "c"]
    data = timm.data.resolve_data_config(model=loaded)
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in DATA} == DATA
    config = json.loads((folder / "config.json").read_text())["pretrained_cfg"]
    assert not set(model_folder.SOURCE_KEYS) & set(config)
    assert "test_input_size" not in config and "test_crop_pct" not in config


@pytest.mark.skipif(
    "data_config" not in inspect.signature(timm.models.save_for_hf).parameters,
    reason="this timm's save_for_hf takes no data_config to compare with",
)
def test_the_folder_equals_what_timm_writes_with_data_config(tmp_path, monkeypatch):
    """Where timm's own writer takes data_config, the config.json written without it is the same (less the
    source keys the recipe drops)."""
    model = timm.create_model("test_vit", num_classes=3, img_size=48).eval()
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in DATA.items()}
    timm.models.save_for_hf(
        model, str(tmp_path / "timm"), model_config={"label_names": ["a", "b", "c"]}, data_config=data
    )
    expected = json.loads((tmp_path / "timm" / "config.json").read_text())
    for key in model_folder.SOURCE_KEYS:
        expected["pretrained_cfg"].pop(key, None)
    _without_data_config(monkeypatch)
    folder = model_folder.write_timm_folder(model, tmp_path / "ours", ["a", "b", "c"], DATA, "# card\n")
    assert json.loads((folder / "config.json").read_text()) == expected
