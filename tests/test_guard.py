"""common/guard.py: the first non-finite step and its terms, recorded without host syncs."""

from __future__ import annotations

import types

import pytest
import torch

from common.guard import NonFiniteGuard, NonFiniteLoss

SINGLE = types.SimpleNamespace(gather=lambda t: t)  # one process: gather is the identity


def test_first_bad_step_and_all_terms_are_reported():
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(1, {"loss": torch.tensor(2.0), "box": torch.tensor(0.5)})
    guard.check(SINGLE)  # all finite: nothing happens
    guard.observe(2, {"loss": torch.tensor(float("inf")), "box": torch.tensor(0.25)})
    guard.observe(3, {"loss": torch.tensor(float("nan")), "box": torch.tensor(float("nan"))})
    with pytest.raises(
        NonFiniteLoss, match=r"^non-finite loss at step 2: loss=inf, box=0\.25; last good checkpoint: ckpt/step_1$"
    ):
        guard.check(SINGLE, "ckpt/step_1")


def test_fault_injection_marks_that_step(monkeypatch):
    monkeypatch.setenv("CV_RECIPES_FAULT_NAN_AT_STEP", "4")
    guard = NonFiniteGuard(torch.device("cpu"))
    for step in range(1, 4):
        guard.observe(step, {"loss": torch.tensor(1.0)})
    guard.check(SINGLE)
    guard.observe(4, {"loss": torch.tensor(1.0)})
    with pytest.raises(NonFiniteLoss, match="step 4: loss=nan; no checkpoint was saved"):
        guard.check(SINGLE)


def test_earliest_step_across_processes_wins():
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.observe(9, {"loss": torch.tensor(float("nan"))})
    other_rank = torch.tensor([5.0, float("inf")])  # another process went bad earlier
    two = types.SimpleNamespace(gather=lambda t: torch.cat([t, other_rank]))
    with pytest.raises(NonFiniteLoss, match="step 5: loss=inf"):
        guard.check(two)
