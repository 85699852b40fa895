"""The time-budget half of :class:`common.loop.Loop` (``--max_time``): the timing of the first steps, the plan and
its schedules, the speed followed afterwards and the schedules' rest laid over the steps that fit, the evaluations
left out to end in time. The numbers: :mod:`common.budget`; what a user sees: docs/scaling.md."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from common.budget import BudgetClock, Length, Plan, epochs_for
from common.schedules import LaidOut, steps_total


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
        self.plan = plan
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
        if not self.clock.timed():
            return
        self._apply(self.clock.plan(self.cfg, self.step, self.steps_per_epoch, self.eval_images))
        assert self.plan is not None
        self.run.print(self.plan.describe(self._first_step_s, self.length.per_epoch(0)))
        self.run.log({"time/planned_steps": float(self.plan.steps)}, self.step, echo=False)

    def budget_left(self) -> float:
        """Seconds of ``--max_time`` left (infinite without one)."""
        return self.clock.left() if self.budget_s else math.inf

    def _keep_time(self) -> None:
        """After a planned step: where the steps left, the final evaluation and the end no longer fit what is left
        of the budget (a busier machine), or leave much of it unused (a faster one), the rest of every schedule is
        laid over the steps that fit (:meth:`_refit`): the decay still runs to its end, within the budget. Said
        once each way; kept in the checkpoints for a resume."""
        assert self.plan is not None
        if not self.clock.timed_ends:  # a resumed session keeps its checkpoint's schedule: the budget was the start's
            return
        total = self.clock.fit(self.step, self.total_steps, self.plan, self.cfg.max_steps)
        if total == self.total_steps:
            return
        how = "slower" if total < self.total_steps else "faster"
        if not any((t < s) == (how == "slower") for s, t in self.extra.get("refit", [])):  # said once each way
            step_s = self.clock.step_s(self.plan.step_s)
            self.run.print(
                f"max_time: the steps run {how} than timed ({step_s:.2f} s/step, timed {self.plan.step_s:.2f}): the "
                f"schedules' rest after step {self.step:,} is laid over {total - self.step:,} steps, to step "
                f"{total:,} (was {self.total_steps:,}), so that the decay, the final evaluation and the weights "
                "end within the budget"
            )
        self.extra.setdefault("refit", []).append([self.step, total])
        self._refit(self.step, total)

    def _refit(self, at: int, total: int) -> None:
        """Every schedule's values from step ``at`` on, resampled (linearly) onto ``total - at`` steps: the same
        curve from where it is to its end, faster or slower; the run now ends at ``total``."""
        self.schedules.refit(at, self.total_steps, total)
        self.total_steps = total
        self.schedules.length = dataclasses.replace(self.length, epochs=epochs_for(total, self.steps_per_epoch))
        if self.progress is not None:
            self.progress.total = total
            self.progress.refresh()

    def _resume_budget(self) -> None:
        """A resumed budgeted run: the plan and refits its checkpoint holds (no timing again); a checkpoint of a run
        started without a budget: the budget is ignored, with a line."""
        if "plan" in self.extra:  # the same steps and schedules as the run it continues
            self._apply(Plan(**self.extra["plan"]))
            for at, total in self.extra.get("refit", []):
                self._refit(at, total)
            self.run.print(f"resume: max_time's plan kept: {self.total_steps:,} optimizer steps")
        elif self.step > 0 and "max_time_s" not in self.extra:
            self.run.print("warning: max_time is ignored: the run it resumes was started without one")
            self.budget_s, cfg = 0.0, self.cfg
            total = steps_total(cfg.epochs, self.steps_per_epoch, cfg.max_steps)
            self.schedules = LaidOut(self.schedules.lay_out, Length(total, self.steps_per_epoch, *[cfg.epochs] * 2))
            self.total_steps = total

    def _evaluation_fits(self) -> bool:
        """Whether an evaluation before the last leaves time for the steps left at their recent speed, the final
        evaluation and the end; one that does not is left out (said once)."""
        assert self.plan is not None
        eval_s = self.clock.eval_s or self.plan.eval_s
        rest = (self.total_steps - self.step) * self.clock.step_s(self.plan.step_s) + 2 * eval_s + self.plan.end_s
        if self.budget_left() >= rest:
            return True
        if not self.extra.get("evaluations_left_out"):
            self.run.print(f"max_time: the evaluation of epoch {self.epoch} left out to end in time")
        self.extra["evaluations_left_out"] = self.extra.get("evaluations_left_out", 0) + 1
        return False
