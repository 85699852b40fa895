"""Properties of Faster R-CNN's target assignment as recipes/faster_rcnn_model.py configures torchvision's RPN
and RoI heads, on many seeded random scenes: each test is named for the rule it pins, so that a copier who
changes a threshold, a fraction or a budget sees which rule broke. Both kinds of model the recipe builds are
checked: the demo's timm backbone (its own budgets) and a torchvision preset (torchvision's).

The rules (Faster R-CNN's, as torchvision's reference trains it):
- RPN: an anchor is foreground at IoU >= 0.7 with a box, background below 0.3, ignored between; every box's
  best anchors are foreground whatever their IoU (low-quality matches); 128 / 256 anchors sampled per image,
  at most half of them foreground.
- RoI heads: a proposal is foreground (the box's class) at IoU >= 0.5, else background, none ignored and no
  low-quality matches; the boxes themselves join the proposals; 32 / 512 sampled, at most a quarter foreground.
- Box coders: RPN deltas with weights (1, 1, 1, 1), RoI deltas with (10, 10, 5, 5); decoding inverts encoding.
"""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import box_iou

from common.config import parse_config
from conftest import load_recipe
from faster_rcnn_model import TwoStageDetector, create_model  # the recipe's sibling

frcnn = load_recipe("faster_rcnn")

SCENES = 100
NUM_CLASSES = 5
RPN_FG, RPN_BG, RPN_FRACTION = 0.7, 0.3, 0.5
ROI_FG, ROI_FRACTION = 0.5, 0.25
# What each kind of model samples per image: (RPN anchors, RoI proposals)
KINDS = {
    "demo": ([], (128, 32)),
    "preset": (["--model", "fasterrcnn_mobilenet_v3_large_fpn", "--model_kwargs", "{}"], (256, 512)),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request) -> tuple[TwoStageDetector, tuple[int, int]]:
    args, budgets = KINDS[request.param]
    torch.manual_seed(0)
    return create_model(parse_config(frcnn.Config, args), NUM_CLASSES).train(), budgets


def _boxes(gen: torch.Generator, n: int, side: float = 96.0) -> torch.Tensor:
    """n random XYXY boxes, 4 px to half the image's side, inside a side x side image."""
    wh = torch.rand(n, 2, generator=gen) * (side / 2 - 4) + 4
    xy = torch.rand(n, 2, generator=gen) * (side - wh)
    return torch.cat([xy, xy + wh], -1)


