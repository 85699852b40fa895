"""common/schedules.py: values at warmup end, midpoint and end; per-group scaling; the line a resume prints for
every jump of the learning rate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.schedules import resumed_schedule, schedule, set_group_values, weight_decay_groups

# 10 warmup steps, then 101 steps of decay: t = (step - 10) / 100, so step 60 is the midpoint.
TOTAL, WARMUP = 111, 10


def test_warmup_is_linear_and_ends_at_peak():
    v = schedule("cosine", 1.0, 0.0, TOTAL, WARMUP, warmup_start=0.1)
    assert v[0] == pytest.approx(0.1)
    assert v[5] == pytest.approx(0.1 + 0.9 * 5 / 10)
    assert v[WARMUP] == pytest.approx(1.0)  # first step after warmup is the peak


@pytest.mark.parametrize(
    "kind, mid, end",
    [
        ("cosine", 0.5 * (1.0 + 0.1), 0.1),  # (1 + cos(pi/2))/2 = 0.5 between 1.0 and 0.1
        ("linear", 1.0 + (0.1 - 1.0) * 0.5, 0.1),
        ("poly", 0.1 + 0.9 * 0.5**2, 0.1),  # power 2
        ("constant", 1.0, 1.0),
    ],
)
def test_midpoint_and_end(kind, mid, end):
    v = schedule(kind, 1.0, 0.1, TOTAL, WARMUP, power=2.0)
    assert len(v) == TOTAL
    assert v[60] == pytest.approx(mid)
    assert v[-1] == pytest.approx(end)


def test_cosine_quarter_point():
    v = schedule("cosine", 2.0, 0.0, TOTAL, WARMUP)
    assert v[35] == pytest.approx(1.0 + math.cos(math.pi / 4))


def test_step_drops_at_milestones():
    v = schedule("step", 0.02, 0.0, 100, 5, milestones=[60, 80], gamma=0.1)
    assert v[59] == pytest.approx(0.02) and v[60] == pytest.approx(0.002)
    assert v[79] == pytest.approx(0.002) and v[80] == pytest.approx(0.0002) and v[-1] == pytest.approx(0.0002)


def test_increasing_schedule_for_momentum():
    v = schedule("cosine", 0.996, 1.0, 1000)
    assert v[0] == pytest.approx(0.996) and v[-1] == pytest.approx(1.0) and np.all(np.diff(v) >= 0)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown schedule 'cosin'"):
        schedule("cosin", 1.0, 0.0, 10)


def test_group_scaling_and_no_decay_group():
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.05}, {"params": [b], "weight_decay": 0.0, "lr_scale": 0.1}], lr=1.0
    )
    set_group_values(opt, "lr", 0.5)
    set_group_values(opt, "weight_decay", 0.4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05])
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.4, 0.0])
    set_group_values(opt, "weight_decay", 0.04)  # the scale found on first call sticks
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.04, 0.0])


def test_weight_decay_groups_split_and_follow_the_schedule_from_zero():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].requires_grad_(False)  # frozen: in no group
    groups = weight_decay_groups(model, 0.0)
    assert [len(g["params"]) for g in groups] == [1, 3]  # Linear weight | Linear bias, norm weight and bias
    assert groups[0]["params"][0] is model[0].weight
    opt = torch.optim.AdamW(groups, lr=1.0)
    set_group_values(opt, "weight_decay", 0.4)  # a decay schedule that starts at 0 still reaches the first group
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.4, 0.0])


def saved(lr: np.ndarray, step: int, **earlier: float) -> dict:
    """The ``extra`` a checkpoint at ``step`` of the schedule ``lr`` holds, as common/loop.py's
    ``save_checkpoint`` writes it; ``earlier``: values an earlier save left in it."""
    extra = {**earlier, "schedule_steps": len(lr)}
    if step < len(lr):
        extra["next_lr"] = float(lr[step])
    if 0 < step <= len(lr):
        extra["last_lr"] = float(lr[step - 1])
    return extra


def test_extending_a_finished_run_says_the_lr_it_jumps_to():
    """4 steps of cosine from 1e-3 done, then --max_steps 8: step 5 restarts high on the longer cosine."""
    before, after = schedule("cosine", 1e-3, 0.0, 4), schedule("cosine", 1e-3, 0.0, 8)
    line = resumed_schedule(saved(before, 4), 8, 4, after)
    assert line == (
        f"resume: the schedule is now 8 optimizer steps, was 4; the lr goes from {before[3]:.3g} (step 4, the last "
        f"of the finished run) to {after[4]:.3g} at step 5"
    )
    # a checkpoint that does not record its last lr still names the new one; a next_lr that an earlier save of
    # the finished run left behind is not taken for the finished run's plan
    extra = {k: v for k, v in saved(before, 4, next_lr=float(before[2])).items() if k != "last_lr"}
    assert resumed_schedule(extra, 8, 4, after) == (
        f"resume: the schedule is now 8 optimizer steps, was 4; the lr of step 5 is {after[4]:.3g} (the finished "
        "run planned no step 5)"
    )


@pytest.mark.parametrize(
    "after, why",
    [
        (schedule("cosine", 3e-4, 1e-5, 20, 4), "another --lr"),
        (schedule("cosine", 1e-3, 1e-5, 20, 12), "a longer warmup: step 9 is still in it"),
        (schedule("step", 1e-3, 0.0, 20, 4, milestones=[6]), "another schedule kind"),
    ],
)
def test_a_resume_to_another_lr_of_the_same_length_says_so(after, why):
    before = schedule("cosine", 1e-3, 1e-5, 20, 4)
    assert resumed_schedule(saved(before, 8), 20, 8, after) == (
        f"resume: the lr of step 9 goes from {before[8]:.3g} to {after[8]:.3g}"
    ), why


def test_a_resume_onto_the_same_schedule_says_nothing():
    lr = schedule("cosine", 1e-3, 1e-5, 20, 4)
    assert resumed_schedule(saved(lr, 8), 20, 8, lr.copy()) == ""
    assert resumed_schedule(saved(lr, 8), 20, 8, None) == ""  # a recipe that keeps no lr values
    assert resumed_schedule(saved(lr, 20), 20, 20, lr) == ""  # a finished run resumed as it was: no step left
    assert resumed_schedule({}, 20, 0, lr) == ""  # a fresh start


def test_another_length_says_both_lengths_and_the_lr_of_the_next_step():
    before, squeezed = schedule("cosine", 1.0, 0.0, 18), schedule("cosine", 1.0, 0.0, 10)
    assert resumed_schedule(saved(before, 8), 10, 8, squeezed) == (
        f"resume: the schedule is now 10 optimizer steps, was 18; the lr of step 9 goes from {before[8]:.3g} to "
        f"{squeezed[8]:.3g}"
    )
    constant = schedule("constant", 0.01, 0.0, 18)  # a length that leaves the value where it was
    assert resumed_schedule(saved(constant, 8), 30, 8, schedule("constant", 0.01, 0.0, 30)) == (
        "resume: the schedule is now 30 optimizer steps, was 18; the lr of step 9 stays 0.01"
    )


def test_values_alike_to_3_digits_are_shown_with_the_digits_that_tell_them_apart():
    before = schedule("constant", 0.0010001, 0.0, 10)
    assert resumed_schedule(saved(before, 5), 10, 5, schedule("constant", 0.0010002, 0.0, 10)) == (
        "resume: the lr of step 6 goes from 0.0010001 to 0.0010002"
    )
