"""A run's folder: which one a run writes to, whether a resumed run's config may continue the saved
one, its complete checkpoints (:class:`TrainState`, written whole or not at all), and the logged metrics a
resumed run takes back.

The folder and the resume check are decided before anything is written, so a refusal leaves every
existing folder as it was.

- The default folder is ``runs/<recipe>/<config name>`` (``default`` without ``--config``); for
  ``--eval_only`` and ``--predict`` it is ``eval-<name>`` and ``predict-<name>``, named after the run
  folder of the weights. When it holds output (a ``config.yaml``, ``metrics.jsonl`` or
  ``checkpoints/``: every command writes its config first), a fresh run moves on to ``-2``, ``-3``, ...
- ``--resume auto`` without a folder continues the newest interrupted run of that name (a complete
  checkpoint that is not the end of training); when there is none it starts a new run, and says so.
- An explicit ``output_dir`` that holds output is refused unless resuming.
- A run's own ``config.yaml`` given back with ``--config`` (and no other ``--output_dir``) starts a new
  run in the next free sibling of the folder the file is in; with ``--resume`` it continues that run.
- ``--resume`` with a config whose model, data or training fields differ from the saved
  ``config.yaml`` is refused with one line naming them; only the fields in :data:`MAY_CHANGE_ON_RESUME`
  may differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import yaml

from common import UserError
from common.config import RunConfig, to_dict
from common.console import launch_command


@dataclasses.dataclass
class TrainState:
    """Where the training loop (:class:`common.loop.Loop`) is, written into each checkpoint as
    ``train_state.json`` (:func:`write_checkpoint`) and read back by :meth:`common.run.Run.resume`. ``step``
    counts optimizer steps; ``batches_in_epoch`` the (micro-)batches of ``epoch`` already consumed,
    which a resumed run skips; ``extra`` JSON values that must survive a restart (``best/<metric>``,
    recipe values such as DINO's step-0 baselines); ``finished`` marks the checkpoint at the end of training."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished: bool = False  # the end of training: ``--resume auto`` alone looks for runs without it


#: The file in each checkpoint folder, beside ``train_state.json``, that makes the checkpoint weights: the metadata
#: of the weights files the run saves (common.weights.weights_metadata: recipe, config, classes, category ids,
#: normalisation, as JSON strings) and, where the recipe's weights are a part of the trained model, ``part``: the
#: prefix of its tensors (DINO's ``backbone.``). ``--weights <checkpoint>`` reads it (common/weights.py).
CHECKPOINT_METADATA = "weights_metadata.json"


#: Fields a resumed run may change: where and how it reports, how long it runs, how it loads data.
#: Any other field shapes the model, the data or the optimisation the checkpoint was trained with.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "config",
        "output_dir",
        "resume",
        "epochs",
        "max_steps",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "num_workers",
        "report_to",
        "project",
        "run_name",
        "log_weights",
        "export",
        "push_to_hub",
        "plot_images",
        "eval_batch_size",
        "mixed_precision",
        "compile",
        "tf32",
    }
)