def _scene(gen: torch.Generator, anchors: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """(boxes [G, 4], candidates [N, 4]): random boxes and candidate anchors / proposals, a third of them jittered
    copies of the boxes (so that every IoU from 0 to 1 occurs), the rest random."""
    gt = _boxes(gen, int(torch.randint(1, 7, (1,), generator=gen)))
    near = anchors // 3
    pick = gt[torch.randint(len(gt), (near,), generator=gen)]
    size = (pick[:, 2:] - pick[:, :2]).repeat(1, 2)
    jitter = torch.randn(near, 4, generator=gen) * size * torch.rand(near, 1, generator=gen) * 0.4
    jittered = pick + jitter
    jittered[:, 2:] = torch.maximum(jittered[:, 2:], jittered[:, :2] + 1)
    return gt, torch.cat([jittered, _boxes(gen, anchors - near)])


def _rpn_labels(model: TwoStageDetector, gt: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels, matched = model.rpn.assign_targets_to_anchors([anchors], [{"boxes": gt}])
    return labels[0], matched[0]


def _best_of_each_box(iou: torch.Tensor) -> torch.Tensor:
    """[N] True at the anchors that are some box's best (ties included)."""
    return (iou == iou.amax(1, keepdim=True)).any(0)


# ============================================================================================
# RPN: anchors
# ============================================================================================
def test_frcnn_rpn_anchor_is_foreground_from_iou_0_7_background_below_0_3_ignored_between(kind):
    """An anchor that is no box's best: label 1 (matched to its best box) at IoU >= 0.7 with some box, 0 when its
    best IoU is below 0.3, -1 (no loss) in between."""
    model, _ = kind
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros(3)
    for _ in range(SCENES):
        gt, anchors = _scene(gen)
        labels, matched = _rpn_labels(model, gt, anchors)
        iou = box_iou(gt, anchors)
        best, which = iou.max(0)
        expected = torch.where(best >= RPN_FG, 1.0, torch.where(best < RPN_BG, 0.0, -1.0))
        others = ~_best_of_each_box(iou)
        assert torch.equal(labels[others], expected[others])
        fg = labels == 1
        assert torch.equal(matched[fg], gt[which[fg]])
        seen += torch.stack([(expected[others] == v).sum() for v in (1.0, 0.0, -1.0)])
    assert bool((seen > 100).all()), seen  # every kind of anchor occurred


def test_frcnn_rpn_gives_every_box_its_best_anchors_even_below_0_7(kind):
    """Low-quality matches: each box's best anchors (ties included) are foreground whatever their IoU, even
    below the background threshold, matched to the box they overlap most."""
    model, _ = kind
    gen = torch.Generator().manual_seed(1)
    low = 0
    for _ in range(SCENES):
        gt = _boxes(gen, int(torch.randint(1, 5, (1,), generator=gen)))
        anchors = _boxes(gen, 60)  # random anchors only: the best IoUs are often low
        iou = box_iou(gt, anchors)
        if bool((iou.amax(1) == 0).any()):
            continue  # a box overlapping no anchor at all: every anchor ties at 0
        labels, matched = _rpn_labels(model, gt, anchors)
        best = _best_of_each_box(iou)
        assert bool((labels[best] == 1).all())
        assert torch.equal(matched[best], gt[iou.argmax(0)[best]])
        low += int((iou.amax(1) < RPN_BG).sum())
    assert low > 20  # boxes whose best anchor is below 0.3 occurred


def test_frcnn_rpn_image_without_boxes_has_only_background_anchors(kind):
    model, _ = kind
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        labels, _ = _rpn_labels(model, torch.zeros(0, 4), _boxes(gen, 100))
        assert bool((labels == 0).all())


# ============================================================================================
# RoI heads: proposals
# ============================================================================================
def test_frcnn_roi_proposal_is_its_boxs_class_from_iou_0_5_else_background_without_low_quality_matches(kind):
    """A proposal takes the class of the box it overlaps most when that IoU >= 0.5, else background (0); none is
    ignored, and a box whose best proposal overlaps it below 0.5 gets no foreground proposal."""
    model, _ = kind
    gen = torch.Generator().manual_seed(3)
    unmatched = 0
    for scene in range(SCENES):
        gt, proposals = _scene(gen, 200)
        if scene % 2:  # random proposals only: some boxes are overlapped below 0.5 by all of them
            proposals = _boxes(gen, 60)
        classes = torch.randint(1, NUM_CLASSES + 1, (len(gt),), generator=gen)
        matched, labels = model.roi_heads.assign_targets_to_proposals([proposals], [gt], [classes])
        iou = box_iou(gt, proposals)
        best, which = iou.max(0)
        expected = torch.where(best >= ROI_FG, classes[which], 0)
        assert torch.equal(labels[0], expected)
        fg = expected > 0
        assert torch.equal(matched[0][fg], which[fg])
        unmatched += int((iou.amax(1) < ROI_FG).sum())
    assert unmatched > 0


def test_frcnn_roi_training_samples_include_the_boxes_themselves(kind):
    """When training, the ground-truth boxes join the proposals: with only background proposals, the sampled
    foreground is exactly the boxes, with their classes and zero regression targets."""
    model, _ = kind
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)  # the sampler draws from torch's generator
    for _ in range(SCENES // 2):
        gt = _boxes(gen, int(torch.randint(1, 8, (1,), generator=gen)))
        proposals = _boxes(gen, 150)
        proposals = proposals[box_iou(gt, proposals).amax(0) < ROI_FG]
        classes = torch.randint(1, NUM_CLASSES + 1, (len(gt),), generator=gen)
        sampled, _, labels, regression = model.roi_heads.select_training_samples(
            [proposals], [{"boxes": gt, "labels": classes}]
        )
        fg = labels[0] > 0
        found = sorted(zip(sampled[0][fg].tolist(), labels[0][fg].tolist()))
        assert found == sorted(zip(gt.tolist(), classes.tolist()))
        assert regression[0][fg].abs().max() < 1e-5


# ============================================================================================
# Sampling
# ============================================================================================
def test_frcnn_samplers_take_at_most_the_positive_fraction_of_their_budget_then_fill_with_negatives(kind):
    """Per image the RPN samples its budget (demo 128, preset 256) with at most half foreground, the RoI heads
    theirs (demo 32, preset 512) with at most a quarter: positives = min(#foreground, fraction x budget),
    negatives = min(#background, budget - positives), drawn from the right sets, ignored ones never."""
    model, (rpn_budget, roi_budget) = kind
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    samplers = (
        (model.rpn.fg_bg_sampler, rpn_budget, RPN_FRACTION),
        (model.roi_heads.fg_bg_sampler, roi_budget, ROI_FRACTION),
    )
    for sampler, budget, fraction in samplers:
        for _ in range(SCENES):
            counts = torch.randint(0, 2 * budget, (3,), generator=gen)
            labels = torch.cat(
                [
                    torch.randint(1, NUM_CLASSES + 1, (int(counts[0]),), generator=gen),
                    torch.zeros(int(counts[1])),
                    -torch.ones(int(counts[2])),
                ]
            )
            labels = labels[torch.randperm(len(labels), generator=gen)].long()
            (pos,), (neg,) = sampler([labels])
            pos, neg = pos.bool(), neg.bool()
            n_pos = min(int(counts[0]), int(budget * fraction))
            assert int(pos.sum()) == n_pos, (budget, counts)
            assert int(neg.sum()) == min(int(counts[1]), budget - n_pos), (budget, counts)
            assert bool((labels[pos] >= 1).all()) and bool((labels[neg] == 0).all())


# ============================================================================================
# Box coders
# ============================================================================================
def test_frcnn_box_coders_decode_what_they_encode_with_weights_1_and_10_10_5_5(kind):
    """decode(encode(box, anchor), anchor) = box for both coders; an anchor encodes itself as 0; the deltas are
    the weighted (dx / w, dy / h, log(w' / w), log(h' / h)) and do not change when both boxes move or scale."""
    model, _ = kind
    gen = torch.Generator().manual_seed(6)
    for coder, weights in (
        (model.rpn.box_coder, (1.0, 1.0, 1.0, 1.0)),
        (model.roi_heads.box_coder, (10.0, 10.0, 5.0, 5.0)),
    ):
        for _ in range(SCENES // 4):
            gt, anchors = _boxes(gen, 50), _boxes(gen, 50)
            deltas = coder.encode_single(gt, anchors)
            assert torch.allclose(coder.decode_single(deltas, anchors), gt, atol=1e-3)
            assert coder.encode_single(anchors, anchors).abs().max() < 1e-5
            aw, ah = (anchors[:, 2] - anchors[:, 0]), (anchors[:, 3] - anchors[:, 1])
            gw, gh = (gt[:, 2] - gt[:, 0]), (gt[:, 3] - gt[:, 1])
            expected = torch.stack(
                [
                    weights[0] * ((gt[:, 0] + gt[:, 2]) - (anchors[:, 0] + anchors[:, 2])) / 2 / aw,
                    weights[1] * ((gt[:, 1] + gt[:, 3]) - (anchors[:, 1] + anchors[:, 3])) / 2 / ah,
                    weights[2] * torch.log(gw / aw),
                    weights[3] * torch.log(gh / ah),
                ],
                -1,
            )
            assert torch.allclose(deltas, expected, atol=1e-4)
            scale, shift = float(torch.rand((), generator=gen)) * 3 + 0.5, torch.randn(2, generator=gen).repeat(2) * 50
            moved = coder.encode_single(gt * scale + shift, anchors * scale + shift)
            assert torch.allclose(moved, deltas, atol=1e-3)


def test_frcnn_anchors_have_the_configured_sizes_and_aspect_ratios_at_each_level():
    """The RPN's anchors at FPN level l are every (size, ratio) of anchor_sizes[l] x aspect_ratios: area size^2 and
    height / width = ratio (to torchvision's rounding to whole pixels), centred on the cell."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        small, ratio = float(torch.rand((), generator=gen)) * 10 + 8, float(torch.rand((), generator=gen)) + 0.3
        base = [small, small * 2]  # sizes and ratios far enough apart to pair each anchor with its (size, ratio)
        sizes = [[round(s * 2**level, 1) for s in base] for level in range(3)]
        ratios = [round(ratio, 2), round(ratio * 3, 2)]
        cfg = parse_config(frcnn.Config, ["--anchor_sizes", str(sizes), "--aspect_ratios", str(ratios)])
        model = create_model(cfg, NUM_CLASSES)
        for level, cell in enumerate(model.rpn.anchor_generator.cell_anchors):
            assert len(cell) == len(sizes[level]) * len(ratios)
            w, h = cell[:, 2] - cell[:, 0], cell[:, 3] - cell[:, 1]
            assert torch.allclose(cell[:, :2] + cell[:, 2:], torch.zeros(len(cell), 2), atol=1.0)  # centred
            got = sorted(zip(w.tolist(), h.tolist()))
            want = sorted((s / r**0.5, s * r**0.5) for s in sizes[level] for r in ratios)
            for (gw, gh), (ww, wh) in zip(got, want):
                assert gw == pytest.approx(ww, abs=1.01) and gh == pytest.approx(wh, abs=1.01), (level, got, want)
