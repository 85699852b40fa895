"""Configuration: dataclass defaults <- ``--config file.yaml`` <- ``--field value`` flags.

Every recipe declares a ``Config`` dataclass whose defaults are its built-in demo. It extends
:class:`RunConfig`, the fields every recipe has with one meaning (run folder, seeds, logging, checkpoints,
tracker, optimisation budget), re-declaring one only to give its own default and description; ``common/``
reads a config only through RunConfig's fields. :func:`parse_config` layers a YAML file and command-line
flags on top; every field is a flag of the same name. An unknown key is an error naming the closest valid
key, a value of the wrong type one naming the field; both raise :class:`ConfigError`, one ``error:`` line.

Each field is declared in one place, ``name: type = arg(default, "help", ge=..., le=...)``
(:func:`common.config_help.arg`): its default, its description for ``--help`` and, for a number, its range. A
field with a fixed set of values is annotated ``Literal["a", "b"]``; a set known only at run time (timm's
optimizers) is ``arg(..., choices=fn)``, ``fn()`` called only when the field is given. A value outside the set,
or a number outside its field's range, is a ConfigError raised while parsing, before a recipe writes anything.
``--help`` (:mod:`common.config_help`) lists every field with its help and range, under the comment-line
headings of the ``Config`` source.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from common import UserError
from common.budget import seconds_of
from common.config_help import ALIASES, Range, arg, field_metadata, field_ranges, ordered_fields, recipe_file
from common.config_help import show as _show

C = TypeVar("C")

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
# the upper ends of the fields' ranges: beyond them a run would only allocate its way to a crash
MAX_SIDE = 16384  # an image side, pixels
MAX_COUNT = 2**20  # a batch, a width, a number of things made per image or per step
MAX_EPOCHS = 100_000  # the schedules hold one value per optimizer step


class ConfigError(UserError):
    """An unknown key, a wrong type, a value outside a field's choices or an unreadable config file."""


