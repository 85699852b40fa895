"""What a run prints at its start and at its end: the banner and the summary, each line within 120
columns (pure functions of host values; :class:`common.loop.Loop` prints them on the main process),
and :func:`cli_main`, the recipes' entry point that turns a mistake into one ``error:`` line; a step after the
weights that fails is one such line too (:func:`recorded_failure`), with the command that redoes it."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from common import RunStopped, StepsFailed, UserError
from common.guard import NonFiniteLoss
from common.meters import format_seconds

WIDTH = 120


def _fit(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun``, singular for one: ``counted(1, "class", "classes")`` is ``'1 class'``, ``counted(1200,
    "image")`` ``'1,200 images'`` (``plural`` defaults to ``noun + 's'``)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU computes in bf16 natively (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``: the
    flags of Linux's ``cpuinfo``); None where that cannot be told."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    if not flags:
        return None
    return not flags.isdisjoint({"avx512_bf16", "amx_bf16", "bf16"})


def emulated_bf16_note(mixed_precision: str, device_type: str) -> str:
    """A warning line for under the start banner when a run autocasts to bf16 on a CPU that lacks native bf16
    (:func:`native_bf16`), as a GPU config started on a laptop does: PyTorch then emulates each bf16 operation
    with conversions, many times slower than fp32. '' otherwise."""
    if mixed_precision != "bf16" or device_type != "cpu" or native_bf16() is not False:
        return ""
    return (
        "warning: bf16 on a CPU without native bf16 (avx512_bf16, amx_bf16) is emulated, many times slower: "
        "pass --mixed_precision no"
    )


def _names(classes: Sequence[str], room: int) -> str:
    """``'cat, dog, ... (1000)'`` within ``room`` characters."""
    shown = ""
    for i, name in enumerate(classes):
        candidate = f"{shown}, {name}" if shown else str(name)
        if len(candidate) + 12 > room and i < len(classes) - 1:
            return f"{shown}, ... ({len(classes)})" if shown else f"({len(classes)})"
        shown = candidate
    return shown


def tracker_line(report_to: str, project: str, name: str) -> str:
    """The banner's tracker entry (paths are relative to the run folder, named on the banner's first line)."""
    if report_to == "wandb":
        mode = os.environ.get("WANDB_MODE", "online").lower()
        where = f" ({mode}: wandb/ in the run folder)" if mode in ("offline", "dryrun", "disabled") else ""
        return f"wandb project '{project}', run '{name}'{where}; metrics.jsonl"
    if report_to == "tensorboard":
        return "tensorboard (tensorboard --logdir <run folder>); metrics.jsonl"
    return "metrics.jsonl only (report_to none)"


def banner(
    recipe: str,
    folder: str,
    device: str,
    processes: int,
    precision: str,
    train_images: int,
    eval_images: int | None,
    classes: Sequence[str] | None,
    steps_per_epoch: int,
    epochs: int,
    total_steps: int,
    global_batch: int,
    tracker: str,
    budget: str = "",
) -> str:
    """The run at a glance, before its first step: where it writes, on what it runs, on what data, for
    how long (``budget``: a ``--max_time``), and where to watch it."""
    data = counted(train_images, "training image")
    if eval_images is not None:
        data += ", " + counted(eval_images, "evaluation image")
    if classes:
        data += f", {counted(len(classes), 'class', 'classes')}: "
        data += _names(list(classes), WIDTH - 13 - len(data))
    steps = f"{total_steps:,} optimizer steps: {epochs} epochs x {steps_per_epoch:,}"
    if budget:  # the steps follow from the first ones' time (common/budget.py)
        steps = f"as many optimizer steps as {budget} holds ({steps_per_epoch:,} an epoch), planned after the first"
    elif total_steps < epochs * steps_per_epoch:
        steps = f"{total_steps:,} optimizer steps (max_steps; {epochs} epochs would be {epochs * steps_per_epoch:,})"
    lines = [
        f"{recipe}: {folder}",
        f"  devices   {processes} process{'es' if processes > 1 else ''} on {device}, precision {precision}",
        f"  data      {data}",
        f"  steps     {steps}, global batch {global_batch:,}",
        f"  tracker   {tracker}",
    ]
    return "\n".join([lines[0]] + [_fit(line) for line in lines[1:]])  # the folder's path is never cut


def no_value(key: str, v: Any) -> bool:
    """Whether ``v`` is COCO evaluation's -1 for "no ground truth of this kind in the split" (``map_large`` of a
    set without large objects; the masks' ``mask_map_large`` likewise): the console shows it as ``n/a``; files and
    trackers keep the -1."""
    return v == -1 and key.rsplit("/", 1)[-1].removeprefix("mask_").startswith(("map", "mar"))


def shown_value(key: str, v: Any, digits: str = ".4g") -> str:
    """A logged value as a step line shows it: ``n/a`` for :func:`no_value`, else ``digits`` formatting."""
    return "n/a" if no_value(key, v) else format(v, digits)


def _value(v: Any, key: str = "") -> str:
    if no_value(key, v):
        return "n/a"
    if not isinstance(v, (int, float)):
        return str(v)
    if math.isnan(v):
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


HEADLINE = 8  # the most final metrics the summary shows


def summary(
    seconds: float, final: Mapping[str, Any], best: Mapping[str, tuple[float, int]], weights: Sequence[str]
) -> str:
    """The end of a run: its final evaluation's headline metrics as a table (at most :data:`HEADLINE` values
    named ``<group>/<metric>``; per-class values, ``<group>/<metric>/<class>``, stay in metrics.jsonl and the
    files), the best value of each tracked metric and its step, the weights written, and the session's time."""
    lines = [f"done in {format_seconds(seconds)}"]  # the run folder is the command's last line (Run.finish)
    scalars = {k: v for k, v in final.items() if not k.startswith("best/") and isinstance(v, (int, float))}
    headline = [k for k in scalars if k.count("/") == 1][:HEADLINE]
    shown = {k: scalars[k] for k in headline}
    if shown:
        width = max(len(k) for k in [*shown, "final metrics"])
        lines.append(f"  {'final metrics':<{width}}  value")
        lines += [f"  {k:<{width}}  {_value(v, k)}" for k, v in shown.items()]
    if len(scalars) > len(shown):
        lines.append(f"  ... {len(scalars) - len(shown)} more in metrics.jsonl")
    for metric, (value, step) in best.items():
        lines.append(f"  best {metric} {_value(value, metric)} at step {step}")
    if weights:
        lines.append("  weights   " + ", ".join(weights))
    return "\n".join(_fit(line) for line in lines)


