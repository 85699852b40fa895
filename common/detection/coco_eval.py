"""COCO box mAP (and mask mAP, for a model that segments) with pycocotools, from predictions in original image
pixels, across processes; and, from the same pass, what the pictures of an evaluation need (:class:`EvalDetails`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, overload

import numpy as np
import torch

from common import UserError
from common.detection.masks import coco_segmentation
from common.detection.voc07 import voc07_ap50
from common.detection.voc07 import xyxy as _xyxy

METRICS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large")  # COCOeval.stats[:6]
# the same six of the masks (COCOeval(iouType="segm")), with masks
MASK_METRICS = tuple(f"mask_{name}" for name in METRICS)
# One more number, the figure Pascal VOC 2007 papers quote (GluonCV, the original YOLO and SSD): AP@0.5 with
# VOC07's 11-point interpolation, with the VOC devkit's matching and thresholds (:func:`voc07_ap50`).
VOC07_METRIC = "map_50_11pt"
# The detection confusion matrix counts predictions at least this confident, matched to ground truth
# at this IoU: the values Ultralytics' confusion matrix uses, so the pictures read the same.
CONFUSION_SCORE = 0.25
CONFUSION_IOU = 0.5


@dataclasses.dataclass
class EvalDetails:
    """What one :meth:`CocoEvaluator.evaluate` pass found, beyond its six numbers. K = number of classes."""

    classes: list[str]
    ap: np.ndarray  # [K] AP@[.5:.95] per class, 0..1; NaN for a class without ground truth
    ap50: np.ndarray  # [K] AP@.5 per class, 0..1; NaN likewise
    instances: np.ndarray  # [K] int64: ground-truth boxes per class (crowd regions excluded)
    # COCOeval's eval["precision"]: [T=10 IoUs .5:.05:.95, R=101 recall points, K, A=4 areas (all, small,
    # medium, large), M=3 maxDets (1, 10, 100)]; -1 where a class has no ground truth.
    precision: np.ndarray
    # [K+1, K+1] int64, rows the true class, columns the predicted one, index K = background: predictions
    # with score >= CONFUSION_SCORE matched to ground truth at IoU >= CONFUSION_IOU; an unmatched
    # prediction counts in the background row, a missed box in the background column.
    confusion: np.ndarray
    # image_id (every image of the split) -> exactly the rows that were scored, [N, 6] float64: x, y, w, h
    # (original pixels), score, class index
    rows: dict[int, np.ndarray]
    # with masks: image_id -> each row's mask as COCO's compressed RLE (``counts`` a str), and the masks' AP@[.5:.95]
    # and AP@.5 per class [K] as ``ap`` and ``ap50`` hold the boxes'
    masks: dict[int, list[dict[str, Any]]] | None = None
    mask_ap: np.ndarray | None = None
    mask_ap50: np.ndarray | None = None

    @functools.cached_property
    def predictions(self) -> dict[int, dict[str, np.ndarray]]:
        """image_id -> the predictions scored for it, for drawing: ``boxes`` [N, 4] float32 XYXY in original
        pixels, ``scores`` [N] float32, ``labels`` [N] int64 (class indices)."""
        return {
            image_id: {
                "boxes": _xyxy(rows).astype(np.float32),
                "scores": rows[:, 4].astype(np.float32),
                "labels": rows[:, 5].astype(np.int64),
            }
            | ({"masks": self.masks.get(image_id, [])} if self.masks is not None else {})
            for image_id, rows in self.rows.items()
        }

    def coco_results(self, category_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The scored predictions in the COCO results format (``image_id``, ``category_id``, ``bbox``
        [x, y, w, h] in original pixels, ``score``), images by id, with class index i written as
        ``category_ids[i]`` (the dataset's own ids; the class indices when None); with masks, each result's
        ``segmentation`` too (COCO's compressed RLE). pycocotools scoring this list against the split's original
        json gives the metrics of this pass (``iouType="segm"``: the mask metrics)."""
        ids = list(range(len(self.classes))) if category_ids is None else [int(i) for i in category_ids]
        return [
            {
                "image_id": image_id,
                "category_id": ids[int(row[5])],
                "bbox": [float(v) for v in row[:4]],
                "score": float(row[4]),
            }
            | ({"segmentation": self.masks[image_id][k]} if self.masks is not None else {})
            for image_id in sorted(self.rows)
            for k, row in enumerate(self.rows[image_id])
        ]

    def table(self) -> list[dict[str, Any]]:
        """One row per class (class, instances, ap50, ap; with masks mask_ap50, mask_ap), for
        :func:`common.artifacts.figures.format_table`."""
        rows = [
            {"class": name, "instances": int(n), "ap50": float(a50), "ap": float(a)}
            for name, n, a50, a in zip(self.classes, self.instances, self.ap50, self.ap)
        ]
        if self.mask_ap is not None and self.mask_ap50 is not None:
            for row, a50, a in zip(rows, self.mask_ap50, self.mask_ap):
                row.update(mask_ap50=float(a50), mask_ap=float(a))
        return rows


