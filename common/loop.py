"""The training loop's bookkeeping, shared by every recipe: epochs, the mid-epoch resume skip, the
checkpoint cadence, stop requests, meters and the progress bar, and the best metric so far.

A recipe's loop then shows only its method::

    loop = Loop(run, train_loader, total_steps)       # after run.resume(): continues where it stopped
    for epoch in loop.epochs():                        # checkpoints the epoch's end after its body
        model.train()
        for batch in loop.batches():                   # skips what a resumed checkpoint already saw
            ...forward, loss terms, backward, clip, optimizer.step()...
            if not loop.optimizer_stepped():           # still accumulating gradients
                continue
            ...schedules, EMA; every log_every steps: loop.log_train(lr=...)
        if loop.eval_due():
            ...evaluate; if loop.improved("map_50", value): save best weights
    if loop.stopped:                                   # SIGTERM/SIGINT: checkpoint saved, run ended
        return

Between two optimizer steps (when the loop asks for the next batch, so after the recipe's EMA update
and logging) the iterator checks for a stop request on every process and saves a checkpoint every
``cfg.checkpoint_every`` steps. Each checkpoint records the position (epoch, batches consumed in it)
and ``extra`` (the best metrics, recipe values), so ``--resume auto`` continues with exactly the
batches, augmentations and random numbers the uninterrupted run would have used.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from common.heartbeat import SILENCE_S
from common.meters import Meters, format_seconds, prefixed
from common.run import Run, TrainState


def rate(means: Mapping[str, float]) -> str:
    """A step line's speed: images/s, or seconds per step where that is below one image a second."""
    if means.get("images_per_s", 0.0) >= 1 or "s_per_step" not in means:
        return f"{means.get('images_per_s', 0.0):.0f} img/s"
    return f"{means['s_per_step']:.1f} s/step"


def schedule_warnings(cfg: Any, total_steps: int, steps_per_epoch: int) -> list[str]:
    """Lines for under the start banner when the schedule does not fit the run (it still starts): warmup that
    lasts the whole run, and an evaluation interval longer than the run (the only evaluation is then its last)."""
    warnings = []
    epochs = min(cfg.epochs, math.ceil(total_steps / max(steps_per_epoch, 1)))  # those max_steps leaves
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    if warmup >= total_steps > 0 and cfg.warmup_epochs > 0:
        warnings.append(
            f"warning: warmup_epochs {cfg.warmup_epochs:g} ({warmup:,} steps) outlasts the run ({total_steps:,} "
            "steps): the lr never reaches its peak; lower --warmup_epochs"
        )
    if cfg.eval_every > epochs > 1:
        warnings.append(
            f"warning: eval_every {cfg.eval_every} epochs is longer than the run's {epochs}: it is evaluated at its "
            "end only; lower --eval_every"
        )
    return warnings


def steps_total(epochs: int, steps_per_epoch: Any, max_steps: int = 0) -> int:
    """Optimizer steps in the whole run: ``steps_per_epoch`` (an int, or a function of the epoch)
    summed over epochs, capped by ``max_steps`` (0 = no cap)."""
    per_epoch = steps_per_epoch if callable(steps_per_epoch) else (lambda e: steps_per_epoch)
    total = sum(per_epoch(e) for e in range(epochs))
    return min(total, max_steps) if max_steps > 0 else total


