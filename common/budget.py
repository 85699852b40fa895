"""A run's length: its optimizer steps and how the config's epoch counts map onto them (:class:`Length`), and the
plan that turns a time budget (``--max_time 10m``) into such a length (:func:`plan_budget`).

Without a budget a run is ``epochs`` x steps per epoch (capped by ``max_steps``) and every epoch count of the
config (warmup, milestones, the epochs without mosaic, ...) means what it says. With one, the run first times
itself for a few steps (its *timing steps*, at every schedule's starting value), then fixes how many optimizer
steps the rest of the budget holds and lays every schedule over them: an epoch count of the config becomes the
same share of this run (``warmup_epochs 3`` of ``epochs 100`` is the first 3 % of its steps), as if the config's
run had been shrunk or stretched to the budget. :class:`common.loop.Loop` does the timing and keeps the plan in
its checkpoints, so a resume continues the very same schedule.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import UserError
from common.meters import format_seconds

_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|min|m|sec|s)")

# the share of the budget the run's evaluations may take, the final one included; those beyond it are left out
EVAL_SHARE = 0.10
# the steps' share of what is left for them: slower steps than timed (a busier machine) still end in time
STEP_MARGIN = 0.95


def seconds_of(text: str) -> float:
    """``90s``, ``10m``, ``2h``, ``1h30m``, ``1.5h`` -> seconds; '' -> 0 (no budget). Anything else, a bare number
    included (seconds? minutes? Ultralytics' ``time`` is hours), is a :class:`UserError` naming the forms."""
    text = str(text).strip().lower().replace(" ", "")
    if not text:
        return 0.0
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text or len({_UNITS[u] for _, u in parts}) != len(parts):
        raise UserError(f"max_time '{text}' is not a duration: give one with its unit, e.g. 90s, 10m, 2h or 1h30m")
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise UserError(f"max_time '{text}' is no time at all: give the run's budget, e.g. 10m")
    return seconds


@dataclass(frozen=True)
class Length:
    """The optimizer steps a run's schedules span and its epochs. ``steps``: the schedules' length (a budgeted run's
    steps after its ``timing`` steps); ``steps_per_epoch``: an int or a function of the epoch (a changing gradient
    accumulation); ``epochs``: the epochs the run trains, the last one possibly cut short; ``config_epochs``: the
    config's ``epochs``, of which a budgeted run's epoch counts are shares (``budgeted``)."""

    steps: int
    steps_per_epoch: int | Callable[[int], int]
    epochs: int
    config_epochs: int
    timing: int = 0
    budgeted: bool = False

    def per_epoch(self, epoch: int) -> int:
        return steps_in(self.steps_per_epoch, epoch)

    def at(self, epochs: float) -> int:
        """The step (of the schedules, from 0) a config's epoch count ends at: ``warmup_epochs``, a milestone.
        Budgeted: the same share of ``steps`` as of the config's epochs."""
        if self.budgeted:
            return round(epochs / max(self.config_epochs, 1) * self.steps)
        whole, part = int(epochs), epochs - int(epochs)
        return round(sum(self.per_epoch(e) for e in range(whole)) + part * self.per_epoch(whole))

    def in_epochs(self, epochs: float) -> float:
        """A config's epoch count in this run's epochs (as given, without a budget)."""
        return epochs * self.epochs / max(self.config_epochs, 1) if self.budgeted else float(epochs)

    @property
    def total(self) -> int:
        """Optimizer steps of the whole run, the timing steps included."""
        return self.timing + self.steps


def steps_in(steps_per_epoch: int | Callable[[int], int], epoch: int) -> int:
    """Optimizer steps of ``epoch`` (``steps_per_epoch``: an int or a function of the epoch), at least 1."""
    return max(int(steps_per_epoch(epoch) if callable(steps_per_epoch) else steps_per_epoch), 1)


def epochs_for(steps: int, steps_per_epoch: int | Callable[[int], int]) -> int:
    """The epochs ``steps`` optimizer steps start (the last one possibly cut short)."""
    epochs, done = 0, 0
    while done < steps:
        done += steps_in(steps_per_epoch, epochs)
        epochs += 1
    return max(epochs, 1)


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_budget` decided, kept in every checkpoint so that a resume lays out the same run."""

    budget_s: float  # --max_time, seconds
    steps: int  # optimizer steps of the whole run, the timing steps included
    timing: int  # the first steps, trained at every schedule's starting value while the run timed itself
    epochs: int  # the epochs those steps start (the last one possibly cut short)
    eval_every: int  # epochs between two evaluations (the last epoch is always evaluated)
    step_s: float  # the timed seconds per optimizer step
    eval_s: float  # one evaluation's seconds (measured, or estimated from the steps)
    end_s: float  # seconds kept for the end: final weights, model folder, the export with --export

    def describe(self, started_s: float, spe: int) -> str:
        """The one line the run prints when it has planned."""
        evals = math.ceil(self.epochs / self.eval_every)
        per = f"{self.step_s:.2f} s/step" if self.step_s >= 0.1 else f"{self.step_s * 1000:.0f} ms/step"
        return (
            f"max_time {format_seconds(self.budget_s)}: {self.steps:,} optimizer steps ({self.epochs} epoch"
            f"{'s' * (self.epochs != 1)} of {spe:,}), timed over the first {self.timing} at {per}; "
            f"{evals} evaluation{'s' * (evals != 1)} of ~{self.eval_s:.0f} s, the schedules laid over the steps "
            f"after step {self.timing}; {format_seconds(started_s)} spent before the first step"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_budget(
    budget_s: float,
    elapsed_s: float,
    step_s: float,
    eval_s: float,
    end_s: float,
    timing: int,
    steps_per_epoch: int | Callable[[int], int],
    evaluations: int,
    max_steps: int = 0,
) -> Plan:
    """The run a budget holds. ``elapsed_s``: seconds since the process started (start-up and the ``timing`` steps
    done); ``step_s``: seconds per optimizer step; ``eval_s``: one evaluation; ``end_s``: what follows the last
    evaluation; ``evaluations``: as many as the config asks for (its epochs over ``eval_every``), fewer where they
    would take more than :data:`EVAL_SHARE` of the budget, at least the final one; ``max_steps`` > 0 caps the steps.

    The steps get what is left after the evaluations and the end, less a margin (:data:`STEP_MARGIN`)."""
    evals = max(1, min(evaluations, math.floor(EVAL_SHARE * budget_s / max(eval_s, 1e-3))))
    left = budget_s - elapsed_s - end_s - evals * eval_s
    steps = timing + max(math.floor(STEP_MARGIN * left / max(step_s, 1e-6)), 0)
    if max_steps > 0:
        steps = min(steps, max_steps)
    steps = max(steps, timing, 1)
    epochs = epochs_for(steps, steps_per_epoch)
    eval_every = max(1, math.ceil(epochs / evals))
    return Plan(budget_s, steps, timing, epochs, eval_every, step_s, eval_s, end_s)


_IMPORTED = time.time()  # where /proc is missing: the budget counts from the first import of this module


@functools.cache
def process_start() -> float:
    """When this process started, ``time.time()`` seconds: a budget counts from there (imports, data, model).
    Linux: the kernel's start time of the process (``/proc/self/stat``, in clock ticks since boot, against
    ``/proc/uptime``); elsewhere when this module was first imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


# a budgeted run times the steps after its first two (workers and caches still warming up): at least 3, at most
# 30, and fewer than 30 once they took TIMING_SHARE of the budget
TIMING_STEPS = (3, 30)
TIMING_SHARE = 0.04
RECENT_STEPS = 20  # after the plan, the run's speed: the median of this many recent steps
EVAL_MARGIN = 1.25  # the final evaluation may take longer than the last one (a busier machine, more detections)
CHECK_EVERY = 10  # with several processes the budget is checked every this many steps (one collective)
STRETCH = 1.1  # a run whose steps turned faster stretches its schedules' rest when this many times its steps fit
# kept for what follows the last evaluation: the final weights, the model folder and the process's exit (seconds,
# and a share of the budget for larger models' files), 20 s more for an --export
END_S, END_SHARE, EXPORT_S = 5.0, 0.01, 20.0


SKEW_VARIABLE = "CV_RECIPES_CLOCK_SKEW_S"


class BudgetClock:
    """A budgeted run's clock: it times the first steps (:meth:`timed`), makes the :class:`Plan`
    (:meth:`plan`), follows the steps' speed afterwards and says how many steps still fit (:meth:`fit`), and how
    long is left (:meth:`left`). Decisions that change what every process does are the main process's, broadcast
    (``accelerator``), so that they agree."""

    def __init__(self, seconds: float, accelerator: Any, started: float | None = None) -> None:
        self.seconds, self.accelerator = seconds, accelerator
        self.created = time.perf_counter()  # the first step's start, at the latest
        # perf_counter() at the session's start (common.run.Run.started: the process's start for its first run)
        self.started = started if started is not None else time.perf_counter() - (time.time() - process_start())
        self.timed_ends: list[float] = []  # perf_counter() at the end of each step, until planned
        self.ends: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS + 1)  # and after it
        self.recent_s: float | None = None  # seconds per step lately, kept across an evaluation's gap
        self.eval_s: float | None = None  # the last evaluation's seconds, this session
        self.spent_before = 0.0  # seconds the sessions before this one spent (a resume's checkpoint says)
        # fault injection for tests: the other processes' clocks this many seconds ahead of the main one's
        self.skew_s = 0.0 if accelerator.is_main_process else float(os.environ.get(SKEW_VARIABLE, "0") or 0)

    def spent(self) -> float:
        """Seconds of the budget spent: the earlier sessions' and this one's since it started."""
        return self.spent_before + time.perf_counter() - self.started + self.skew_s

    def left(self) -> float:
        return self.seconds - self.spent()

    def agreed(self, value: float) -> float:
        """The main process's ``value`` on every process."""
        if self.accelerator.num_processes == 1:
            return value
        import torch
        from accelerate.utils import broadcast

        return float(broadcast(torch.tensor(value, device=self.accelerator.device, dtype=torch.float64)).item())

    def timed(self, max_steps: int = 0) -> bool:
        """After a step before the plan: whether enough steps are timed to plan (the same on every process). A run
        of ``max_steps`` plans after a quarter of them at the latest, so that most of it follows its schedule."""
        self.timed_ends.append(time.perf_counter())
        n, seconds = len(self.timed_ends) - 2, self.timed_ends[-1] - self.timed_ends[min(1, len(self.timed_ends) - 1)]
        enough = n >= TIMING_STEPS[0] and (seconds >= TIMING_SHARE * self.seconds or n >= TIMING_STEPS[1])
        return bool(self.agreed(float(enough or 0 < max_steps <= 4 * len(self.timed_ends))))

    def _timed_step_s(self) -> float:
        """Seconds per step of the timing: from the third step's start on (workers and caches warm), or over
        every step timed where a short run timed fewer."""
        ends = self.timed_ends
        if len(ends) >= 3:
            return (ends[-1] - ends[1]) / (len(ends) - 2)
        return (ends[-1] - self.created) / len(ends)

    def plan(self, cfg: Any, step: int, steps_per_epoch: int | Callable[[int], int], eval_images: int | None) -> Plan:
        """The plan after ``step`` timed steps (the main process's, on every process). An evaluation not yet
        measured is estimated from the steps: three quarters of a training step's time per image, its pictures
        and a start."""
        plan = None
        acc = self.accelerator
        if acc.is_main_process:
            step_s = self._timed_step_s()
            per_image = step_s / (cfg.batch_size * cfg.grad_accum_steps)
            eval_s = self.eval_s or 2.0 + 0.75 * per_image * (eval_images or 0) / acc.num_processes
            end_s = self.end_s(cfg)
            elapsed = self.spent()
            evaluations = math.ceil(cfg.epochs / cfg.eval_every)
            plan = plan_budget(self.seconds, elapsed, step_s, EVAL_MARGIN * eval_s, end_s, step, steps_per_epoch,
                               evaluations, cfg.max_steps).as_dict()  # fmt: skip
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            plan = broadcast_object_list([plan])[0]
        return Plan(**plan)

    def end_s(self, cfg: Any) -> float:
        """Seconds kept for what follows the last evaluation (:data:`END_S`)."""
        return END_S + END_SHARE * self.seconds + (EXPORT_S if getattr(cfg, "export", False) else 0.0)

    def step_s(self, timed: float) -> float:
        """Seconds per step lately: the median of the last :data:`RECENT_STEPS` steps' wall times, an evaluation's
        interval left out; until there are 5 since the last evaluation, the median before it (``timed``, the
        plan's, in a session that has none)."""
        ends = list(self.ends)
        recent = [b - a for a, b in zip(ends, ends[1:]) if b > a]
        if len(recent) >= 5:
            self.recent_s = float(np.median(recent))
        return self.recent_s if self.recent_s is not None else timed

    def evaluated(self, seconds: float) -> None:
        self.eval_s = seconds
        self.ends.clear()  # the next step's interval holds the evaluation: not a step's time

    def room(self, plan: Plan, evaluations: int) -> float:
        """How many steps at their recent speed the budget's rest holds, after the ``evaluations`` still to come
        (the final one included) and the end."""
        eval_s = EVAL_MARGIN * self.eval_s if self.eval_s else plan.eval_s  # plan.eval_s has the margin in
        return (self.left() - evaluations * eval_s - plan.end_s) / self.step_s(plan.step_s)

    def fitting(self, step: int, plan: Plan, evaluations: int, room: float | None = None) -> int:
        """The last step to plan for after ``step``: :data:`STEP_MARGIN` of the :meth:`room`, so that noise in the
        steps' speed does not refit it back, and at least one more step."""
        room = self.room(plan, evaluations) if room is None else room
        return step + max(math.floor(STEP_MARGIN * room), 1)

    def fit(self, step: int, total: int, plan: Plan, evaluations: int = 1, max_steps: int = 0) -> int:
        """After a planned step: the run's last step so that the steps left at their recent speed, the
        ``evaluations`` still to come and the end fit what is left of the budget: ``total`` while they do; fewer
        steps when they no longer do; more when :data:`STRETCH` times as many steps fit (a machine that turned
        faster), at most ``max_steps``. Checked every :data:`CHECK_EVERY` steps with several processes, the main
        process's answer on all."""
        self.ends.append(time.perf_counter())
        if step >= total or (self.accelerator.num_processes > 1 and step % CHECK_EVERY):
            return total
        room = self.room(plan, evaluations)
        fits = self.fitting(step, plan, evaluations, room)
        if step + room < total or (len(self.ends) > RECENT_STEPS and fits > STRETCH * total):
            total = min(fits, max_steps) if max_steps > 0 else fits
        return int(self.agreed(float(total)))
