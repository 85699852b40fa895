"""Properties of YOLO's anchor-free head (recipes/yolo_free.py, ``--head free``): the task-aligned assignment
on a hand-checked toy and on many seeded random scenes, the three losses at a perfect prediction, their
gradients, fp32 geometry under bf16 autocast, and the decoding the export ships. Each test is named for the
rule it pins.

The rule (TOOD's task-aligned assignment as YOLOv8 uses it): a prediction is a candidate for a box when its
cell's centre lies inside the box; each box takes its top-k candidates by t = s^0.5 * IoU^6 (s: the predicted
probability of the box's class, IoU: of the predicted box with it); a prediction taken by several boxes goes
to the box it overlaps most; the class target is t / max t of the box x the box's best IoU.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch

from yolo_free import BINS, FREE_LOSS_TERMS, YOLOFree, assign_aligned, free_loss, small_backbone
from yolo_model import batch_iou

NUM_CLASSES = 3


@pytest.fixture(scope="module")
def model() -> YOLOFree:
    """The free head on a tiny timm backbone at strides 8, 16, 32 (the assignment reads its strides only)."""
    torch.manual_seed(0)
    backbone = timm.create_model("resnet10t", features_only=True, out_indices=(2, 3, 4))
    return YOLOFree(backbone, NUM_CLASSES, neck_channels=32, prior_size=64).eval()


def _targets(boxes: list[list[float]], labels: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
    return {
        "boxes": torch.tensor([boxes], dtype=torch.float32),
        "labels": torch.tensor([labels]),
        "weights": torch.tensor([weights], dtype=torch.float32),
    }


# ============================================================================================
# Assignment
# ============================================================================================
def test_free_assignment_of_a_two_box_toy_by_hand():
    """One level of stride 16 on a 64 x 64 image (cell centres 8, 24, 40, 56), top-2, all scores 0.5.
    Box A [0, 0, 32, 32] (class 0, weight 1) holds the centres (8|24, 8|24); box B [20, 20, 64, 64]
    (class 1, mixup weight 0.5) holds those with x, y in {24, 40, 56}; (24, 24) is inside both.
    Predicted boxes: at (24, 24) exactly A, at (8, 8) [0, 0, 30, 30] (IoU with A 900/1024), at (40, 40) exactly
    B, elsewhere a 1-px box in the corner (no overlap with either). By hand:
    A's top-2: (24, 24) (t = 0.5^0.5 * 1), (8, 8) (t = 0.5^0.5 * (900/1024)^6); the others 0.
    B's top-2: (40, 40) (IoU 1) and (24, 24) (IoU of A's box with B = 144 / 2816); (24, 24) overlaps A more,
    so it stays A's. Positives: (8, 8) and (24, 24) for A, (40, 40) for B.
    Soft targets: A's best IoU is 1 and its best t at (24, 24): 1 there, (900/1024)^6 at (8, 8); B: 1 x 0.5."""
    xs = torch.tensor([8.0, 24.0, 40.0, 56.0])
    points = torch.stack(torch.meshgrid(xs, xs, indexing="xy"), -1).reshape(-1, 2)  # (x, y), row by row
    index = {tuple(p.tolist()): i for i, p in enumerate(points)}
    boxes = torch.tensor([[63.0, 0.0, 64.0, 1.0]]).repeat(16, 1)
    boxes[index[(24.0, 24.0)]] = torch.tensor([0.0, 0.0, 32.0, 32.0])
    boxes[index[(8.0, 8.0)]] = torch.tensor([0.0, 0.0, 30.0, 30.0])
    boxes[index[(40.0, 40.0)]] = torch.tensor([20.0, 20.0, 64.0, 64.0])
    scores = torch.full((1, 16, 2), 0.5)
    t = _targets([[0, 0, 32, 32], [20, 20, 64, 64], [0, 0, 0, 0]], [0, 1, 0], [1.0, 0.5, 0.0])  # and a padding row
    a = assign_aligned(scores, boxes[None], points, t["boxes"], t["labels"], t["weights"], topk=2)
    positives = {tuple(points[i].tolist()) for i in a["positive"][0].nonzero()[:, 0].tolist()}
    assert positives == {(8.0, 8.0), (24.0, 24.0), (40.0, 40.0)}
    expected = torch.zeros(16, 2)
    expected[index[(24.0, 24.0)], 0] = 1.0
    expected[index[(8.0, 8.0)], 0] = (900 / 1024) ** 6
    expected[index[(40.0, 40.0)], 1] = 0.5
    assert torch.allclose(a["scores"][0], expected, atol=1e-6)
    assert a["boxes"][0, index[(24.0, 24.0)]].tolist() == [0, 0, 32, 32]
    assert a["boxes"][0, index[(40.0, 40.0)]].tolist() == [20, 20, 64, 64]
    assert a["labels"][0, index[(40.0, 40.0)]] == 1