class CocoEvaluator:
    """The ground truth of an evaluation split, and :meth:`evaluate`, which scores one pass of
    predictions over it. Nothing else is kept: each call scores exactly the predictions it is given.

    Ground truth comes from the evaluation ``datasets.Dataset`` (normalised schema): boxes in original
    pixels, category id = class index, COCO areas and crowd flags as loaded, so the numbers are those
    of pycocotools on the original json. ``stoppable``: a run's ``interruptible`` (:class:`common.run.Run`), around
    pycocotools' scoring, which has no batches to stop at: with one process a stop signal ends it at once.
    ``masks``: the predictions carry masks and are scored as masks too (``iouType="segm"``) against the split's
    ``objects.segmentation`` (an object without one counts as its box).
    """

    def __init__(
        self,
        ds: Any,
        classes: Sequence[str] | None = None,
        stoppable: Callable[[str], AbstractContextManager[None]] | None = None,
        masks: bool = False,
    ) -> None:
        self.stoppable = stoppable or (lambda what: contextlib.nullcontext())
        self.masks = masks
        from pycocotools.coco import COCO

        meta = ds.select_columns(["image_id", "width", "height", "objects"])[:]
        ids = [int(i) for i in meta["image_id"]]
        if len(set(ids)) != len(ids):
            raise UserError("the evaluation split has repeated image_id values; COCO evaluation needs them unique")
        images, annotations = [], []
        for image_id, w, h, objects in zip(ids, meta["width"], meta["height"], meta["objects"]):
            images.append({"id": image_id, "width": int(w), "height": int(h)})
            shapes = objects.get("segmentation") or [""] * len(objects["bbox"])
            for box, category, area, crowd, shape in zip(
                objects["bbox"], objects["category"], objects["area"], objects["iscrowd"], shapes
            ):
                if masks:  # COCO's own value; an object without one: its box as a polygon
                    x, y, bw, bh = box
                    outline = [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]
                    segmentation = coco_segmentation(shape, int(h), int(w)) or outline
                # ids from 1: COCOeval takes a matched id of 0 for "unmatched"
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": image_id,
                        "bbox": list(box),
                        "category_id": int(category),
                        "area": float(area),
                        "iscrowd": int(crowd),
                    }
                    | ({"segmentation": segmentation} if masks else {})
                )
        count = len(classes) if classes is not None else 1 + max((a["category_id"] for a in annotations), default=0)
        names = list(classes) if classes is not None else [str(i) for i in range(count)]
        self.gt = COCO()
        self.gt.dataset = {
            "images": images,
            "annotations": annotations,
            "categories": [{"id": i, "name": n} for i, n in enumerate(names)],
        }
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            self.gt.createIndex()
        self.image_ids = frozenset(ids)

    @overload
    def evaluate(
        self, batches: Iterable[Sequence[dict[str, Any]]], accelerator: Any = None, details: Literal[False] = False
    ) -> dict[str, float]: ...

    @overload
    def evaluate(
        self, batches: Iterable[Sequence[dict[str, Any]]], accelerator: Any = None, *, details: Literal[True]
    ) -> tuple[dict[str, float], EvalDetails]: ...

    def evaluate(
        self, batches: Iterable[Sequence[dict[str, Any]]], accelerator: Any = None, details: bool = False
    ) -> dict[str, float] | tuple[dict[str, float], EvalDetails]:
        """COCO metrics of the predictions in ``batches``: an iterable (a generator over the evaluation
        loader, say) of per-batch lists, one dict per image: ``image_id`` (int), ``boxes`` [N, 4] XYXY in
        original pixels, ``scores`` [N], ``labels`` [N] (class indices); tensors on any device, copied to
        the CPU as they come.

        The first predictions seen per image_id count: the repeated samples with which Accelerate pads
        the last evaluation batch count once, so results do not depend on batch size or process count.
        With ``accelerator`` (more than one process), every process's predictions are gathered and every
        process gets the same numbers; all must call this. Returns fractions 0..1 as pycocotools gives
        them, -1 where the split has no ground truth of that size (``map_large`` on digits_det).

        With ``details=True``, returns ``(metrics, details)``: the same metrics and an
        :class:`EvalDetails` of the same pass (per-class AP, the precision array for PR curves, the
        detection confusion matrix, the predictions per image_id), equal on every process.
        """

        predictions: dict[int, tuple[np.ndarray, list | None]] = {}  # image_id -> rows (N, 6), masks (N RLEs)
        for batch in batches:
            for p in batch:
                image_id = int(p["image_id"])
                if image_id not in self.image_ids:
                    raise ValueError(f"prediction for image_id {image_id}, which is not in the evaluation split")
                if self.masks and "masks" not in p:
                    raise ValueError(f"prediction for image_id {image_id} has no masks; a mask evaluation needs them")
                if image_id not in predictions:
                    predictions[image_id] = (_rows(p), list(p["masks"]) if self.masks else None)
        local = list(predictions.items())
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            local = gather_object(local)  # every process's list, in rank order
        found: dict[int, tuple[np.ndarray, list | None]] = {}
        for image_id, value in local:
            found.setdefault(image_id, value)
        merged = {image_id: rows for image_id, (rows, _) in found.items()}
        masks = {image_id: m for image_id, (_, m) in found.items()} if self.masks else None
        # A fixed order (images by id, each image's detections as the model gave them): COCOeval breaks
        # score ties by input order, so the order of arrival must not matter.
        results = [
            {"image_id": image_id, "bbox": row[:4].tolist(), "score": float(row[4]), "category_id": int(row[5])}
            | ({"segmentation": masks[image_id][k]} if masks is not None else {})
            for image_id in sorted(merged)
            for k, row in enumerate(merged[image_id])
        ]
        evaluation = self._scored(results, "bbox")
        metrics = {name: float(value) for name, value in zip(METRICS, evaluation.stats[:6])}
        metrics[VOC07_METRIC] = voc07_ap50(self.gt.dataset["annotations"], merged, len(self.gt.dataset["categories"]))
        segm = None
        if masks is not None:  # the same detections scored by their masks' IoU
            segm = self._scored(results, "segm")
            metrics.update({name: float(value) for name, value in zip(MASK_METRICS, segm.stats[:6])})
        if not details:
            return metrics
        found_details = self._details(evaluation, merged)
        if segm is not None:
            found_details.masks = {image_id: masks.get(image_id, []) for image_id in found_details.rows}
            found_details.mask_ap, found_details.mask_ap50 = _class_ap(segm)
        return metrics, found_details

    def _scored(self, results: list[dict[str, Any]], iou_type: str) -> Any:
        """pycocotools' COCOeval of ``results`` (COCO result dicts) against the ground truth, accumulated and
        summarised; ``iou_type``: ``bbox`` or ``segm``."""
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        with contextlib.redirect_stdout(io.StringIO()), self.stoppable("COCO's scoring"):
            if results:
                # results with a bbox: loadRes takes each one's area from its box (both scorings, as pycocotools
                # reads predictions.json), and keeps its segmentation for the segm scoring
                dt = self.gt.loadRes(results)
            else:  # loadRes rejects an empty list; no detections scores 0 wherever there is ground truth
                dt = COCO()
                dt.dataset = {
                    "images": list(self.gt.dataset["images"]),
                    "annotations": [],
                    "categories": list(self.gt.dataset["categories"]),
                }
                dt.createIndex()
            evaluation = COCOeval(self.gt, dt, iouType=iou_type)
            evaluation.evaluate()
            evaluation.accumulate()
            evaluation.summarize()
        return evaluation

    def _details(self, evaluation: Any, merged: dict[int, np.ndarray]) -> EvalDetails:
        """The :class:`EvalDetails` of a scored pass: ``evaluation`` (accumulated COCOeval), ``merged``
        (image_id -> COCO result rows (N, 6): x, y, w, h, score, class)."""
        categories = sorted(self.gt.dataset["categories"], key=lambda c: c["id"])
        k = len(categories)
        precision = np.asarray(evaluation.eval["precision"], np.float64)  # [T, R, K, A, M]
        ap, ap50 = _class_ap(evaluation)
        instances = np.zeros(k, np.int64)
        for a in self.gt.dataset["annotations"]:
            instances[a["category_id"]] += not a["iscrowd"]
        confusion = np.zeros((k + 1, k + 1), np.int64)
        scored = {image_id: merged.get(image_id, np.zeros((0, 6))) for image_id in sorted(self.image_ids)}
        for image_id, rows in scored.items():
            annotations = self.gt.imgToAnns.get(image_id, [])
            gt = np.array([a["bbox"] + [a["category_id"], a["iscrowd"]] for a in annotations], np.float64).reshape(
                -1, 6
            )
            gt[:, 2:4] += gt[:, :2]  # COCO xywh -> XYXY
            confusion += detection_confusion(_xyxy(rows), rows[:, 4], rows[:, 5], gt[:, :4], gt[:, 4], k, gt[:, 5] > 0)
        return EvalDetails([c["name"] for c in categories], ap, ap50, instances, precision, confusion, scored)