@dataclasses.dataclass
class RunConfig:
    """The fields every recipe's ``Config`` has (``class Config(RunConfig)``), as DETR's ``main.py`` takes
    its shared arguments from a parent parser. A recipe re-declares a field to give its own default and
    description; one it re-declares with a plain default keeps the description and range written here."""

    # fmt: off
    config: str = arg("", "the YAML file this run was read from (set by --config)")
    # data, budget and precision
    data: str = arg("", "the dataset: a built-in name, a local folder or a hub dataset name")
    train_split: str = arg("train", "the split to train on")
    eval_split: str = arg("", "the split to evaluate on; empty: validation/val/valid/test, else a seeded 10 % of train")
    num_workers: int = arg(-1, "DataLoader workers per training process; -1: its share of the "
        "cores, at most 8; 0: none", ge=-1, le=1024)
    bad_images: Literal["skip", "error"] = arg("skip", "unreadable images found before training: left out, or refused")
    cache_images: Literal["", "ram", "disk"] = arg("", "each image decoded once, kept in ram or on disk")
    epochs: int = arg(1, "training epochs", ge=1, le=MAX_EPOCHS,
        note="evaluating saved weights without training is --eval_only --weights W")
    max_steps: int = arg(0, ">0: stop after this many optimizer steps", ge=0)
    max_time: str = arg("", "a time budget for the whole run, e.g. 90s, 10m, 2h: the first steps time the run, "
        "then its steps and every schedule (warmup, decay, milestones, evaluations) are laid out to end within it, "
        "final evaluation and weights included; the config's epoch counts become shares of it (empty: epochs and "
        "max_steps decide)")
    batch_size: int = arg(16, "images per process and micro-step: global batch = this x processes x grad_accum_steps",
        ge=1, le=MAX_COUNT)
    grad_accum_steps: int = arg(1, "micro-batches accumulated into each optimizer step", ge=1, le=MAX_COUNT)
    lr: float = arg(1e-3, "peak learning rate for a global batch of lr_batch images (scaled to the run's: lr_scale)",
        ge=0)
    lr_batch: int = arg(256, "the global batch lr is written for", ge=1, le=MAX_COUNT)
    lr_scale: Literal["linear", "sqrt"] = arg("linear", "the peak x (global batch / lr_batch), or x its square root "
        "(timm's rule for adam-type optimizers); global batch = batch_size x processes x grad_accum_steps")
    warmup_epochs: float = arg(0.0, "linear learning-rate warmup, epochs (fractions allowed)", ge=0)
    weight_decay: float = arg(0.0, "weight decay; biases and norms get none", ge=0)
    clip_grad: float = arg(0.0, "clip the global gradient norm to this (0: off)", ge=0)
    mixed_precision: Literal["", "no", "fp16", "bf16"] = arg("", "no: fp32; empty: as `accelerate launch` says")
    tf32: bool = arg(True, "CUDA: TF32 tensor-core matmuls and convolutions, and cudnn.benchmark autotuning (false: "
        "full fp32 precision and a fixed convolution algorithm)")
    compile: bool = arg(False, "torch.compile through Accelerate (inductor); the first steps "
        "are slow while it compiles")
    # run
    output_dir: str = arg("", "the run folder; empty: runs/<recipe file name>/<config name>")
    seed: int = arg(0, "seeds data order, augmentation and initialisation", ge=0, le=2**31 - 1)
    log_every: int = arg(20, "log training metrics every this many optimizer steps", ge=1)
    eval_every: int = arg(1, "evaluate every this many epochs; also at the end", ge=1)
    checkpoint_every: int = arg(500, "save a checkpoint every this many optimizer steps; also at the end", ge=1)
    keep_checkpoints: int = arg(3, "the newest checkpoints kept; older ones are deleted", ge=1)
    resume: str = arg("", "auto (the run folder's newest complete checkpoint), a checkpoint folder, or empty (afresh)")
    report_to: Literal["wandb", "tensorboard", "none"] = arg("wandb", "tracker; wandb logs offline without "
        "credentials; metrics.jsonl is written in every case")
    project: str = arg("", "tracker project; empty: $WANDB_PROJECT, else the recipe's file name")
    run_name: str = arg("", "tracker run name; empty: $WANDB_NAME, else the run folder's name")
    log_weights: bool = arg(False, "wandb: upload the final and best weights (model folder, "
        "ONNX) as W&B model artifacts")
    push_to_hub: str = arg("", "ORG/NAME: upload the model folder (<run>/model) to the Hugging Face hub at the end")
    # saved weights (the model fields default to the file's saved config)
    weights: str = arg("", "weights this recipe saved: best.safetensors, a model/ or checkpoint folder, model.onnx")
    predict: str = arg("", "an image file or folder to run --weights on; the predictions go to the run folder")
    eval_only: bool = arg(False, "evaluate --weights on the evaluation split, no training")
    export: bool = arg(False, "ONNX (+ .pt2) in <run>/export/, checked against eager; --export --weights W: W only")
    # fmt: on

    def peak_lr(self, processes: int) -> float:
        """The run's peak learning rate: ``lr`` carried from ``lr_batch`` images to the global batch."""
        ratio = self.batch_size * processes * self.grad_accum_steps / self.lr_batch
        return self.lr * (ratio if self.lr_scale == "linear" else math.sqrt(ratio))


def _closest(key: str, valid: Sequence[str], aliases: dict[str, str] | None = None) -> str:
    lower = {v.lower(): v for v in valid}
    alias = (aliases or {}).get(key.lower())
    if alias in valid:
        match = [alias]
    elif key.lower() in lower:
        match = [lower[key.lower()]]
    else:
        match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _choices_error(name: str, value: Any, allowed: Sequence[Any], source: str = "") -> ConfigError:
    listed = (
        ", ".join(_show(a) for a in allowed)
        if len(allowed) <= 12
        else (f"the {len(allowed)} names {source or 'its choices'} lists")
    )
    hint = _closest(str(value), [str(a) for a in allowed])
    return ConfigError(f"config field '{name}' must be one of {listed}; got {value!r}{hint}")


