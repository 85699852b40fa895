"""Properties of DETR's Hungarian matcher and set criterion (recipes/detr_model.py) on many seeded random cases:
each test is named for the rule it pins, so that a copier who changes a rule sees which one broke.
tests/test_detr.py checks the cost and each loss term against hand-computed values.

The rules: the matcher is a one-to-one assignment of queries to targets at the lowest total cost
``cost_class * -p(class) + cost_bbox * L1 + cost_giou * -GIoU``; the criterion's cross-entropy runs over every
query (unmatched ones towards no-object, weighted ``eos_coef``), its L1 and GIoU over matched pairs only, summed
and divided by the batch's box count.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import box_convert, generalized_box_iou

from detr_model import HungarianMatcher, SetCriterion  # the recipe's sibling

CASES = 60
C = 4  # object classes; index C is no-object
WEIGHTS = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}


def _case(gen: torch.Generator, queries: int, counts: list[int]) -> tuple[dict, list[dict]]:
    """Random outputs (normalised cxcywh boxes inside the image) and targets of len(counts) images."""

    def boxes(n: int) -> torch.Tensor:
        wh = torch.rand(n, 2, generator=gen) * 0.4 + 0.05
        return torch.cat([torch.rand(n, 2, generator=gen) * (1 - wh) + wh / 2, wh], -1)

    outputs = {
        "pred_logits": torch.randn(len(counts), queries, C + 1, generator=gen) * 2,
        "pred_boxes": boxes(len(counts) * queries).view(len(counts), queries, 4),
    }
    targets = [{"labels": torch.randint(C, (n,), generator=gen), "boxes": boxes(n)} for n in counts]
    return outputs, targets


def _sizes(gen: torch.Generator, max_q: int, max_t: int, images: int = 3) -> tuple[int, list[int]]:
    q = int(torch.randint(1, max_q + 1, (1,), generator=gen))
    return q, torch.randint(0, max_t + 1, (images,), generator=gen).tolist()


def _criterion(eos_coef: float = 0.1, matcher: HungarianMatcher | None = None) -> SetCriterion:
    return SetCriterion(C, matcher or HungarianMatcher(1.0, 5.0, 2.0), dict(WEIGHTS), eos_coef, ["labels", "boxes"])


def _image_cost(matcher: HungarianMatcher, outputs: dict, targets: list[dict], i: int) -> torch.Tensor:
    """Image i's [Q, T_i] matching cost, from the matcher's own cost for that image alone."""
    return matcher.cost({k: v[i : i + 1] for k, v in outputs.items()}, [targets[i]])[0]


def _brute_force_minimum(cost: torch.Tensor) -> float:
    """The lowest total cost of a one-to-one assignment of min(Q, T) pairs, over every injective map."""
    q, t = cost.shape
    if q == 0 or t == 0:
        return 0.0
    if t <= q:
        return min(sum(float(cost[p, j]) for j, p in enumerate(ps)) for ps in itertools.permutations(range(q), t))
    return min(sum(float(cost[i, p]) for i, p in enumerate(ps)) for ps in itertools.permutations(range(t), q))


def _total(cost: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> float:
    return float(cost[rows, cols].sum()) if len(rows) else 0.0


# ============================================================================================
# Hungarian matcher
# ============================================================================================
def test_detr_matcher_is_one_to_one():
    """Every image: min(Q, T) pairs, no query twice, no target twice, indices in range; with at least as many
    queries as targets every target is matched (with more targets than queries, every query)."""
    gen = torch.Generator().manual_seed(0)
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    for _ in range(CASES):
        q, counts = _sizes(gen, 8, 10)
        outputs, targets = _case(gen, q, counts)
        for (rows, cols), n in zip(matcher(outputs, targets), counts):
            assert len(rows) == len(cols) == min(q, n)
            assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)
            assert all(0 <= r < q for r in rows.tolist()) and all(0 <= c < n for c in cols.tolist())
            if n <= q:
                assert sorted(cols.tolist()) == list(range(n))
            else:
                assert sorted(rows.tolist()) == list(range(q))


def test_detr_matcher_total_cost_is_the_brute_force_minimum():
    """The assignment's total cost is the minimum over every one-to-one assignment (itertools), for fewer,
    as many and more targets than queries, whatever the cost weights."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(CASES):
        weights = (torch.rand(3, generator=gen) * 4 + 0.1).tolist()
        matcher = HungarianMatcher(*weights)
        q, counts = _sizes(gen, 5, 6)
        outputs, targets = _case(gen, q, counts)
        for i, (rows, cols) in enumerate(matcher(outputs, targets)):
            cost = _image_cost(matcher, outputs, targets, i)
            assert _total(cost, rows, cols) == pytest.approx(_brute_force_minimum(cost), abs=1e-4), (weights, i)


