"""Properties of YOLOv5's target rule and losses in recipes/yolo_model.py (``YOLOv3(rule="yolov5")``,
``assign_yolov5``, ``yolov5_loss``, ``box_ciou``) on seeded random scenes: each test is named for the rule it
pins. tests/test_properties_yolo.py pins GluonCV's rule, which stays the default.

The rule (YOLOv5): each ground-truth box -> every anchor of every level whose shape is within anchor_t = 4 of the
box's (max over w and h of max(r, 1 / r) < 4, r = box side / anchor side), each at up to 3 cells of that anchor's
level: the cell holding the box's centre, plus the horizontal and the vertical neighbour on the side nearer the
centre (less than half a cell from their shared edge), where that neighbour is inside the grid. Boxes decode as
centre (2 sigmoid(t) - 0.5 + cell) x stride (so a neighbour's prediction can reach the box), size
(2 sigmoid(t))^2 x anchor.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchvision.ops import complete_box_iou_loss

from test_properties_yolo import _scene  # the same random scenes as the GluonCV rule's tests
from yolo_model import (  # the model beside the recipe
    COCO_ANCHORS,
    YOLOV5_LOSS_TERMS,
    YOLOV5_LOSS_WEIGHTS,
    YOLOv3,
    assign_yolov5,
    box_ciou,
    yolo_loss,
    yolov5_loss,
)

SCENES = 60  # random scenes per assignment test
NUM_CLASSES = 4

# The layouts of tests/test_properties_yolo.py: YOLOv3's (3 anchors per level, strides 32, 16, 8; COCO's anchors
# at a quarter of their 416 px size) and the demo's (1 anchor per level, strides 16, 8, 4). Anchors small to large.
LAYOUTS = {
    "yolov3": ((2, 3, 4), [[w / 4, h / 4] for w, h in COCO_ANCHORS]),
    "demo": ((1, 2, 3), [[10.0, 14.0], [24.0, 20.0], [40.0, 56.0]]),
}
# YOLOv5's objectness balance by stride, written out per layout: 4.0 at the smallest stride, 1.0, 0.4 at the largest
BALANCE = {"yolov3": {8: 4.0, 16: 1.0, 32: 0.4}, "demo": {4: 4.0, 8: 1.0, 16: 0.4}}


@functools.cache
def _build(name: str, rule: str = "yolov5") -> tuple[YOLOv3, torch.Tensor]:
    """(model, anchors [3 * A, 2] as given: small to large), as recipes/yolo.py's create_model builds it."""
    out_indices, anchors = LAYOUTS[name]
    anchors = torch.tensor(anchors)
    torch.manual_seed(0)
    backbone = timm.create_model("resnet10t", features_only=True, out_indices=out_indices)
    return YOLOv3(backbone, NUM_CLASSES, anchors, neck_channels=8, rule=rule).eval(), anchors


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request) -> tuple[YOLOv3, torch.Tensor, str]:
    return (*_build(request.param), request.param)


