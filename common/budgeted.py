"""The time-budget half of :class:`common.loop.Loop` (``--max_time``): the timing of the first steps, the plan and
its schedules, the speed followed afterwards and the schedules' rest laid over the steps that fit, the evaluations
left out to end in time. The numbers: :mod:`common.budget`; what a user sees: docs/scaling.md."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from common.budget import BudgetClock, Length, Plan, epochs_for
from common.meters import format_seconds
from common.schedules import LaidOut, steps_total

#: Optimizer steps a run takes where it cannot time its steps: its budget was spent before the first step
SHORT_RUN = 6


class BudgetedLoop:
    """Mixed into :class:`common.loop.Loop`, whose state it reads and sets (``run``, ``cfg``, ``step``, ``epoch``,
    ``total_steps``, ``schedules``, ``extra``, ``progress``)."""

    run: Any
    cfg: Any
    step: int
    epoch: int
    total_steps: int
    steps_per_epoch: Any
    eval_images: int | None
    extra: dict[str, Any]
    progress: Any
    schedules: Any
    budget_s: float
    plan: Plan | None
    eval_every: int  # epochs between two evaluations: the plan's, then spread over a refit's epochs
    clock: BudgetClock
    _first_step_s: float

    @property
    def length(self) -> Length:
        return self.schedules.length

    @property
    def _unplanned(self) -> bool:
        return bool(self.budget_s) and self.plan is None

    def _apply(self, plan: Plan) -> None:
        """Lay the schedules over ``plan``'s steps after its timing steps (those keep every schedule's first
        value), and end the run there."""
        self.plan, self.eval_every = plan, plan.eval_every
        steps = plan.steps - plan.timing
        self.schedules.relay(Length(steps, self.steps_per_epoch, plan.epochs, self.cfg.epochs, plan.timing, True))
        self.total_steps = plan.steps
        self.extra["plan"] = plan.as_dict()
        if self.progress is not None:
            self.progress.total = plan.steps
            self.progress.refresh()

    def _time_steps(self) -> None:
        """A budgeted run's timing, after each step until planned; once enough are timed, the plan (the same on
        every process), its line and its schedules."""
        if not self.clock.timed(self.cfg.max_steps):
            return
        self._apply(self.clock.plan(self.cfg, self.step, self.steps_per_epoch, self.eval_images))
        assert self.plan is not None
        self.run.print(self.plan.describe(self._first_step_s, self.length.per_epoch(0)))
        self.run.log({"time/planned_steps": float(self.plan.steps)}, self.step, echo=False)

    def budget_left(self) -> float:
        """Seconds of ``--max_time`` left (infinite without one)."""
        return self.clock.left() if self.budget_s else math.inf

    def _evaluations_left(self) -> int:
        """The evaluations from this epoch's on, the final one included."""
        return sum(1 for e in range(self.epoch, self.length.epochs) if self._eval_at(e)) or 1  # type: ignore[attr-defined]

    def _keep_time(self) -> None:
        """After a planned step: where the steps left, the evaluations to come and the end no longer fit what is
        left of the budget (a busier machine), or leave much of it unused (a faster one), the rest of every schedule
        is laid over the steps that fit (:meth:`_refit`): the decay still runs to its end, within the budget. Said
        once each way; kept in the checkpoints for a resume."""
        assert self.plan is not None
        if self.plan.step_s <= 0:  # a plan made without timing (a budget spent before the first step): kept
            return
        total = self.clock.fit(self.step, self.total_steps, self.plan, self._evaluations_left(), self.cfg.max_steps)
        if total == self.total_steps:
            return
        how = "slower" if total < self.total_steps else "faster"
        if how not in self._refit_directions():
            step_s = self.clock.step_s(self.plan.step_s)
            self.run.print(
                f"max_time: the steps run {how} than timed ({step_s:.2f} s/step, timed {self.plan.step_s:.2f}): the "
                f"schedules' rest after step {self.step:,} is laid over {total - self.step:,} steps, to step "
                f"{total:,} (was {self.total_steps:,}), so that the decay, the evaluations and the weights end "
                "within the budget"
            )
        self.extra.setdefault("refit", []).append([self.step, total])
        self._refit(self.step, total)

    def _refit_directions(self) -> set[str]:
        """The ways the run's refits went so far ("slower": fewer steps, "faster": more)."""
        assert self.plan is not None
        was, ways = self.plan.steps, set()
        for _, total in self.extra.get("refit", []):
            ways.add("slower" if total < was else "faster")
            was = total
        return ways

    def _refit(self, at: int, total: int) -> None:
        """Every schedule's values from step ``at`` on, resampled (linearly) onto ``total - at`` steps: the same
        curve from where it is to its end, faster or slower; the run now ends at ``total``."""
        self.schedules.refit(at, self.total_steps, total)
        self.total_steps = total
        self.schedules.length = dataclasses.replace(self.length, epochs=epochs_for(total, self.steps_per_epoch))
        assert self.plan is not None  # the plan's evaluations, spread over the epochs the run now has
        self.eval_every = max(1, math.ceil(self.length.epochs / math.ceil(self.plan.epochs / self.plan.eval_every)))
        if self.progress is not None:
            self.progress.total = total
            self.progress.refresh()

    def _resume_budget(self) -> None:
        """A resumed budgeted run: the time its sessions spent counts; the plan and refits its checkpoint holds (no
        timing again), laid over the steps that fit what is left (one line); a checkpoint of a run started without a
        budget: the budget is ignored, with a line."""
        self.clock.spent_before = float(self.extra.get("spent_s", 0.0))
        if "plan" in self.extra:  # the same steps and schedules as the run it continues
            self._apply(Plan(**self.extra["plan"]))
            for at, total in self.extra.get("refit", []):
                self._refit(at, total)
            assert self.plan is not None
            if self.plan.step_s <= 0:  # planned without timing: its few steps as they were
                return
            fits = self.clock.fitting(self.step, self.plan, self._evaluations_left())
            fits = int(self.clock.agreed(float(min(fits, self.cfg.max_steps or fits))))
            self.run.print(
                f"resume: {format_seconds(self.clock.spent_before)} of max_time {format_seconds(self.budget_s)} spent; "
                f"{fits:,} steps fit, the plan had {self.total_steps:,}"
                + (f": its rest laid over the steps to {fits:,}" if fits < self.total_steps else "")
            )
            if fits < self.total_steps:
                self.extra.setdefault("refit", []).append([self.step, fits])
                self._refit(self.step, fits)
        elif self.step > 0 and "max_time_s" not in self.extra:
            self.run.print("warning: max_time is ignored: the run it resumes was started without one")
            self.budget_s, cfg = 0.0, self.cfg
            total = steps_total(cfg.epochs, self.steps_per_epoch, cfg.max_steps)
            self.schedules = LaidOut(self.schedules.lay_out, Length(total, self.steps_per_epoch, *[cfg.epochs] * 2))
            self.total_steps = total
        elif self.step > 0:
            spent, budget = format_seconds(self.clock.spent_before), format_seconds(self.budget_s)
            self.run.print(f"resume: {spent} of max_time {budget} spent before the plan; the steps are timed again")
        spent_out = bool(self.clock.agreed(float(self.clock.left() <= 0)))  # the main process's clock decides
        if self._unplanned and (spent_out or 0 < self.cfg.max_steps - self.step <= SHORT_RUN):
            self._plan_untimed(spent_out)

    def _plan_untimed(self, spent_out: bool) -> None:
        """Plan before the first step, without timing: the budget is spent already (start-up took it), or
        ``max_steps`` leaves too few steps to time them. The schedules are laid over the steps the run will take
        (:data:`SHORT_RUN`, or to ``max_steps``), the final evaluation only; a spent budget is said in one line."""
        cfg, spent = self.cfg, self.clock.spent()
        total = self.step + SHORT_RUN if spent_out else cfg.max_steps
        total = min(total, cfg.max_steps) if cfg.max_steps else total
        epochs = epochs_for(total, self.steps_per_epoch)
        end_s = self.clock.end_s(cfg)
        self._apply(Plan(self.budget_s, total, self.step, epochs, epochs, 0.0, 0.0, end_s))
        if spent_out:
            self.run.print(
                f"warning: max_time {format_seconds(self.budget_s)} was spent before the first step "
                f"({format_seconds(spent)} spent): the run trains {total - self.step} steps, its whole schedule laid "
                "over them, then its final evaluation"
            )

    def _evaluation_fits(self) -> bool:
        """Whether an evaluation before the last leaves time for the steps left at their recent speed, the final
        evaluation and the end; one that does not is left out (said once)."""
        assert self.plan is not None
        eval_s = self.clock.eval_s or self.plan.eval_s
        rest = (self.total_steps - self.step) * self.clock.step_s(self.plan.step_s) + 2 * eval_s + self.plan.end_s
        if self.clock.agreed(float(self.budget_left() >= rest)):  # the main process's clock decides for all
            return True
        if not self.extra.get("evaluations_left_out"):
            self.run.print(f"max_time: the evaluation of epoch {self.epoch} left out to end in time")
        self.extra["evaluations_left_out"] = self.extra.get("evaluations_left_out", 0) + 1
        return False