def test_detr_matcher_follows_a_permutation_of_queries_and_targets():
    """Permuting the queries and the targets permutes the matched pairs alike: the same (prediction, target)
    pairs are matched whatever the order (random costs: the optimum is unique)."""
    gen = torch.Generator().manual_seed(2)
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    for _ in range(CASES):
        q, counts = _sizes(gen, 8, 10)
        outputs, targets = _case(gen, q, counts)
        qp = torch.randperm(q, generator=gen)
        tps = [torch.randperm(n, generator=gen) for n in counts]
        shuffled_out = {k: v[:, qp] for k, v in outputs.items()}
        shuffled_tgt = [{k: v[p] for k, v in t.items()} for t, p in zip(targets, tps)]
        for (rows, cols), (srows, scols), tp in zip(
            matcher(outputs, targets), matcher(shuffled_out, shuffled_tgt), tps
        ):
            assert set(zip(rows.tolist(), cols.tolist())) == set(zip(qp[srows].tolist(), tp[scols].tolist()))


def test_detr_matcher_weighs_each_cost_term_by_its_weight():
    """Each weight alone matches by its own term, computed here independently (highest summed probability of
    the target classes; lowest summed L1 of the boxes; highest summed GIoU), and scaling all three weights by a
    positive constant changes no match."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(CASES // 2):
        q, counts = _sizes(gen, 5, 5)
        outputs, targets = _case(gen, q, counts)
        prob = outputs["pred_logits"].softmax(-1)
        xyxy = box_convert(outputs["pred_boxes"], "cxcywh", "xyxy")
        for i, t in enumerate(targets):
            terms = {
                (1.0, 0.0, 0.0): -prob[i][:, t["labels"]],
                (0.0, 1.0, 0.0): torch.cdist(outputs["pred_boxes"][i], t["boxes"], p=1),
                (0.0, 0.0, 1.0): -generalized_box_iou(xyxy[i], box_convert(t["boxes"], "cxcywh", "xyxy")),
            }
            one = {k: v[i : i + 1] for k, v in outputs.items()}
            for weights, term in terms.items():
                ((rows, cols),) = HungarianMatcher(*weights)(one, [t])
                assert _total(term, rows, cols) == pytest.approx(_brute_force_minimum(term), abs=1e-5), weights
            scale = float(torch.rand((), generator=gen)) * 10 + 0.1
            a, b = HungarianMatcher(1.0, 5.0, 2.0)(one, [t]), HungarianMatcher(scale, 5 * scale, 2 * scale)(one, [t])
            assert set(zip(*(x.tolist() for x in a[0]))) == set(zip(*(x.tolist() for x in b[0])))


def test_detr_matcher_pairs_each_target_with_its_exact_confident_prediction():
    """Queries that are exact copies of the targets (box and a confident class) are matched to their targets,
    wherever they sit among random queries."""
    gen = torch.Generator().manual_seed(4)
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    for _ in range(CASES):
        q, counts = _sizes(gen, 10, 5)
        q = max(q, max(counts))
        outputs, targets = _case(gen, q, counts)
        placed = []
        for i, t in enumerate(targets):
            slots = torch.randperm(q, generator=gen)[: len(t["labels"])]
            outputs["pred_boxes"][i, slots] = t["boxes"]
            outputs["pred_logits"][i, slots] = F.one_hot(t["labels"], C + 1).float() * 20
            placed.append(dict(zip(range(len(slots)), slots.tolist())))
        for (rows, cols), where in zip(matcher(outputs, targets), placed):
            assert dict(zip(cols.tolist(), rows.tolist())) == where


# ============================================================================================
# Set criterion
# ============================================================================================
def test_detr_box_losses_are_zero_for_perfect_predictions():
    """Predictions that are the targets (exact boxes, confident classes, the other queries confidently
    no-object): L1 and GIoU are 0 and the cross-entropy is ~0."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(CASES // 2):
        q, counts = _sizes(gen, 8, 6)
        q = max(q, max(counts))
        outputs, targets = _case(gen, q, counts)
        outputs["pred_logits"] = F.one_hot(torch.full((len(counts), q), C), C + 1).float() * 30
        for i, t in enumerate(targets):
            slots = torch.randperm(q, generator=gen)[: len(t["labels"])]
            outputs["pred_boxes"][i, slots] = t["boxes"]
            outputs["pred_logits"][i, slots] = F.one_hot(t["labels"], C + 1).float() * 30
        losses = _criterion()(outputs, targets)
        assert float(losses["loss_bbox"]) < 1e-6 and float(losses["loss_giou"]) < 1e-6
        assert float(losses["loss_ce"]) < 1e-6