def _coerce(name: str, value: Any, hint: Any, from_cli: bool) -> Any:
    """Convert ``value`` to the field type ``hint``; raise ConfigError when it does not fit. YAML already typed
    file values; command-line values arrive as strings and are parsed by the field's type, so ``--lr 3e-4`` is a
    float and ``--data 10`` stays a string."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X]: None or X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (from_cli and str(value).lower() in ("none", "null")):
            return None
        return _coerce(name, value, args[0], from_cli)
    if origin is typing.Literal:  # a fixed set, e.g. Literal["cosine", "step"]: typed like its values
        allowed = typing.get_args(hint)
        for option in allowed:
            try:
                if _coerce(name, value, type(option), from_cli) == option:
                    return option
            except ConfigError:
                continue
        raise _choices_error(name, value, allowed)
    if origin is dict or hint is dict:  # e.g. model_kwargs: {depth: 4, embed_dim: 96}
        if from_cli and isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError:
                pass
        if not isinstance(value, dict):
            raise ConfigError(f"config field '{name}' expects a mapping like {{key: value}}, got {value!r}")
        return dict(value)
    if origin in (list, tuple):
        (item_hint, *_) = typing.get_args(hint) or (Any,)
        if from_cli and isinstance(value, str):  # '[0.5, 1.0]' (YAML), '0.5,1.0', or '' for an empty list
            try:
                value = yaml.safe_load(value) if value.strip().startswith("[") else value.split(",") if value else []
            except yaml.YAMLError:
                raise ConfigError(f"config field '{name}' expects a list like [0.5, 1.0], got {value!r}") from None
            value = [] if value is None else value
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config field '{name}' expects a list, got {value!r}")
        items = [_coerce(name, v, item_hint, from_cli or isinstance(v, str)) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"config field '{name}' expects true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"config field '{name}' expects an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config field '{name}' expects a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config field '{name}' expects a string, got {value!r}")
    raise TypeError(f"unsupported config field type {hint!r} for '{name}'")  # a recipe bug


def _check_choices(name: str, value: Any, choices: Any) -> None:
    """``arg(..., choices=fn)``: the value must be one of ``fn()`` (an empty list checks nothing)."""
    if choices is None or value is None:
        return
    allowed = list(choices() if callable(choices) else choices)
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if allowed and item not in allowed:
            raise _choices_error(name, item, allowed, f"{getattr(choices, '__name__', 'its choices')}()")


def _check_range(name: str, value: Any, legal: Range) -> None:
    """A number (or each number of a list) within ``legal``; outside it is a ConfigError naming the field and
    the range in words."""
    if all(v in legal for v in _numbers(value)):
        return
    every = "every value of " if isinstance(value, (list, tuple)) else ""
    note = f"; {legal.note}" if legal.note else ""
    raise ConfigError(f"{every}{name} must be {legal.words()}, got {_show(value)}{note}")


def _numbers(value: Any) -> list[float]:
    """The numbers in a value, in nested lists too (booleans, strings and None are none)."""
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _apply(cfg: Any, values: dict[str, Any], hints: dict[str, Any], source: str, from_cli: bool) -> None:
    declared, ranges = field_metadata(type(cfg)), field_ranges(type(cfg))
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key '{key}' in {source}{_closest(key, list(declared), ALIASES)}")
        value = _coerce(key, _older_list(cfg, key, value), hints[key], from_cli)
        _check_choices(key, value, declared.get(key, {}).get("choices"))
        if key in ranges:
            _check_range(key, value, ranges[key])
        setattr(cfg, key, value)


def _older_list(cfg: Any, key: str, value: Any) -> Any:
    """A mapping field given as a list, as older versions wrote it (``loss_weights: [2.0, 5.0, 2.0]``): the
    values in the order of the default's names, said in one line; anything else as it is."""
    default = getattr(cfg, key, None)
    if not isinstance(value, list) or not isinstance(default, dict) or not 0 < len(value) <= len(default):
        return value
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {key} given as a list (an older config): read in its order as {dict(zip(default, value))}")
    return dict(zip(default, value))


def _recipe_of(keys: Sequence[str], cls: type) -> str:
    """The one recipe beside ``cls``'s own script whose Config has every one of ``keys`` (a config file written
    for it): its script name, else ''. Read from the scripts' source, not imported."""
    here = recipe_file(cls)
    if not issubclass(cls, RunConfig) or not here.is_file():
        return ""
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    found = []
    for path in sorted(here.parent.glob("*.py")):
        text = path.read_text(errors="replace") if path != here else ""
        try:
            tree = ast.parse(text) if "class Config(RunConfig)" in text else ast.Module([], [])
        except SyntaxError:
            continue
        for config in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"):
            own = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and hasattr(n.target, "id")}
            found += [path.stem] if set(keys) <= shared | own else []
    return found[0] if len(found) == 1 else ""


