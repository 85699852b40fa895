"""Pascal VOC 2007's figure, AP@0.5 with 11-point interpolation, computed as the VOC devkit computes it; the
number :class:`common.detection.coco_eval.CocoEvaluator` reports as ``map_50_11pt`` beside COCO's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def voc07_ap50(annotations: Sequence[dict[str, Any]], predictions: dict[int, np.ndarray], num_classes: int) -> float:
    """VOC07's 11-point AP@0.5, computed as the VOC devkit (``voc_eval.py``, ``use_07_metric=True``) does,
    averaged over the classes with ground truth; -1 when none has any.

    ``annotations``: the ground truth as COCO annotation dicts (``image_id``, ``bbox`` x, y, w, h in pixels,
    ``category_id`` = class index, ``iscrowd``: VOC's difficult flag, as the VOC reader
    (:mod:`common.detection.voc`) and MMDetection's VOC-to-COCO converter write it). ``predictions``: image_id ->
    rows [N, 6] x, y, w, h, score, class index. With the reader's boxes (``x = xmin - 1``, ``w = xmax - xmin + 1``)
    the plain IoU here is the devkit's ``+ 1`` IoU of the XML's corners, so the figure is the devkit's own.

    The devkit's rules, each of which differs from COCOeval's: every detection of a class counts (not the
    best 100 per image), in order of decreasing score; each takes the box of its class with the highest
    plain IoU (intersection / union) in its image, taken or not, difficult or not; above IoU 0.5 (strictly)
    it is a true positive if that box is not difficult and not yet taken, ignored if it is difficult, a
    false positive if taken; below, a false positive. Recall counts the boxes that are not difficult; a
    class whose boxes are all difficult has no AP. The 11 points are the best precision at recall >= t for
    t in ``numpy.arange(0, 1.1, 0.1)`` (0.30000000000000004, not 0.3: a recall of exactly 0.3 does not reach
    that point), 0 where no recall reaches t."""
    boxes: dict[tuple[int, int], list[list[float]]] = {}  # (class, image_id) -> ground-truth boxes XYXY
    difficult: dict[tuple[int, int], list[bool]] = {}
    positives = np.zeros(num_classes, np.int64)
    for a in annotations:
        key = (int(a["category_id"]), int(a["image_id"]))
        x, y, w, h = (float(v) for v in a["bbox"])
        boxes.setdefault(key, []).append([x, y, x + w, y + h])
        difficult.setdefault(key, []).append(bool(a["iscrowd"]))
        positives[key[0]] += not a["iscrowd"]
    aps = []
    for c in np.flatnonzero(positives):
        # every detection of class c: score, and 1 / 0 / -1 for true positive, ignored, false positive
        scores: list[float] = []
        outcomes: list[int] = []
        for image_id in sorted(predictions):
            rows = predictions[image_id]
            rows = rows[rows[:, 5] == c]
            if not len(rows):
                continue
            rows = rows[np.argsort(-rows[:, 4], kind="stable")]
            gt = np.asarray(boxes.get((int(c), image_id), []), np.float64).reshape(-1, 4)
            hard = np.asarray(difficult.get((int(c), image_id), []), bool)
            iou = _iou(xyxy(rows), gt)  # [N, G]
            taken = np.zeros(len(gt), bool)
            for i in range(len(rows)):  # within an image the devkit's global score order is the local one
                j = int(iou[i].argmax()) if len(gt) else -1
                if j < 0 or iou[i, j] <= 0.5:
                    outcome = -1
                elif hard[j]:
                    outcome = 0
                else:
                    outcome = -1 if taken[j] else 1
                    taken[j] = True
                scores.append(float(rows[i, 4]))
                outcomes.append(outcome)
        order = np.argsort(-np.asarray(scores), kind="stable")
        result = np.asarray(outcomes, np.int64)[order]
        tp, fp = np.cumsum(result == 1), np.cumsum(result == -1)
        recall = tp / positives[c]
        precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        points = [precision[recall >= t].max() if (recall >= t).any() else 0.0 for t in np.arange(0.0, 1.1, 0.1)]
        aps.append(sum(points) / 11)
    return float(np.mean(aps)) if aps else -1.0


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU (intersection / union) of XYXY boxes ``a`` [N, 4] and ``b`` [G, 4]: [N, G]."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).clip(0).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).clip(0).prod(-1)
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-12)


def xyxy(rows: np.ndarray) -> np.ndarray:
    """The boxes of COCO result rows (N, 6) as XYXY (N, 4)."""
    return np.concatenate([rows[:, :2], rows[:, :2] + rows[:, 2:4]], 1)
