"""common/config.py: defaults <- YAML <- flags, closest-key errors, type errors, fixed sets of values,
--help from each field's arg() and the headings above it, saved config."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Literal

import pytest
import yaml

from common.config import MAX_EPOCHS, ConfigError, RunConfig, arg, parse_config, save_config, to_dict
from common.config_help import field_docs, usage

RECIPES = ["classifier", "dino", "yolo", "detr", "faster_rcnn"]


def optimizers() -> list[str]:
    """Names known only at run time."""
    optimizers.calls += 1
    return ["adamw", "sgd", "lamb"]


optimizers.calls = 0


@dataclass
class Cfg:
    # fmt: off
    config: str = arg("", "the YAML file")
    # data
    data: str = arg("digits", "dataset name")
    lr: float = arg(1e-3, "peak learning rate; "
        "a continuation line", ge=0)
    epochs: int = arg(10, "training epochs")  # a comment beside a field is no help
    # two comment lines above a field
    # make one heading
    compile: bool = arg(False, "compile")
    scale: list[float] = arg([0.08, 1.0], "crop area")
    milestones: list[int] = arg([], "epochs")
    note: str | None = arg(None, "a note")
    model_kwargs: dict = arg(
        {"depth": 4, "embed_dim": 96},
        "a field over four lines",
    )
    # optimization: a heading with a colon
    sched: Literal["cosine", "linear", "step", "poly", "constant"] = arg("cosine", "the schedule")
    precision: Literal["", "no", "bf16"] = arg("", "empty: as launched")
    opt: str = arg("adamw", "any optimizer optimizers() lists", choices=optimizers)
    undocumented: int = 0
    # fmt: on


def test_defaults_then_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 3e-4\nepochs: 5\nscale: [0.5, 1.0]\n")  # YAML 1.1 reads 3e-4 as a string
    cfg = parse_config(Cfg, ["--config", str(path), "--epochs", "7", "--compile", "--milestones", "3,6"])
    assert cfg.lr == pytest.approx(3e-4) and isinstance(cfg.lr, float)
    assert cfg.epochs == 7  # the flag wins over the file
    assert cfg.compile is True and cfg.scale == [0.5, 1.0] and cfg.milestones == [3, 6]
    assert cfg.data == "digits" and cfg.config == str(path)


def test_flag_forms():
    cfg = parse_config(
        Cfg, ["--lr=0.1", "--compile", "false", "--data", "10", "--scale", "[0.2, 0.9]", "--note", "none"]
    )
    assert cfg.lr == 0.1 and cfg.compile is False and cfg.data == "10" and cfg.scale == [0.2, 0.9]
    assert cfg.note is None


def test_mapping_fields():
    cfg = parse_config(Cfg, ["--model_kwargs", "{depth: 4, embed_dim: 96}"])
    assert cfg.model_kwargs == {"depth": 4, "embed_dim": 96}
    with pytest.raises(ConfigError, match="'model_kwargs' expects a mapping"):
        parse_config(Cfg, ["--model_kwargs", "[1, 2]"])


@pytest.mark.parametrize(
    ("recipe", "old", "named"),
    [
        ("detr", [1.0, 5.0, 2.0], {"ce": 1.0, "bbox": 5.0, "giou": 2.0}),
        (
            "faster_rcnn",
            [1.0, 2.0, 1.0, 3.0],
            {"rpn_objectness": 1.0, "rpn_box": 2.0, "roi_classifier": 1.0, "roi_box": 3.0, "mask": 1.0},
        ),  # fmt: skip
    ],
)
def test_an_older_config_with_a_list_of_loss_weights_loads_in_its_order(tmp_path, capsys, recipe, old, named):
    """config.yaml of a run from before the weights were named: the list read in the names' order, one line."""
    from conftest import load_recipe

    config = load_recipe(recipe).Config
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"loss_weights": old}))
    cfg = parse_config(config, ["--config", str(path)])
    assert {**dict(config().loss_weights), **cfg.loss_weights} == named
    assert capsys.readouterr().out.count("note: loss_weights given as a list (an older config)") == 1


def test_unknown_flag_names_closest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'lrr' in the command line \(did you mean 'lr'\?\)"):
        parse_config(Cfg, ["--lrr", "0.1"])


