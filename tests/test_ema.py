"""common/ema.py: EMA math against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from common.ema import ModelEma, ema_update_


def test_ema_update_matches_formula():
    target = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    source = [torch.tensor([3.0, -2.0]), torch.tensor([[10.0]])]
    ema_update_(target, source, 0.9)
    assert torch.allclose(target[0], torch.tensor([0.9 * 1 + 0.1 * 3, 0.9 * 2 + 0.1 * -2]))
    assert torch.allclose(target[1], torch.tensor([[1.0]]))
    assert torch.equal(source[0], torch.tensor([3.0, -2.0]))  # sources untouched


def test_ema_update_casts_source_dtype():
    target = [torch.zeros(3)]
    ema_update_(target, [torch.ones(3, dtype=torch.bfloat16)], 0.5)
    assert target[0].dtype == torch.float32 and torch.allclose(target[0], torch.full((3,), 0.5))


def test_model_ema_warmup_and_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.99, warmup=True)
    assert all(not p.requires_grad for p in ema.module.parameters()) and not ema.module.training
    assert ema.momentum(0) == pytest.approx(1 / 10) and ema.momentum(10_000) == pytest.approx(0.99)

    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.fill_(4.0)
        model[1].num_batches_tracked.fill_(7)
    ema.update(model, step=0)  # momentum 0.1: the EMA moves 90 % of the way
    m = 0.1
    after = ema.module.state_dict()
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(after[k], m * before[k] + (1 - m) * v), k
    assert int(after["1.num_batches_tracked"]) == 7  # integer buffers are copied


def test_model_ema_without_warmup_and_state_dict():
    model = torch.nn.Linear(3, 1)
    ema = ModelEma(model, decay=0.5, warmup=False)
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.mul_(3.0)
    ema.update(model, step=1000)
    assert torch.allclose(ema.module.weight, 0.5 * w0 + 0.5 * 3.0 * w0)
    other = ModelEma(model, decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.module.weight, ema.module.weight)