def _class_ap(evaluation: Any) -> tuple[np.ndarray, np.ndarray]:
    """AP@[.5:.95] and AP@.5 per class [K] of an accumulated COCOeval (area "all", 100 detections); NaN for a class
    without ground truth."""
    precision = np.asarray(evaluation.eval["precision"], np.float64)  # [T, R, K, A, M]
    valid = precision[..., 0, -1] > -1  # [T, R, K]
    with np.errstate(invalid="ignore"):  # a class without ground truth: 0 / 0 -> NaN, as intended
        ap = np.where(valid, precision[..., 0, -1], 0).sum((0, 1)) / valid.sum((0, 1))
        ap50 = np.where(valid[0], precision[0, :, :, 0, -1], 0).sum(0) / valid[0].sum(0)
    return ap, ap50


def detection_confusion(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray,
    gt_boxes: np.ndarray,
    gt_labels: np.ndarray,
    num_classes: int,
    gt_crowd: np.ndarray | None = None,
    score_threshold: float = CONFUSION_SCORE,
    iou_threshold: float = CONFUSION_IOU,
) -> np.ndarray:
    """One image's detection confusion matrix [K+1, K+1] int64 (rows true class, columns predicted,
    index K = background). Predictions (XYXY ``boxes`` [N, 4], ``scores``, ``labels`` [N]) with score >=
    ``score_threshold``, in order of decreasing score, each take the unmatched ground-truth box (XYXY
    ``gt_boxes`` [G, 4], ``gt_labels`` [G]) of any class with the highest IoU >= ``iou_threshold``:
    (true, predicted) += 1. A prediction left unmatched counts as (background, predicted), unless it
    lies mostly (>= half its area) in a crowd region (``gt_crowd`` [G] True), which COCO ignores; a
    ground-truth box left unmatched as (true, background)."""
    from torchvision.ops import box_iou

    crowd = np.zeros(len(gt_boxes), bool) if gt_crowd is None else np.asarray(gt_crowd, bool)
    scores = np.asarray(scores, np.float64).reshape(-1)
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] >= score_threshold]
    boxes, labels = np.asarray(boxes, np.float64).reshape(-1, 4)[order], np.asarray(labels, np.int64).reshape(-1)[order]
    gt_boxes, gt_labels = np.asarray(gt_boxes, np.float64).reshape(-1, 4), np.asarray(gt_labels, np.int64).reshape(-1)
    crowd_boxes, gt_boxes, gt_labels = gt_boxes[crowd], gt_boxes[~crowd], gt_labels[~crowd]
    iou = box_iou(torch.from_numpy(boxes), torch.from_numpy(gt_boxes)).numpy()  # [N, G]
    matrix = np.zeros((num_classes + 1, num_classes + 1), np.int64)
    taken = np.zeros(len(gt_boxes), bool)
    for i, c in enumerate(labels):
        candidates = np.where(taken, -1.0, iou[i])
        j = int(candidates.argmax()) if len(candidates) else -1
        if j >= 0 and candidates[j] >= iou_threshold:
            taken[j] = True
            matrix[gt_labels[j], c] += 1
        elif not _in_crowd(boxes[i], crowd_boxes):
            matrix[num_classes, c] += 1
    np.add.at(matrix[:, num_classes], gt_labels[~taken], 1)
    return matrix