class Loop:
    """Epochs and batches of one training run (see the module docstring for the loop it serves).

    ``train_loader`` is the prepared loader; its batch sampler must have ``set_epoch`` (as
    :class:`common.loaders.EpochBatchSampler`). ``total_steps`` is the run's optimizer-step count
    (:func:`steps_total`). ``eval_images`` and ``classes`` describe the data in the start banner.
    ``lr``: the recipe's learning rate per optimizer step (its schedule), recorded with each checkpoint so that a
    resume whose schedule differs (another ``max_steps`` or ``epochs``) says what it changes.
    ``replaced``: the training dataset's count of images replaced during the run
    (:attr:`common.data.classification.ImageRows.replaced`, a :func:`common.loaders.shared_count`), logged as
    ``train/replaced_images`` once it is above 0; None for a dataset without one.
    Here the run folder is created (``run.begin()``), the banner printed, and the state to continue
    from read with ``run.resume()``.
    """

    def __init__(
        self,
        run: Run,
        train_loader: Any,
        total_steps: int,
        eval_images: int | None = None,
        classes: Sequence[str] | None = None,
        replaced: Any = None,
        lr: Sequence[float] | None = None,
    ) -> None:
        self.run, self.cfg, self.accelerator = run, run.cfg, run.accelerator
        self.train_loader, self.total_steps, self.replaced = train_loader, total_steps, replaced
        self.lr = lr  # the learning rate of each optimizer step: a resume that changes it says so
        run.begin()
        self._banner(eval_images, classes)
        # From here on each process draws its own random numbers (dropout, drop path, Mixup/CutMix),
        # as timm and DeiT do: seed + process index. Models were initialised under the shared seed
        # and prepared (DDP broadcasts rank 0's weights); per-sample augmentation stays keyed by
        # (seed, epoch, index). A resumed run restores every process's generators below.
        set_seed(self.cfg.seed, device_specific=True)
        self.start = run.resume()
        self.step, self.epoch, self.batches_done = self.start.step, self.start.epoch, self.start.batches_in_epoch
        self.extra: dict[str, Any] = dict(self.start.extra)
        self._schedule_changed()
        self.stopped = False
        self.meters = Meters(self.accelerator.device)
        self.meters.pause()  # the clock of img/s runs inside the epochs' steps (batches()) only
        self._tail_s: float | None = None  # the last epoch's final loader call (it found no batch), seconds
        self._loop_end: float | None = None  # perf_counter() when the epochs ended, for time/save_s
        self._last_line, self._last_step = time.monotonic(), self.step  # the last step line (no progress bar)
        self._epoch_done = False
        self._stepped = False
        from tqdm.auto import tqdm

        self.progress = tqdm(
            total=total_steps,
            initial=self.step,
            desc=run.recipe,
            dynamic_ncols=True,
            disable=None if self.accelerator.is_main_process else True,  # None: no bar in a log file
        )

    def _banner(self, eval_images: int | None, classes: Sequence[str] | None) -> None:
        from common.console import banner, tracker_line
        from common.trackers import project_name, run_name

        acc, cfg, run = self.accelerator, self.cfg, self.run
        precision = {"no": "fp32"}.get(str(acc.mixed_precision), f"{acc.mixed_precision} autocast")
        tracker = tracker_line(cfg.report_to, project_name(cfg, run.recipe), run_name(cfg, run.dir))
        run.print(
            banner(
                run.recipe,
                str(run.dir),
                str(acc.device),
                acc.num_processes,
                precision,
                len(self.train_loader.dataset),
                eval_images,
                classes,
                math.ceil(len(self.train_loader) / cfg.grad_accum_steps),
                cfg.epochs,
                self.total_steps,
                cfg.batch_size * acc.num_processes * cfg.grad_accum_steps,
                tracker,
            )
        )
        for note in run.notes:  # the recipe's own lines about this run's settings
            run.print(note)
        for warning in schedule_warnings(
            cfg, self.total_steps, math.ceil(len(self.train_loader) / cfg.grad_accum_steps)
        ):
            run.print(warning)

    def _schedule_changed(self) -> None:
        """After a resume: when the schedule's length differs from the checkpoint's (a resume with another
        ``max_steps`` or ``epochs`` stretches or squeezes the cosine over what is left), one line with the old and
        new length and the learning rate the next step jumps to."""
        old = self.extra.get("schedule_steps")
        if old is None or old == self.total_steps or self.step == 0:
            return
        line = f"resume: the schedule is now {self.total_steps:,} optimizer steps, was {old:,}"
        if self.lr is not None and "next_lr" in self.extra and self.step < len(self.lr):
            line += (
                f"; the lr of step {self.step + 1} goes from {self.extra['next_lr']:.3g} to {self.lr[self.step]:.3g}"
            )
        self.run.print(line)

    def _extra(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the position: ``extra``, the schedule's length and the next step's lr."""
        kept = {**self.extra, "schedule_steps": self.total_steps}
        if self.lr is not None and self.step < len(self.lr):
            kept["next_lr"] = float(self.lr[self.step])
        return kept

    def state(self) -> TrainState:
        return TrainState(self.step, self.epoch, self.batches_done, self._extra())

    # -- epochs ----------------------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs left to train. After each epoch's body (its evaluation included) the position is
        checkpointed: a finished epoch as the start of the next (every ``checkpoint_every`` steps, and
        always after the last), a last epoch cut short by ``max_steps`` as where it stopped."""
        for epoch in range(self.start.epoch, self.cfg.epochs):
            if self.step >= self.total_steps:
                break
            self.epoch, self._epoch_done = epoch, False
            if epoch != self.start.epoch:
                self.batches_done = 0
            # Accelerate's loader re-applies its own epoch counter to the sampler whenever it starts
            # iterating; a resumed run's counter starts at 0, so both are set to the true epoch here.
            if hasattr(self.train_loader, "set_epoch"):
                self.train_loader.set_epoch(epoch)
            sampler = self.train_loader.batch_sampler
            for candidate in (sampler, getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)):
                if hasattr(candidate, "set_epoch"):
                    candidate.set_epoch(epoch)
            yield epoch
            if self.stopped:
                return
            if self._epoch_done and (self.step % self.cfg.checkpoint_every == 0 or self.last_epoch):
                self.run.save_checkpoint(TrainState(self.step, epoch + 1, 0, self._extra(), self.last_epoch))
            elif self.last_epoch:
                self.run.save_checkpoint(dataclasses.replace(self.state(), finished=True))
        self._loop_end = time.perf_counter()
        self.progress.close()
        self.run.loop_done()

    @property
    def last_epoch(self) -> bool:
        return self.epoch + 1 >= self.cfg.epochs or self.step >= self.total_steps

    def eval_due(self) -> bool:
        """Whether the epoch just trained is evaluated: every ``eval_every`` epochs and after the last
        (never after a stop request: the run ends at once). Before an evaluation, a loss that went
        non-finite since the last check stops the run (one host sync): diverged weights are never
        evaluated, nor saved as the best or the final ones. A due evaluation starts its clock
        (:meth:`common.run.Run.evaluation_started`)."""
        due = not self.stopped and ((self.epoch + 1) % self.cfg.eval_every == 0 or self.last_epoch)
        if due:
            self.run.guard.check(self.accelerator, self.run.last_checkpoint)
            self.run.evaluation_started()  # its metrics' record gets time/eval_s
        return due

    # -- batches ---------------------------------------------------------------------------------
    def batches(self) -> Iterator[Any]:
        """This epoch's batches, from where a resumed checkpoint left off. Between optimizer steps:
        the stop check (every process agrees) and the checkpoint cadence; ends at ``total_steps``."""
        skip = self.batches_done
        loader = self.accelerator.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
        length = len(self.train_loader)
        restart = time.perf_counter()
        iterator = iter(loader)
        first = True
        while True:
            tick = time.perf_counter()
            batch = next(iterator, None)
            if batch is None:
                self._tail_s = time.perf_counter() - tick
                self.meters.pause()  # evaluation, plots and checkpoints between epochs: not a step
                self._epoch_done = True
                return
            if first:  # the loader's (re)start: time/epoch_boundary_s, outside the steps' clock
                first = False
                if self._tail_s is not None:  # not the session's first epoch (that one is in time/first_step_s)
                    boundary = self._tail_s + time.perf_counter() - restart
                    self.run.log({"time/epoch_boundary_s": boundary}, self.step, echo=False)
                self.meters.resume()
            else:
                self.meters.data_time(time.perf_counter() - tick)
            self._stepped = False
            yield batch
            self.batches_done += 1
            if not self._stepped:
                continue
            last_batch = self.batches_done == length
            stopping = self.run.should_stop()
            # An epoch's last batch is checkpointed by epochs(), after the evaluation.
            if stopping or (self.step % self.cfg.checkpoint_every == 0 and not last_batch):
                self.meters.pause()  # time/checkpoint_s, not a step
                self.run.save_checkpoint(self.state())
                self.meters.resume()
            if stopping:
                self.stopped = True
                self.progress.close()
                self.run.stopped(self.step)
                return
            if self.step >= self.total_steps:
                self._epoch_done = last_batch
                return

    def optimizer_stepped(self) -> bool:
        """Call once per batch, after ``optimizer.step()``: whether this batch completed an optimizer
        step (Accelerate's ``sync_gradients``; False while gradients accumulate). If so it counts it
        in ``step``, the meters and the progress bar."""
        if not self.accelerator.sync_gradients:
            return False
        self._stepped = True
        self.step += 1
        self.meters.step()
        self.progress.update(1)
        if self.step == self.start.step + 1:  # the session's first step: one line, no meters read (no sync)
            took = time.perf_counter() - self.run.started
            self.run.log({"time/first_step_s": took}, self.step, echo=False)
            self.run.print(
                f"epoch {self.epoch} step {self.step}/{self.total_steps}  first step {took:.1f} s after the start"
            )
            self._last_line, self._last_step = time.monotonic(), self.step
        elif self._silent_too_long():
            self._progress_line()
        return True

    # -- logging and the best metric ---------------------------------------------------------------
    def log_due(self) -> bool:
        """Whether this optimizer step logs the training meters: every ``log_every`` steps, and the last
        step, so a run shorter than ``log_every`` still has its training loss."""
        return self.step % self.cfg.log_every == 0 or self.step == self.total_steps

    def _silent_too_long(self) -> bool:
        """Whether the main process, without a progress bar (a log file, a cluster job), has printed no step
        line for :data:`SILENCE_S` seconds: ``log_every`` steps take longer than that."""
        quiet = self.accelerator.is_main_process and self.progress.disable  # no bar: output to a file
        return bool(quiet) and time.monotonic() - self._last_line >= SILENCE_S

    def _progress_line(self) -> None:
        """A step line between two ``log_every`` logs, on the main process: where the run is and how fast it
        goes since the last line (host clocks only: no meter is read, nothing synchronises, metrics.jsonl is
        unchanged, so a slow run is never silent and every run logs the same records)."""
        now = time.monotonic()
        per_step = (now - self._last_line) / max(self.step - self._last_step, 1)
        self.run.print(
            f"epoch {self.epoch} step {self.step}/{self.total_steps}  {per_step:.1f} s/step  "
            f"eta {format_seconds(per_step * (self.total_steps - self.step))}"
        )
        self._last_line, self._last_step = now, self.step

    def log_train(self, **values: float) -> dict[str, float]:
        """The interval's meter means (one all-reduce, one host sync) and ``values`` (host floats such
        as the learning rate), under ``train/``, to metrics.jsonl and the trackers; raises if a loss
        went non-finite since the last check. Returns the logged means."""
        means = self.meters.summary(self.accelerator, steps_left=self.total_steps - self.step)
        self.run.guard.check(self.accelerator, self.run.last_checkpoint)
        means.update({k: float(v) for k, v in values.items()})
        replaced = self.replaced.value if self.replaced is not None else 0
        if replaced:  # images that broke during the run, replaced (this process's count, since the start)
            means["replaced_images"] = float(replaced)
        if self.accelerator.device.type == "cuda":  # this process's peak since the start, GiB
            means["max_memory_gib"] = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
        self.run.log({**prefixed(means, "train"), "epoch": self.epoch}, self.step, echo=False)
        self._last_line, self._last_step = time.monotonic(), self.step
        self.run.print(
            f"epoch {self.epoch} step {self.step}/{self.total_steps}  loss {means.get('loss', math.nan):.4g}"
            + (f"  lr {means['lr']:.3g}" if "lr" in means else "")
            + f"  {rate(means)}  eta {format_seconds(means.get('eta_s', 0.0))}"
        )
        return means

    def improved(self, metric: str, value: float) -> bool:
        """Record an evaluation's ``value`` of ``metric`` (higher is better). True when it beats every
        earlier evaluation of the run (a tie does not); the best is kept as ``extra['best/<metric>']``
        and survives resume."""
        key = f"best/{metric}"
        if value > self.extra.get(key, -math.inf):
            self.extra[key] = value
            self.extra[f"best_step/{metric}"] = self.step
            return True
        return False

    def best(self, metric: str) -> float:
        return self.extra.get(f"best/{metric}", math.nan)

    def best_for_card(self, metric: str, unit: str = "") -> dict[str, float]:
        """The best evaluation of ``metric`` named with its step, as a model card reports it."""
        step = self.extra.get(f"best_step/{metric}", self.step)
        return {f"{metric}{unit}, the best evaluation (step {step})": self.best(metric)}

    def finish(self, results: Mapping[str, Any], weights: Sequence[Path] = ()) -> None:
        """End a completed run: the summary (final metrics, the best ones and their steps, the weights
        files, wall time), then ``run.finish`` (weights as W&B artifacts with ``log_weights``)."""
        from common.console import summary

        if self._loop_end is not None:  # the final weights, model folder and exports (time/save_s)
            self.run.log({"time/save_s": time.perf_counter() - self._loop_end}, self.step, echo=False)
        weights = [Path(w) for w in weights if Path(w).is_file()]  # best.safetensors: only once one improved
        bests = {k.removeprefix("best/"): v for k, v in self.extra.items() if k.startswith("best/")}
        best = {m: (v, self.extra.get(f"best_step/{m}", self.step)) for m, v in bests.items()}
        self.run.print(summary(time.perf_counter() - self.run.started, results, best, [w.name for w in weights]))
        self.run.finish(weights)