def step_line(epoch: int, step: int, total: int, means: Mapping[str, float], unit: str = "") -> str:
    """A log interval's line: the loss and, when the total has several, its terms (``loss_<name>``, not the
    auxiliary decoder layers' ``loss_<name>_<i>``), the learning rate, the speed and the time left. ``unit``:
    ``img/s`` or ``s/step`` (a run keeps the one of its first line); empty: below one image a second, s/step.
    ``total`` 0: not known yet (a budgeted run still timing its steps), no eta either."""
    terms = [(k[5:], v) for k, v in means.items() if k.startswith("loss_") and not k.rsplit("_", 1)[1].isdigit()]
    shown = f" ({' '.join(f'{k} {v:.3g}' for k, v in terms)})" if len(terms) > 1 else ""
    lr = f"  lr {means['lr']:.3g}" if "lr" in means else ""
    if not unit:
        unit = "img/s" if means.get("images_per_s", 0.0) >= 1 or "s_per_step" not in means else "s/step"
    if unit == "img/s" or "s_per_step" not in means:
        per_s = means.get("images_per_s", 0.0)
        speed = f"{per_s:.0f} img/s" if per_s >= 10 else f"{per_s:.2g} img/s"
    else:
        speed = f"{means['s_per_step']:.1f} s/step"
    eta = f"  eta {format_seconds(means['eta_s'])}" if "eta_s" in means else ""
    steps = f"{step}/{total}" if total else f"{step}"
    return f"epoch {epoch} step {steps}  loss {means.get('loss', math.nan):.4g}{shown}{lr}  {speed}{eta}"