def _assign(model: YOLOv3, h: int, w: int, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return assign_yolov5(model, targets["boxes"], targets["labels"], targets["weights"], h, w)


def _count(model: YOLOv3, h: int, w: int) -> int:
    return sum(a * b * model.num_anchors for a, b in model.level_shapes(h, w))


def _candidates(model: YOLOv3, t: dict[str, torch.Tensor], h: int, w: int, image: int = 0) -> dict[tuple, int]:
    """The valid candidates of ``image``: (box row, stride, cell x, cell y, anchor w, anchor h) -> prediction index,
    read from the model's own per-prediction tables (so the index must agree with the output layout)."""
    table = model.tables(h, w, torch.device("cpu"))
    out = {}
    for i, j, c in t["valid"][image].nonzero().tolist():
        n = int(t["index"][image, i, j, c])
        x, y = table["cells"][n].tolist()
        key = (i, int(table["strides"][n]), int(x), int(y), *table["anchors"][n].tolist())
        assert key not in out, f"one (box, anchor, cell) twice: {key}"
        assert table["anchors"][n].tolist() == model.anchors.view(-1, 2)[j].tolist()  # the anchor of its column
        out[key] = n
    return out


def _ratio_ok(box: torch.Tensor, anchor: list[float], anchor_t: float = 4.0) -> bool:
    """The box's shape within anchor_t of the anchor's, both sides (fp32 box sides, as the boxes are given)."""
    ratios = [float(s) / a for s, a in zip((box[2:] - box[:2]).tolist(), anchor)]
    return all(r > 0 and max(r, 1 / r) < anchor_t for r in ratios)


def _expected(model: YOLOv3, anchors: torch.Tensor, box: torch.Tensor, h: int, w: int) -> set[tuple]:
    """The rule, written independently of assign_yolov5: {(stride, cell x, cell y, anchor w, anchor h)} of a box.
    Of the 3 x 3 cells around the centre's, a cell is taken if it is inside the grid and is the centre's own, or
    shares an edge with it that is less than half a cell from the centre; a centre past the grid's last cell (a
    box reaching beyond the image) counts as in the last cell."""
    per_level = len(anchors) // 3
    centre = ((box[:2] + box[2:]) / 2).tolist()
    out = set()
    for j, anchor in enumerate(anchors.tolist()):
        if not _ratio_ok(box, anchor):
            continue
        stride = sorted(model.strides)[j // per_level]  # anchors small to large <-> strides small to large
        grid = (math.ceil(w / stride), math.ceil(h / stride))
        g = [c / stride for c in centre]
        cell = [min(max(math.floor(v), 0), n - 1) for v, n in zip(g, grid)]
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                x, y = cell[0] + dx, cell[1] + dy
                if not (0 <= x < grid[0] and 0 <= y < grid[1]) or (dx and dy):
                    continue
                if dx:
                    edge = cell[0] + (dx > 0)  # the shared edge, in cells
                    if not abs(g[0] - edge) < 0.5:
                        continue
                if dy:
                    edge = cell[1] + (dy > 0)
                    if not abs(g[1] - edge) < 0.5:
                        continue
                out.add((stride, x, y, *anchor))
    return out


def _pad(x: torch.Tensor, m: int) -> torch.Tensor:
    """A [1, M, ...] target row padded with zeros (weight 0: padding) to [1, m, ...], as the collate pads."""
    return torch.cat([x, x.new_zeros(1, m - x.shape[1], *x.shape[2:])], 1)


def _loss_case(model: YOLOv3, gen: torch.Generator, boxes: int | None = None, scale: float = 1.5):
    count = int(torch.randint(1, 5, (1,), generator=gen)) if boxes is None else boxes
    h, w, targets = _scene(gen, count, padding=1)
    raw = (torch.randn(1, _count(model, h, w), 5 + NUM_CLASSES, generator=gen) * scale).requires_grad_()
    return h, w, targets, raw


def _grad(loss: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, raw, retain_graph=True)
    return g


def _distinct(candidates: dict[tuple, int]) -> bool:
    """No two candidates (of different boxes) on one prediction."""
    return len(set(candidates.values())) == len(candidates)


# ============================================================================================
# The model: rule, decoding, output biases
# ============================================================================================
def test_default_rule_is_gluoncv_and_builds_the_very_same_model():
    """YOLOv3 without ``rule`` is rule "gluoncv": the same parameters and buffers, bit for bit, and the same
    decoding as before; an unknown rule is a ValueError."""
    for name in LAYOUTS:
        out_indices, anchors = LAYOUTS[name]
        models = []
        for kwargs in ({}, {"rule": "gluoncv"}):
            torch.manual_seed(0)
            backbone = timm.create_model("resnet10t", features_only=True, out_indices=out_indices)
            models.append(YOLOv3(backbone, NUM_CLASSES, torch.tensor(anchors), 8, **kwargs).eval())
        default, gluoncv = models
        assert default.rule == "gluoncv"
        a, b = default.state_dict(), gluoncv.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        raw = torch.randn(2, _count(default, 64, 96), 5 + NUM_CLASSES) * 3
        for x, y in zip(default.decode(raw, 64, 96), gluoncv.decode(raw, 64, 96)):
            assert torch.equal(x, y)
        t = default.tables(64, 96, torch.device("cpu"))  # GluonCV's box: sigmoid offset in the cell, exp size
        xy = (raw[..., :2].sigmoid() + t["cells"]) * t["strides"]
        wh = raw[..., 2:4].clamp(max=8.0).exp() * t["anchors"]
        assert torch.equal(default.decode(raw, 64, 96)[0], torch.cat([xy - wh / 2, xy + wh / 2], -1))
    with pytest.raises(ValueError, match="rule"):
        _build.__wrapped__("demo", rule="yolov4")


def test_yolov5_rule_changes_only_the_output_biases_not_the_layout_or_forward():
    """rule "yolov5" builds the same network (same parameter shapes, same forward output from the same weights);
    only the output biases start elsewhere: objectness log(8 / (640 / stride)^2) at each level (about 8 objects
    in a 640 x 640 image), classes log(0.6 / (C - 0.99)); the box biases keep PyTorch's default init."""
    # the priors by hand, per stride: log(8 / (640 / s)^2) = log(s^2 / 51200)
    objectness = {4: math.log(1 / 3200), 8: math.log(1 / 800), 16: math.log(1 / 200), 32: math.log(1 / 50)}
    for name in LAYOUTS:
        v5, _ = _build(name)
        v3, _ = _build(name, "gluoncv")
        assert v5.rule == "yolov5"
        sd5, sd3 = v5.state_dict(), v3.state_dict()
        assert {k: v.shape for k, v in sd5.items()} == {k: v.shape for k, v in sd3.items()}
        a = v5.num_anchors
        for out, s in zip(v5.outputs, v5.strides):
            bias = out[-1].bias.detach().view(a, 5 + NUM_CLASSES)
            assert bias[:, 4].tolist() == pytest.approx([objectness[s]] * a, abs=1e-6), (name, s)
            assert bias[:, 5:].flatten().tolist() == pytest.approx([math.log(0.6 / 3.01)] * a * NUM_CLASSES)
        for (k, x), y in zip(sd5.items(), sd3.values()):
            if not re.fullmatch(r"outputs\.\d\.1\.bias", k):  # all but the last 1 x 1 convolutions' biases
                assert torch.equal(x, y), k
            else:  # the box biases (tx, ty, tw, th) as GluonCV's rule leaves them
                assert torch.equal(x.view(a, -1)[:, :4], y.view(a, -1)[:, :4]), k
        images = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
        copy, _ = _build.__wrapped__(name)
        copy.load_state_dict(sd3)
        with torch.no_grad():
            assert torch.equal(copy(images), v3(images))


def test_yolov5_decode_centre_within_half_a_cell_beyond_its_own_and_size_up_to_4_anchors(layout):
    """rule "yolov5": raw 0 decodes to the cell's centre at the anchor's size; any raw output decodes to a centre
    (2 sigmoid - 0.5 + cell) x stride, -0.5..1.5 cells from the cell's corner, and a size (2 sigmoid)^2 x anchor,
    0..4 anchors; scores are sigmoid(objectness) x sigmoid(class logit)."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(20)
    h, w = 96, 64
    t = model.tables(h, w, torch.device("cpu"))
    boxes, scores = model.decode(torch.zeros(1, _count(model, h, w), 5 + NUM_CLASSES), h, w)
    centre, size = (boxes[0, :, :2] + boxes[0, :, 2:]) / 2, boxes[0, :, 2:] - boxes[0, :, :2]
    torch.testing.assert_close(centre, (t["cells"] + 0.5) * t["strides"])
    torch.testing.assert_close(size, t["anchors"])
    assert torch.equal(scores, torch.full_like(scores, 0.25))
    for scale in (1.0, 5.0, 100.0):
        raw = torch.randn(2, _count(model, h, w), 5 + NUM_CLASSES, generator=gen) * scale
        boxes, scores = model.decode(raw, h, w)
        offset = (boxes[..., :2] + boxes[..., 2:]) / 2 / t["strides"] - t["cells"]
        expected = raw[..., :2].sigmoid() * 2 - 0.5
        torch.testing.assert_close(offset, expected, atol=1e-4, rtol=0)
        assert bool(((offset >= -0.5 - 1e-4) & (offset <= 1.5 + 1e-4)).all())
        ratio = (boxes[..., 2:] - boxes[..., :2]) / t["anchors"]
        torch.testing.assert_close(ratio, (raw[..., 2:4].sigmoid() * 2) ** 2, atol=1e-4, rtol=1e-5)
        assert bool(((ratio >= 0) & (ratio <= 4 + 1e-4)).all())
        torch.testing.assert_close(scores, raw[..., 4:5].sigmoid() * raw[..., 5:].sigmoid())


# ============================================================================================
# Target assignment
# ============================================================================================
def test_yolov5_two_box_toy_by_hand_one_anchor_per_level():
    """The demo's layout (strides 16, 8, 4; anchors [10, 14], [24, 20], [40, 56]) on a 64 x 64 image; grids
    4 x 4, 8 x 8, 16 x 16; outputs ordered stride 16, 8, 4: level offsets 0, 16, 80. Worked out by hand:

    box 0: (51, 3, 63, 23), 12 x 20, centre (57, 13). Shape ratios: [10, 14] 1.43, [24, 20] 2, [40, 56] 3.33: all.
      stride 4:  centre (14.25, 3.25) cells: (14, 3); x .25 -> left (13, 3); y .25 -> up (14, 2)
      stride 8:  (7.125, 1.625): (7, 1); x .125 -> left (6, 1); y .625 -> down (7, 2)
      stride 16: (3.5625, 0.8125): (3, 0); x .5625 -> right would be (4, 0), past the grid: none; y -> down (3, 1)
    box 1: (0, 10, 3, 48), 3 x 38, centre (1.5, 29). Ratios: [10, 14] 3.33; [24, 20] 8 and [40, 56] 13.3: not.
      stride 4: (0.375, 7.25): (0, 7); x .375 -> left would be (-1, 7): none; y .25 -> up (0, 6)
    row 2: padding (weight 0), a box that would match: nothing."""
    model, _ = _build("demo")
    boxes = torch.tensor([[[51.0, 3.0, 63.0, 23.0], [0.0, 10.0, 3.0, 48.0], [20.0, 20.0, 44.0, 40.0]]])
    targets = {"boxes": boxes, "labels": torch.tensor([[1, 2, 3]]), "weights": torch.tensor([[1.0, 0.5, 0.0]])}
    t = _assign(model, 64, 64, targets)
    small, middle, large = [10.0, 14.0], [24.0, 20.0], [40.0, 56.0]
    expected = {
        (0, 4, 14, 3, *small),
        (0, 4, 13, 3, *small),
        (0, 4, 14, 2, *small),
        (0, 8, 7, 1, *middle),
        (0, 8, 6, 1, *middle),
        (0, 8, 7, 2, *middle),
        (0, 16, 3, 0, *large),
        (0, 16, 3, 1, *large),
        (1, 4, 0, 7, *small),
        (1, 4, 0, 6, *small),
    }
    got = _candidates(model, t, 64, 64)
    assert set(got) == expected
    # prediction indices by hand: offset + (y * grid width + x) * A + anchor
    assert got[(0, 4, 14, 3, *small)] == 80 + 3 * 16 + 14
    assert got[(0, 8, 6, 1, *middle)] == 16 + 1 * 8 + 6
    assert got[(0, 16, 3, 1, *large)] == 0 + 1 * 4 + 3
    assert got[(1, 4, 0, 6, *small)] == 80 + 6 * 16 + 0
    assert t["index"].shape == t["valid"].shape == t["cls"].shape == t["weight"].shape == (1, 3, 3, 3)
    assert t["box"].shape == (1, 3, 3, 3, 4)
    assert not t["valid"][0, 2].any()
    for i in (0, 1):
        ok = t["valid"][0, i]
        assert (t["box"][0, i][ok] == boxes[0, i]).all() and (t["cls"][0, i][ok] == i + 1).all()
        assert (t["weight"][0, i][ok] == targets["weights"][0, i]).all()


def test_yolov5_two_box_toy_by_hand_three_anchors_per_level():
    """YOLOv3's layout (strides 32, 16, 8; COCO's anchors / 4) on a 64 x 64 image; grids 2 x 2, 4 x 4, 8 x 8;
    outputs ordered stride 32, 16, 8 with 3 anchors each: level offsets 0, 12, 60. Anchors, small to large:
    stride 8 [2.5, 3.25] [4, 7.5] [8.25, 5.75]; stride 16 [7.5, 15.25] [15.5, 11.25] [14.75, 29.75];
    stride 32 [29, 22.5] [39, 49.5] [93.25, 81.5]. Worked out by hand:

    box 0: (13, 35, 29, 51), 16 x 16, centre (21, 43). Ratios: [2.5, 3.25] 6.4 no; [4, 7.5] exactly 4: no (< 4);
      [8.25, 5.75] 2.78, [7.5, 15.25] 2.13, [15.5, 11.25] 1.42, [14.75, 29.75] 1.86, [29, 22.5] 1.81,
      [39, 49.5] 3.09: yes; [93.25, 81.5] 5.83: no.
      stride 8:  centre (2.625, 5.375) cells: (2, 5); x .625 -> right (3, 5); y .375 -> up (2, 4)
      stride 16: (1.3125, 2.6875): (1, 2); left (0, 2); down (1, 3)
      stride 32: (0.65625, 1.34375): (0, 1); right (1, 1); up (0, 0)
    box 1: (30, 0, 62, 3), 32 x 3, centre (46, 1.5). Ratios: [8.25, 5.75] 3.88 and [15.5, 11.25] 3.75: yes;
      [7.5, 15.25] 5.08, [2.5, 3.25] 12.8, [4, 7.5] 8, the rest more: no.
      stride 8:  (5.75, 0.1875): (5, 0); right (6, 0); up would be (5, -1): none
      stride 16: (2.875, 0.09375): (2, 0); right (3, 0); up: none"""
    model, _ = _build("yolov3")
    boxes = torch.tensor([[[13.0, 35.0, 29.0, 51.0], [30.0, 0.0, 62.0, 3.0]]])
    targets = {"boxes": boxes, "labels": torch.tensor([[0, 3]]), "weights": torch.tensor([[1.0, 1.0]])}
    a8, a16, b16, c16, a32, b32 = [8.25, 5.75], [7.5, 15.25], [15.5, 11.25], [14.75, 29.75], [29.0, 22.5], [39.0, 49.5]
    expected = {(0, 8, x, y, *a8) for x, y in ((2, 5), (3, 5), (2, 4))}
    expected |= {(0, 16, x, y, *a) for x, y in ((1, 2), (0, 2), (1, 3)) for a in (a16, b16, c16)}
    expected |= {(0, 32, x, y, *a) for x, y in ((0, 1), (1, 1), (0, 0)) for a in (a32, b32)}
    expected |= {(1, 8, x, 0, *a8) for x in (5, 6)} | {(1, 16, x, 0, *b16) for x in (2, 3)}
    got = _candidates(model, _assign(model, 64, 64, targets), 64, 64)
    assert len(expected) == 18 + 4 and set(got) == expected
    # prediction indices by hand: offset + (y * grid width + x) * A + anchor
    assert got[(0, 8, 2, 5, *a8)] == 60 + (5 * 8 + 2) * 3 + 2
    assert got[(1, 16, 3, 0, *b16)] == 12 + (0 * 4 + 3) * 3 + 1
    assert got[(0, 32, 0, 0, *b32)] == 0 + 0 + 1


def test_yolov5_box_gets_every_anchor_within_the_shape_ratio_and_none_outside(layout):
    """Per box, the anchors with a candidate are exactly those (of all 3 x A, every level) with max(r, 1 / r) < 4
    on both sides: not the best one only (GluonCV), not a fixed level; a box no anchor fits has none."""
    model, anchors, _ = layout
    gen = torch.Generator().manual_seed(1)
    without = 0
    for _ in range(SCENES):
        h, w, targets = _scene(gen, int(torch.randint(1, 6, (1,), generator=gen)))
        got = _candidates(model, _assign(model, h, w, targets), h, w)
        for i, box in enumerate(targets["boxes"][0]):
            fitting = {tuple(a) for a in anchors.tolist() if _ratio_ok(box, a)}
            assert {k[4:] for k in got if k[0] == i} == fitting, (box.tolist(), h, w)
            without += not fitting
    assert without > 0  # some of the random boxes (2 px, or long and thin) fit no anchor


def test_yolov5_box_sits_in_its_centre_cell_and_the_nearer_neighbours_inside_the_grid(layout):
    """Per (box, anchor): the cell holding the centre always, plus the horizontal and the vertical neighbour on
    the side nearer the centre, never the farther side, never a diagonal, never outside the grid (boxes at the
    image's edges and corners included): 1 to 3 cells, the same set as the rule written independently."""
    model, anchors, _ = layout
    gen = torch.Generator().manual_seed(2)
    neighbours = 0
    for s in range(SCENES):
        h, w, targets = _scene(gen, 4)
        if s % 2:  # boxes touching the left, right, top and bottom edges, and a corner
            boxes = targets["boxes"][0]
            boxes[0, 0], boxes[1, 2], boxes[2, 1], boxes[3, 3], boxes[0, 1] = 0.0, float(w), 0.0, float(h), 0.0
        got = _candidates(model, _assign(model, h, w, targets), h, w)
        for i, box in enumerate(targets["boxes"][0]):
            mine = {k[1:] for k in got if k[0] == i}
            assert mine == _expected(model, anchors, box, h, w), (box.tolist(), h, w)
            centre = ((box[:2] + box[2:]) / 2).tolist()
            for anchor in {k[3:] for k in mine}:
                cells = [k[:3] for k in mine if k[3:] == anchor]
                stride = cells[0][0]
                grid = (math.ceil(w / stride), math.ceil(h / stride))
                own = tuple(min(int(c // stride), n - 1) for c, n in zip(centre, grid))
                assert 1 <= len(cells) <= 3 and (stride, *own) in cells
                for _, x, y in cells:
                    assert 0 <= x < grid[0] and 0 <= y < grid[1]
                    dx, dy = x - own[0], y - own[1]
                    assert abs(dx) + abs(dy) <= 1
                    if dx:  # on the side of the centre's nearer edge
                        assert (centre[0] / stride - own[0] - 0.5) * dx > 0
                    if dy:
                        assert (centre[1] / stride - own[1] - 0.5) * dy > 0
                    neighbours += bool(dx or dy)
    assert neighbours > 100


def test_yolov5_candidates_carry_their_boxs_coordinates_label_and_weight(layout):
    """Every candidate of a box, valid or not, holds that box's xyxy, label and mixup weight; shapes are fixed by
    B, M and A alone ([B, M, 3A, 3]); indices are all inside the N predictions (safe to gather)."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(3)
    k = 3 * model.num_anchors
    for _ in range(SCENES // 2):
        h, w, targets = _scene(gen, int(torch.randint(1, 5, (1,), generator=gen)), padding=2)
        t = _assign(model, h, w, targets)
        m = targets["boxes"].shape[1]
        assert t["index"].shape == t["valid"].shape == t["cls"].shape == t["weight"].shape == (1, m, k, 3)
        assert t["valid"].dtype == torch.bool and t["box"].shape == (1, m, k, 3, 4)
        assert int(t["index"].min()) >= 0 and int(t["index"].max()) < _count(model, h, w)
        assert torch.equal(t["box"], targets["boxes"][:, :, None, None].expand(-1, -1, k, 3, -1))
        assert torch.equal(t["cls"], targets["labels"][:, :, None, None].expand(-1, -1, k, 3))
        assert torch.equal(t["weight"], targets["weights"][:, :, None, None].expand(-1, -1, k, 3))


def test_yolov5_padding_rows_give_nothing(layout):
    """Rows of weight 0 (the collate's padding) are never valid whatever they hold, and change neither the real
    rows' candidates nor any loss; an image of padding only has no candidate, and no box or class loss."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(4)
    for _ in range(SCENES // 2):
        h, w, padded = _scene(gen, int(torch.randint(0, 4, (1,), generator=gen)), padding=3)
        real = padded["weights"].shape[1] - 3
        plain = {k: v[:, :real] for k, v in padded.items()}
        a, b = _assign(model, h, w, padded), _assign(model, h, w, plain)
        assert not a["valid"][:, real:].any()
        for key in a:
            assert torch.equal(a[key][:, :real], b[key]), key
        raw = torch.randn(1, _count(model, h, w), 5 + NUM_CLASSES, generator=gen)
        la, lb = yolov5_loss(model, raw, padded, h, w), yolov5_loss(model, raw, plain, h, w)
        for key in YOLOV5_LOSS_TERMS:
            assert float(la[key]) == pytest.approx(float(lb[key]), rel=1e-6, abs=1e-7), key
        if real == 0:
            assert float(la["loss_box"]) == 0 and float(la["loss_cls"]) == 0 and float(la["loss_obj"]) > 0


# ============================================================================================
# Losses
# ============================================================================================
def _true_offsets(model: YOLOv3, raw: torch.Tensor, got: dict[tuple, int], boxes: torch.Tensor, h: int, w: int):
    """Writes, at each candidate's prediction, the raw (tx, ty, tw, th) that decode exactly to its box (fp64)."""
    table = model.tables(h, w, torch.device("cpu"))
    for key, n in got.items():
        box = boxes[key[0]].double()
        stride, anchor = float(table["strides"][n]), table["anchors"][n].double()
        offset = (box[:2] + box[2:]) / 2 / stride - table["cells"][n].double()  # -0.5 .. 1.5 cells
        size = (box[2:] - box[:2]) / anchor  # 1/4 .. 4 anchors
        raw[0, n, :2] = torch.logit((offset + 0.5) / 2).float()
        raw[0, n, 2:4] = torch.logit(size.sqrt() / 2).float()


def test_yolov5_a_box_is_decodable_from_each_of_its_candidates(layout):
    """At every candidate (neighbouring cells included: their offset is -0.5..0 or 1..1.5 cells, in YOLOv5's
    range) some raw output decodes exactly to the box: written there, decode gives the box, its CIoU with the box
    is 1, and loss_box is 0."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(5)
    checked = 0
    while checked < SCENES // 2:
        h, w, targets, raw = _loss_case(model, gen)
        t = _assign(model, h, w, targets)
        got = _candidates(model, t, h, w)
        if not got or not _distinct(got):
            continue
        checked += 1
        exact = raw.detach().clone()
        _true_offsets(model, exact, got, targets["boxes"][0], h, w)
        decoded, _ = model.decode(exact, h, w)
        for key, n in got.items():
            box = targets["boxes"][0, key[0]]
            assert decoded[0, n].tolist() == pytest.approx(box.tolist(), abs=1e-4 * max(h, w) / 64), key
            assert float(box_ciou(decoded[0, n], box)) == pytest.approx(1.0, abs=1e-4), key
        assert float(yolov5_loss(model, exact, targets, h, w)["loss_box"]) < 1e-5


def test_yolov5_ciou_is_torchvisions_complete_iou_and_finite_on_degenerate_boxes():
    """box_ciou(a, b) = 1 - torchvision's complete_box_iou_loss on random boxes (overlapping, nested, apart,
    identical), values and gradients; on zero-width or zero-height boxes, where torchvision divides by 0, it and
    its gradients stay finite."""
    gen = torch.Generator().manual_seed(6)
    a = torch.rand(4000, 4, generator=gen) * 100
    a[:, 2:] = a[:, :2] + torch.rand(4000, 2, generator=gen) * 60 + 0.1
    b = a + (torch.rand(4000, 4, generator=gen) - 0.5) * torch.rand(4000, 1, generator=gen) * 80
    b[:, 2:] = torch.maximum(b[:, 2:], b[:, :2] + 0.1)
    b[:500] = a[:500]  # identical
    b[500:1000, :2], b[500:1000, 2:] = a[500:1000, :2] + 0.05, a[500:1000, 2:] - 0.05  # nested
    mine = box_ciou(a.requires_grad_(), b)
    theirs = 1 - complete_box_iou_loss(a, b)
    torch.testing.assert_close(mine, theirs, atol=2e-6, rtol=0)
    # the same gradient too: alpha held constant (as in the paper and torchvision), v's gradient not
    (g_mine,), (g_theirs,) = (torch.autograd.grad(x[1000:].sum(), a) for x in (mine, theirs))
    torch.testing.assert_close(g_mine, g_theirs, atol=1e-5, rtol=1e-3)
    a, mine = a.detach(), mine.detach()
    assert mine[:500].tolist() == pytest.approx([1.0] * 500, abs=1e-6)
    assert float(mine.min()) < -0.5 and bool((mine <= 1 + 1e-6).all())  # apart: CIoU reaches below 0
    flat = a.clone().requires_grad_()
    with torch.no_grad():
        flat[:1000, 3] = flat[:1000, 1]  # zero height
        flat[1000:2000, 2] = flat[1000:2000, 0]  # zero width
        flat[2000:2100, 2:] = flat[2000:2100, :2]  # a point
    for x, y in ((flat, b), (b, flat), (flat, flat.detach())):
        out = box_ciou(x, y)
        (g,) = torch.autograd.grad(out.sum(), flat)
        assert bool(out.isfinite().all()) and bool(g.isfinite().all())


def test_yolov5_losses_match_a_candidate_by_candidate_reference(layout):
    """With the candidates' boxes decoded by model.decode and torchvision's CIoU: loss_box = sum of weight x
    (1 - CIoU) / count of candidates, loss_cls = sum of weight x BCE(class logits, one-hot) / (count x C),
    loss_obj = sum over levels of the level's balance (4, 1, 0.4 from the smallest stride, by stride) x the mean
    BCE of its objectness logits with target CIoU (clamped at 0) at candidates, else 0; the objectness gradient is
    that of this sum at every prediction."""
    model, _, name = layout
    gen = torch.Generator().manual_seed(7)
    checked = 0
    while checked < SCENES // 3:
        h, w, targets, raw = _loss_case(model, gen)
        t = _assign(model, h, w, targets)
        got = _candidates(model, t, h, w)
        if not _distinct(got):
            continue
        checked += 1
        losses = yolov5_loss(model, raw, targets, h, w)
        assert set(losses) == set(YOLOV5_LOSS_TERMS)
        x = raw.detach()[0]
        decoded, _ = model.decode(x[None], h, w)
        box_sum = cls_sum = 0.0
        obj_target = torch.zeros(x.shape[0])
        for key, n in got.items():
            box, weight = targets["boxes"][0, key[0]], float(targets["weights"][0, key[0]])
            ciou = 1 - float(complete_box_iou_loss(decoded[0, n], box))
            box_sum += weight * (1 - ciou)
            onehot = F.one_hot(targets["labels"][0, key[0]], NUM_CLASSES).float()
            cls_sum += weight * float(F.binary_cross_entropy_with_logits(x[n, 5:], onehot, reduction="sum"))
            obj_target[n] = max(ciou, 0.0)
        count = max(len(got), 1)
        assert float(losses["loss_box"].detach()) == pytest.approx(box_sum / count, rel=1e-4, abs=1e-5)
        assert float(losses["loss_cls"].detach()) == pytest.approx(cls_sum / (count * NUM_CLASSES), rel=1e-5, abs=1e-6)
        obj, start, want_grad = 0.0, 0, torch.zeros(x.shape[0])
        for (lh, lw), stride in zip(model.level_shapes(h, w), model.strides):
            level = slice(start, start + lh * lw * model.num_anchors)
            size, start = level.stop - level.start, level.stop
            balance = BALANCE[name][stride]
            obj += balance * float(F.binary_cross_entropy_with_logits(x[level, 4], obj_target[level]))
            want_grad[level] = balance * (x[level, 4].sigmoid() - obj_target[level]) / size
        assert float(losses["loss_obj"].detach()) == pytest.approx(obj, rel=1e-5)
        g = _grad(losses["loss_obj"], raw)[0]
        torch.testing.assert_close(g[:, 4], want_grad, atol=1e-4 / x.shape[0], rtol=1e-3)


def test_yolov5_box_and_class_losses_reach_only_the_candidates_objectness_every_prediction(layout):
    """loss_box has a gradient at the valid candidates' (tx, ty, tw, th) only, loss_cls at their class logits
    only, loss_obj at the objectness of every prediction and nothing else."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(8)
    for _ in range(SCENES // 3):
        h, w, targets, raw = _loss_case(model, gen)
        losses = yolov5_loss(model, raw, targets, h, w)
        reached = torch.zeros(raw.shape[1], dtype=torch.bool)
        reached[list(_candidates(model, _assign(model, h, w, targets), h, w).values())] = True
        for key, columns in (("loss_box", slice(0, 4)), ("loss_cls", slice(5, None)), ("loss_obj", slice(4, 5))):
            g = _grad(losses[key], raw)[0]
            others = torch.ones(g.shape[-1], dtype=torch.bool)
            others[columns] = False
            assert not g[:, others].any(), key
            if key == "loss_obj":
                assert bool((g[:, 4] != 0).all())
            else:
                assert torch.equal(g[:, columns].abs().amax(-1) > 0, reached), key


def test_yolov5_candidates_sharing_a_prediction_leave_one_of_their_cious_as_objectness_target(layout):
    """Two boxes on the same candidates (one jittered from the other): the objectness target at a shared prediction
    is the CIoU of one of them (read back from the gradient), not their sum or a mix."""
    model, anchors, name = layout
    gen = torch.Generator().manual_seed(9)
    shared_seen = 0
    while shared_seen < 20:
        h, w, targets, raw = _loss_case(model, gen, boxes=1)
        box = targets["boxes"][0, 0]
        second = box + (torch.rand(4, generator=gen) - 0.5) * 0.2 * (box[2:] - box[:2]).repeat(2)
        targets["boxes"][0, 1], targets["weights"][0, 1] = second, 0.7  # the padding row becomes a real box
        got = _candidates(model, _assign(model, h, w, targets), h, w)
        shared = {n for k, n in got.items() if k[0] == 0} & {n for k, n in got.items() if k[0] == 1}
        if not shared:
            continue
        shared_seen += 1
        g = _grad(yolov5_loss(model, raw, targets, h, w)["loss_obj"], raw)[0, :, 4]
        decoded, _ = model.decode(raw.detach(), h, w)
        table = model.tables(h, w, torch.device("cpu"))
        sizes = {s: lh * lw * model.num_anchors for (lh, lw), s in zip(model.level_shapes(h, w), model.strides)}
        for n in shared:
            stride = int(table["strides"][n])
            target = float(raw[0, n, 4].detach().sigmoid() - g[n] * sizes[stride] / BALANCE[name][stride])
            cious = [max(1 - float(complete_box_iou_loss(decoded[0, n], b)), 0.0) for b in (box, second)]
            assert min(abs(target - c) for c in cious) < 1e-4, (target, cious)


def test_yolov5_losses_are_averages_not_multiplied_by_the_batch_size(layout):
    """A batch of an image twice gives that image's losses (nothing x batch size); halving every box's mixup
    weight halves loss_box and loss_cls and leaves loss_obj (target: the CIoU) as it is."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(10)
    for _ in range(SCENES // 4):
        h, w, targets, raw = _loss_case(model, gen)
        once = yolov5_loss(model, raw.detach(), targets, h, w)
        twice = yolov5_loss(
            model, raw.detach().repeat(2, 1, 1), {k: torch.cat([v, v]) for k, v in targets.items()}, h, w
        )
        half = yolov5_loss(model, raw.detach(), {**targets, "weights": targets["weights"] / 2}, h, w)
        for key in YOLOV5_LOSS_TERMS:
            assert float(twice[key]) == pytest.approx(float(once[key]), rel=1e-5), key
        assert float(half["loss_box"]) == pytest.approx(float(once["loss_box"]) / 2, rel=1e-5)
        assert float(half["loss_cls"]) == pytest.approx(float(once["loss_cls"]) / 2, rel=1e-5)
        assert float(half["loss_obj"]) == pytest.approx(float(once["loss_obj"]), rel=1e-6)
    assert set(YOLOV5_LOSS_WEIGHTS) == set(YOLOV5_LOSS_TERMS)


def test_yolov5_gradients_are_finite_at_large_magnitudes(layout):
    """Random raw outputs up to 1e4 (saturated sigmoids: boxes of zero size, centres at the range's ends, CIoU
    far below 0): every loss and every gradient is finite."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(11)
    for scale in (1.0, 10.0, 100.0, 1e4):
        for _ in range(4):
            h, w, targets, raw = _loss_case(model, gen, scale=scale)
            losses = yolov5_loss(model, raw, targets, h, w)
            assert all(bool(v.isfinite()) for v in losses.values()), (scale, losses)
            g = _grad(sum(losses.values()), raw)
            assert bool(g.isfinite().all()), scale


def test_yolov5_geometry_is_fp32_under_bf16_autocast(layout):
    """At 640 px, raw outputs in bf16 as autocast hands them over: inside torch.autocast('cpu', bfloat16) the
    losses are fp32, finite, and those of the same values in fp32 outside autocast; the assignment inside
    autocast is the one outside; gradients reach the bf16 outputs, finite."""
    model, _, _ = layout
    gen = torch.Generator().manual_seed(12)
    n = _count(model, 640, 640)
    centre, size = torch.rand(2, 6, 2, generator=gen) * 600 + 20, torch.rand(2, 6, 2, generator=gen) * 200 + 4
    targets = {
        "boxes": torch.cat([centre - size / 2, centre + size / 2], -1),
        "labels": torch.randint(0, NUM_CLASSES, (2, 6), generator=gen),
        "weights": torch.ones(2, 6),
    }
    raw = (torch.randn(2, n, 5 + NUM_CLASSES, generator=gen) * 2).bfloat16().requires_grad_()
    want = yolov5_loss(model, raw.detach().float(), targets, 640, 640)
    want_t = _assign(model, 640, 640, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = yolov5_loss(model, raw, targets, 640, 640)
        got_t = _assign(model, 640, 640, targets)
    for key in YOLOV5_LOSS_TERMS:
        assert got[key].dtype == torch.float32 and bool(got[key].isfinite()), key
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)
    for key in want_t:
        assert torch.equal(got_t[key], want_t[key]), key
    assert int(want_t["valid"].sum()) > 12
    (g,) = torch.autograd.grad(sum(got.values()), raw)
    assert g.dtype == torch.bfloat16 and bool(g.isfinite().all()) and bool(g.any())


class _Ops(TorchDispatchMode):
    """Records each aten op run inside it, and whether it indexed with a boolean mask (a data-dependent shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.masked: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.names.add(name)
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_") and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1])):
                self.masked.add(name)
        return func(*args, **(kwargs or {}))


def test_yolov5_assignment_and_loss_have_no_host_sync_or_data_dependent_shape(layout):
    """assign_yolov5 and yolov5_loss, forward and backward, run no op that reads a value back to the host or
    gives a shape that depends on the data (nonzero, item, masked_select, boolean-mask indexing, unique), so a
    GPU step never waits on them and a compiled graph does not break."""
    model, _, _ = layout
    h, w = 64, 64
    targets = {  # boxes of the hand-checked toys: candidates in both layouts
        "boxes": torch.tensor([[[51.0, 3.0, 63.0, 23.0], [13.0, 35.0, 29.0, 51.0], [0.0, 0.0, 0.0, 0.0]]]),
        "labels": torch.tensor([[1, 2, 0]]),
        "weights": torch.tensor([[1.0, 0.5, 0.0]]),
    }
    raw = torch.randn(1, _count(model, h, w), 5 + NUM_CLASSES, generator=torch.Generator().manual_seed(13))
    raw.requires_grad_()
    model.tables(h, w, torch.device("cpu"))  # made once per size (host -> device copies, not syncs)
    with _Ops() as ops:
        t = _assign(model, h, w, targets)
        losses = yolov5_loss(model, raw, targets, h, w)
        torch.autograd.grad(sum(losses.values()), raw)
    forbidden = {"aten.nonzero", "aten._local_scalar_dense", "aten.masked_select", "aten.item", "aten.is_nonzero"}
    forbidden |= {"aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.nonzero_static"}
    assert not ops.names & forbidden and not ops.masked, (ops.names & forbidden, ops.masked)
    assert "aten.gather" in ops.names  # the mode did see the loss's ops
    assert t["valid"].any()


def test_yolov5_loss_refuses_a_model_built_for_gluoncvs_rule():
    """yolov5_loss trains the YOLOv5 parametrisation: a model that decodes GluonCV's way is a ValueError, not a
    model whose predictions at inference mean something else than in training."""
    model, _ = _build("demo", "gluoncv")
    h, w, targets, raw = _loss_case(model, torch.Generator().manual_seed(14))
    with pytest.raises(ValueError, match="yolov5"):
        yolov5_loss(model, raw, targets, h, w)
    assert set(yolo_loss(model, raw, targets, h, w, 0.7, False)) == {
        "loss_obj",
        "loss_center",
        "loss_scale",
        "loss_cls",
    }
