"""common/schedules.py: values at warmup end, midpoint and end; per-group scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.schedules import schedule, set_group_values, weight_decay_groups

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