def has_run(folder: Path) -> bool:
    """Whether ``folder`` holds a command's output: every command writes its ``config.yaml`` first."""
    return any((folder / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


def _next_free(base: Path, numbered: bool = False) -> Path:
    """``base`` itself when it holds no run, else the first free ``<name>-2``, ``<name>-3``, ...; with
    ``numbered``, ``base`` is itself one of such a series (``default-2``), whose name is ``default``."""
    name = re.sub(r"-\d+$", "", base.name) if numbered and has_run(base) else base.name
    out, k = base, 1
    while has_run(out):
        k += 1
        out = base.with_name(f"{name}-{k}")
    return out


def saved_run_folder(cfg: RunConfig) -> Path | None:
    """The run folder whose own config.yaml ``--config`` named, with the output_dir it holds (not one
    given on the command line); None otherwise. The file's folder counts, so a moved run still works."""
    config = Path(cfg.config)
    if config.name != "config.yaml" or not has_run(config.parent):
        return None
    saved = (yaml.safe_load(config.read_text()) or {}).get("output_dir")
    return config.parent if saved == cfg.output_dir else None


def default_name(cfg: RunConfig) -> str:
    """The folder name of a run given no ``output_dir``: the config file's name (``default`` without one);
    for ``--eval_only`` / ``--predict`` / ``--export --weights``, ``eval-`` / ``predict-`` / ``export-`` and
    the weights' source (:func:`weights_source`)."""
    mode = "eval" if cfg.eval_only else "predict" if cfg.predict else "export" if cfg.weights else ""
    if mode:  # weights without either mode are the export's
        return f"{mode}-{weights_source(cfg.weights)}"
    return Path(cfg.config or "default").stem


def weights_source(weights: str) -> str:
    """What a weights path is called in the names of the folders made from it: the run it belongs to (a file
    in a run folder, or in its ``model/`` or ``export/``), else the file's own name without its suffix (a
    folder's name); an ONNX file adds ``-onnx``, so its predictions stand apart from its weights'
    (``predict-default-onnx``; from a loose file's export, ``predict-mine-onnx`` rather than
    ``predict-export-mine-onnx``); a checkpoint folder, its run's name and its own (``default-step_00000087``)."""
    path = Path(weights)
    if path.parent.name == "checkpoints" and has_run(path.parent.parent):
        return f"{path.parent.parent.name}-{path.name}"
    folder = path.parent if path.suffix else path
    if folder.name in ("model", "export") and has_run(folder.parent):
        folder = folder.parent
    name = folder.name if has_run(folder) or not path.suffix else path.stem
    if path.suffix == ".onnx":
        name = re.sub(r"^export-", "", name) + "-onnx"
    return name or "weights"


def choose_output_dir(cfg: RunConfig, recipe: str) -> tuple[Path, str]:
    """The run folder for ``cfg`` (see the module docstring) and a line saying how ``--resume auto``
    chose it ('' otherwise); reads, never writes."""
    saved = saved_run_folder(cfg)
    if saved is not None:
        return (saved if cfg.resume else _next_free(saved, numbered=True)), ""
    if cfg.output_dir:
        out = Path(cfg.output_dir)
        if has_run(out) and not cfg.resume:
            raise UserError(
                f"run folder '{out}' already holds a run; pass --resume auto to continue it "
                "or choose another --output_dir"
            )
        return out, ""
    base = Path("runs") / recipe / default_name(cfg)
    if cfg.resume != "auto":
        return _next_free(base), ""
    folders = [base] + sorted(base.parent.glob(f"{base.name}-*"), key=lambda p: p.name)
    folders = [p for p in folders if re.fullmatch(re.escape(base.name) + r"(-\d+)?", p.name)]
    interrupted = {p: last for p in folders if (last := _interrupted_at(p)) is not None}
    if not interrupted:
        out = _next_free(base)
        return out, f"resume auto: no interrupted run named {base.name} in {base.parent}; a new run in {out}"
    newest = max(interrupted, key=lambda p: interrupted[p].stat().st_mtime)
    others = [p.name for p in interrupted if p != newest]
    also = f" (also interrupted: {', '.join(others)}; name one with --config <folder>/config.yaml)" if others else ""
    return newest, f"resume auto: continuing {newest}, the newest interrupted run named {base.name}{also}"


def _interrupted_at(folder: Path) -> Path | None:
    """The newest complete checkpoint of ``folder`` when the run there stopped before the end of its
    training (that checkpoint is not marked ``finished``), else None."""
    found = complete_checkpoints(folder / "checkpoints")
    if not found or json.loads((found[-1] / "train_state.json").read_text()).get("finished", False):
        return None
    return found[-1]


def changed_on_resume(cfg: RunConfig, folder: Path) -> dict[str, tuple[Any, Any]]:
    """Fields of ``cfg`` that differ from the folder's saved config.yaml: name -> (saved, given).
    Empty when there is no saved config (a run stopped before it wrote one)."""
    saved_file = folder / "config.yaml"
    if not saved_file.is_file():
        return {}
    saved = yaml.safe_load(saved_file.read_text()) or {}
    given = to_dict(cfg)
    return {k: (saved.get(k), v) for k, v in given.items() if k in saved and saved[k] != v}


def check_resume(cfg: RunConfig, folder: Path) -> dict[str, tuple[Any, Any]]:
    """Refuse a resume whose config changes more than :data:`MAY_CHANGE_ON_RESUME` allows; return the
    allowed changes (to be reported)."""
    changed = changed_on_resume(cfg, folder)
    refused = {k: v for k, v in changed.items() if k not in MAY_CHANGE_ON_RESUME}
    if refused:
        listed = ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, (a, b) in refused.items())
        raise UserError(
            f"--resume: the run in '{folder}' was trained with other values of {listed}; "
            f"continue it with --config {folder / 'config.yaml'} --resume auto, or start a new run"
        )
    return {k: v for k, v in changed.items() if k not in ("config", "output_dir", "resume")}


def flag_value(value: Any) -> str:
    """``value`` as the command line writes it after ``--field`` (YAML flow style, shell-quoted where needed):
    ``20``, ``true``, ``'[640, 800]'``."""
    if value == "":
        return "''"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()
    return shlex.quote(text)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def drop_metrics_after(metrics: Path, step: int) -> None:
    """Drop the lines of ``metrics.jsonl`` logged after ``step`` (a resumed checkpoint's): they will be
    logged again. Rewritten to a temporary file and renamed, never half a file; no file, nothing to do."""
    if not metrics.exists():
        return
    kept = [ln for ln in metrics.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step]
    tmp = metrics.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, metrics)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint folder (one with its ``train_state.json``)."""
    return path.is_dir() and (path / "train_state.json").is_file()


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder`` (a run's ``checkpoints/``), oldest first."""
    found = [p for p in folder.glob("step_*") if is_checkpoint(p)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def write_checkpoint(
    accelerator: Any, folder: Path, state: TrainState, keep: int, weights_metadata: dict[str, str] | None = None
) -> Path:
    """Write Accelerate's state and ``state`` into ``folder/step_XXXXXXXX`` (every process calls it) through a
    temporary folder renamed into place, then drop all but the newest ``keep`` (at least 1): a kill at any
    moment leaves either the old set of checkpoints or the new one, never a half-written folder that
    ``--resume auto`` would pick. ``weights_metadata`` (what the recipe's weights files carry) goes into
    :data:`CHECKPOINT_METADATA`, which makes the checkpoint weights too. Returns the checkpoint's folder."""
    final = folder / f"step_{state.step:08d}"
    tmp = folder / f".tmp-step_{state.step:08d}"
    if accelerator.is_main_process:
        folder.mkdir(exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if weights_metadata is not None:
            (tmp / CHECKPOINT_METADATA).write_text(json.dumps(weights_metadata, indent=1) + "\n")
        state_file = tmp / "train_state.json"
        state_file.write_text(json.dumps(dataclasses.asdict(state)))
        with open(state_file) as f:
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(folder)[: -max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def record_resume(
    run_dir: Path, checkpoint: Path, step: int, changed: dict[str, tuple[Any, Any]], common: str = ""
) -> None:
    """A resume from ``checkpoint`` at ``step`` (main process): drop the metrics logged after it, which will be
    logged again, and add one line to ``resumes.jsonl`` with the checkpoint, what the resume changed and ``common``
    (:func:`common.origin.common_origin`: the code the run continues with, which config.yaml's header gave at its
    start)."""
    drop_metrics_after(run_dir / "metrics.jsonl", step)
    record = {"step": step, "checkpoint": checkpoint.name, "changed": {k: [a, b] for k, (a, b) in changed.items()}}
    record |= {"common": common} if common else {}
    with open(run_dir / "resumes.jsonl", "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# A checkpoint as weights (--weights <run>/checkpoints/step_X; common.weights reads it)
# --------------------------------------------------------------------------------------------
def is_checkpoint_folder(path: str | Path) -> bool:
    """Whether ``path`` is a run's checkpoint folder (Accelerate's state: its ``train_state.json``, or the random
    states of a save that was cut short), which ``--weights`` takes as the trained model's weights."""
    path = Path(path)
    return path.is_dir() and ((path / "train_state.json").is_file() or any(path.glob("random_states_*.pkl")))


def finish_command(run: Path, recipe: str) -> str:
    """The command that finishes the run in the folder ``run`` (its weights files), as far as it is known. Another
    process started that run, perhaps on several devices (an FSDP run's sharded checkpoint): ``accelerate launch``,
    which takes the user's own launch config, rather than this process's launcher."""
    flags = f"--config {run / 'config.yaml'} --resume auto"
    return f"{launch_command(recipe, 'accelerate launch')} {flags}" if recipe else f"the recipe with {flags}"


def checkpoint_model(folder: Path, recipe: str = "") -> Path:
    """The trained model's file in the checkpoint ``folder`` (Accelerate writes ``model.safetensors``); a save cut
    short, an FSDP run's sharded state or a pickled model is one :class:`UserError` naming the command that
    writes the run's weights files (``recipe``: the script that saved it, where known)."""
    finish = finish_command(folder.parent.parent, recipe)
    if not is_checkpoint(folder):
        raise UserError(
            f"weights '{folder}' are not a complete checkpoint (no train_state.json: its save was cut short)"
        )
    model = folder / "model.safetensors"
    if model.is_file():
        return model
    sharded = sorted(p.name for p in folder.glob("pytorch_model_fsdp*"))
    if sharded:  # torch.distributed.checkpoint's files (its .metadata is a pickle) or a pickled full state
        raise UserError(
            f"weights '{folder}' are an FSDP run's checkpoint ({sharded[0]}: the model as the processes held it, "
            f"not one safetensors file); its weights files come from finishing the run, launched as it was: {finish}"
        )
    raise UserError(
        f"weights '{folder}': the checkpoint holds no model.safetensors (a pickled model is never loaded); "
        f"its weights files come from finishing the run: {finish}"
    )


def checkpoint_metadata(folder: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The metadata strings (``common.weights.weights_metadata``) of the checkpoint ``folder`` and what
    ``common.weights.read_metadata`` adds as ``checkpoint``; checks the model file is there
    (:func:`checkpoint_model`)."""
    file = folder / CHECKPOINT_METADATA
    if file.is_file():
        try:
            meta = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"weights '{folder}': {file.name} could not be read: {type(e).__name__}: {e}") from None
    else:  # a checkpoint written before checkpoints carried it: the run's own config alone
        config = folder.parent.parent / "config.yaml"
        meta = {"config": json.dumps((yaml.safe_load(config.read_text()) if config.is_file() else None) or {})}
    checkpoint_model(folder, meta.get("recipe", ""))
    state = json.loads((folder / "train_state.json").read_text())
    part = meta.pop("part", "")
    info = {"step": state.get("step", 0), "run": str(folder.parent.parent), "part": part, "complete": file.is_file()}
    return meta, info


def checkpoint_tensors(folder: Path, part: str = "", keys_only: bool = False) -> dict[str, Any]:
    """The trained model's tensors in the checkpoint ``folder``, named as the recipe's own weights files name them:
    without torch.compile's ``_orig_mod.`` and DDP's ``module.`` (as ``common.weights.save_weights``), and of
    ``part`` (a prefix, such as DINO's ``backbone.``) alone, without it. ``keys_only``: the names alone, each
    mapped to its name in the file (nothing read)."""
    import safetensors

    with safetensors.safe_open(str(checkpoint_model(folder)), "pt") as f:
        keys = {k.replace("_orig_mod.", ""): k for k in f.keys()}
        if keys and all(k.startswith("module.") for k in keys):  # DDP's wrapper, when not unwrapped
            keys = {k.removeprefix("module."): v for k, v in keys.items()}
        keys = {k.removeprefix(part): v for k, v in keys.items() if k.startswith(part)}
        return dict(keys) if keys_only else {k: f.get_tensor(v) for k, v in keys.items()}