def _scene(gen: torch.Generator, model: YOLOFree, boxes: int, padding: int = 2):
    """A random image size (multiples of 32, 64..192 px), ``boxes`` random boxes (sides 4 px .. the image),
    ``padding`` garbage padding rows, random predicted boxes and scores: (points, scores, pred boxes, targets)."""
    h, w = (32 * int(torch.randint(2, 7, (1,), generator=gen)) for _ in range(2))
    points = model.tables(h, w, torch.device("cpu"))["points"]
    n = len(points)
    side = torch.exp(torch.rand(boxes, 2, generator=gen) * math.log(min(h, w) / 4)) * 4
    x0, y0 = torch.rand(boxes, generator=gen) * (w - side[:, 0]), torch.rand(boxes, generator=gen) * (h - side[:, 1])
    real = torch.stack([x0, y0, x0 + side[:, 0], y0 + side[:, 1]], -1)
    pad = torch.rand(padding, 4, generator=gen) * 64
    pad[:, 2:] += pad[:, :2] + 8
    centre = points + (torch.rand(n, 2, generator=gen) - 0.5) * 16
    size = torch.rand(n, 2, generator=gen) * 60 + 2
    pred = torch.cat([centre - size / 2, centre + size / 2], -1)
    targets = {
        "boxes": torch.cat([real, pad])[None],
        "labels": torch.randint(NUM_CLASSES, (1, boxes + padding), generator=gen),
        "weights": torch.cat([torch.rand(boxes, generator=gen) * 0.9 + 0.1, torch.zeros(padding)])[None],
    }
    return points, torch.rand(1, n, NUM_CLASSES, generator=gen), pred[None], targets


def _assign(points, scores, pred, t, topk=10):
    return assign_aligned(scores, pred, points, t["boxes"], t["labels"], t["weights"], topk=topk)


def test_free_positives_lie_inside_their_box_at_most_topk_each_and_padding_assigns_nothing(model):
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        boxes = int(torch.randint(1, 6, (1,), generator=gen))
        points, scores, pred, t = _scene(gen, model, boxes)
        a = _assign(points, scores, pred, t)
        pos = a["positive"][0]
        assigned = a["boxes"][0][pos]
        inside = (points[pos] > assigned[:, :2]).all(-1) & (points[pos] < assigned[:, 2:]).all(-1)
        assert inside.all()
        real = t["boxes"][0, :boxes]
        owner = (assigned[:, None, :] == real[None]).all(-1)  # which real box each positive took
        assert owner.any(-1).all(), "a positive took a padding row"
        assert (owner.sum(0) <= 10).all()
        without_padding = {k: v[:, :boxes] for k, v in t.items()}
        b = _assign(points, scores, pred, without_padding)
        assert torch.equal(a["positive"], b["positive"]) and torch.allclose(a["scores"], b["scores"])


