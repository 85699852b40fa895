"""COCO box mAP with pycocotools, from predictions in original image pixels, across processes."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from common import UserError

METRICS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large")  # COCOeval.stats[:6]


class CocoEvaluator:
    """The ground truth of an evaluation split, and :meth:`evaluate`, which scores one pass of
    predictions over it. Nothing else is kept: each call scores exactly the predictions it is given.

    Ground truth comes from the evaluation ``datasets.Dataset`` (normalised schema): boxes in original
    pixels, category id = class index, COCO areas and crowd flags as loaded, so the numbers are those
    of pycocotools on the original json.
    """

    def __init__(self, ds: Any, classes: Sequence[str] | None = None) -> None:
        from pycocotools.coco import COCO

        meta = ds.select_columns(["image_id", "width", "height", "objects"])[:]
        ids = [int(i) for i in meta["image_id"]]
        if len(set(ids)) != len(ids):
            raise UserError("the evaluation split has repeated image_id values; COCO evaluation needs them unique")
        images, annotations = [], []
        for image_id, w, h, objects in zip(ids, meta["width"], meta["height"], meta["objects"]):
            images.append({"id": image_id, "width": int(w), "height": int(h)})
            for box, category, area, crowd in zip(objects["bbox"], objects["category"], objects["area"],
                                                  objects["iscrowd"]):
                # ids from 1: COCOeval takes a matched id of 0 for "unmatched"
                annotations.append({"id": len(annotations) + 1, "image_id": image_id, "bbox": list(box),
                                    "category_id": int(category), "area": float(area), "iscrowd": int(crowd)})
        count = len(classes) if classes is not None else 1 + max((a["category_id"] for a in annotations), default=0)
        names = list(classes) if classes is not None else [str(i) for i in range(count)]
        self.gt = COCO()
        self.gt.dataset = {"images": images, "annotations": annotations,
                           "categories": [{"id": i, "name": n} for i, n in enumerate(names)]}
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            self.gt.createIndex()
        self.image_ids = frozenset(ids)

    def evaluate(self, batches: Iterable[Sequence[dict[str, Any]]], accelerator: Any = None) -> dict[str, float]:
        """COCO metrics of the predictions in ``batches``: an iterable (a generator over the evaluation
        loader, say) of per-batch lists, one dict per image: ``image_id`` (int), ``boxes`` [N, 4] XYXY in
        original pixels, ``scores`` [N], ``labels`` [N] (class indices); tensors on any device, copied to
        the CPU as they come.

        The first predictions seen per image_id count: the repeated samples with which Accelerate pads
        the last evaluation batch count once, so results do not depend on batch size or process count.
        With ``accelerator`` (more than one process), every process's predictions are gathered and every
        process gets the same numbers; all must call this. Returns fractions 0..1 as pycocotools gives
        them, -1 where the split has no ground truth of that size (``map_large`` on digits_det).
        """
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        predictions: dict[int, np.ndarray] = {}  # image_id -> (N, 6): x, y, w, h, score, class
        for batch in batches:
            for p in batch:
                image_id = int(p["image_id"])
                if image_id not in self.image_ids:
                    raise ValueError(f"prediction for image_id {image_id}, which is not in the evaluation split")
                if image_id not in predictions:
                    predictions[image_id] = _rows(p)
        local = list(predictions.items())
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            local = gather_object(local)  # every process's list, in rank order
        merged: dict[int, np.ndarray] = {}
        for image_id, rows in local:
            merged.setdefault(image_id, rows)
        # A fixed order (images by id, each image's detections as the model gave them): COCOeval breaks
        # score ties by input order, so the order of arrival must not matter.
        results = [{"image_id": image_id, "bbox": row[:4].tolist(), "score": float(row[4]), "category_id": int(row[5])}
                   for image_id in sorted(merged) for row in merged[image_id]]
        with contextlib.redirect_stdout(io.StringIO()):
            if results:
                dt = self.gt.loadRes(results)
            else:  # loadRes rejects an empty list; no detections scores 0 wherever there is ground truth
                dt = COCO()
                dt.dataset = {"images": list(self.gt.dataset["images"]), "annotations": [],
                              "categories": list(self.gt.dataset["categories"])}
                dt.createIndex()
            evaluation = COCOeval(self.gt, dt, iouType="bbox")
            evaluation.evaluate()
            evaluation.accumulate()
            evaluation.summarize()
        return {name: float(value) for name, value in zip(METRICS, evaluation.stats[:6])}


def _rows(prediction: dict[str, Any]) -> np.ndarray:
    """One image's predictions as COCO result rows (N, 6) float64: x, y, w, h (pixels), score, class."""
    boxes = torch.as_tensor(prediction["boxes"]).as_subclass(torch.Tensor).detach()
    boxes = boxes.to("cpu", torch.float64).reshape(-1, 4)
    scores = torch.as_tensor(prediction["scores"]).detach().to("cpu", torch.float64).reshape(-1, 1)
    labels = torch.as_tensor(prediction["labels"]).detach().to("cpu", torch.float64).reshape(-1, 1)
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1)
    return torch.cat([xywh, scores, labels], 1).numpy()
