"""Properties of YOLO's target assignment and losses (recipes/yolo_model.py) on many seeded random scenes:
each test is named for the rule it pins, so that a copier who changes a rule sees which one broke.
tests/test_yolo.py checks the same functions against hand-computed values.

The rule (GluonCV's YOLOv3): each ground-truth box -> exactly one anchor, the one of all 3 x A whose shape
(both centred at 0) has the best IoU with the box's, at that anchor's level, in the cell holding the box's centre.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torchvision.ops import box_iou

from yolo_model import COCO_ANCHORS, YOLOv3, assign_targets, yolo_loss  # the model beside the recipe

SCENES = 100  # random scenes per assignment test
NUM_CLASSES = 4

# Two layouts: YOLOv3's (3 anchors per level, strides 32, 16, 8; COCO's anchors at a quarter of their
# 416 px size) and the demo's (1 anchor per level, strides 16, 8, 4). Anchors small to large, as the config.
LAYOUTS = {
    "yolov3": ((2, 3, 4), [[w / 4, h / 4] for w, h in COCO_ANCHORS]),
    "demo": ((1, 2, 3), [[10.0, 14.0], [24.0, 20.0], [40.0, 56.0]]),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request) -> tuple[YOLOv3, torch.Tensor]:
    """(model, anchors [3 * A, 2] as given: small to large): YOLOv3 on a timm features_only backbone, as
    recipes/yolo.py's create_model builds it (the assignment reads only its strides and anchors)."""
    out_indices, anchors = LAYOUTS[request.param]
    anchors = torch.tensor(anchors)
    torch.manual_seed(0)
    backbone = timm.create_model("resnet10t", features_only=True, out_indices=out_indices)
    return YOLOv3(backbone, NUM_CLASSES, anchors, neck_channels=8).eval(), anchors


