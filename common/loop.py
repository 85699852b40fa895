"""The training loop's bookkeeping: epochs, the mid-epoch resume skip, meters, the progress bar and the best
metric. Every change of a run's state is a call the recipe makes; the questions only answer::

    loop = Loop(run, train_loader, lay_out)            # the run folder and the start banner; lay_out(length): schedules
    set_seed(cfg.seed, device_specific=True)            # from here each process draws its own random numbers
    loop.resume()                                       # model, optimizer, ... from --resume's checkpoint
    for epoch in loop.epochs():                         # sets the samplers' epoch; ends at total_steps
        for batch in loop.batches():                    # skips what a resumed checkpoint already saw
            lr = loop.value("lr")                       # this step's value of the schedules lay_out made
            ...forward: losses = {"loss_x": ..., ...}; loss = sum(w * losses[k] for k, w in weight_dict.items())
            ...backward, clip, optimizer.step()
            loop.record(loss, losses, len(images))      # meters and the non-finite guard, on the device
            if not accelerator.sync_gradients:          # still accumulating gradients
                continue
            loop.end_step()                             # one more optimizer step
            ...EMA; if loop.log_due(): loop.log_train(lr=lr)
            if loop.stop_requested():                   # SIGTERM/SIGINT/SIGUSR1 on any process
                loop.save_checkpoint()
                return loop.stop(results)
            if loop.checkpoint_due():
                loop.save_checkpoint()
        if loop.eval_due():
            with loop.evaluation():                     # the non-finite check, the clock; a stop: checkpoint
                ...evaluate; if loop.update_best("map_50", value): save best weights
        if loop.checkpoint_due():                       # every checkpoint_every steps, and after the last epoch
            loop.save_checkpoint()

A run's length (:class:`common.budget.Length`) is ``epochs`` x steps per epoch, capped by ``max_steps``, or, with
``--max_time``, what the budget holds: the loop times the first steps, plans (:func:`common.budget.plan_budget`) and
then lays the recipe's schedules (``lay_out``) over the steps planned. A recipe reads each step's values with
:meth:`Loop.value`. A checkpoint records the position, the plan and ``extra`` (best metrics, recipe values): a resume
continues with the very batches, schedules and random numbers of the uninterrupted run. Terms are ``losses`` keys
named ``loss_*`` (DETR's naming).

A stop signal is honoured within one step wherever it lands: in the batches by the recipe's ``stop_requested``;
in an evaluation (its batches, pictures, best weights) by :meth:`Loop.evaluation`, whose checkpoint makes a resume
evaluate again before it goes on; between epochs by :meth:`Loop.epochs`. The last two end the run with
:class:`common.RunStopped` once the checkpoint is written.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from common import RunStopped
from common.budget import BudgetClock, Length, process_start, seconds_of
from common.budgeted import BudgetedLoop
from common.console import step_line, summary
from common.heartbeat import SILENCE_S
from common.loaders import shutdown_workers
from common.meters import Meters, format_seconds, prefixed
from common.run import Run
from common.run_folder import TrainState
from common.schedules import LaidOut, resumed_schedule, steps_total

LayOut = Callable[[Length], Mapping[str, np.ndarray]]


class Loop(BudgetedLoop):
    """Epochs and batches of one run (the module docstring shows the loop it serves). ``train_loader``: prepared,
    its batch sampler with ``set_epoch``; ``lay_out``: the recipe's schedules for a :class:`Length` (a name ->
    one value per step of ``length.steps``; ``lr`` among them is kept in checkpoints, so that a resume with another
    schedule says what changes), called again when a budget is planned; it may also set what the run's length
    decides elsewhere (the epochs without mosaic); ``steps_per_epoch``: an int or a function of the epoch (default:
    the loader's batches over ``grad_accum_steps``); ``eval_images``, ``classes``: for the banner; ``replaced``:
    the training set's :func:`common.loaders.shared_count` of images replaced during the run. Creates the run
    folder and prints the banner; :meth:`resume` then says where the loop starts."""

    def __init__(self, run: Run, train_loader: Any, lay_out: LayOut | None = None, eval_images: int | None = None,
                 classes: Any = None, replaced: Any = None,
                 steps_per_epoch: int | Callable[[int], int] | None = None) -> None:  # fmt: skip
        self.run, self.cfg, self.accelerator = run, run.cfg, run.accelerator
        self.train_loader, self.replaced = train_loader, replaced
        cfg, self.plan = self.cfg, None
        spe = self.steps_per_epoch = steps_per_epoch or math.ceil(len(train_loader) / cfg.grad_accum_steps)
        self.budget_s = seconds_of(getattr(cfg, "max_time", ""))
        total = steps_total(cfg.epochs, spe, cfg.max_steps)  # a budget: its plan's, and until then the config's
        self.schedules = LaidOut(lay_out, Length(total, spe, cfg.epochs, cfg.epochs, 0, bool(self.budget_s)))
        self.total_steps = (cfg.max_steps or 2**62) if self.budget_s else total
        run.begin()
        run.print_banner(train_loader, self.total_steps, eval_images, classes, self.budget_s)
        self.eval_images = eval_images
        self.start = TrainState()  # where the loop starts: resume() reads it from the checkpoint
        self.step = self.epoch = self.batches_done = 0
        self.extra: dict[str, Any] = {}
        self.meters = Meters(self.accelerator.device)
        self.meters.pause()  # the clock of img/s runs inside the epochs' batches only
        self._in_epoch = self._epoch_done = False
        self._evaluating: dict[str, Any] | None = None  # in evaluation(): ``extra`` as it was when it started
        self._evaluate = False  # eval_due(): decided when an epoch's batches end
        self._saved_step = -1  # the step of the newest checkpoint this session wrote or resumed from
        self._tail_s: float | None = None  # the last epoch's final loader call (it found no batch), seconds
        self._loop_end: float | None = None  # perf_counter() at the epochs' end
        self._last_line, self._last_step = time.monotonic(), self.step  # the last step line (no progress bar)
        self.clock = BudgetClock(self.budget_s, self.accelerator, run.started)  # a budget's timing, speed, time left
        self._step_s, self._steps_timed = 0.0, 0  # the step clock's seconds and steps, this session (the eta)
        self._unit = ""  # the step line's speed unit, fixed by its first line
        self._first_step_s = 0.0  # seconds from the process's start to this session's first step's end
        self.progress: Any = None

    def value(self, name: str) -> float:
        """This step's value of the schedule ``name`` (``lay_out``'s); a budgeted run's timing steps: its first."""
        return self.schedules.value(name, self.step)

    @property
    def lr(self) -> np.ndarray | None:
        return self.schedules.values.get("lr")

    def resume(self) -> TrainState:
        """Continue from the checkpoint ``--resume`` names (:meth:`common.run.Run.resume`: model, optimizer, EMA,
        every object registered for checkpointing and every process's random generators), or start at step 0; a
        budgeted run's plan comes from it too. Says how a changed schedule continues. Returns where the loop starts."""
        self.start = self.run.resume()
        self.step, self.epoch, self.batches_done = self.start.step, self.start.epoch, self.start.batches_in_epoch
        self.extra = dict(self.start.extra)
        self._saved_step = self.step if self.run.last_checkpoint else -1
        self._last_step = self.step
        if self.budget_s:
            self._resume_budget()
        if changed := resumed_schedule(self.extra, self.total_steps, self.step, self.lr):  # another length
            self.run.print(changed)
        main = None if self.accelerator.is_main_process else True  # None: no bar in a log file
        total = None if self._unplanned else self.total_steps
        self.progress = tqdm(total=total, initial=self.step, desc=self.run.recipe, dynamic_ncols=True, disable=main)
        self.run.stop_phase = "training"
        return self.start

    # -- iterating ---------------------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs left to train; a stop signal between two of them saves a checkpoint and ends the run. When
        they end, the progress bar closes, the loader's workers stop and from then on a stop signal ends the run at
        the next check (``run.loop_done()``). A checkpoint written before its epoch's evaluation (a stop during
        it) resumes into that epoch, past its batches, so that the evaluation runs again."""
        if self.progress is None:
            raise RuntimeError("Loop.resume() comes before Loop.epochs(): it says where the loop starts")
        epoch = self.start.epoch - 1
        while (epoch := epoch + 1) < self.length.epochs or self._unplanned:  # a budget: its plan's epochs
            if epoch != self.start.epoch and self.run.should_stop():  # at the boundary: nothing half done
                self._stop_now()
            evaluation_left = epoch == self.start.epoch and self.start.batches_in_epoch > 0 and not self.start.finished
            if self.step >= self.total_steps and not evaluation_left:
                break
            self.epoch, self._epoch_done = epoch, False
            if epoch != self.start.epoch:
                self.batches_done = 0
            # Accelerate's loader re-applies its own epoch counter (0 after a resume) whenever it starts iterating
            if hasattr(self.train_loader, "set_epoch"):
                self.train_loader.set_epoch(epoch)
            sampler = self.train_loader.batch_sampler
            for candidate in (sampler, getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)):
                if hasattr(candidate, "set_epoch"):
                    candidate.set_epoch(epoch)
            yield epoch
        self._loop_end = time.perf_counter()
        self.progress.close()
        shutdown_workers(self.train_loader)  # a loader not in use holds no workers
        self.run.loop_done()

    def batches(self) -> Iterator[Any]:
        """This epoch's batches from where a resumed checkpoint left off, until ``total_steps``. A batch counts as
        consumed once handed out (a checkpoint in the loop's body resumes after it). Waiting for the loader is
        the meters' data time; an epoch's first wait is ``time/epoch_boundary_s``, outside the steps' clock."""
        skip = self.batches_done
        if self.step >= self.total_steps or skip >= len(self.train_loader):  # resumed before an evaluation
            self._epoch_done = skip >= len(self.train_loader)
            self._evaluate = self._evaluation_decided()
            return
        loader = self.accelerator.skip_first_batches(self.train_loader, skip) if skip else self.train_loader
        self._in_epoch, restart, iterator, first, over = True, time.perf_counter(), iter(loader), True, False
        while self.step < self.total_steps:
            tick = time.perf_counter()
            batch = next(iterator, None)
            if over := batch is None:  # the epoch is over: its evaluation, plots and checkpoint are not steps
                self._tail_s = time.perf_counter() - tick
                self.meters.pause()
                break
            if first:
                first = False
                if self._tail_s is not None:  # not the session's first epoch (that one is time/first_step_s)
                    boundary = self._tail_s + time.perf_counter() - restart
                    self.run.log({"time/epoch_boundary_s": boundary}, self.step, echo=False)
                self.meters.resume()
            else:
                self.meters.data_time(time.perf_counter() - tick)
            self.batches_done += 1
            yield batch
        self._in_epoch, self._epoch_done = False, over or self.batches_done == len(self.train_loader)
        if loader is not self.train_loader:  # a resumed epoch's own loader: its workers end with it
            shutdown_workers(loader)
        self._evaluate = self._evaluation_decided()  # eval_due()'s answer, said where an evaluation is left out

    # -- a step ------------------------------------------------------------------------------------
    def record(self, loss: torch.Tensor, losses: Mapping[str, torch.Tensor], images: int, **counts: Any) -> None:
        """One (micro-)batch's ``loss`` and its terms into the meters (means weighted by ``images``) and the
        non-finite guard (the total and the ``loss_*`` terms), on the device: nothing synchronises.
        ``counts``: per-batch totals for the interval's rates (boxes, dropped boxes)."""
        terms = {k: v for k, v in losses.items() if k.startswith("loss_")}
        self.run.guard.observe(self.step + 1, {"loss": loss, **terms})  # the step it belongs to, 1-based as logged
        self.meters.update(n=images, loss=loss, **losses)
        self.meters.images(images, **counts)

    def end_step(self) -> None:
        """After ``optimizer.step()`` of a batch that completed a step (``accelerator.sync_gradients``): count it
        in ``step``, the meters and the progress bar; the session's first step, and a step after a long silence
        without a progress bar, print a line (host clocks only: no meter is read)."""
        self.step += 1
        self.meters.step()
        self.progress.update(1)
        if self._unplanned:  # a budget: the first steps time the run, then it is planned
            self._time_steps()
        elif self.plan is not None:
            self._keep_time()
        quiet = self.accelerator.is_main_process and self.progress.disable  # no bar: output to a file
        where = f"epoch {self.epoch} step {self.step}/" + ("?" if self._unplanned else f"{self.total_steps}")
        if self.step == self.start.step + 1:
            took = time.perf_counter() - self.run.started
            self._first_step_s = time.time() - process_start()
            self.run.log({"time/first_step_s": took}, self.step, echo=False)
            self.run.print(f"{where}  first step {took:.1f} s after the start")
        elif quiet and not self.log_due() and time.monotonic() - self._last_line >= SILENCE_S:
            per_step = (time.monotonic() - self._last_line) / max(self.step - self._last_step, 1)
            mean = self._step_s / self._steps_timed if self._steps_timed else per_step  # as the step lines
            eta = "" if self._unplanned else f"  eta {format_seconds(self._eta(mean))}"
            self.run.print(f"{where}  {per_step:.1f} s/step{eta}")
        else:
            return
        self._last_line, self._last_step = time.monotonic(), self.step

    def log_due(self) -> bool:
        """Every ``log_every`` steps, and the last step (a run shorter than ``log_every`` still logs its loss)."""
        return self.step % self.cfg.log_every == 0 or self.step == self.total_steps

    def log_train(self, **values: float) -> dict[str, float]:
        """The interval's meter means (one all-reduce, one host sync) and ``values`` (host floats: the learning
        rate) under ``train/``, to metrics.jsonl and the trackers, and the step line with the loss terms; stops
        the run if a loss went non-finite since the last check. Returns the logged means."""
        steps = self.meters.interval_steps  # before the summary resets them
        means = self.meters.summary(self.accelerator, steps_left=self.total_steps - self.step)
        if "s_per_step" in means:  # the eta from every step of this session, not the last interval's alone
            self._step_s, self._steps_timed = self._step_s + means["s_per_step"] * steps, self._steps_timed + steps
            means["eta_s"] = self._eta(self._step_s / self._steps_timed)
        if self._unplanned:
            means.pop("eta_s", None)
        self.run.guard.check(self.accelerator, self.run.last_checkpoint)
        means.update({k: float(v) for k, v in values.items()})
        if self.replaced is not None and self.replaced.value:  # images that broke during the run, replaced
            means["replaced_images"] = float(self.replaced.value)
        if self.accelerator.device.type == "cuda":  # this process's peak since the start, GiB
            means["max_memory_gib"] = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
        self.run.log({**prefixed(means, "train"), "epoch": self.epoch}, self.step, echo=False)
        self._last_line, self._last_step = time.monotonic(), self.step
        if not self._unit:  # one unit for the whole run: below one image a second, seconds per step
            self._unit = "img/s" if means.get("images_per_s", 0.0) >= 1 or "s_per_step" not in means else "s/step"
        total = 0 if self._unplanned else self.total_steps
        self.run.print(step_line(self.epoch, self.step, total, means, self._unit))
        return means

    def _eta(self, step_s: float) -> float:
        """Seconds to the run's end: the steps left at ``step_s``, and the evaluations left at the last one's."""
        evals = 0
        if self.clock.eval_s is not None:
            per_epoch = self.length.per_epoch(self.epoch)
            left = range(self.epoch, min(self.epoch + math.ceil((self.total_steps - self.step) / per_epoch) + 1,
                                         self.length.epochs))  # fmt: skip
            evals = sum(1 for e in left if self._eval_at(e))
        return step_s * max(self.total_steps - self.step, 0) + evals * (self.clock.eval_s or 0.0)

    # -- checkpoints and stops -----------------------------------------------------------------------
    @property
    def last_epoch(self) -> bool:
        if self._unplanned:  # a budget still timing its steps: no end but max_steps
            return self.step >= self.total_steps
        return self.epoch + 1 >= self.length.epochs or self.step >= self.total_steps

    def stop_requested(self) -> bool:
        """Whether a stop signal reached any process (every process gets the same answer at the same step)."""
        return self.run.should_stop()

    def checkpoint_due(self) -> bool:
        """In an epoch's batches: every ``checkpoint_every`` steps but at its last batch (the epoch's end saves
        that one, after the evaluation). After them: every ``checkpoint_every`` steps and after the last epoch."""
        if self._in_epoch:
            return self.step % self.cfg.checkpoint_every == 0 and self.batches_done != len(self.train_loader)
        return (self._epoch_done and self.step % self.cfg.checkpoint_every == 0) or self.last_epoch

    def save_checkpoint(self) -> None:
        """Checkpoint the position: in the batches, the batch just read; after a whole epoch, the start of the
        next; marked finished after the last epoch (``--resume auto`` alone then looks for other runs)."""
        kept = {**self.extra, "schedule_steps": self.total_steps}
        if self.budget_s:  # a resume before the plan times the steps again; one without it was never budgeted
            kept["max_time_s"], kept["spent_s"] = self.budget_s, self.clock.spent()
        kept.pop("next_lr", None)  # an earlier save's; a finished run plans no next step
        if self.lr is not None and self.step < len(self.lr):
            kept["next_lr"] = float(self.lr[self.step])
        if self.lr is not None and 0 < self.step <= len(self.lr):  # a resume that extends the run jumps from it
            kept["last_lr"] = float(self.lr[self.step - 1])
        if self._in_epoch:
            self.meters.pause()  # time/checkpoint_s, not a step
            self.run.save_checkpoint(TrainState(self.step, self.epoch, self.batches_done, kept))
            self.meters.resume()
        elif self._evaluating is not None:  # before this epoch's evaluation: a resume evaluates first
            self.run.save_checkpoint(TrainState(self.step, self.epoch, self.batches_done, kept))
        else:  # a whole epoch: the start of the next; a last epoch cut short by max_steps: where it stopped
            at = (self.epoch + 1, 0) if self._epoch_done else (self.epoch, self.batches_done)
            self.run.save_checkpoint(TrainState(self.step, *at, kept, finished=self.last_epoch))
        self._saved_step = self.step

    def stop(self, results: dict[str, float]) -> dict[str, float]:
        """End a run a signal stopped (its checkpoint saved): how to continue it, the run's finish; ``results``."""
        self.progress.close()
        shutdown_workers(self.train_loader)
        self.run.stopped(self.step)
        return results

    def _stop_now(self) -> None:
        """A stop outside the steps (between epochs, in an evaluation): a checkpoint where this session trained since
        the last one, the run's end, and :class:`RunStopped` (its lines already printed)."""
        evaluating = self._evaluating is not None
        if evaluating:  # best metrics as before the evaluation: a resume redoes it, best weights too
            self.extra = self._evaluating
        if 0 < self.step != self._saved_step:  # nothing trained at step 0: no checkpoint to keep
            self.save_checkpoint()
        self.progress.close()
        shutdown_workers(self.train_loader)
        self.run.stopped(self.step, evaluating)
        raise RunStopped("")

    # -- evaluation and the best metric ----------------------------------------------------------------
    def _eval_at(self, epoch: int) -> bool:
        every = self.eval_every if self.plan is not None else self.cfg.eval_every
        return (epoch + 1) % every == 0 or epoch + 1 >= self.length.epochs

    def eval_due(self) -> bool:
        """Whether this epoch ends with an evaluation: every ``eval_every`` epochs (a budget: its plan's, spread over
        the run's epochs) and after the last; a budget still timing: the last only, and one behind its plan leaves out
        an evaluation that would not leave time for the rest (said once, when the epoch's batches end)."""
        return self._evaluate

    def _evaluation_decided(self) -> bool:
        if self.last_epoch or self._unplanned or not self._eval_at(self.epoch):
            return self.last_epoch
        return self.plan is None or self._evaluation_fits()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation and what follows from it (metrics, pictures, best weights). First the run stops if a
        loss went non-finite since the last check (one host sync), so diverged weights are never evaluated nor
        saved; then the evaluation's clock starts (``time/eval_s``). A stop signal, before it or at any of its
        checks (each batch, between pictures), ends it: a checkpoint that evaluates again on resume, then the run's
        end. The run's stop checks must agree across processes, so every process enters it."""
        self.run.guard.check(self.accelerator, self.run.last_checkpoint)
        self._evaluating, phase = copy.deepcopy(self.extra), self.run.stop_phase
        self.run.stop_phase = "evaluation"
        started = time.perf_counter()
        try:
            self.run.check_stop("the evaluation")
            self.run.evaluation_started()
            yield
            self.clock.evaluated(time.perf_counter() - started)  # a budget's guard and the eta follow it
        except RunStopped:
            self._stop_now()
        finally:
            self._evaluating, self.run.stop_phase = None, phase

    def update_best(self, metric: str, value: float) -> bool:
        """Record ``value`` of ``metric`` (higher is better); True when it beats every earlier one (a tie does not).
        Kept as ``extra['best/<metric>']`` with its step: it survives a resume."""
        if value > self.extra.get(f"best/{metric}", -math.inf):
            self.extra[f"best/{metric}"], self.extra[f"best_step/{metric}"] = value, self.step
            return True
        return False

    def best(self, metric: str) -> float:
        return self.extra.get(f"best/{metric}", math.nan)

    def best_for_card(self, metric: str, unit: str = "") -> dict[str, float]:
        """The best evaluation of ``metric`` named with its step, as a model card reports it."""
        step = self.extra.get(f"best_step/{metric}", self.step)
        return {f"{metric}{unit}, the best evaluation (step {step})": self.best(metric)}

    def finish(self, results: Mapping[str, Any], weights: Sequence[Path] = ()) -> None:
        """End a completed run: ``time/save_s``, the summary (final metrics, the best ones and their steps, the
        weights files, wall time), then ``run.finish`` (the weights as W&B artifacts with ``log_weights``)."""
        if self._loop_end is not None:  # the final weights, model folder and exports
            self.run.log({"time/save_s": time.perf_counter() - self._loop_end}, self.step, echo=False)
        weights = [Path(w) for w in weights if Path(w).is_file()]  # best.safetensors: only once one improved
        steps = {k[10:]: v for k, v in self.extra.items() if k.startswith("best_step/")}
        best = {k[5:]: (v, steps.get(k[5:], self.step)) for k, v in self.extra.items() if k.startswith("best/")}
        self.run.print(summary(time.perf_counter() - self.run.started, results, best, [w.name for w in weights]))
        self.run.finish(weights)
