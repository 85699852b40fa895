"""Every numeric field of every recipe has a legal range, declared with it (``arg(..., ge=8, le=MAX_SIDE)``) and
checked while parsing (common/config.py): 0, a negative and a huge value of each are either legal or one error line
naming the field and its range, and a refused value leaves no run folder behind."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass

import pytest
import yaml

from common.config import MAX_SIDE, ConfigError, RunConfig, arg, parse_config, save_config
from common.config_help import field_ranges, usage

RECIPES = ["classifier", "dino", "yolo", "detr", "faster_rcnn"]
_loaded: dict = {}


def recipe(name: str):
    if name not in _loaded:
        from conftest import load_recipe

        _loaded[name] = load_recipe(name)
    return _loaded[name]


def numeric_fields(config) -> list[str]:
    hints = typing.get_type_hints(config)
    return [f.name for f in dataclasses.fields(config) if hints[f.name] in (int, float)]


def inside(value: float, spec: str) -> bool:
    """Whether ``value`` lies in the interval ``spec`` ("[1, inf)", "(0, 1]; a note": a Range as --help shows
    it), read independently of common/config.py."""
    low_end, low, high, high_end = re.match(r"([\[(])(.+?), (.+?)([\])])", str(spec)).groups()
    low, high = float(low), float(high)
    return (low <= value if low_end == "[" else low < value) and (value <= high if high_end == "]" else value < high)


@pytest.mark.parametrize("name", RECIPES)
def test_every_numeric_field_has_a_range_its_default_and_shipped_configs_keep(name, tmp_path):
    config = recipe(name).Config
    ranges = field_ranges(config)
    fields = {f.name for f in dataclasses.fields(config)}
    assert set(ranges) <= fields, f"recipes/{name}.py: ranges name no field {set(ranges) - fields}"
    unbounded = [f for f in numeric_fields(config) if f not in ranges]
    assert not unbounded, f"recipes/{name}.py: numeric fields without a range: {unbounded}"
    save_config(config(), tmp_path / "defaults.yaml")  # every default, through the range check
    assert parse_config(config, ["--config", str(tmp_path / "defaults.yaml")]) == config(
        config=str(tmp_path / "defaults.yaml")
    )


@pytest.mark.parametrize("name", RECIPES)
def test_zero_negative_and_huge_values_are_legal_or_one_line_naming_the_range(name, tmp_path):
    """The sweep of issue 28: each numeric field at 0, -3 and 10**12, on the command line and in YAML."""
    config = recipe(name).Config
    ranges = field_ranges(config)
    for field in numeric_fields(config):
        for value in (0, -3, 10**12):
            path = tmp_path / "run.yaml"
            path.write_text(yaml.safe_dump({field: value}))
            for argv in ([f"--{field}", str(value)], ["--config", str(path)]):
                try:
                    cfg = parse_config(config, argv)
                except ConfigError as e:
                    message = str(e)
                    assert not inside(value, ranges[field]), (field, value, message)
                    assert "\n" not in message and message.startswith(f"{field} must be "), message
                    low, high = re.match(r"[\[(](.+?), (.+?)[\])]", str(ranges[field])).groups()
                    assert (low in message or low == "-inf") and (high in message or high == "inf"), message
                else:
                    assert getattr(cfg, field) == value and inside(value, ranges[field]), (field, value)


@pytest.mark.parametrize(
    "name, field, legal, refused",
    [
        ("classifier", "batch_size", [1, 4096], [0, -3, 10**12]),
        ("classifier", "img_size", [32, 224, 8192], [0, -3, 10**12]),
        ("classifier", "hflip", [0, 0.5, 1], [-0.1, 1.5]),
        ("classifier", "drop_path_rate", [0, 0.1], [1, -3]),
        ("classifier", "lr", [0, 8e-3, 10], [-1e-3]),
        ("classifier", "max_steps", [0, 10], [-1]),
        ("classifier", "epochs", [1, 300], [0, -3, 10**12]),
        ("classifier", "seed", [0, 42], [-1, 2**40]),
        ("dino", "teacher_temp", [0.04, 0.07], [0, -0.04]),
        ("dino", "local_crops", [0, 10], [-1]),
        ("yolo", "img_size", [32, 608], [0, 16, 10**12]),
        ("detr", "out_index", [-1, 0, 3], [-9, 9]),
        ("detr", "dropout", [0, 0.1], [1]),
        ("faster_rcnn", "aspect_ratio_group_factor", [-1, 0, 3], [-2]),
    ],
)
def test_ranges_follow_what_each_field_means(name, field, legal, refused):
    config = recipe(name).Config
    for value in legal:
        assert math.isclose(getattr(parse_config(config, [f"--{field}", str(value)]), field), value)
    for value in refused:
        with pytest.raises(ConfigError, match=f"^{field} must be (at least|more than)"):
            parse_config(config, [f"--{field}", str(value)])


def test_range_messages_in_words():
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("classifier").Config, ["--batch_size", "-3"])
    assert str(e.value) == "batch_size must be at least 1 and at most 1048576, got -3"
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("classifier").Config, ["--drop_rate", "1"])
    assert str(e.value) == "drop_rate must be at least 0 and less than 1, got 1.0"
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("dino").Config, ["--student_temp", "0"])
    assert str(e.value) == "student_temp must be more than 0, got 0.0"
    with pytest.raises(ConfigError) as e:  # a list field: every item
        parse_config(recipe("classifier").Config, ["--scale", "0", "1"])
    assert str(e.value) == "every value of scale must be more than 0 and at most 1, got [0.0, 1.0]"
    with pytest.raises(ConfigError, match="--eval_only --weights W"):  # epochs 0 is not how to skip training
        parse_config(recipe("dino").Config, ["--epochs", "0"])


def test_help_shows_the_range(capsys):
    with pytest.raises(SystemExit):
        recipe("classifier").main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  --batch_size int (default: 64)")
    assert "      range: [1, 1048576]" in lines[at : at + 4]


def test_a_field_declared_with_arg_has_its_help_and_range_in_help_and_in_the_error():
    """What a copier writes to add a field: one line, whose range --help shows and parsing checks."""

    @dataclass
    class Mine(RunConfig):
        # fmt: off
        # my group
        img_size: int = arg(32, "training resolution, pixels", ge=8, le=MAX_SIDE)
        keep: float = arg(0.5, "the fraction kept", gt=0, le=1, note="1 keeps every image")
        temps: list[float] = arg([0.1], "softmax temperatures", gt=0)
        # fmt: on

    lines = usage(Mine).splitlines()
    at = lines.index("  --img_size int (default: 32)")
    assert lines[at - 1] == "my group:"
    assert lines[at + 1 : at + 3] == ["      training resolution, pixels", "      range: [8, 16384]"]
    at = lines.index("  --keep float (default: 0.5)")
    assert lines[at + 1 : at + 3] == ["      the fraction kept", "      range: (0, 1]; 1 keeps every image"]
    assert "      range: (0, inf)" in lines
    for argv, message in [
        (["--img_size", "4"], "img_size must be at least 8 and at most 16384, got 4"),
        (["--keep", "0"], "keep must be more than 0 and at most 1, got 0.0; 1 keeps every image"),
        (["--temps", "0.1", "0"], "every value of temps must be more than 0, got [0.1, 0.0]"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_config(Mine, argv)
        assert str(e.value) == message
    assert parse_config(Mine, ["--keep", "1"]).keep == 1.0 and Mine().temps is not Mine().temps
    with pytest.raises(TypeError):
        arg(0.0, "two lower bounds", ge=0, gt=0)


@pytest.mark.parametrize("args", [["--batch_size", "-3"], ["--img_size", "0"]])
def test_a_value_out_of_range_writes_no_run_folder(args, tmp_path, capsys):
    """Issue 28: `--batch_size -3` used to fail in a loader worker after config.yaml was written."""
    from conftest import error_line

    folder = tmp_path / "x"
    line = error_line(capsys, recipe("classifier").main, ["--output_dir", str(folder), "--report_to", "none", *args])
    assert line.startswith(f"error: {args[0][2:]} must be at least")
    assert not folder.exists() and not any(tmp_path.iterdir())
