"""Run plumbing: the Accelerator, the run folder, trackers, logging, and the steps after the weights.

A recipe makes one :class:`Run` from its config first thing in ``main()``: it chooses the run folder
(:mod:`common.run_folder`: refusing a resume whose config changed), builds the ``Accelerator``
(mixed precision, gradient accumulation, trackers, the inductor backend with ``compile``) and seeds
every generator with ``cfg.seed``. Nothing is written before :meth:`Run.begin`, which
:class:`common.loop.Loop` (or the first :meth:`Run.log`) calls once data and model are built: a
mistake found while loading the data or building the model leaves no run folder behind. The recipe uses
``run.accelerator``, ``run.log(values, step)``, ``run.log_plots`` and ``run.guarded``; checkpoints, resume
and the stop signals are :mod:`common.checkpoints` (mixed in), which :class:`common.loop.Loop` drives.

Run folder (``runs/<recipe>/<name>/``): ``config.yaml``, ``metrics.jsonl`` (every logged value,
always), ``checkpoints/step_XXXXXXXX/`` (Accelerate state + ``train_state.json``, last K kept),
safetensors weights written by the recipe, ``plots/``.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import math
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    ProjectConfiguration,
    broadcast_object_list,
    parse_flag_from_env,
    set_seed,
)
from PIL import Image

from common import StepsFailed
from common.budget import process_start
from common.checkpoints import Checkpoints
from common.config import RunConfig, save_config, to_dict
from common.console import banner, emulated_bf16_note, launch_command, recorded_failure, shown_value, tracker_line
from common.guard import NonFiniteGuard
from common.heartbeat import heartbeat, progress
from common.loaders import auto_workers
from common.origin import origin_comment
from common.run_folder import (
    check_resume,
    choose_output_dir,
)
from common.schedules import schedule_warnings
from common.trackers import check_hub_push, init_trackers, log_images, log_weights, project_name, push_folder, run_name
from common.weights import weights_line

_runs_made = 0  # Run objects this process made


def _skip_final_collections() -> None:
    """At the interpreter's exit, its last garbage collections walk every object that torch, torchvision and timm
    made (seconds after the run's last line, which a time budget counts); frozen, the objects are left to the
    operating system. ``atexit`` runs this after every exit handler registered later (the loaders', wandb's)."""
    gc.freeze()


class Run(Checkpoints):
    """Everything around the training loop that is the same for every recipe (the module docstring)."""

    def __init__(self, cfg: RunConfig, recipe: str) -> None:
        self.cfg = cfg
        self.recipe = recipe  # the recipe file's name: runs/<recipe>/, the tracker project, the progress bar
        global _runs_made
        # the session's clock (the first step's and the summary's times): a process's first run counts from the
        # process's start, as its command's user waits; a later run in the same program from its own start
        self.started = time.perf_counter() - (time.time() - process_start()) * (_runs_made == 0)
        _runs_made += 1
        atexit.unregister(_skip_final_collections)  # once, however many runs a program makes
        atexit.register(_skip_final_collections)
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
        # set by the recipe before its loop: its weights files' metadata, in every checkpoint (--weights takes those)
        self.weights_metadata: dict[str, str] | None = None
        self.failed: list[str] = []  # steps after the weights that failed, one line each (guarded)
        self.start_checkpoints()  # checkpoints, resume and the stop signals (common/checkpoints.py)

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
                save_config(dataclasses.replace(cfg, resume=""), self.dir / "config.yaml", origin_comment())
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

    def print_banner(
        self, train_loader: Any, total_steps: int, eval_images: int | None, classes: Any, budget_s: float = 0.0
    ) -> None:
        """The start banner (devices, data, steps or ``budget_s``, tracker), the notes under it and the schedule's
        warnings (none with a budget: it lays every schedule out for its own length)."""
        acc, cfg = self.accelerator, self.cfg
        precision = {"no": "fp32"}.get(str(acc.mixed_precision), f"{acc.mixed_precision} autocast")
        per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
        tracker = tracker_line(cfg.report_to, project_name(cfg, self.recipe), run_name(cfg, self.dir))
        global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum_steps
        data = (len(train_loader.dataset), eval_images, classes)
        where = (self.recipe, str(self.dir), str(acc.device), acc.num_processes, precision)
        budget = f"max_time {cfg.max_time}" if budget_s else ""
        self.print(banner(*where, *data, per_epoch, cfg.epochs, total_steps, global_batch, tracker, budget))
        warnings = [] if budget_s else schedule_warnings(cfg, total_steps, per_epoch)
        for line in [*self.notes, *warnings]:
            self.print(line)

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

    def progress(
        self, iterable: Iterable[Any], desc: str, images: int | None = None, shared: bool = True
    ) -> Iterator[Any]:
        """``iterable`` (a pass's batches) with a progress bar, or a line a minute where none shows
        (:func:`common.heartbeat.progress`; ``images``: how many the pass holds), and a stop checked before each
        batch (:meth:`check_stop`): a stop signal ends the pass at its next batch with :class:`common.RunStopped`.
        ``shared`` False: only this process runs the pass (see :meth:`check_stop`)."""
        total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
        batches = iter(progress(iterable, desc, self.accelerator.is_main_process, self.print, images))
        done = 0
        while True:
            self.check_stop(f"{desc} ({done:,} of {total:,} batches)" if total else desc, shared)
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch
            done += 1

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
        self.check_stop("the plots")
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
        self.collect_stop_flags()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        for line in self.failed:  # after the summary, beside the run folder's line
            print(f"error: {line}", file=sys.stderr, flush=True)
        if self._stop_signal is None:  # a stopped run's last line is the command that continues it
            self.print(f"output: {self.dir}")
        self.hand_back_signals()  # a run inside a longer program gets them back
        if self.failed:
            raise StepsFailed("\n".join(self.failed))