def _pairs(outputs: dict, targets: list[dict], matcher: HungarianMatcher) -> list[tuple[int, int, int]]:
    """(image, query, target) of every matched pair."""
    return [
        (i, r, c)
        for i, (rows, cols) in enumerate(matcher(outputs, targets))
        for r, c in zip(rows.tolist(), cols.tolist())
    ]


def test_detr_box_losses_sum_over_matched_pairs_and_divide_by_the_batch_box_count():
    """loss_bbox = sum of |prediction - target| over matched pairs, loss_giou = sum of (1 - GIoU), both divided by
    the number of target boxes in the whole batch (at least 1), not averaged per image: a batch's box losses are
    its images' alone, weighted by their box counts."""
    gen = torch.Generator().manual_seed(6)
    criterion = _criterion()
    for _ in range(CASES):
        q, counts = _sizes(gen, 6, 6)
        outputs, targets = _case(gen, q, counts)
        l1 = giou = 0.0
        for i, r, c in _pairs(outputs, targets, criterion.matcher):
            p, t = outputs["pred_boxes"][i, r], targets[i]["boxes"][c]
            l1 += float((p - t).abs().sum())
            xyxy = box_convert(torch.stack([p, t]), "cxcywh", "xyxy")
            giou += 1 - float(generalized_box_iou(xyxy[:1], xyxy[1:])[0, 0])
        losses = criterion(outputs, targets)
        n = max(sum(counts), 1)
        assert float(losses["loss_bbox"]) == pytest.approx(l1 / n, rel=1e-5, abs=1e-7)
        assert float(losses["loss_giou"]) == pytest.approx(giou / n, rel=1e-5, abs=1e-7)
        alone = [criterion({k: v[i : i + 1] for k, v in outputs.items()}, [t]) for i, t in enumerate(targets)]
        for key in ("loss_bbox", "loss_giou"):
            weighted = sum(float(a[key]) * len(t["labels"]) for a, t in zip(alone, targets)) / n
            assert float(losses[key]) == pytest.approx(weighted, rel=1e-5, abs=1e-7), key


