"""``--help`` for a recipe's ``Config``: every field's description, read from the comments in the
Config source, so the comments are the one place the text lives (:func:`field_docs`)::

    # data                                          <- a comment line above a documented field: a group heading
    img_size: int = 32  # resolution, pixels        <- the trailing comment: the field's description
    hflip: float = 0.0  # 0.5 for natural images;   <- a long one goes on under the field, in comment
    #   digits must not be mirrored                 <- lines indented inside the comment ("#   ")
    # the comment lines right above a field with no trailing comment: its description
    label_column: str = ""

Continuation lines are indented inside the comment, not before it, so that the formatter (ruff
format, which puts every comment line at its block's indentation) leaves them as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types
import typing
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
class FieldDoc:
    description: str  # the trailing comment and its continuation lines, or the comment lines above
    heading: str  # the group this field starts (a comment line above a documented field), else ""


def _class_docs(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (trailing comment, comment lines right above) for the fields written in ``cls``'s
    own source (not its bases'), each with its continuation lines joined."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return {}  # no source (an interactive session, a frozen program): help without descriptions
    comments: dict[int, tuple[int, str]] = {}  # row -> (column, text) of every comment
    continued: set[int] = set()  # rows of comments indented inside the comment: "#   goes on"
    code_rows: set[int] = set()  # rows holding anything but a comment
    fields: list[tuple[str, int, int]] = []  # (name, first row, last row) of each annotated assignment
    depth, body_col = 0, -1  # nesting (the class body is 1) and the class body's indentation
    statement: tuple[str, int] | None = None  # the field being read: (name, first row)
    at_start = True  # the next token begins a logical line
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
            if tok.string.startswith("#  "):
                continued.add(tok.start[0])
        elif tok.type in (tokenize.INDENT, tokenize.DEDENT):
            depth += 1 if tok.type == tokenize.INDENT else -1
        elif tok.type == tokenize.NEWLINE:
            if statement is not None:
                fields.append((*statement, tok.start[0]))
            statement, at_start = None, True
        elif tok.type not in (tokenize.NL, tokenize.ENDMARKER):
            code_rows.update(range(tok.start[0], tok.end[0] + 1))
            if at_start and depth == 1:  # a statement of the class body: `name: type ...` is a field
                body_col = tok.start[1] if body_col < 0 else body_col
                if tok.type == tokenize.NAME and i + 1 < len(tokens) and tokens[i + 1].string == ":":
                    statement = (tok.string, tok.start[0])
            at_start = False

    def comment_only(row: int) -> bool:
        return row in comments and row not in code_rows

    docs: dict[str, tuple[str, str]] = {}
    for name, first, last in fields:
        trailing = [comments[r][1] for r in range(first, last + 1) if r in comments]
        row = last + 1  # continuation: comment lines right below, indented inside the comment or deeper
        while comment_only(row) and (row in continued or comments[row][0] > body_col):
            trailing.append(comments[row][1])
            row += 1
        above: list[str] = []  # comment lines right above, at the field's indentation
        row = first - 1
        while comment_only(row) and comments[row][0] <= body_col and row not in continued:
            above.insert(0, comments[row][1])
            row -= 1
        docs[name] = (" ".join(t for t in trailing if t), " ".join(a for a in above if a))
    return docs


def ordered_fields(cls: type) -> list[dataclasses.Field]:
    """The dataclass fields of ``cls`` as a reader meets them: those written in ``cls`` itself in its
    order (re-declared ones included), then the inherited rest (e.g. common.config.RunConfig's) in theirs."""
    own = list(inspect.get_annotations(cls))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return [fields[n] for n in own if n in fields] + [f for f in fields.values() if f.name not in own]


@functools.cache
def field_docs(cls: type) -> dict[str, FieldDoc]:
    """Field name -> FieldDoc (description and group heading), from the comments in the source of
    ``cls`` and of the dataclasses it derives from (a re-declaration without a comment keeps the base's
    description); a field described nowhere has an empty description."""
    docs: dict[str, FieldDoc] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for name, (trailing, above) in _class_docs(klass).items():
                inherited = docs[name].description if name in docs else ""
                if trailing:
                    docs[name] = FieldDoc(trailing, above)
                elif inherited:  # re-declared without a comment: the lines above can only be a heading
                    docs[name] = FieldDoc(inherited, above)
                else:
                    docs[name] = FieldDoc(above, "")
    return {f.name: docs.get(f.name, FieldDoc("", "")) for f in dataclasses.fields(cls)}


def recipe_file(cls: type) -> Path:
    """The script that defines ``cls`` (a recipe's ``Config``: ``recipes/detr.py``); ``Path("")`` if none."""
    return Path(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")


@functools.cache
def field_ranges(cls: type) -> dict[str, str]:
    """Field name -> its legal range, e.g. ``"[1, inf)"`` (common.config.RunConfig.ranges), from the ``ranges``
    of ``cls`` and of the classes it derives from, a subclass's winning."""
    ranges: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for interval, names in vars(klass).get("ranges", {}).items():
            ranges.update(dict.fromkeys(names.split(), interval))
    return ranges


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


def field_choices(f: dataclasses.Field, hint: Any) -> str:
    """What ``--help`` prints after ``choices:`` for a field with a fixed set of values, else ""."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return ", ".join(show(a) for a in typing.get_args(hint))
    choices = f.metadata.get("choices")
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
    ``--name TYPE (default: X)`` with its description (and ``choices:``) wrapped below it."""
    module = sys.modules.get(cls.__module__)
    script = Path(getattr(module, "__file__", None) or sys.argv[0]).name
    summary = (inspect.getdoc(module) or "").strip().split("\n")[0] if module is not None else ""
    hints = typing.get_type_hints(cls)
    docs, ranges = field_docs(cls), field_ranges(cls)
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
        choices = field_choices(f, hints[f.name])
        if choices:
            lines.append(wrap(f"choices: {choices}"))
        if f.name in ranges:
            lines.append(wrap(f"range: {ranges[f.name]}"))
    return "\n".join(lines)