def _in_crowd(box: np.ndarray, crowd: np.ndarray) -> bool:
    """Whether at least half of ``box`` (XYXY) lies inside one of the ``crowd`` regions [C, 4]."""
    if not len(crowd):
        return False
    w = np.clip(np.minimum(box[2], crowd[:, 2]) - np.maximum(box[0], crowd[:, 0]), 0, None)
    h = np.clip(np.minimum(box[3], crowd[:, 3]) - np.maximum(box[1], crowd[:, 1]), 0, None)
    return bool((w * h).max() >= 0.5 * max((box[2] - box[0]) * (box[3] - box[1]), 1e-9))


def _rows(prediction: dict[str, Any]) -> np.ndarray:
    """One image's predictions as COCO result rows (N, 6) float64: x, y, w, h (pixels), score, class."""
    boxes = torch.as_tensor(prediction["boxes"]).as_subclass(torch.Tensor).detach()
    boxes = boxes.to("cpu", torch.float64).reshape(-1, 4)
    scores = torch.as_tensor(prediction["scores"]).detach().to("cpu", torch.float64).reshape(-1, 1)
    labels = torch.as_tensor(prediction["labels"]).detach().to("cpu", torch.float64).reshape(-1, 1)
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1)
    return torch.cat([xywh, scores, labels], 1).numpy()