def test_detr_class_loss_is_the_mean_weighted_by_eos_coef_for_no_object():
    """loss_ce = sum over every query of w x CE(logits, class) / sum of w, where the class is the matched target's
    (w = 1) or no-object for unmatched queries (w = eos_coef)."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(CASES):
        eos = float(torch.rand((), generator=gen)) * 0.95 + 0.05
        criterion = _criterion(eos)
        q, counts = _sizes(gen, 8, 6)
        outputs, targets = _case(gen, q, counts)
        classes = torch.full((len(counts), q), C)
        for i, r, c in _pairs(outputs, targets, criterion.matcher):
            classes[i, r] = targets[i]["labels"][c]
        ce = -outputs["pred_logits"].log_softmax(-1).gather(-1, classes[..., None])[..., 0]
        w = torch.where(classes == C, eos, 1.0)
        expected = float((w * ce).sum() / w.sum())
        assert float(criterion(outputs, targets)["loss_ce"]) == pytest.approx(expected, rel=1e-5), eos


def test_detr_losses_do_not_depend_on_query_or_target_order():
    """Permuting the queries of each image and the targets of each image leaves every loss term unchanged."""
    gen = torch.Generator().manual_seed(8)
    criterion = _criterion()
    for _ in range(CASES):
        q, counts = _sizes(gen, 8, 8)
        outputs, targets = _case(gen, q, counts)
        qp = torch.randperm(q, generator=gen)
        shuffled_out = {k: v[:, qp] for k, v in outputs.items()}
        tps = [torch.randperm(n, generator=gen) for n in counts]
        shuffled_tgt = [{k: v[p] for k, v in t.items()} for t, p in zip(targets, tps)]
        a, b = criterion(outputs, targets), criterion(shuffled_out, shuffled_tgt)
        for key in WEIGHTS:
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), key


def test_detr_box_losses_reach_only_matched_queries_and_the_class_loss_every_query():
    """The gradient of L1 + GIoU reaches the boxes of matched queries only (every one of them); the cross-entropy
    reaches the logits of every query, pushing unmatched ones towards no-object."""
    gen = torch.Generator().manual_seed(9)
    criterion = _criterion()
    for _ in range(CASES // 2):
        q, counts = _sizes(gen, 8, 6)
        outputs, targets = _case(gen, q, counts)
        outputs = {k: v.requires_grad_() for k, v in outputs.items()}
        losses = criterion(outputs, targets)
        (g_box,) = torch.autograd.grad(
            losses["loss_bbox"] + losses["loss_giou"], outputs["pred_boxes"], retain_graph=True
        )
        matched = torch.zeros(len(counts), q, dtype=torch.bool)
        for i, r, _ in _pairs(outputs, targets, criterion.matcher):
            matched[i, r] = True
        assert torch.equal(g_box.abs().amax(-1) > 0, matched)
        (g_cls,) = torch.autograd.grad(losses["loss_ce"], outputs["pred_logits"])
        assert bool((g_cls.abs().amax(-1) > 0).all())
        assert bool((g_cls[~matched][:, C] < 0).all())  # raising no-object's logit lowers the loss


def test_detr_an_image_without_targets_adds_no_box_loss():
    """An image without objects adds nothing to L1 and GIoU (the count of boxes is unchanged), and a batch with
    no objects at all has box losses 0 and a finite cross-entropy towards no-object."""
    gen = torch.Generator().manual_seed(10)
    criterion = _criterion()
    for _ in range(CASES // 2):
        q, counts = _sizes(gen, 6, 6, images=2)
        outputs, targets = _case(gen, q, counts)
        empty, _ = _case(gen, q, [0])
        more = {k: torch.cat([v, empty[k]]) for k, v in outputs.items()}
        nothing = {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}
        a, b = criterion(outputs, targets), criterion(more, [*targets, nothing])
        for key in ("loss_bbox", "loss_giou"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-6, abs=1e-8), key
        none = criterion(empty, [nothing])
        assert float(none["loss_bbox"]) == float(none["loss_giou"]) == 0.0
        ce = -empty["pred_logits"][0].log_softmax(-1)[:, C].mean()
        assert float(none["loss_ce"]) == pytest.approx(float(ce), rel=1e-5)
