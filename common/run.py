"""Run plumbing: Accelerator, run folder, trackers, checkpoints and resume, signals, non-finite guard.

A recipe makes one :class:`Run` from its config first thing in ``main()``: it chooses the run folder
(:mod:`common.run_folder`: refusing a resume whose config changed), builds the ``Accelerator``
(mixed precision, gradient accumulation, trackers, the inductor backend with ``compile``) and seeds
every generator with ``cfg.seed``. Nothing is written before :meth:`Run.begin`, which
:class:`common.loop.Loop` (or the first :meth:`Run.log`) calls once data and model are built: a
mistake found while loading the data or building the model leaves no run folder behind. The recipe uses
``run.accelerator``, ``run.log(values, step)``, ``run.log_plots``, ``run.guard.observe(step,
losses)``; the loop uses ``run.resume()``, ``run.save_checkpoint(state)`` and ``run.should_stop()``.

Run folder (``runs/<recipe>/<name>/``): ``config.yaml``, ``metrics.jsonl`` (every logged value,
always), ``checkpoints/step_XXXXXXXX/`` (Accelerate state + ``train_state.json``, last K kept),
safetensors weights written by the recipe, ``plots/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    ProjectConfiguration,
    broadcast_object_list,
    parse_flag_from_env,
    set_seed,
)
from PIL import Image

from common import RunStopped, StepsFailed, UserError
from common.config import RunConfig, save_config, to_dict
from common.console import emulated_bf16_note, launch_command, recorded_failure, shown_value
from common.guard import NonFiniteGuard
from common.heartbeat import heartbeat, progress
from common.loaders import STOP_SIGNALS, auto_workers
from common.run_folder import (
    TrainState,
    check_resume,
    choose_output_dir,
    complete_checkpoints,
    flag_value,
    is_checkpoint,
    record_resume,
    write_checkpoint,
)
from common.trackers import check_hub_push, init_trackers, log_images, log_weights, push_folder
from common.weights import weights_line


class Run:
    """Everything around the training loop that is the same for every recipe (the module docstring)."""

    def __init__(self, cfg: RunConfig, recipe: str) -> None:
        self.cfg = cfg
        self.recipe = recipe  # the recipe file's name: runs/<recipe>/, the tracker project, the progress bar
        self.started = time.perf_counter()
        self._eval_from: float | None = None  # an evaluation's start (:meth:`evaluation_started`)
        self._plots_from: float | None = None  # its metrics' record: what follows until log_plots() is plots
        self._metrics: Any = None  # common.curves.MetricsReader of metrics.jsonl, made at the first curves
        # report_to and mixed_precision were checked against their choices when the config was parsed
        mixed = cfg.mixed_precision or None  # empty: whatever `accelerate launch` set

        # Every process looks at the folder before any creates it (so a refusal stops all alike),
        # then all take the main process's choice. PartialState sets up the process group; the
        # Accelerator made below shares it.
        procs = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as the Accelerator would
        check_hub_push(cfg.push_to_hub)
        choice = [*map(str, choose_output_dir(cfg, recipe))]  # the folder, and how --resume auto chose it
        if procs.num_processes > 1:
            procs.wait_for_everyone()
            broadcast_object_list(choice)
        self.dir = Path(choice[0])
        # lines for under the start banner (common.loop.Loop prints them): how --resume auto chose the
        # folder, and what a recipe adds about its settings
        self.notes: list[str] = [choice[1]] if choice[1] else []
        self.files: dict[str, str] = {}  # name -> text: written into the run folder when it is made
        self.checkpoint_dir = self.dir / "checkpoints"
        self.plots_dir = self.dir / "plots"
        cfg.output_dir = str(self.dir)
        if cfg.num_workers < 0:  # -1: what this machine has per process (common.loaders.auto_workers)
            cfg.num_workers = auto_workers(cfg.num_workers)
            self.note(
                f"  workers   {cfg.num_workers} loader workers per process (num_workers -1: the cores, at most 8)"
            )
        self.resume_changes: dict[str, tuple[Any, Any]] = {}
        if cfg.resume:  # the checkpoint's own run folder holds the config it was trained with
            origin = self.dir if cfg.resume == "auto" else Path(cfg.resume).resolve().parent.parent
            self.resume_changes = check_resume(cfg, origin)

        self.accelerator = Accelerator(
            mixed_precision=mixed,
            gradient_accumulation_steps=cfg.grad_accum_steps,
            log_with=None if cfg.report_to == "none" else cfg.report_to,
            project_config=ProjectConfiguration(project_dir=str(self.dir), logging_dir=str(self.dir)),
            dynamo_backend="inductor" if cfg.compile else "no",
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(non_blocking=True),
        )
        set_seed(cfg.seed)  # the same on every process: model initialisation agrees before prepare()
        self.note(emulated_bf16_note(self.accelerator.mixed_precision, self.accelerator.device.type))
        # CUDA: TF32 tensor-core matmuls and convolutions, and cuDNN's autotuned convolution algorithms
        # (fixed input sizes); cfg.tf32 false: full fp32 precision and a fixed algorithm choice. The
        # flags change nothing on a CPU.
        fast = cfg.tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = fast
        torch.backends.cudnn.benchmark = fast
        self.begun = False
        self.guard = NonFiniteGuard(self.accelerator.device)
        self.last_checkpoint = ""
        # set by the recipe before its loop: its weights files' metadata, in every checkpoint (--weights takes those)
        self.weights_metadata: dict[str, str] | None = None
        self.failed: list[str] = []  # steps after the weights that failed, one line each (guarded)
        self._stop_signal: int | None = None
        self._loop_done = False  # after the training loop a stop signal ends the run at once (RunStopped)
        self._stop_group = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        if self.accelerator.num_processes > 1 and dist.is_initialized():
            # Stop requests are agreed on over gloo (CPU) so that checking every step never
            # waits on the GPU stream.
            self._stop_group = dist.new_group(
                backend="gloo"
            )  # its own group: never interleaves with training collectives
        # SIGTERM, SIGINT and SIGUSR1 (Slurm's pre-emption warning), to this process or its whole group. Loader
        # workers ignore them (common.loaders.leave_stop_signals); until they have set that, forked ones inherit
        # this handler, and only the process that installed it acts on a signal.
        self._pid = os.getpid()
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def begin(self) -> None:
        """Create the run folder, write ``config.yaml`` and start the tracker (once; every process)."""
        if self.begun:
            return
        self.begun = True
        acc, cfg = self.accelerator, self.cfg
        if acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)  # checkpoints/ and plots/ appear with their first file
            # ``resume`` is an action, not a setting: `--config <run>/config.yaml` alone starts a new run. A
            # resumed run keeps the config it was started with; what the resume changed goes to resumes.jsonl.
            if self.resume_checkpoint() is None or not (self.dir / "config.yaml").is_file():
                save_config(dataclasses.replace(cfg, resume=""), self.dir / "config.yaml")
            for name, text in self.files.items():
                (self.dir / name).write_text(text)
        acc.wait_for_everyone()
        if cfg.report_to != "none":
            init_trackers(acc, cfg, self.recipe, self.dir, to_dict(cfg), self.print)
        if cfg.weights:  # --eval_only, --predict, --export: the file the model comes from
            self.print(weights_line(cfg.weights))
        if self.resume_changes:
            self.print(
                "resume with changed " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.resume_changes.items())
            )

    # -- output -----------------------------------------------------------------------------
    def note(self, *lines: str) -> None:
        """Lines for under the start banner (:class:`common.loop.Loop` prints them, in order): what a recipe
        or a data helper says about this run's settings; empty lines (a helper with nothing to say) are left out."""
        self.notes += [line for line in lines if line]

    def print(self, *args: Any) -> None:
        """Print on the main process only, without breaking a progress bar."""
        if self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(" ".join(str(a) for a in args), file=sys.stdout)

    def progress(self, iterable: Iterable[Any], desc: str, images: int | None = None) -> Iterable[Any]:
        """``iterable`` (a pass's batches) with a progress bar, or a line a minute where none shows
        (:func:`common.heartbeat.progress`; ``images``: how many the pass holds)."""
        return progress(iterable, desc, self.accelerator.is_main_process, self.print, images)

    def heartbeat(self, what: str) -> AbstractContextManager[None]:
        """Around one long call (the export and its checks): a line a minute where no progress bar shows."""
        return heartbeat(what, self.accelerator.is_main_process, self.print)

    def evaluation_started(self) -> None:
        """Start an evaluation's clock (:meth:`common.loop.Loop.eval_due` does, and a recipe before its
        step-0 evaluation): the next record without ``train/`` values (the evaluation's metrics) gets its
        seconds as ``time/eval_s``, and what follows until :meth:`log_plots` ends is ``time/plots_s``."""
        self._eval_from = time.perf_counter()

    def log(self, values: dict[str, float], step: int, echo: bool = True) -> None:
        """Send host floats to the trackers and ``metrics.jsonl`` (main process), and print a line."""
        if self._eval_from is not None and not any(k.startswith(("train/", "time/")) for k in values):
            self._plots_from = time.perf_counter()
            values = {**values, "time/eval_s": self._plots_from - self._eval_from}
            self._eval_from = None
        self.begin()
        acc = self.accelerator
        if not acc.is_main_process:
            return
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in values.items()}}
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.cfg.report_to != "none":
            acc.log(values, step=step)
        if echo:  # wrapped at 120 columns, continuation lines indented
            line = f"step {step}: " + "  ".join(
                f"{k} {shown_value(k, v)}" for k, v in values.items() if isinstance(v, float)
            )
            self.print(textwrap.fill(line, 120, subsequent_indent="    ", break_long_words=False))

    def log_plots(self, step: int, **pictures: Image.Image | None) -> None:
        """After an evaluation (every process calls it): redraw ``plots/curves.png`` from metrics.jsonl (not
        for ``--eval_only``) and send it and ``pictures`` (saved under ``plots/`` by the recipe on the main
        process; None elsewhere) to the tracker as images keyed ``plots/<name>``. Logs ``time/plots_s``: from the
        evaluation's metrics record (:meth:`evaluation_started`), so the recipe's own pictures count, to here."""
        started, self._plots_from = self._plots_from or time.perf_counter(), None
        if not self.accelerator.is_main_process:
            return
        from common.curves import MetricsReader, plot_curves

        if not self.cfg.eval_only:
            if self._metrics is None:  # kept: each epoch's curves parse only the lines added since the last
                self._metrics = MetricsReader(self.dir / "metrics.jsonl")
            pictures["curves"] = plot_curves(self._metrics, self.plots_dir / "curves.png")
        shown = {f"plots/{k}": v for k, v in pictures.items() if v is not None}
        log_images(self.accelerator, self.cfg.report_to, shown, step)
        if not self.cfg.eval_only:  # a training run's time outside its steps; --eval_only logs its metrics alone
            self.log({"time/plots_s": time.perf_counter() - started}, step, echo=False)

    def wandb_run(self) -> Any:
        """The W&B run on the main process with ``report_to wandb`` (for media only W&B takes, such as
        box overlays), else None."""
        if self.cfg.report_to != "wandb" or not self.accelerator.is_main_process:
            return None
        return self.accelerator.get_tracker("wandb", unwrap=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, state: TrainState) -> None:
        """Write Accelerate state and ``state`` as the newest checkpoint, whole or not at all
        (:func:`common.run_folder.write_checkpoint`). Refuses to save (raising :class:`NonFiniteLoss`) once a
        loss went non-finite, so the last good one stays newest; logs ``time/checkpoint_s``."""
        self.begin()
        tick = time.perf_counter()
        self.guard.check(self.accelerator, self.last_checkpoint)
        final = write_checkpoint(
            self.accelerator, self.checkpoint_dir, state, self.cfg.keep_checkpoints, self.weights_metadata
        )
        self.last_checkpoint = str(final)
        self.log({"time/checkpoint_s": time.perf_counter() - tick}, state.step, echo=False)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint ``cfg.resume`` names (``auto``: the newest complete one), or None when the
        run starts afresh; lets a recipe skip work the checkpoint already holds before :meth:`resume`."""
        if not self.cfg.resume:
            return None
        if self.cfg.resume == "auto":
            found = self.checkpoints()
            return found[-1] if found else None
        path = Path(self.cfg.resume)
        if not is_checkpoint(path):
            raise UserError(f"--resume '{path}' is not a complete checkpoint folder (no train_state.json)")
        return path

    def resume(self) -> TrainState:
        """Load the checkpoint :meth:`resume_checkpoint` names.

        Model, optimizer, scaler, RNG states and every object registered with
        ``accelerator.register_for_checkpointing`` come back; the returned state says where to
        continue. ``metrics.jsonl`` lines past the checkpoint are dropped, as they will be logged
        again. Returns a fresh state when there is nothing to resume.
        """
        path = self.resume_checkpoint()
        if path is None:
            if self.cfg.resume == "auto":
                self.print("resume auto: no checkpoint yet, starting from scratch")
            return TrainState()
        self.accelerator.load_state(str(path))
        state = TrainState(**json.loads((path / "train_state.json").read_text()))
        self.last_checkpoint = str(path)
        if self.accelerator.is_main_process:
            record_resume(self.dir, path, state.step, self.resume_changes)
        self.accelerator.wait_for_everyone()
        self.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batches_in_epoch})")
        return state

    # -- signals -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a DataLoader worker: the training process stops it
            return
        if self._stop_signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            return  # already stopping (Slurm's SIGTERM at the time limit after its SIGUSR1 warning): said once
        self._stop_signal = signum
        if self._loop_done:
            self._raise_stopped()
        self.print(f"{signal.Signals(signum).name} received: finishing the step, saving a checkpoint, then exiting")

    def loop_done(self) -> None:
        """The training loop ended and its last checkpoint is written: from here on (the recipe's final
        weights, the export) a stop signal ends the run at once with :class:`RunStopped`, as does one
        that arrived during the last epoch's evaluation."""
        self._loop_done = True
        if self._stop_signal is not None:
            self._raise_stopped()

    def _raise_stopped(self) -> None:
        for sig, handler in self._handlers.items():  # the run ends here: the signals go back
            signal.signal(sig, handler)
        name = signal.Signals(self._stop_signal).name
        raise RunStopped(
            f"stopped by {name} after the training loop, before the run's last files were written; everything "
            f"written so far is kept (last checkpoint: {self.last_checkpoint or 'none'})\n"
            f"finish it with: {self.continue_command()}"
        )

    def should_stop(self) -> bool:
        """True on every process once any process got a stop signal (SIGTERM, SIGINT, SIGUSR1); call once per step.

        With several processes the flags are combined by an asynchronous all-reduce over gloo
        (CPU): each call collects the reduction started by the previous call and starts the next,
        so the loop never waits on it and every process sees the same answer at the same step
        (one step after the signal).
        """
        if self._stop_group is None:
            return self._stop_signal is not None
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = bool(flag.item())  # a CPU tensor: no device synchronisation
        flag = torch.tensor([0 if self._stop_signal is None else 1])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_group, async_op=True), flag)
        return stop

    def stopped(self, step: int) -> None:
        """End a run stopped by a signal at ``step``: say how to continue, then :meth:`finish`."""
        reason = signal.Signals(self._stop_signal).name if self._stop_signal is not None else "a stop request"
        self.print(f"stopped by {reason} at step {step}; checkpoint {self.last_checkpoint}")
        self.print(f"continue with: {self.continue_command()}")
        self.finish()

    def continue_command(self) -> str:
        """The command that continues this run where its newest checkpoint left off: its own saved config
        (every flag it was started with), the flags a resume changed, and ``--resume auto``. After the end of
        training it redoes what follows the final checkpoint (final weights, model folder, export, hub push)."""
        changed = "".join(f" --{k} {flag_value(new)}" for k, (_, new) in self.resume_changes.items())
        return f"{launch_command(self.recipe)} --config {self.dir / 'config.yaml'}{changed} --resume auto"

    def export_command(self, weights: Path) -> str:
        """The command that exports ``weights`` (a file this recipe saved) as the run's ``--export`` does."""
        return f"{launch_command(self.recipe)} --export --weights {weights}"

    def guarded(self, what: str, redo: str = "") -> AbstractContextManager[None]:
        """Around a step after the weights are saved: a failure is one line (``what``, its error, ``redo``, by
        default :meth:`continue_command`) that :meth:`finish` tells; the run goes on (``recorded_failure``)."""
        return recorded_failure(self.failed, what, redo or self.continue_command())

    def finish(self, weights: Sequence[Path] = ()) -> None:
        """End the run: with ``cfg.log_weights``, ``weights`` (files in the run folder) and the model folder
        and ONNX file where the run wrote them become W&B artifacts; with ``cfg.push_to_hub``, the model
        folder goes to the hub; the tracker is closed and the signal handlers handed back. Steps that failed
        (:meth:`guarded`, these two included) are told last, one ``error:`` line each, and end the run with
        :class:`StepsFailed` (exit status 1)."""
        model_out = [p for p in (self.dir / "model", self.dir / "export" / "model.onnx") if p.exists()]
        if self.cfg.log_weights and weights:
            paths = [Path(w) for w in weights if Path(w).exists()] + model_out
            with self.guarded("W&B artifacts"):
                log_weights(self.accelerator, self.cfg.report_to, paths, f"{self.recipe}-{self.dir.name}")
        if self.cfg.push_to_hub and self.accelerator.is_main_process:
            folder, repo = self.dir / "model", self.cfg.push_to_hub
            with self.guarded("push_to_hub", f"hf upload {repo} {folder} ."):
                self.print(push_folder(folder, repo))
        if self._pending is not None:  # collect the last stop-flag reduction before shutting down
            self._pending[0].wait()
            self._pending = None
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        for line in self.failed:  # after the summary, beside the run folder's line
            print(f"error: {line}", file=sys.stderr, flush=True)
        if self._stop_signal is None:  # a stopped run's last line is the command that continues it
            self.print(f"output: {self.dir}")
        for sig, handler in self._handlers.items():  # a run inside a longer program hands the signals back
            signal.signal(sig, handler)
        if self.failed:
            raise StepsFailed("\n".join(self.failed))