def test_unknown_yaml_key_names_closest_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'epoch'.*did you mean 'epochs'"):
        parse_config(Cfg, ["--config", str(path)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "ten"], "'epochs' expects an integer, got 'ten'"),
        (["--lr", "fast"], "'lr' expects a number"),
        (["--compile", "maybe"], "'compile' expects true or false"),
        (["--scale", "[a, 1]"], "'scale' expects a number"),
        (["--epochs"], "flag '--epochs' needs a value"),
        (["epochs", "3"], "unexpected argument 'epochs'"),
    ],
)
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


def test_lists_as_timm_and_argparse_users_type_them():
    """Issue 28: `--scale 0.08 1.0` (argparse's nargs="+", timm's train.py) was refused."""
    cfg = parse_config(Cfg, ["--scale", "0.08", "1.0", "--compile", "--milestones", "3", "6", "9", "--lr", "0.1"])
    assert cfg.scale == [0.08, 1.0] and cfg.milestones == [3, 6, 9] and cfg.compile is True and cfg.lr == 0.1
    assert parse_config(Cfg, ["--scale=0.2", "0.9"]).scale == [0.2, 0.9]
    assert parse_config(Cfg, ["--scale", "-1", "2"]).scale == [-1.0, 2.0]  # a negative number is no flag
    assert parse_config(Cfg, ["--scale", "[0.3,", "0.7]"]).scale == [0.3, 0.7]  # '[0.3, 0.7]' split by the shell
    assert parse_config(Cfg, ["--milestones", ""]).milestones == []
    with pytest.raises(ConfigError, match=r"'scale' expects a list like \[0.5, 1.0\], got '\[0.3, 0.7'"):
        parse_config(Cfg, ["--scale", "[0.3, 0.7"])
    with pytest.raises(ConfigError, match="unexpected argument 'x'"):  # a scalar field still takes one value
        parse_config(Cfg, ["--lr", "0.1", "x"])
    classifier = parse_config(
        recipe("classifier").Config, ["--mean", "0.5", "0.5", "0.5", "--std", "0.2", "0.2", "0.2"]
    )
    assert (classifier.mean, classifier.std) == ([0.5] * 3, [0.2] * 3)
    anchors = parse_config(recipe("faster_rcnn").Config, ["--anchor_sizes", "16,24", "32,48", "64,96"]).anchor_sizes
    assert anchors == [[16.0, 24.0], [32.0, 48.0], [64.0, 96.0]]


@pytest.mark.parametrize(
    "flag, field",
    [
        ("learning_rate", "lr"),  # difflib alone proposed decay_rate
        ("wd", "weight_decay"),
        ("bs", "batch_size"),
        ("batch", "batch_size"),
        ("workers", "num_workers"),
        ("out", "output_dir"),
        ("num_epochs", "epochs"),
        ("drop_path", "drop_path_rate"),
        ("Learning_Rate", "lr"),
    ],
)
def test_names_from_other_tools_suggest_the_field_they_mean(flag, field):
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("classifier").Config, [f"--{flag}", "1"])
    assert str(e.value) == f"unknown config key '{flag}' in the command line (did you mean '{field}'?)"


def test_an_alias_suggests_only_a_field_the_config_has():
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("yolo").Config, ["--drop_path", "0.1"])  # yolo.py has no drop_path_rate
    assert "drop_path_rate" not in str(e.value)


