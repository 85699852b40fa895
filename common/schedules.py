"""Per-step schedules with linear warmup, for learning rate, weight decay, EMA momentum, temperatures.

A schedule is a NumPy array with one value per optimizer step (index = step). Arrays are
stateless, so resuming at step ``s`` needs nothing but ``s``; they also make the curve easy to
plot and test. 100 epochs x 5,000 steps is 500,000 float64 values: 4 MB.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

KINDS = ("cosine", "linear", "step", "poly", "constant")


def schedule(
    kind: str,
    start: float,
    end: float,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_start: float = 0.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    power: float = 1.0,
) -> np.ndarray:
    """Values for steps ``0 .. total_steps-1``.

    Warmup: linear from ``warmup_start`` at step 0 to ``start`` at step ``warmup_steps``.
    After warmup, with ``t`` going from 0 to 1 over the remaining steps (``t = 1`` on the last):

    - ``cosine``: ``end + (start - end) * (1 + cos(pi t)) / 2``
    - ``linear``: ``start + (end - start) * t``
    - ``poly``: ``end + (start - end) * (1 - t) ** power``
    - ``step``: ``start * gamma ** k`` with ``k`` the number of ``milestones`` (absolute steps) passed
    - ``constant``: ``start``
    """
    if kind not in KINDS:
        raise ValueError(f"unknown schedule '{kind}', expected one of {', '.join(KINDS)}")
    total_steps = max(int(total_steps), 1)
    warmup_steps = min(max(int(warmup_steps), 0), total_steps)
    steps = np.arange(total_steps, dtype=np.float64)
    decay_len = max(total_steps - warmup_steps - 1, 1)
    t = np.clip((steps - warmup_steps) / decay_len, 0.0, 1.0)
    if kind == "cosine":
        values = end + (start - end) * 0.5 * (1.0 + np.cos(math.pi * t))
    elif kind == "linear":
        values = start + (end - start) * t
    elif kind == "poly":
        values = end + (start - end) * (1.0 - t) ** power
    elif kind == "step":
        passed = np.searchsorted(np.sort(np.asarray(milestones, dtype=np.float64)), steps, side="right")
        values = start * gamma ** passed.astype(np.float64)
    else:
        values = np.full(total_steps, float(start))
    if warmup_steps > 0:
        values[:warmup_steps] = np.linspace(warmup_start, start, warmup_steps, endpoint=False)
    return values


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer param groups of ``model``'s trainable parameters: weights and kernels (ndim > 1)
    decayed by ``weight_decay``, and biases and other 1-D parameters (norms, weight-norm magnitudes)
    not decayed. The scales are explicit (1 and 0), so :func:`set_group_values` keeps the second
    group at zero whatever the first group's starting value, 0 included."""
    params = [p for p in model.parameters() if p.requires_grad]  # frozen stages stay out
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay, "weight_decay_scale": 1.0},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "weight_decay_scale": 0.0},
    ]


def set_group_values(optimizer: torch.optim.Optimizer, name: str, value: float) -> None:
    """Set ``group[name] = value * group[name + '_scale']`` for every param group.

    The per-group scale lets one schedule drive groups that differ by a factor: timm's layer
    decay writes ``lr_scale``; a backbone at a tenth of the head's rate sets ``lr_scale = 0.1``.
    A group without a scale gets one on first call: 1.0, or 0.0 when the group was created with
    ``group[name] == 0`` (so a no-weight-decay group for biases and norms stays at zero).
    """
    key = f"{name}_scale"
    for group in optimizer.param_groups:
        if key not in group:
            group[key] = 0.0 if group.get(name, 1.0) == 0 else 1.0
        group[name] = value * group[key]


def steps_total(epochs: int, steps_per_epoch: Any, max_steps: int = 0) -> int:
    """Optimizer steps in the whole run: ``steps_per_epoch`` (an int, or a function of the epoch)
    summed over epochs, capped by ``max_steps`` (0 = no cap)."""
    per_epoch = steps_per_epoch if callable(steps_per_epoch) else (lambda e: steps_per_epoch)
    total = sum(per_epoch(e) for e in range(epochs))
    return min(total, max_steps) if max_steps > 0 else total


# epoch counts that start something (a milestone) or last from the start (a warmup): a run that ends before them
# never gets there. Those of another phase (DETR's crop pre-training) and warmup_epochs (its own line) are not here.
_UNREACHED_SKIP = ("epochs", "warmup_epochs", "pretrain_crops_epochs", "no_aug_epochs")


