"""A ``Config`` field in one place, :func:`arg`: its default, its description for ``--help`` and, for a number,
its legal range; and ``--help`` itself (:func:`usage`)::

    # fmt: off
    # data                                                        <- a comment line above a field: a group heading
    img_size: int = arg(32, "training and evaluation resolution (pixels)", ge=8, le=MAX_SIDE)
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must "
        "not be mirrored", ge=0, le=1)                            <- a long description goes on below
    opt: str = arg("adamw", "any timm optimizer name", choices=timm_optimizers)    <- a set known at run time
    epochs: int = 12                      <- re-declared with a plain default: the base's description and range
    # fmt: on

The bounds read as the error says them: ``ge`` at least, ``gt`` more than, ``le`` at most, ``lt`` less than
(:class:`Range`); a list field's every item is checked. ``# fmt: off`` keeps a field on its line or two: ruff
format would put each argument of a call longer than a line on a line of its own.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

HELP_WIDTH = 100  # columns of --help; descriptions wrap below their flag, indented


# names other tools give a field (timm's train.py, Hugging Face's Trainer): what "did you mean" proposes for them
ALIASES = dict(
    pair.split(":")
    for pair in """learning_rate:lr wd:weight_decay bs:batch_size batch:batch_size workers:num_workers out:output_dir
    output:output_dir num_epochs:epochs optimizer:opt scheduler:sched drop:drop_rate drop_path:drop_path_rate
    model_ema_decay:ema_decay num_train_epochs:epochs per_device_train_batch_size:batch_size max_grad_norm:clip_grad
    gradient_accumulation_steps:grad_accum_steps dataloader_num_workers:num_workers init_weights:init_backbone
    lr_base_scale:lr_scale""".split()
)


def show(value: Any) -> str:
    """A value as a user types it in a flag or a YAML file: ``''``, ``true``, ``none``, ``[0.5, 1.0]``."""
    if isinstance(value, str):
        return value if value and value.strip() == value and "\n" not in value else repr(value)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, (list, tuple, dict)):
        plain = list(value) if isinstance(value, tuple) else value
        return yaml.safe_dump(plain, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's legal numbers: from ``low`` to ``high``, each end included unless open (an infinite end is open).
    ``str()`` is what --help shows, ``[0, 1)`` or ``(0, inf)``; ``note`` follows it there and in the error."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = True
    high_open: bool = True
    note: str = ""

    def __contains__(self, value: float) -> bool:
        above = self.low < value if self.low_open else self.low <= value
        return above and (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        ends = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{ends[0]}{self.low}, {self.high}{ends[1]}" + (f"; {self.note}" if self.note else "")

    def words(self) -> str:
        """The range as an error says it: ``at least 1 and less than 2``."""
        low = [f"{'more than' if self.low_open else 'at least'} {self.low}"] if self.low > -math.inf else []
        high = [f"{'less than' if self.high_open else 'at most'} {self.high}"] if self.high < math.inf else []
        return " and ".join(low + high)


def arg(
    default: Any,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    note: str = "",
    choices: Callable[[], Any] | None = None,
) -> Any:
    """A Config field: its ``default`` (a list or dict is copied for each config), its ``help`` for --help; for a
    number its range, each value (or item of a list) at least ``ge`` or more than ``gt``, at most ``le`` or less
    than ``lt``, with a ``note`` shown after the range; ``choices``: a function listing the legal values, called only
    when the field is given (a fixed set is a ``Literal`` annotation). What a re-declaration leaves out, its base
    says (:func:`field_metadata`)."""
    low, high = ge if gt is None else gt, le if lt is None else lt
    if None not in (ge, gt) or None not in (le, lt) or (note and low is None and high is None):
        raise TypeError("a range takes one of ge/gt, one of le/lt, and a note only with a bound")  # a recipe bug
    metadata: dict[str, Any] = {"help": help} if help else {}
    if low is not None or high is not None:
        low, high = -math.inf if low is None else low, math.inf if high is None else high
        metadata["range"] = Range(low, high, low_open=ge is None, high_open=le is None, note=note)
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def field_metadata(cls: type) -> dict[str, dict[str, Any]]:
    """Field name -> what :func:`arg` declared (help, range, choices), each from the nearest class in ``cls``'s
    MRO that declares it: a field re-declared with a plain default keeps its base's description and range."""
    merged: dict[str, dict[str, Any]] = {}
    for klass in reversed(cls.__mro__):
        own = vars(klass).get("__dataclass_fields__", {})
        for name in inspect.get_annotations(klass):
            if name in own:
                merged[name] = {**merged.get(name, {}), **own[name].metadata}
    return {f.name: merged.get(f.name, {}) for f in dataclasses.fields(cls)}


def field_ranges(cls: type) -> dict[str, Range]:
    """Field name -> its legal range, for the fields that have one."""
    return {name: meta["range"] for name, meta in field_metadata(cls).items() if "range" in meta}


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    description: str  # the field's help
    heading: str  # the group this field starts (the comment lines right above it), else ""