def _is_list(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[list[...]]
        return any(_is_list(a) for a in typing.get_args(hint))
    return typing.get_origin(hint) in (list, tuple)


def timm_optimizers() -> list[str]:
    """timm's optimizer names (timm.optim.list_optimizers(), timm >= 1.0.12), also with timm's lookahead_ prefix.

    Imported when first called, i.e. only when a config sets the field it checks; with an older
    timm the list is empty and nothing is checked."""
    try:
        from timm.optim import list_optimizers
    except ImportError:
        return []
    names = list(list_optimizers())
    return names + [f"lookahead_{n}" for n in names]


def parse_config(cls: type[C], argv: Sequence[str] | None = None, base: dict[str, Any] | None = None) -> C:
    """Build ``cls`` from its defaults, then ``base`` (e.g. the config saved in a weights file), then
    ``--config FILE.yaml``, then ``--field value`` flags.

    A bool flag given alone (``--compile``) means true. ``--help`` prints the fields and exits.
    The YAML file's path is kept in ``cfg.config`` when the dataclass has such a field.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from common.config_help import print_usage  # reads the recipe's source (the headings): only for --help

        print_usage(cls)
        raise SystemExit(0)
    every_hint = typing.get_type_hints(cls)
    hints = {f.name: every_hint[f.name] for f in dataclasses.fields(cls)}  # the fields: not the ClassVars
    cli: dict[str, Any] = {}
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}': flags look like --field value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if hints.get(key) is bool and (nxt is None or nxt.startswith("--")):
                value = "true"  # a bare boolean flag
            elif nxt is None:
                raise ConfigError(f"flag '--{key}' needs a value")
            else:
                value, i = nxt, i + 1
        more = []  # a list field takes every value up to the next flag, as argparse's nargs="+": --scale 0.08 1.0
        while _is_list(hints.get(key)) and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            more, i = [*more, argv[i + 1]], i + 1
        if more:  # an unquoted YAML list arrives split by the shell: --scale [0.08, 1.0]
            value = " ".join([value, *more]) if value.startswith("[") else [value, *more]
        if key == "config" and "config" not in hints:
            config_file = value
        else:
            cli[key] = value  # given twice: the last one wins, as with argparse
        i += 1
    if "config" in hints and "config" in cli:
        config_file = cli["config"]

    cfg = cls()
    if base:
        _apply(cfg, base, hints, "the weights' saved config", from_cli=False)
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file '{config_file}' does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file '{config_file}'{where}: not valid YAML: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{config_file}' must hold a mapping of field: value")
        try:
            _apply(cfg, loaded, hints, f"'{config_file}'", from_cli=False)
        except ConfigError:  # another recipe's file (its runs/<recipe>/<name>/config.yaml, configs/<recipe>/)?
            unknown = [k for k in loaded if k not in hints]
            other = _recipe_of(list(loaded), cls) if unknown else ""
            if not other:
                raise
            this = recipe_file(cls).stem
            keys = ", ".join(map(repr, unknown[:3])) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
            raise ConfigError(
                f"config file '{config_file}' is for {other}.py, not {this}.py: {this}.py has no {keys}"
            ) from None
        if "config" in hints:
            cfg.config = str(config_file)  # type: ignore[attr-defined]
    _apply(cfg, cli, hints, "the command line", from_cli=True)
    if "max_time" in hints:
        try:
            seconds_of(cfg.max_time)  # type: ignore[attr-defined]
        except UserError as e:
            raise ConfigError(str(e)) from None
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain YAML-serialisable values (tuples become lists), the recipe's own fields first."""
    out = dataclasses.asdict(cfg)
    return {
        f.name: list(out[f.name]) if isinstance(out[f.name], tuple) else out[f.name] for f in ordered_fields(type(cfg))
    }


def save_config(cfg: Any, path: str | Path, header: str = "") -> None:
    """Write the resolved config; ``--config`` on this file reproduces the run. ``header``: YAML comment lines
    to put first (a run's: which ``common/`` it ran with), which loading the file ignores."""
    Path(path).write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