def schedule_warnings(cfg: Any, total_steps: int, steps_per_epoch: int) -> list[str]:
    """Lines for under the start banner when the schedule does not fit the run (it still starts): warmup that
    lasts the whole run, an evaluation interval longer than the run (the only evaluation is then its last), and
    any other epoch count of the config (``*_epochs``, ``*_epoch``, ``decay_milestones``, ``freeze_last_layer``)
    the run never reaches; ``no_aug_epochs``: an end phase the run never reaches, or one covering all of it."""
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
    for name, value in vars(cfg).items():
        counted = name.endswith(("_epochs", "_epoch")) or name in ("decay_milestones", "freeze_last_layer")
        if not counted or name in _UNREACHED_SKIP or isinstance(value, bool):
            continue
        late = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int | float) and v > 0]
        if late := [v for v in late if v >= epochs]:
            lasting = name.startswith(("warmup", "freeze"))  # a phase from the start, else something that starts
            where = "outlasts the run" if lasting else "lies at or past the end of the run"
            warnings.append(
                f"warning: {name} {', '.join(f'{v:g}' for v in late)} {where} ({epochs} epochs): lower it, or give "
                "--max_time to lay the schedules out over the run's length"
            )
    no_aug = getattr(cfg, "no_aug_epochs", 0)
    if no_aug and (getattr(cfg, "mosaic", 0) or getattr(cfg, "mixup", 0)):
        if no_aug >= cfg.epochs:
            warnings.append(f"warning: no_aug_epochs {no_aug} >= epochs {cfg.epochs}: mosaic and mixup never happen")
        elif epochs <= cfg.epochs - no_aug:
            warnings.append(
                f"warning: no_aug_epochs {no_aug}: the run ends (epoch {epochs}) before its last {no_aug} epochs "
                "without mosaic and mixup"
            )
    return warnings


def _two_values(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 3 significant digits, or as many more as tell them apart (at most 12)."""
    for digits in range(3, 13):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def resumed_schedule(extra: dict[str, Any], total_steps: int, step: int, lr: Sequence[float] | None) -> str:
    """After a resume at ``step`` (optimizer steps done), one line for every change of the schedule the
    checkpoint was trained on, '' when there is none. ``extra``: the checkpoint's ``schedule_steps`` (its
    length), ``next_lr`` (the lr its next step would have had; absent once the run is finished) and ``last_lr``
    (the lr of its last step done); ``lr``: this run's value per step. Said are another length (another
    ``max_steps`` or ``epochs``: the decay stretches or squeezes over what is left) and the lr the
    next step jumps to wherever it is not the one the checkpoint planned (another ``lr``, warmup, schedule or
    length), including a finished run extended, which planned no next step: then the jump is from the lr of
    its last step, where the checkpoint records it."""
    if step == 0:  # a fresh start: nothing was planned
        return ""
    old = extra.get("schedule_steps")
    finished = old is not None and step >= old  # its checkpoint's next_lr, if any, is an earlier save's
    parts = (
        [f"the schedule is now {total_steps:,} optimizer steps, was {old:,}"] if old not in (None, total_steps) else []
    )
    new = float(lr[step]) if lr is not None and step < len(lr) else None
    if new is not None and finished:
        if "last_lr" in extra:
            last, now = _two_values(float(extra["last_lr"]), new)
            parts.append(
                f"the lr goes from {last} (step {step}, the last of the finished run) to {now} at step {step + 1}"
            )
        else:
            parts.append(f"the lr of step {step + 1} is {new:.3g} (the finished run planned no step {step + 1})")
    elif new is not None and "next_lr" in extra:
        planned = float(extra["next_lr"])
        if not math.isclose(planned, new, rel_tol=1e-9, abs_tol=1e-15):  # float noise is no jump
            was, now = _two_values(planned, new)
            parts.append(f"the lr of step {step + 1} goes from {was} to {now}")
        elif parts:  # another length that leaves this step's value as it was
            parts.append(f"the lr of step {step + 1} stays {new:.3g}")
    return f"resume: {'; '.join(parts)}" if parts else ""


class LaidOut:
    """A recipe's schedules over its run's length: ``lay_out(length)`` (a name -> one value per step of
    ``length.steps``) as :class:`common.loop.Loop` calls it, then per step (:meth:`value`). A budgeted run has only
    every schedule's first value until its plan (:meth:`plan`: the timing steps keep them, the schedules are laid
    over the steps after), and may lay the rest over fewer or more steps later (:meth:`refit`)."""

    def __init__(self, lay_out: Callable[[Any], Mapping[str, Any]] | None, length: Any) -> None:
        self.lay_out, self.length = lay_out, length
        self.values = self._laid(length)
        if length.budgeted:  # until planned: every schedule's starting value
            self.values = {k: v[:1] for k, v in self.values.items()}
        self.first = {k: float(v[0]) for k, v in self.values.items()}  # what the timing steps train with

    def _laid(self, length: Any) -> dict[str, np.ndarray]:
        values = self.lay_out(length) if self.lay_out is not None else {}
        return {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}

    def value(self, name: str, step: int) -> float:
        values = self.values[name]
        return float(values[min(step, len(values) - 1)])

    def relay(self, length: Any) -> None:
        """The schedules over another length, from its step ``length.timing`` on (the steps before it keep their
        first values)."""
        self.length = length
        laid = self._laid(length)
        self.values = {k: np.concatenate([np.full(length.timing, self.first[k]), v]) for k, v in laid.items()}

    def refit(self, at: int, was: int, total: int) -> None:
        """Every schedule's values from step ``at`` to ``was``, resampled (linearly) onto ``total - at`` steps: the
        same curve from where it is to its end, faster or slower."""
        for name, values in self.values.items():
            rest = values[at:was]
            if len(rest) > 1:
                n = max(total - at, 1)  # one step left: the curve's end
                points = np.linspace(0, len(rest) - 1, n) if n > 1 else np.array([len(rest) - 1.0])
                self.values[name] = np.concatenate([values[:at], np.interp(points, np.arange(len(rest)), rest)])