@pytest.mark.parametrize(
    "text, where",
    [
        ("lr: 0.1\nscale: [0.5, 1.0\nepochs: 3\n", "line 3, column 7: not valid YAML: expected ',' or ']'"),
        ("lr: 0.1\n  epochs: 3\n", "line 2, column 9: not valid YAML: mapping values are not allowed here"),
        ("lr: 0.1\n\tepochs: 3\n", "line 2, column 1: not valid YAML: found character '\\t'"),
    ],
)
def test_invalid_yaml_names_the_file_and_line(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_config(Cfg, ["--config", str(path)])
    assert str(e.value).startswith(f"config file '{path}', {where}") and "\n" not in str(e.value)


def test_another_recipes_config_names_the_recipe_it_is_for(tmp_path):
    """Issue 28: yolo.py's saved config.yaml given to classifier.py said "'color_jitter' expects a number"."""
    saved = tmp_path / "runs" / "yolo" / "default" / "config.yaml"
    saved.parent.mkdir(parents=True)
    save_config(recipe("yolo").Config(), saved)
    with pytest.raises(ConfigError) as e:
        parse_config(recipe("classifier").Config, ["--config", str(saved)])
    assert str(e.value) == (
        f"config file '{saved}' is for yolo.py, not classifier.py: "
        "classifier.py has no 'multiscale', 'multiscale_every', 'augment' and 19 more"
    )
    from conftest import ROOT

    shipped = ROOT / "configs" / "detr" / "cppe5.yaml"
    with pytest.raises(ConfigError, match=r"is for detr.py, not faster_rcnn.py: faster_rcnn.py has no 'scales'"):
        parse_config(recipe("faster_rcnn").Config, ["--config", str(shipped)])
    mine = tmp_path / "mine.yaml"  # a typo in a recipe's own file stays a typo
    mine.write_text("img_size: 64\nhflipp: 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'hflipp' .*\(did you mean 'hflip'\?\)$"):
        parse_config(recipe("classifier").Config, ["--config", str(mine)])


def test_saved_config_round_trips(tmp_path):
    cfg = parse_config(Cfg, ["--lr", "0.25", "--scale", "0.3,0.7"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["lr"] == 0.25
    again = parse_config(Cfg, ["--config", str(tmp_path / "config.yaml")])
    assert (again.lr, again.scale, again.epochs) == (0.25, [0.3, 0.7], 10)


def test_every_shipped_config_fits_its_recipe():
    """Each configs/<recipe>/*.yaml parses against that recipe's Config: no stale or misspelled key."""
    from conftest import ROOT

    checked = 0
    for folder in sorted((ROOT / "configs").iterdir()):
        if not (ROOT / "recipes" / f"{folder.name}.py").is_file():
            continue
        for path in sorted(folder.glob("*.yaml")):
            cfg = parse_config(recipe(folder.name).Config, ["--config", str(path)])
            assert cfg.config == str(path)
            checked += 1
    assert checked >= 5


def _header_command(path, start: str) -> list[str]:
    """The arguments after the recipe's file of the command in ``path``'s header comments that begins with
    ``start`` (continued by backslashes)."""
    import shlex

    comments = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    first = next(i for i, line in enumerate(comments) if line.startswith(start))
    command = comments[first]
    for line in comments[first + 1 :]:
        if not command.endswith("\\"):
            break
        command = command[:-1] + " " + line
    words = shlex.split(command)
    return words[words.index(f"recipes/{path.parent.name}.py") + 1 :]


def test_own_photos_cpu_and_gpu_commands_parse():
    """Each own_photos.yaml header names a CPU command (`python recipes/<recipe>.py ...`) and a one-GPU one
    (`accelerate launch --config_file configs/accelerate/single_gpu.yaml ...`), both of fields of its recipe with
    values they take: the CPU form is a 10-minute budget with fewer workers and no larger a batch."""
    from common.budget import seconds_of
    from conftest import ROOT

    paths = sorted((ROOT / "configs").glob("*/own_photos.yaml"))
    assert {p.parent.name for p in paths} == {"classifier", "dino", "yolo", "detr", "faster_rcnn"}
    for path in paths:
        name = path.parent.name
        forms = {}
        for form, start in (("cpu", f"python recipes/{name}.py"), ("gpu", "accelerate launch --config_file")):
            args = _header_command(path, start)
            assert args[:2] == ["--config", f"configs/{name}/own_photos.yaml"], (path, args)
            forms[form] = parse_config(recipe(name).Config, ["--config", str(path), *args[2:]])
        cpu, gpu = forms["cpu"], forms["gpu"]
        assert seconds_of(cpu.max_time) == 600, path
        assert cpu.batch_size <= gpu.batch_size and cpu.num_workers < gpu.num_workers, path


# ---- fixed sets of values ---------------------------------------------------------------------
def test_literal_fields_take_their_values(tmp_path):
    cfg = parse_config(Cfg, ["--sched", "step", "--precision", ""])
    assert cfg.sched == "step" and cfg.precision == ""
    path = tmp_path / "run.yaml"
    path.write_text("sched: poly\nprecision: bf16\n")
    cfg = parse_config(Cfg, ["--config", str(path)])
    assert (cfg.sched, cfg.precision) == ("poly", "bf16")


def test_literal_typo_on_the_command_line_names_the_closest_value():
    with pytest.raises(ConfigError) as e:
        parse_config(Cfg, ["--sched", "cosin"])
    assert str(e.value) == (
        "config field 'sched' must be one of cosine, linear, step, poly, constant; got 'cosin' (did you mean 'cosine'?)"
    )
    with pytest.raises(
        ConfigError, match=r"'precision' must be one of '', no, bf16; got 'bf61' \(did you mean 'bf16'\?\)"
    ):
        parse_config(Cfg, ["--precision", "bf61"])


def test_literal_typo_in_yaml_names_the_closest_value(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("sched: Step\n")
    with pytest.raises(ConfigError, match=r"'sched' must be one of .*; got 'Step' \(did you mean 'step'\?\)"):
        parse_config(Cfg, ["--config", str(path)])
    path.write_text("sched: 3\n")  # a YAML number is no schedule either
    with pytest.raises(ConfigError, match=r"'sched' must be one of cosine, .*; got 3$"):
        parse_config(Cfg, ["--config", str(path)])


def test_run_time_choices_are_checked_only_when_given():
    calls = optimizers.calls
    assert parse_config(Cfg, []).opt == "adamw" and optimizers.calls == calls  # the default: not looked up
    assert parse_config(Cfg, ["--opt", "lamb"]).opt == "lamb"
    with pytest.raises(
        ConfigError, match=r"'opt' must be one of adamw, sgd, lamb; got 'adamx' \(did you mean 'adamw'\?\)"
    ):
        parse_config(Cfg, ["--opt", "adamx"])


# ---- help from each field's arg(), headings from the Config source ------------------------------
def test_field_docs_read_arg_and_the_headings():
    docs = field_docs(Cfg)
    assert docs["config"].description == "the YAML file" and docs["config"].heading == ""  # not "fmt: off"
    assert (docs["data"].description, docs["data"].heading) == ("dataset name", "data")
    assert docs["lr"].description == "peak learning rate; a continuation line"
    assert docs["epochs"].description == "training epochs"
    assert (docs["compile"].description, docs["compile"].heading) == (
        "compile",
        "two comment lines above a field make one heading",
    )
    assert docs["scale"].heading == "" and docs["model_kwargs"].heading == ""
    assert docs["model_kwargs"].description == "a field over four lines"
    assert docs["sched"].heading == "optimization: a heading with a colon"
    assert docs["undocumented"].description == ""


def test_usage_lists_every_field_by_group():
    lines = usage(Cfg).splitlines()
    assert lines[0] == __doc__.splitlines()[0]  # the first docstring line of the module the Config lives in
    assert "usage: test_config.py [--config FILE.yaml] [--FIELD VALUE ...]" in lines
    assert "  --lr float (default: 0.001)" in lines
    assert "      peak learning rate; a continuation line" in lines
    assert "  --scale list[float] (default: [0.08, 1.0])" in lines
    assert "  --model_kwargs dict (default: {depth: 4, embed_dim: 96})" in lines
    assert "  --precision str (default: '')" in lines and "      choices: '', no, bf16" in lines
    assert "      choices: cosine, linear, step, poly, constant" in lines
    assert "      choices: Names known only at run time" in lines
    assert "  --note str | none (default: none)" in lines and "  --compile bool (default: false)" in lines
    assert lines.index("data:") < lines.index("  --data str (default: digits)")
    assert lines.index("optimization: a heading with a colon") < lines.index("  --sched str (default: cosine)")
    assert all(len(line) <= 100 for line in lines)


# ---- the recipes ------------------------------------------------------------------------------
_loaded: dict = {}


def recipe(name: str):
    """Each recipe module imported once for this file's tests."""
    if name not in _loaded:
        from conftest import load_recipe

        _loaded[name] = load_recipe(name)
    return _loaded[name]


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_field_is_described(name):
    docs = field_docs(recipe(name).Config)
    assert len(docs) == len(dataclasses.fields(recipe(name).Config))
    missing = [f for f, d in docs.items() if not d.description.strip()]
    assert not missing, f"recipes/{name}.py: Config fields without a help: {missing}"
    assert docs["data"].heading == "data"  # the section comments are headings, not descriptions


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_help_shows_every_field(name, capsys):
    module = recipe(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(module.__doc__.strip().splitlines()[0])
    assert f"usage: {name}.py [--config FILE.yaml] [--FIELD VALUE ...]" in out
    flat = _words(out)
    hints = typing.get_type_hints(module.Config)
    for f in dataclasses.fields(module.Config):
        assert f"  --{f.name} " in out, f.name
        assert _words(field_docs(module.Config)[f.name].description) in flat, f.name
        if typing.get_origin(hints[f.name]) is Literal:
            assert "choices: " + ", ".join(a or "''" for a in typing.get_args(hints[f.name])) in flat, f.name
    assert "choices: wandb, tensorboard, none" in flat and "choices: '', no, fp16, bf16" in flat


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_config_extends_the_run_contract(name):
    """The shared fields are written once (common.config.RunConfig); a recipe re-declares one only to give its
    own default or description, and its own fields come first in --help and config.yaml."""
    config = recipe(name).Config
    assert issubclass(config, RunConfig)
    shared = {f.name: f for f in dataclasses.fields(RunConfig)}
    docs, shared_docs = field_docs(config), field_docs(RunConfig)
    for f in dataclasses.fields(config):
        if f.name in shared and f.name in inspect.get_annotations(config):
            own_default = f.default != shared[f.name].default
            own_words = docs[f.name].description != shared_docs[f.name].description
            assert own_default or own_words, f"recipes/{name}.py re-declares '{f.name}' as RunConfig has it"
    keys = list(to_dict(config()))
    assert keys[0] == "data" and keys.index("output_dir") > keys.index("model")


def test_a_redeclared_field_keeps_the_shared_description_and_help_lists_own_fields_first():
    @dataclass
    class Mine(RunConfig):
        # data
        data: str = "digits"
        img_size: int = arg(32, "pixels")
        epochs: int = 3
        lr: float = arg(0.1, "my own words")

    docs = field_docs(Mine)
    assert docs["data"].description == field_docs(RunConfig)["data"].description and docs["data"].heading == "data"
    assert docs["epochs"].description == "training epochs" and docs["lr"].description == "my own words"
    with pytest.raises(ConfigError, match=f"^epochs must be at least 1 and at most {MAX_EPOCHS}, got 0; evaluating"):
        parse_config(Mine, ["--epochs", "0"])  # and the shared range
    with pytest.raises(ConfigError, match="^lr must be at least 0, got -1.0$"):
        parse_config(Mine, ["--lr", "-1"])
    text = usage(Mine)
    assert (
        text.index("--data str (default: digits)") < text.index("--img_size") < text.index("--epochs int (default: 3)")
    )
    assert (
        text.index("--epochs")
        < text.index("every recipe's fields (common.config.RunConfig):")
        < text.index("--output_dir")
    )
    assert text.count("--epochs") == 1


@pytest.mark.parametrize(
    "name, argv, message",
    [
        (
            "classifier",
            ["--sched", "cosin"],
            "'sched' must be one of cosine, linear, step, poly, constant; got 'cosin' (did you mean 'cosine'?)",
        ),
        ("classifier", ["--interpolation", "bicubik"], "(did you mean 'bicubic'?)"),
        ("classifier", ["--opt", "adamW"], "got 'adamW' (did you mean 'adamw'?)"),
        ("dino", ["--opt", "SGD"], "'opt' must be one of adamw, sgd; got 'SGD' (did you mean 'sgd'?)"),
        (
            "yolo",
            ["--report_to", "wandbb"],
            "'report_to' must be one of wandb, tensorboard, none; got 'wandbb' (did you mean 'wandb'?)",
        ),
        ("detr", ["--mixed_precision", "bf61"], "got 'bf61' (did you mean 'bf16'?)"),
        ("faster_rcnn", ["--sched", "cosine"], "'sched' must be one of poly, step; got 'cosine'"),
    ],
)
def test_recipe_choices_are_checked_when_parsed(name, argv, message, tmp_path):
    """On the command line and in YAML alike, before the recipe makes anything."""
    module = recipe(name)
    with pytest.raises(ConfigError) as e:
        parse_config(module.Config, argv)
    assert message in str(e.value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({argv[0][2:]: argv[1]}))
    with pytest.raises(ConfigError) as e:
        parse_config(module.Config, ["--config", str(path)])
    assert message in str(e.value)


def test_classifier_takes_any_timm_optimizer():
    config = recipe("classifier").Config
    assert parse_config(config, ["--opt", "lamb"]).opt == "lamb"
    assert parse_config(config, ["--opt", "lookahead_adamw"]).opt == "lookahead_adamw"
