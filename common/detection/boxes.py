"""Small box helpers shared by the detection recipes and data. Boxes are XYXY in pixels unless a
name says otherwise (COCO ``xywh``: top-left corner, width, height)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image


def areas(boxes: torch.Tensor) -> torch.Tensor:
    """Areas (N,) of XYXY boxes (N, 4); a box with a negative side has area 0."""
    return (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)


def rescale_boxes(boxes_xyxy: torch.Tensor, size: tuple[int, int], orig_size: tuple[int, int]) -> torch.Tensor:
    """Map XYXY boxes (N, 4) from the transformed image (``target["size"]``: the unpadded (h, w)) to the
    original image (``target["orig_size"]``), per axis: what :class:`common.detection.coco_eval.CocoEvaluator`
    expects. Not clipped."""
    (h, w), (oh, ow) = size, orig_size
    scale = torch.tensor([ow / w, oh / h, ow / w, oh / h], dtype=torch.float32, device=boxes_xyxy.device)
    return boxes_xyxy.float() * scale


#: The narrowest side, in the original image's pixels, of a box a detector returns (:func:`without_tiny`).
MIN_SIDE_PX = 1.0


def without_tiny(detections: dict[str, Any], min_side: float = MIN_SIDE_PX) -> dict[str, Any]:
    """One image's ``detections`` (``boxes`` XYXY [N, 4] in the original image's pixels and, beside them, per-box
    tensors such as ``scores`` and ``labels``) without the boxes under ``min_side`` pixels wide or tall: a box
    clipped at the border to a sliver, drawn as a line with a class label, is no detection. Other values (the
    ``image_id``) stay as they are."""
    boxes = detections["boxes"]
    keep = (boxes[:, 2] - boxes[:, 0] >= min_side) & (boxes[:, 3] - boxes[:, 1] >= min_side)
    if bool(keep.all()):
        return detections
    n = len(boxes)
    return {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() and len(v) == n else v for k, v in detections.items()}


def crop_box(
    image: Image.Image, xywh: Sequence[float], size: int, margin: float = 0.15, shift: tuple[float, float] = (0.0, 0.0)
) -> Image.Image:
    """The COCO box ``xywh`` (pixels) of ``image`` grown by ``margin`` of its longer side on every
    side, moved by ``shift`` (fractions of the grown window's width and height), clipped to the
    image and resized to ``size`` x ``size`` (bicubic): a detection box as a classification sample."""
    x, y, w, h = xywh
    m = margin * max(w, h)
    x0, y0, x1, y1 = x - m, y - m, x + w + m, y + h + m
    dx, dy = shift[0] * (x1 - x0), shift[1] * (y1 - y0)
    box = (max(x0 + dx, 0), max(y0 + dy, 0), min(x1 + dx, image.width), min(y1 + dy, image.height))
    return image.resize((size, size), Image.BICUBIC, box=box)