def test_free_a_lone_box_takes_its_topk_best_aligned_candidates(model):
    """Alone in the image, a box takes min(k, candidates) positives, exactly those of highest alignment; a
    candidate whose predicted box misses the box (alignment 0) is never one."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(60):
        points, scores, pred, t = _scene(gen, model, 1, padding=0)
        a = _assign(points, scores, pred, t, topk=5)
        box, label = t["boxes"][0, 0], int(t["labels"][0, 0])
        inside = (points > box[:2]).all(-1) & (points < box[2:]).all(-1)
        iou = batch_iou(box[None, None], pred)[0, 0]
        metric = scores[0, :, label].sqrt() * iou**6 * inside
        expected = set(metric.topk(5).indices[: min(5, int((metric > 0).sum()))].tolist())
        assert set(a["positive"][0].nonzero()[:, 0].tolist()) == expected
        if expected:  # the best aligned positive gets the box's best IoU x its weight (t below 1e-9: less)
            best = max(expected, key=lambda i: float(metric[i]))
            top_iou, top = max(float(iou[i]) for i in expected), float(metric[best])
            soft = top_iou * float(t["weights"][0, 0]) * top / (top + 1e-9)
            assert float(a["scores"][0, best, label]) == pytest.approx(soft, rel=1e-4)


def test_free_a_prediction_two_boxes_take_goes_to_the_one_it_overlaps_most(model):
    gen = torch.Generator().manual_seed(3)
    contested = 0
    for _ in range(80):
        points, scores, pred, t = _scene(gen, model, 4, padding=0)
        a = _assign(points, scores, pred, t)
        alone = [_assign(points, scores, pred, {k: v[:, i : i + 1] for k, v in t.items()}) for i in range(4)]
        iou = batch_iou(t["boxes"], pred)[0]  # [4, N]
        for n in range(len(points)):
            takers = [i for i in range(4) if alone[i]["positive"][0, n]]
            if len(takers) > 1:
                contested += 1
                winner = max(takers, key=lambda i: float(iou[i, n]))
                assert torch.equal(a["boxes"][0, n], t["boxes"][0, winner])
    assert contested > 10  # the scenes did test the rule


# ============================================================================================
# Losses
# ============================================================================================
def _perfect_raw(model: YOLOFree, box: list[float], label: int, h: int, w: int) -> torch.Tensor:
    """Raw outputs that decode, at every cell whose centre is inside ``box``, to exactly ``box`` (each side's
    distance split between its two bins), with class probability ~1 for ``label`` there and ~0 elsewhere."""
    t = model.tables(h, w, torch.device("cpu"))
    b = torch.tensor(box)
    true = torch.cat([t["points"] - b[:2], b[2:] - t["points"]], -1) / t["strides"]  # [N, 4]
    inside = (true > 0).all(-1)
    true = true.clamp(0, BINS - 1 - 0.01)
    left = true.floor().long()
    p = torch.full((len(true), 4, BINS), 1e-12)
    p.scatter_(-1, left[..., None], (left + 1 - true)[..., None])
    p.scatter_(-1, left[..., None] + 1, (true - left)[..., None])
    cls = torch.full((len(true), NUM_CLASSES), -30.0)
    cls[inside, label] = 30.0
    return torch.cat([p.clamp(min=1e-12).log().flatten(1), cls], -1)[None], true, inside


def test_free_losses_at_a_perfect_prediction(model):
    """Box and class losses 0; the distribution focal loss at its minimum, the entropy of each side's two-bin
    target (it is 0 only for whole-stride distances), with a zero gradient there."""
    h = w = 64
    box, label = [20.0, 12.0, 44.0, 36.0], 2  # few cells inside (fewer than top-k): all of them are positives
    raw, true, inside = _perfect_raw(model, box, label, h, w)
    raw.requires_grad_(True)
    losses = free_loss(model, raw, _targets([box], [label], [1.0]), h, w)
    assert set(losses) == set(FREE_LOSS_TERMS)
    assert float(losses["loss_box"].detach()) < 1e-5 and float(losses["loss_cls"].detach()) < 1e-6
    frac = (true - true.floor())[inside]
    entropy = -(frac * frac.clamp(min=1e-12).log() + (1 - frac) * (1 - frac).clamp(min=1e-12).log()).mean(-1)
    assert float(losses["loss_dfl"].detach()) == pytest.approx(float(entropy.mean()), abs=1e-4)
    (grad,) = torch.autograd.grad(losses["loss_dfl"], raw)
    assert float(grad.abs().max()) < 1e-4


def test_free_losses_grow_as_the_prediction_moves_off_the_box(model):
    h = w = 64
    box = [20.0, 12.0, 44.0, 36.0]
    raw, _, _ = _perfect_raw(model, box, 0, h, w)
    t = _targets([box], [0], [1.0])
    previous = free_loss(model, raw, t, h, w)
    for shift in (1.0, 2.0, 4.0):
        moved = _perfect_raw(model, [box[0] + shift, box[1], box[2] + shift, box[3]], 0, h, w)[0]
        losses = free_loss(model, moved, t, h, w)
        assert losses["loss_box"] > previous["loss_box"] and losses["loss_dfl"] > previous["loss_dfl"]
        previous = losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_free_gradients_are_finite_and_geometry_is_fp32(model, dtype):
    """Random and extreme raw outputs (bf16 under autocast included): the decoded boxes, the targets and every
    loss are fp32 and finite, and so is the gradient; an image without boxes trains its classes to 0."""
    h, w = 96, 64
    n = sum(a * b for a, b in model.level_shapes(h, w))
    gen = torch.Generator().manual_seed(4)
    for scale in (1.0, 30.0):
        raw = (torch.randn(2, n, 4 * BINS + NUM_CLASSES, generator=gen) * scale).to(dtype).requires_grad_(True)
        t = _targets([[5, 5, 40, 70], [0, 0, 0, 0]], [1, 0], [1.0, 0.0])
        t = {k: torch.cat([v, torch.zeros_like(v)]) for k, v in t.items()}  # the 2nd image: padding only
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            boxes, scores = model.decode(raw, h, w)
            losses = free_loss(model, raw, t, h, w)
        assert boxes.dtype == scores.dtype == torch.float32
        assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values()), losses
        (grad,) = torch.autograd.grad(sum(losses.values()), raw)
        assert torch.isfinite(grad.float()).all()


def test_free_decoding_puts_each_box_around_its_cell_centre(model):
    """Distances decode to a box around the cell's centre: equal logits put every side at the bins' mean (7.5
    strides), and a box is (centre - (l, t) * stride, centre + (r, b) * stride)."""
    h, w = 64, 96
    n = sum(a * b for a, b in model.level_shapes(h, w))
    raw = torch.zeros(1, n, 4 * BINS + NUM_CLASSES)
    boxes, scores = model.decode(raw, h, w)
    t = model.tables(h, w, torch.device("cpu"))
    assert torch.allclose((boxes[0, :, :2] + boxes[0, :, 2:]) / 2, t["points"])
    assert torch.allclose(boxes[0, :, 2:] - boxes[0, :, :2], 15 * t["strides"].expand(-1, 2))
    assert torch.allclose(scores, torch.full_like(scores, 0.5))
    assert sorted({int(s) for s in t["strides"].flatten().tolist()}) == [8, 16, 32]
    assert len(t["points"]) == 8 * 12 + 4 * 6 + 2 * 3


def test_cs3darknet_xs_is_half_cs3darknet_s_width_at_strides_8_16_32():
    backbone = small_backbone("cs3darknet_xs")
    assert backbone.feature_info.channels() == [64, 128, 256]
    assert backbone.feature_info.reduction() == [8, 16, 32]
    s = timm.create_model("cs3darknet_s", features_only=True, out_indices=(2, 3, 4))
    assert [2 * c for c in backbone.feature_info.channels()] == s.feature_info.channels()


def test_free_losses_are_normalised_by_the_mass_averaged_over_processes(model):
    """With several processes each loss is divided by the processes' mean soft-target mass (an all-reduce; at
    least 1), so that DDP's averaged gradient is one process's on the global batch."""
    h = w = 64
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(1, sum(a * b for a, b in model.level_shapes(h, w)), 4 * BINS + NUM_CLASSES, generator=gen)
    t = _targets([[4.0, 6.0, 50.0, 40.0], [30.0, 30.0, 60.0, 62.0]], [0, 2], [1.0, 1.0])
    alone = free_loss(model, raw, t, h, w)
    seen = []
    larger = free_loss(model, raw, t, h, w, lambda mass: seen.append(float(mass)) or 4 * mass)
    assert len(seen) == 1 and seen[0] > 0  # the two boxes' soft targets on this random prediction
    ratio = max(seen[0], 1.0) / max(4 * seen[0], 1.0)
    for k in FREE_LOSS_TERMS:
        assert float(larger[k]) == pytest.approx(float(alone[k]) * ratio, rel=1e-5), k
