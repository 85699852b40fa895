"""DETR's data pieces, beside recipes/detr.py (which builds its datasets and loaders from them): DETR's
augmentation (multi-scale resize of the shorter side, the random-size crop branch, flips) with torchvision's
``transforms.v2``, the evaluation's resize, and the collate that pads a batch and gives each target's boxes
as DETR's loss wants them: normalised (cx, cy, w, h). Training, evaluation, ``--predict`` and the export's
check all read images through these; copy detr.py and its ``detr_*.py`` files together.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torchvision.ops import box_convert
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, collate


class TransformSettings(Protocol):
    """What the transforms read of recipes/detr.py's Config."""

    scales: list[int]  # shorter side, px: one drawn per training image; evaluation at the last
    max_size: int  # longer side at most, px
    crop: float  # probability of DETR's crop branch
    crop_resize: list[int]  # the crop branch's shorter side before the crop, px
    crop_size: list[int]  # the crop's width and height drawn in [min, max] px
    hflip: float  # horizontal flip probability


class RandomSizeCrop:
    """DETR's crop: width and height drawn uniformly in ``[low, min(image side, high)]``, at a random
    position. Boxes are clipped to the crop; those left empty go at SanitizeBoundingBoxes (DETR's
    rule). Called by ``v2.Compose`` with ``(image, target)``; randomness from torch's generator
    (seeded per sample by DetectionDataset). Written here because v2.RandomCrop takes a fixed size."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def __call__(self, image, target):
        h, w = image.shape[-2:]
        ch = int(torch.randint(min(self.low, h), min(h, self.high) + 1, ()))
        cw = int(torch.randint(min(self.low, w), min(w, self.high) + 1, ()))
        top, left = int(torch.randint(h - ch + 1, ())), int(torch.randint(w - cw + 1, ()))
        return TF.crop(image, top, left, ch, cw), {**target, "boxes": TF.crop(target["boxes"], top, left, ch, cw)}


def data_transforms(cfg: TransformSettings, train: bool) -> v2.Compose:
    """Box-aware ``(PIL image, {"boxes", "labels"}) -> (normalised float image [3, H, W], target)``,
    no padding (the collate pads each batch to its largest image and returns the padding mask).

    train: horizontal flip, then with probability ``crop`` DETR's crop branch, else a resize of the
    shorter side to one of ``scales`` (longer side at most ``max_size``). eval: the last scale.
    """
    steps: list = [v2.ToImage()]
    if train:
        if cfg.hflip > 0:
            steps.append(v2.RandomHorizontalFlip(cfg.hflip))
        resize = v2.RandomShortestSize(
            cfg.scales, cfg.max_size, antialias=True
        )  # DETR's RandomResize(scales, max_size)
        if cfg.crop > 0:
            cropped = v2.Compose(
                [v2.RandomShortestSize(cfg.crop_resize, antialias=True), RandomSizeCrop(*cfg.crop_size), resize]
            )
            steps.append(v2.RandomChoice([resize, cropped], p=[1 - cfg.crop, cfg.crop]))
        else:
            steps.append(resize)
    else:
        steps.append(v2.RandomShortestSize([cfg.scales[-1]], cfg.max_size, antialias=True))  # one choice: deterministic
    steps += [
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=1.0),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]
    return v2.Compose(steps)


def detr_collate(batch):
    """common/detection/data's collate (images [B, 3, H, W] padded right and bottom, mask [B, H, W] True
    on padding), with each target's ``boxes`` as normalised (cx, cy, w, h) [N, 4] of the image's own
    unpadded ``size`` (DETR's convention: the padding is not part of the image). Runs in the workers."""
    images, mask, targets = collate(batch)
    for t in targets:
        h, w = t["size"]
        boxes = box_convert(t["boxes"].as_subclass(torch.Tensor).float(), "xyxy", "cxcywh")
        t["boxes"] = boxes / torch.tensor([w, h, w, h], dtype=torch.float32)
    return images, mask, targets
