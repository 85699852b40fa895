"""The non-finite loss guard: a diverged loss stops the run without a per-step host sync.

``observe`` records, on the device, the first step whose loss terms were not all finite, and the
terms at that step; ``check`` reads that once (at log intervals and before every checkpoint) and
raises :class:`NonFiniteLoss` naming the step and every term. A checkpoint is never written after
the loss diverged, so the newest one on disk is the last good one.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

#: Fault injection for tests and cluster checks: the non-finite guard sees the losses of this
#: step as NaN (the weights are not touched), exactly as if the loss had diverged there.
FAULT_NAN_STEP_ENV = "CV_RECIPES_FAULT_NAN_AT_STEP"


class NonFiniteLoss(RuntimeError):
    """A loss term became NaN or infinite; the message names the step and every term."""


class NonFiniteGuard:
    """Remembers, on the device, the first step whose losses were not finite.

    ``observe`` queues a few tiny kernels and never synchronises; ``check`` (at log intervals
    and before every checkpoint) reads the result once and raises :class:`NonFiniteLoss`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] = []
        self.bad_step = torch.full((), -1.0, device=device)
        self.terms: torch.Tensor | None = None
        fault = os.environ.get(FAULT_NAN_STEP_ENV, "")
        self._fault_step = int(fault) if fault.strip() else None

    def observe(self, step: int, losses: dict[str, torch.Tensor]) -> None:
        values = torch.stack([v.detach().float().reshape(()) for v in losses.values()])
        if self._fault_step == step:
            values = values * float("nan")
        if self.terms is None:
            self.names = list(losses)
            self.terms = torch.zeros_like(values)
        first = ~torch.isfinite(values).all() & (self.bad_step < 0)
        self.bad_step = torch.where(first, float(step), self.bad_step)
        self.terms = torch.where(first, values, self.terms)

    def check(self, accelerator: Accelerator, last_checkpoint: str = "") -> None:
        if self.terms is None:
            return
        packed = torch.cat([self.bad_step.reshape(1), self.terms])
        rows = accelerator.gather(packed).reshape(-1, packed.numel()).tolist()
        bad = [r for r in rows if r[0] >= 0]
        if not bad:
            return
        row = min(bad, key=lambda r: r[0])
        terms = ", ".join(f"{n}={v:.6g}" for n, v in zip(self.names, row[1:]))
        where = f"; last good checkpoint: {last_checkpoint}" if last_checkpoint else "; no checkpoint was saved"
        raise NonFiniteLoss(f"non-finite loss at step {int(row[0])}: {terms}{where}")
