"""The classifier's loss rule (recipes/classifier_model.create_criterion), on seeded random logits: which loss a
config gets and what target distribution it compares the softmax (or the sigmoids) with. A copier who changes
the rule (another smoothing, BCE targets, what Mixup's targets are) fails the test that names it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT

sys.path.insert(0, str(ROOT / "recipes"))
from classifier_model import create_criterion  # noqa: E402

CASES = 50


def config(**fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{"smoothing": 0.0, "bce_loss": False, "bce_target_thresh": 0.0, **fields})


def cases(seed: int):
    """(logits [B, K], class indices [B]) of random sizes and scales."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(CASES):
        b, k = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
        scale = float(torch.rand((), generator=g)) * 8
        yield torch.randn(b, k, generator=g) * scale, torch.randint(0, k, (b,), generator=g)


def soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a target distribution [B, K], mean over the batch."""
    return -(target * F.log_softmax(logits, -1)).sum(-1).mean()


def test_classifier_without_smoothing_or_mixup_is_plain_cross_entropy():
    criterion = create_criterion(config(), mixed=False)
    for logits, labels in cases(0):
        assert criterion(logits, labels) == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)


def test_classifier_label_smoothing_moves_smoothing_onto_a_uniform_over_every_class():
    """Target: (1 - s) on the label plus s / K on every class (the label included), as timm and Inception-v3."""
    for s in (0.1, 0.3):
        criterion = create_criterion(config(smoothing=s), mixed=False)
        for logits, labels in cases(1):
            k = logits.shape[1]
            target = (1 - s) * F.one_hot(labels, k).float() + s / k
            assert criterion(logits, labels) == pytest.approx(float(soft_ce(logits, target)), rel=1e-5, abs=1e-6)


def test_classifier_mixup_targets_are_taken_as_given_without_smoothing_them_again():
    criterion = create_criterion(config(smoothing=0.1), mixed=True)
    g = torch.Generator().manual_seed(2)
    for logits, _ in cases(2):
        target = torch.softmax(torch.randn(logits.shape, generator=g) * 3, -1)  # any soft distribution
        assert criterion(logits, target) == pytest.approx(float(soft_ce(logits, target)), rel=1e-5, abs=1e-6)


def test_classifier_bce_is_one_sigmoid_per_class_with_smoothing_spread_as_off_values():
    """Hard labels: target 1 - s + s / K on the label and s / K elsewhere, one BCE per class, mean over all."""
    s = 0.1
    criterion = create_criterion(config(bce_loss=True, smoothing=s), mixed=False)
    for logits, labels in cases(3):
        k = logits.shape[1]
        target = F.one_hot(labels, k).float() * (1 - s) + s / k
        expected = F.binary_cross_entropy_with_logits(logits, target)
        assert criterion(logits, labels) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)


def test_classifier_bce_target_threshold_binarises_mixed_targets():
    criterion = create_criterion(config(bce_loss=True, bce_target_thresh=0.2), mixed=True)
    g = torch.Generator().manual_seed(4)
    for logits, _ in cases(4):
        target = torch.softmax(torch.randn(logits.shape, generator=g) * 3, -1)
        expected = F.binary_cross_entropy_with_logits(logits, (target > 0.2).float())
        assert criterion(logits, target) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)


def test_classifier_loss_falls_as_the_label_logit_rises():
    """For every rule: raising the true class's logit (others fixed) lowers the loss."""
    for cfg in (config(), config(smoothing=0.1), config(bce_loss=True)):
        criterion = create_criterion(cfg, mixed=False)
        for logits, labels in cases(5):
            higher = logits.clone()
            higher[torch.arange(len(labels)), labels] += 1.0
            assert criterion(higher, labels) < criterion(logits, labels)