def _shape_iou(wh: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """IoU of (w, h) [2] with each anchor [K, 2], both centred at the origin -> [K]."""
    inter = torch.minimum(wh, anchors).prod(-1)
    return inter / (wh.prod() + anchors.prod(-1) - inter)


def _scene(gen: torch.Generator, boxes: int, padding: int = 0) -> tuple[int, int, dict[str, torch.Tensor]]:
    """One image of a random size (multiples of 32, 64..192 px) with ``boxes`` random boxes inside it (sides
    log-uniform from 2 px to the image's side) and ``padding`` padding rows: (H, W, targets with a batch of 1)."""
    h, w = (32 * int(torch.randint(2, 7, (1,), generator=gen)) for _ in range(2))
    side = torch.exp(torch.rand(boxes, 2, generator=gen) * math.log(min(h, w) / 2)) * 2  # 2 .. min side px
    side = torch.minimum(side, torch.tensor([w, h], dtype=torch.float32))
    x0 = torch.rand(boxes, generator=gen) * (w - side[:, 0])
    y0 = torch.rand(boxes, generator=gen) * (h - side[:, 1])
    real = torch.stack([x0, y0, x0 + side[:, 0], y0 + side[:, 1]], -1)
    pad = torch.rand(padding, 4, generator=gen) * 64
    pad[:, 2:] += pad[:, :2] + 2  # garbage boxes that must be ignored
    targets = {
        "boxes": torch.cat([real, pad])[None],
        "labels": torch.randint(NUM_CLASSES, (1, boxes + padding), generator=gen),
        "weights": torch.cat([torch.rand(boxes, generator=gen) * 0.9 + 0.1, torch.zeros(padding)])[None],
    }
    return h, w, targets


def _expected_slot(model: YOLOv3, anchors: torch.Tensor, box: torch.Tensor, h: int, w: int) -> tuple:
    """The rule, written independently of assign_targets: (stride, cell x, cell y, anchor w, anchor h) of a box."""
    wh = (box[2:] - box[:2]).clamp(min=1.0)
    best = int(_shape_iou(wh, anchors).argmax())
    per_level = len(anchors) // 3
    stride = sorted(model.strides)[best // per_level]  # anchors small to large <-> strides small to large
    centre = (box[:2] + box[2:]) / 2
    cells = [math.ceil(w / stride), math.ceil(h / stride)]
    cell = [min(max(int(math.floor(float(c) / stride)), 0), n - 1) for c, n in zip(centre, cells)]
    return (stride, cell[0], cell[1], *anchors[best].tolist())


def _positives(model: YOLOv3, t: dict[str, torch.Tensor], h: int, w: int, image: int = 0) -> dict[tuple, int]:
    """The slots with a positive objectness target in ``image``: (stride, cell x, cell y, anchor w, anchor h) ->
    prediction index, read from the model's own per-prediction tables."""
    table = model.tables(h, w, torch.device("cpu"))
    out = {}
    for n in (t["obj"][image] > 0).nonzero()[:, 0].tolist():
        x, y = table["cells"][n].tolist()
        out[(int(table["strides"][n]), int(x), int(y), *table["anchors"][n].tolist())] = n
    return out


def _assign(model: YOLOv3, h: int, w: int, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return assign_targets(model, targets["boxes"], targets["labels"], targets["weights"], h, w)


def _pad(x: torch.Tensor, m: int) -> torch.Tensor:
    """A [1, M, ...] target row padded with zeros (weight 0: padding) to [1, m, ...], as the collate pads."""
    return torch.cat([x, x.new_zeros(1, m - x.shape[1], *x.shape[2:])], 1)


def _distinct_scenes(model, anchors, gen, count: int, max_boxes: int = 6):
    """Random scenes whose boxes claim distinct slots (no two boxes competing for one anchor of one cell)."""
    found = 0
    while found < count:
        h, w, targets = _scene(gen, int(torch.randint(1, max_boxes + 1, (1,), generator=gen)))
        slots = [_expected_slot(model, anchors, b, h, w) for b in targets["boxes"][0]]
        if len(set(slots)) == len(slots):
            found += 1
            yield h, w, targets, slots


# ============================================================================================
# Target assignment
# ============================================================================================
def test_yolo_assigns_each_box_exactly_one_anchor(layout):
    """One positive per box, never 3 (one per level) or k (top-k shapes): boxes that claim distinct slots give
    as many positives as there are boxes, and a lone box exactly one."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(1)
    for h, w, targets, _ in _distinct_scenes(model, anchors, gen, SCENES):
        t = _assign(model, h, w, targets)
        assert int((t["obj"] > 0).sum()) == targets["boxes"].shape[1], (h, w, targets["boxes"])
        lone = {k: v[:, :1] for k, v in targets.items()}
        assert int((_assign(model, h, w, lone)["obj"] > 0).sum()) == 1


def test_yolo_box_goes_to_the_anchor_of_best_shape_iou_over_all_levels(layout):
    """The anchor is the argmax of shape IoU over all 3 x A anchors of every level (not the best within a level
    picked by the box's size, nor the best of the box's centre overlap); its level is that anchor's level."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(2)
    per_level = len(anchors) // 3
    for _ in range(SCENES):
        h, w, targets = _scene(gen, 1)
        box = targets["boxes"][0, 0]
        ((slot, _),) = _positives(model, _assign(model, h, w, targets), h, w).items()
        ious = _shape_iou((box[2:] - box[:2]).clamp(min=1.0), anchors)
        chosen = anchors.tolist().index(list(slot[3:]))
        assert float(ious[chosen]) == pytest.approx(float(ious.max()), abs=1e-6), (box.tolist(), slot)
        assert slot[0] == sorted(model.strides)[chosen // per_level], (box.tolist(), slot)


def test_yolo_positive_sits_in_the_cell_holding_the_box_centre(layout):
    """At the chosen level the positive's cell is floor(centre / stride), and its centre target is the offset of
    the centre in that cell, in [0, 1)."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(3)
    for h, w, targets, slots in _distinct_scenes(model, anchors, gen, SCENES):
        t = _assign(model, h, w, targets)
        got = _positives(model, t, h, w)
        assert set(got) == set(slots)
        for box, slot in zip(targets["boxes"][0], slots):
            stride, cx, cy = slot[:3]
            centre = (box[:2] + box[2:]) / 2
            offset = t["center"][0, got[slot]]
            assert offset.tolist() == pytest.approx((centre / stride - torch.tensor([cx, cy])).tolist(), abs=1e-5)
            assert bool(((offset >= 0) & (offset < 1)).all()), (box.tolist(), offset.tolist())


def test_yolo_targets_at_a_positive_are_the_boxs_offset_log_size_mixup_weight_and_class(layout):
    """At each positive: obj = the box's mixup weight, cls = its label, box_weight = 2 - w h / (W H), and writing
    (logit(centre target), scale target) as the raw outputs decodes back to the box itself. Elsewhere all zero."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(4)
    for h, w, targets, slots in _distinct_scenes(model, anchors, gen, SCENES // 2):
        t = _assign(model, h, w, targets)
        got = _positives(model, t, h, w)
        raw = torch.zeros(1, t["obj"].shape[1], 5 + NUM_CLASSES)
        raw[..., :2] = torch.logit(t["center"].clamp(1e-6, 1 - 1e-6))
        raw[..., 2:4] = t["scale"]
        decoded, _ = model.decode(raw, h, w)
        for i, slot in enumerate(slots):
            n, box = got[slot], targets["boxes"][0, i]
            assert float(t["obj"][0, n]) == pytest.approx(float(targets["weights"][0, i]))
            assert int(t["cls"][0, n]) == int(targets["labels"][0, i])
            area = float((box[2:] - box[:2]).prod())
            assert float(t["box_weight"][0, n]) == pytest.approx(2 - area / (h * w), rel=1e-5)
            assert decoded[0, n].tolist() == pytest.approx(box.tolist(), abs=2e-3 * max(h, w) / 64)
        negative = torch.ones(t["obj"].shape[1], dtype=torch.bool)
        negative[list(got.values())] = False
        for key in ("obj", "center", "scale", "box_weight", "cls"):
            assert not t[key][0, negative].any(), key


def test_yolo_a_box_the_shape_of_an_anchor_goes_to_that_anchor_with_zero_log_size(layout):
    """A box whose size is exactly an anchor's (anywhere in the image) takes that anchor and a scale target of 0."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(5)
    for _ in range(SCENES // 4):
        for j, (aw, ah) in enumerate(anchors.tolist()):
            h = w = 32 * int(torch.randint(4, 7, (1,), generator=gen))
            if aw > w or ah > h:
                continue
            x0 = float(torch.rand((), generator=gen)) * (w - aw)
            y0 = float(torch.rand((), generator=gen)) * (h - ah)
            targets = {
                "boxes": torch.tensor([[[x0, y0, x0 + aw, y0 + ah]]]),
                "labels": torch.zeros(1, 1, dtype=torch.int64),
                "weights": torch.ones(1, 1),
            }
            t = _assign(model, h, w, targets)
            (slot, n), *rest = _positives(model, t, h, w).items()
            assert not rest and list(slot[3:]) == [aw, ah], (j, slot)
            assert t["scale"][0, n].abs().max() < 1e-5


def test_yolo_padding_rows_assign_nothing(layout):
    """Rows of weight 0 (the collate's padding) change no target, whatever boxes and labels they hold; an image
    of padding only has no positive."""
    model, _ = layout
    gen = torch.Generator().manual_seed(6)
    for _ in range(SCENES // 2):
        h, w, padded = _scene(gen, int(torch.randint(0, 4, (1,), generator=gen)), padding=3)
        real = padded["weights"].shape[1] - 3
        plain = {k: v[:, :real] for k, v in padded.items()}
        a, b = _assign(model, h, w, padded), _assign(model, h, w, plain)
        for key in a:
            assert torch.equal(a[key], b[key]), key
        if real == 0:
            assert not (a["obj"] > 0).any()


def test_yolo_assignment_is_independent_of_box_order_and_of_the_other_images(layout):
    """Boxes claiming distinct slots give the same targets in any order; each image of a batch is assigned as
    it would be alone (scenes of one size batched, padded to the longest box list)."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(7)
    scenes = list(_distinct_scenes(model, anchors, gen, SCENES // 2))
    for h, w, targets, _ in scenes:
        order = torch.randperm(targets["boxes"].shape[1], generator=gen)
        shuffled = {k: v[:, order] for k, v in targets.items()}
        a, b = _assign(model, h, w, targets), _assign(model, h, w, shuffled)
        for key in a:
            assert torch.equal(a[key], b[key]), key
    for size in {(h, w) for h, w, _, _ in scenes}:
        group = [s[2] for s in scenes if s[:2] == size]
        m = max(g["boxes"].shape[1] for g in group)
        batch = {k: torch.cat([_pad(g[k], m) for g in group]) for k in group[0]}
        together = _assign(model, *size, batch)
        for i, g in enumerate(group):
            alone = _assign(model, *size, g)
            for key in alone:
                assert torch.equal(together[key][i], alone[key][0]), (size, i, key)


def test_yolo_boxes_in_one_cell_with_different_best_anchors_are_all_positive(layout):
    """Boxes sharing a centre but shaped like different anchors each get their own anchor: one cell holds
    several positives when the shapes differ (per level, each of its A anchors; across levels, one per level)."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(8)
    for _ in range(SCENES // 4):
        h = w = 192
        centre = torch.rand(2, generator=gen) * 64 + 64
        boxes = torch.stack([torch.cat([centre - a / 2, centre + a / 2]) for a in anchors])
        targets = {
            "boxes": boxes[None],
            "labels": torch.arange(len(anchors))[None] % NUM_CLASSES,
            "weights": torch.ones(1, len(anchors)),
        }
        got = _positives(model, _assign(model, h, w, targets), h, w)
        assert sorted(tuple(s[3:]) for s in got) == sorted(tuple(a) for a in anchors.tolist())
        for stride, cx, cy, *_ in got:
            assert (cx, cy) == (int(centre[0] // stride), int(centre[1] // stride))


def test_yolo_two_boxes_claiming_one_anchor_leave_one_positive_from_one_of_them(layout):
    """Two boxes whose best anchor and cell coincide: that slot is one positive, and its targets are all those
    of one of the two boxes (never a mix); the other box is dropped (GluonCV's rule, not a second anchor)."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(9)
    checked = 0
    while checked < SCENES // 2:
        h, w, first = _scene(gen, 1)
        box = first["boxes"][0, 0]
        jitter = (torch.rand(4, generator=gen) - 0.5) * 0.2 * (box[2:] - box[:2]).repeat(2)
        second = box + jitter
        slots = [_expected_slot(model, anchors, b, h, w) for b in (box, second)]
        if slots[0] != slots[1] or (second[2:] <= second[:2]).any():
            continue
        checked += 1
        targets = {
            "boxes": torch.stack([box, second])[None],
            "labels": torch.tensor([[1, 2]]),
            "weights": torch.tensor([[1.0, 0.5]]),
        }
        t = _assign(model, h, w, targets)
        assert int((t["obj"] > 0).sum()) == 1
        n = _positives(model, t, h, w)[slots[0]]
        alone = [_assign(model, h, w, {k: v[:, i : i + 1] for k, v in targets.items()}) for i in (0, 1)]
        assert any(all(torch.equal(t[k][0, n], a[k][0, n]) for k in t) for a in alone), "targets mix two boxes"


def test_yolo_boxes_at_the_image_border_are_assigned_inside_the_grid(layout):
    """Boxes touching the image's edges and corners get a positive in a cell of the grid; a centre on a cell
    boundary belongs to the cell below / to the right of it (offset 0); a centre past the last cell (a box
    reaching beyond the image) is clamped into the last cell."""
    model, anchors = layout
    gen = torch.Generator().manual_seed(10)
    for _ in range(SCENES // 2):
        h, w, targets = _scene(gen, 4)
        boxes = targets["boxes"][0]
        boxes[0, 0], boxes[1, 2], boxes[2, 1], boxes[3, 3] = 0.0, float(w), 0.0, float(h)  # left, right, top, bottom
        boxes[0, 1] = 0.0  # a corner
        for i, box in enumerate(boxes):
            one = _assign(model, h, w, {k: v[:, i : i + 1] for k, v in targets.items()})
            ((slot, n),) = _positives(model, one, h, w).items()
            assert slot == _expected_slot(model, anchors, box, h, w)
            assert 0 <= slot[1] < math.ceil(w / slot[0]) and 0 <= slot[2] < math.ceil(h / slot[0])
            assert bool(((one["center"][0, n] >= 0) & (one["center"][0, n] < 1)).all())
    per_level = len(anchors) // 3
    for j, wh in enumerate(anchors):  # centres exactly on a boundary between cells, and one past the right edge
        h = w = 128
        stride = sorted(model.strides)[j // per_level]  # the box has anchor j's shape: anchor j's level
        centres = torch.tensor([[stride, stride], [2 * stride, 3 * stride], [w, h / 2]], dtype=torch.float32)
        for c in centres:
            box = torch.cat([c - wh / 2, c + wh / 2])
            targets = {
                "boxes": box[None, None],
                "labels": torch.zeros(1, 1, dtype=torch.int64),
                "weights": torch.ones(1, 1),
            }
            t = _assign(model, h, w, targets)
            ((slot, n),) = _positives(model, t, h, w).items()
            s = slot[0]
            assert s == stride
            assert slot[1:3] == (min(int(c[0] // s), math.ceil(w / s) - 1), min(int(c[1] // s), math.ceil(h / s) - 1))
            if c[0] < w:
                assert t["center"][0, n].tolist() == pytest.approx([c[0] / s - slot[1], c[1] / s - slot[2]], abs=1e-6)


# ============================================================================================
# Losses
# ============================================================================================
def _loss_case(model, gen):
    h, w, targets = _scene(gen, int(torch.randint(1, 5, (1,), generator=gen)), padding=1)
    n = sum(a * b * model.num_anchors for a, b in model.level_shapes(h, w))
    raw = (torch.randn(1, n, 5 + NUM_CLASSES, generator=gen) * 1.5).requires_grad_()
    return h, w, targets, raw


def _grad(loss: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, raw, retain_graph=True)
    return g


def test_yolo_box_and_class_losses_reach_only_the_assigned_anchors(layout):
    """loss_center, loss_scale and loss_cls have a gradient at the positives' outputs only (every positive:
    its centre, size and class logits), and none at objectness; the class target is the box's label."""
    model, _ = layout
    gen = torch.Generator().manual_seed(11)
    for _ in range(40):
        h, w, targets, raw = _loss_case(model, gen)
        losses = yolo_loss(model, raw, targets, h, w, ignore_iou=0.7, label_smoothing=False)
        t = _assign(model, h, w, targets)
        positive = t["obj"][0] > 0
        for key, columns in (("loss_center", slice(0, 2)), ("loss_scale", slice(2, 4)), ("loss_cls", slice(5, None))):
            g = _grad(losses[key], raw)[0]
            touched = g.abs().amax(-1) > 0
            assert torch.equal(touched, positive), key
            others = torch.ones(g.shape[-1], dtype=torch.bool)
            others[columns] = False
            assert not g[:, others].any(), key
        g = _grad(losses["loss_cls"], raw)[0, positive, 5:]  # d BCE / dx = (sigmoid(x) - y) x weight
        y = torch.nn.functional.one_hot(t["cls"][0, positive], NUM_CLASSES).float()
        expected = (raw[0, positive, 5:].detach().sigmoid() - y) * t["obj"][0, positive, None]
        assert torch.allclose(g, expected, atol=1e-6)


def test_yolo_objectness_ignores_negatives_whose_box_overlaps_a_truth_above_ignore_iou(layout):
    """loss_obj: target 1 at positives (weighted by the mixup weight), 0 at negatives, and no loss at negatives
    whose decoded box overlaps a real ground truth with IoU > ignore_iou (padding rows never count)."""
    model, _ = layout
    gen = torch.Generator().manual_seed(12)
    ignored_seen = 0
    for _ in range(60):
        ignore_iou = float(torch.rand((), generator=gen)) * 0.5 + 0.2
        h, w, targets, raw = _loss_case(model, gen)
        losses = yolo_loss(model, raw, targets, h, w, ignore_iou=ignore_iou, label_smoothing=False)
        t = _assign(model, h, w, targets)
        positive = t["obj"][0] > 0
        decoded, _ = model.decode(raw.detach(), h, w)
        real = targets["weights"][0] > 0
        iou = box_iou(decoded[0], targets["boxes"][0, real]).amax(-1)
        ignored = (iou > ignore_iou) & ~positive
        ignored_seen += int(ignored.sum())
        x = raw[0, :, 4].detach()
        weight = torch.where(positive, t["obj"][0], (~ignored).float())
        expected = (x.sigmoid() - positive.float()) * weight
        assert torch.allclose(_grad(losses["loss_obj"], raw)[0, :, 4], expected, atol=1e-6)
    assert ignored_seen > 20  # the random outputs do overlap the boxes now and then


def test_yolo_losses_are_sums_over_predictions_averaged_over_images(layout):
    """Each term is a sum over an image's predictions, averaged over the batch: a batch of two images gives the
    mean of each image's losses, and a batch of an image twice gives that image's."""
    model, _ = layout
    gen = torch.Generator().manual_seed(13)
    for _ in range(30):
        h, w, a, raw_a = _loss_case(model, gen)
        _, _, b, _ = _loss_case(model, gen)
        b["boxes"] = b["boxes"].clamp(max=min(h, w))  # the other image at the same size
        b["boxes"][..., 2:] = torch.maximum(b["boxes"][..., 2:], b["boxes"][..., :2] + 1)
        raw_b = torch.randn(raw_a.shape, generator=gen)
        m = max(a["weights"].shape[1], b["weights"].shape[1])
        both = {k: torch.cat([_pad(a[k], m), _pad(b[k], m)]) for k in a}
        raw = torch.cat([raw_a.detach(), raw_b])
        la, lb = (yolo_loss(model, r, t, h, w, 0.7, False) for r, t in ((raw_a.detach(), a), (raw_b, b)))
        lab = yolo_loss(model, raw, both, h, w, 0.7, False)
        twice = yolo_loss(
            model, raw_a.detach().repeat(2, 1, 1), {k: torch.cat([v, v]) for k, v in a.items()}, h, w, 0.7, False
        )
        for key in la:
            assert float(lab[key]) == pytest.approx((float(la[key]) + float(lb[key])) / 2, rel=1e-4), key
            assert float(twice[key]) == pytest.approx(float(la[key]), rel=1e-5), key


def test_yolo_centre_and_scale_losses_are_minimal_at_the_targets(layout):
    """Raw outputs equal to (logit(centre target), log-size target) at the positives: loss_scale is 0 and
    loss_center is at its minimum (zero gradient; any change of the outputs raises it)."""
    model, _ = layout
    gen = torch.Generator().manual_seed(14)
    for _ in range(40):
        h, w, targets, raw = _loss_case(model, gen)
        t = _assign(model, h, w, targets)
        exact = raw.detach().clone()
        exact[..., :2] = torch.logit(t["center"].clamp(1e-4, 1 - 1e-4))
        exact[..., 2:4] = t["scale"]
        exact.requires_grad_()
        losses = yolo_loss(model, exact, targets, h, w, 0.7, False)
        assert float(losses["loss_scale"].detach()) < 1e-5
        g = _grad(losses["loss_center"], exact)
        assert g.abs().max() < 1e-4
        moved = exact.detach() + torch.randn(exact.shape, generator=gen) * 0.3
        worse = yolo_loss(model, moved, targets, h, w, 0.7, False)
        assert float(worse["loss_center"]) > float(losses["loss_center"].detach())
        assert float(worse["loss_scale"]) > float(losses["loss_scale"].detach())