def _headings(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above its declaration in ``cls``'s own source, joined: a group
    heading. ``# fmt:`` lines, and comment lines indented inside the comment (``#   goes on``), are none."""
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).split("\n")
        (node,) = ast.parse("\n".join(lines)).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return {}  # no source (an interactive session, a frozen program): help without headings
    headings = {}
    for field in (n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
        above, row = [], field.lineno - 2
        while row >= 0 and lines[row].startswith(" " * field.col_offset + "# "):
            text = lines[row].strip()[2:]
            if text.startswith(("fmt:", " ")):
                break
            above.insert(0, text.strip())
            row -= 1
        headings[field.target.id] = " ".join(above)
    return headings


@functools.cache
def field_docs(cls: type) -> dict[str, FieldDoc]:
    """Field name -> FieldDoc: its help (:func:`field_metadata`; "" if none) and its group heading, read from the
    source of the nearest class that declares it."""
    headings: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            headings.update(_headings(klass))
    return {name: FieldDoc(meta.get("help", ""), headings.get(name, "")) for name, meta in field_metadata(cls).items()}


def ordered_fields(cls: type) -> list[dataclasses.Field]:
    """The dataclass fields of ``cls`` as a reader meets them: those written in ``cls`` itself in its
    order (re-declared ones included), then the inherited rest (e.g. common.config.RunConfig's) in theirs."""
    own = list(inspect.get_annotations(cls))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return [fields[n] for n in own if n in fields] + [f for f in fields.values() if f.name not in own]


def recipe_file(cls: type) -> Path:
    """The script that defines ``cls`` (a recipe's ``Config``: ``recipes/detr.py``); ``Path("")`` if none."""
    return Path(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {type(a).__name__ for a in args}
        return kinds.pop() if len(kinds) == 1 else "choice"
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else origin.__name__
    return getattr(hint, "__name__", str(hint))


def field_choices(hint: Any, choices: Any = None) -> str:
    """What ``--help`` prints after ``choices:`` for a field with a fixed set of values (a ``Literal``), or with
    ``choices`` (a function listing them at run time), else ""."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return ", ".join(show(a) for a in typing.get_args(hint))
    if callable(choices):  # a run-time set: say where it comes from rather than list it
        doc = (inspect.getdoc(choices) or "").split("\n")[0].rstrip(".")
        return doc or f"the names {getattr(choices, '__name__', 'its choices')}() lists"
    return ", ".join(show(a) for a in choices) if choices is not None else ""


def print_usage(cls: type) -> None:
    """Print :func:`usage`; a reader that closed the pipe early (``--help | head``) ends it quietly."""
    try:
        print(usage(cls), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits


def usage(cls: type) -> str:
    """``--help``: the recipe's first docstring line, the usage line, then every field by group:
    ``--name TYPE (default: X)`` with its description (and ``choices:``, ``range:``) wrapped below it."""
    module = sys.modules.get(cls.__module__)
    script = Path(getattr(module, "__file__", None) or sys.argv[0]).name
    summary = (inspect.getdoc(module) or "").strip().split("\n")[0] if module is not None else ""
    hints = typing.get_type_hints(cls)
    docs, ranges, meta = field_docs(cls), field_ranges(cls), field_metadata(cls)
    wrap = functools.partial(
        textwrap.fill,
        width=HELP_WIDTH,
        initial_indent=" " * 6,
        subsequent_indent=" " * 6,
        break_on_hyphens=False,
        break_long_words=False,
    )
    lines = [summary, ""] if summary else []
    lines += [
        f"usage: {script} [--config FILE.yaml] [--FIELD VALUE ...]",
        "",
        "Every field is a flag and a key of the YAML file; flags win over the file. Lists: --scale 0.5 1.0,",
        "--scale 0.5,1.0 or --scale '[0.5, 1.0]'; mappings: --model_kwargs '{depth: 4}'; a bool flag alone",
        "means true. A number outside its field's range is refused.",
        "",
    ]
    own = set(inspect.get_annotations(cls))
    for f in ordered_fields(cls):
        doc = docs[f.name]
        if f.name not in own and own:  # the first inherited field: the shared ones follow
            own = set()
            lines += [""] if lines[-1] else []
            lines.append("every recipe's fields (common.config.RunConfig):")
        if doc.heading:
            lines += [""] if lines[-1] else []
            lines.append(textwrap.fill(doc.heading if ":" in doc.heading else f"{doc.heading}:", HELP_WIDTH))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  --{f.name} {_type_name(hints[f.name])} (default: {show(default)})")
        if doc.description:
            lines.append(wrap(doc.description))
        choices = field_choices(hints[f.name], meta[f.name].get("choices"))
        if choices:
            lines.append(wrap(f"choices: {choices}"))
        if f.name in ranges:
            lines.append(wrap(f"range: {ranges[f.name]}"))
    return "\n".join(lines)