def launch_command(recipe: str, launcher: str = "") -> str:
    """The command that starts the recipe's script as this process was started, for the commands a run prints
    (continue, redo): ``accelerate launch <script>`` under ``accelerate launch`` (it exports
    ``ACCELERATE_MIXED_PRECISION`` to the training processes on every path, DeepSpeed's too, and
    ``ACCELERATE_DYNAMO_BACKEND`` on the others; multi-GPU runs go through torchrun, so this is asked first),
    ``torchrun --nproc_per_node N <script>`` under torchrun (``TORCHELASTIC_RUN_ID``; ``--nnodes`` where there are
    several machines, whose rendezvous flags only the user knows), else ``python <script>``. ``launcher`` given
    (``accelerate launch``): that one, for a command another process will run, whose launcher this one cannot know.
    ``<script>``: the recipe file as this process was started (relative to the working directory where it lies under
    it), else ``recipes/<recipe>.py``."""
    script = Path(sys.argv[0]) if Path(sys.argv[0]).stem == recipe else Path(f"recipes/{recipe}.py")
    if script.is_absolute() and script.is_relative_to(Path.cwd()):
        script = script.relative_to(Path.cwd())
    if not launcher:
        env = os.environ
        if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_DYNAMO_BACKEND" in env:
            launcher = "accelerate launch"
        elif "TORCHELASTIC_RUN_ID" in env:
            local = int(env.get("LOCAL_WORLD_SIZE", "1"))
            nodes = int(env.get("WORLD_SIZE", str(local))) // max(local, 1)
            launcher = "torchrun" + (f" --nnodes {nodes}" if nodes > 1 else "") + f" --nproc_per_node {local}"
        else:
            launcher = "python"
    return f"{launcher} {script}"


@contextlib.contextmanager
def recorded_failure(failed: list[str], what: str, redo: str) -> Iterator[None]:
    """Around one step after the weights are saved (the model folder, the export, a hub push): an exception
    there is appended to ``failed`` as one line naming ``what``, the error's first line and ``redo`` (the command
    that redoes the step), and the run goes on. A :class:`UserError` is its message alone. A stop signal
    (:class:`RunStopped`, ``KeyboardInterrupt``) still ends the run at once."""
    try:
        yield
    except RunStopped:
        raise
    except Exception as e:
        cause = (str(e).strip().splitlines() or [""])[0]  # compilers' and exporters' messages run to pages
        cause = cause if isinstance(e, UserError) else f"{type(e).__name__}: {cause}" if cause else type(e).__name__
        failed.append(f"{what} failed ({_fit(cause, 2 * WIDTH)}); redo it with: {redo}")


def _close_bars() -> None:
    from tqdm.auto import tqdm

    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()  # end the progress bar's line so the message stands on a line of its own


def _fail(message: str, code: int) -> None:
    _close_bars()
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextlib.contextmanager
def own_files(prefix: str) -> Iterator[None]:
    """Around a recipe's imports of the files beside it that carry its name (``prefix`` ``detr_``:
    ``detr_model.py`` beside ``detr.py``): a copy made without them stops with one line naming the first
    one missing, exit status 2; any other missing module is left to raise."""
    try:
        yield
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(prefix):
            raise
        print(f"error: this recipe needs {e.name}.py beside it: copy recipes/{prefix}*.py with it", file=sys.stderr)
        raise SystemExit(2) from None


def cli_main(main: Callable[[], Any]) -> None:
    """Run a recipe's ``main``; bad input and a diverged loss become one ``error:`` line and exit 2 / 1; steps
    that failed after the weights were saved (their lines already told) exit 1; a stop signal honoured outside
    the steps its lines (what stopped, what was done, how to go on) and exit 0; a second Ctrl-C one line and exit 130.
    The packages a run uses are checked once its config is read (:func:`common.weights.config_with_weights`)."""
    try:
        main()
    except StepsFailed:
        raise SystemExit(1) from None
    except UserError as e:
        message = str(e)
        if "Original Traceback" in message:  # re-raised from a DataLoader worker: keep the cause
            message = message.strip().splitlines()[-1].split(": ", 1)[-1]
        _fail(message, 2)
    except NonFiniteLoss as e:
        _fail(str(e), 1)
    except RunStopped as e:  # a stop signal outside the steps: what is written stays
        _close_bars()
        if str(e):
            print(e, flush=True)
        raise SystemExit(0) from None
    except KeyboardInterrupt:  # a second Ctrl-C: out at once, without a traceback
        _fail("interrupted by a second Ctrl-C; the run's checkpoints are kept (--resume auto continues)", 130)
