"""common/config.py: defaults <- YAML <- flags, closest-key errors, type errors, saved config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest
import yaml

from common.config import ConfigError, parse_config, save_config


@dataclass
class Cfg:
    config: str = ""
    data: str = "digits"
    lr: float = 1e-3
    epochs: int = 10
    compile: bool = False
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    milestones: list[int] = field(default_factory=list)
    note: Optional[str] = None
    model_kwargs: dict = field(default_factory=dict)


def test_defaults_then_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 3e-4\nepochs: 5\nscale: [0.5, 1.0]\n")  # YAML 1.1 reads 3e-4 as a string
    cfg = parse_config(Cfg, ["--config", str(path), "--epochs", "7", "--compile", "--milestones", "3,6"])
    assert cfg.lr == pytest.approx(3e-4) and isinstance(cfg.lr, float)
    assert cfg.epochs == 7  # the flag wins over the file
    assert cfg.compile is True and cfg.scale == [0.5, 1.0] and cfg.milestones == [3, 6]
    assert cfg.data == "digits" and cfg.config == str(path)


def test_flag_forms():
    cfg = parse_config(Cfg, ["--lr=0.1", "--compile", "false", "--data", "10", "--scale", "[0.2, 0.9]", "--note", "none"])
    assert cfg.lr == 0.1 and cfg.compile is False and cfg.data == "10" and cfg.scale == [0.2, 0.9]
    assert cfg.note is None


def test_mapping_fields():
    cfg = parse_config(Cfg, ["--model_kwargs", "{depth: 4, embed_dim: 96}"])
    assert cfg.model_kwargs == {"depth": 4, "embed_dim": 96}
    with pytest.raises(ConfigError, match="'model_kwargs' expects a mapping"):
        parse_config(Cfg, ["--model_kwargs", "[1, 2]"])


def test_unknown_flag_names_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'lrr' in the command line \(did you mean 'lr'\?\)"):
        parse_config(Cfg, ["--lrr", "0.1"])


def test_unknown_yaml_key_names_closest_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'epoch'.*did you mean 'epochs'"):
        parse_config(Cfg, ["--config", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "ten"], "'epochs' expects an integer, got 'ten'"),
    (["--lr", "fast"], "'lr' expects a number"),
    (["--compile", "maybe"], "'compile' expects true or false"),
    (["--scale", "[a, 1]"], "'scale' expects a number"),
    (["--epochs"], "flag '--epochs' needs a value"),
    (["epochs", "3"], "unexpected argument 'epochs'"),
])
def test_wrong_types_and_shapes(argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_config(Cfg, argv)


def test_yaml_type_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: 2.5\n")
    with pytest.raises(ConfigError, match="'epochs' expects an integer, got 2.5"):
        parse_config(Cfg, ["--config", str(path)])
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        parse_config(Cfg, ["--config", str(path)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(Cfg, ["--config", str(tmp_path / "missing.yaml")])


def test_saved_config_round_trips(tmp_path):
    cfg = parse_config(Cfg, ["--lr", "0.25", "--scale", "0.3,0.7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["lr"] == 0.25
    again = parse_config(Cfg, ["--config", str(tmp_path / "config.yaml")])
    assert (again.lr, again.scale, again.epochs) == (0.25, [0.3, 0.7], 10)


def test_every_shipped_config_fits_its_recipe():
    """Each configs/<recipe>/*.yaml parses against that recipe's Config: no stale or misspelled key."""
    from conftest import ROOT, load_recipe

    checked = 0
    for folder in sorted((ROOT / "configs").iterdir()):
        if not (ROOT / "recipes" / f"{folder.name}.py").is_file():
            continue
        recipe = load_recipe(folder.name)
        for path in sorted(folder.glob("*.yaml")):
            cfg = parse_config(recipe.Config, ["--config", str(path)])
            assert cfg.config == str(path)
            checked += 1
    assert checked >= 5
