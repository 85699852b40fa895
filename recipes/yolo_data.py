"""YOLO's data helpers, beside recipes/yolo.py (as torchvision keeps its detection references'
helpers beside their train.py): the box-aware transforms (the letterbox pipeline: scale jitter, crop,
pad; and GluonCV's YOLOv3 preset: colour, zoom-out, IoU crop, stretch), the multi-scale batch
sampler and k-means anchors from the training boxes. recipes/yolo.py imports them; copy it, this file
and recipes/yolo_model.py together.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from common import UserError
from common.detection.boxes import areas
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD
from common.loaders import EpochBatchSampler


# ============================================================================================
# Box-aware transforms: large-scale jitter, a crop with a visibility rule, padding to a square
# ============================================================================================
class RandomCropAtMost:
    """Crop to at most ``size`` x ``size`` at a random position (a no-op on a smaller image).

    Written here because ``v2.RandomCrop(pad_if_needed=True)`` would also pad, on both sides, and
    neither it nor ``v2.RandomIoUCrop`` (which needs boxes in every image) has a visibility rule.

    A box of which less than ``min_visibility`` of the area stays in the crop is made empty, so
    SanitizeBoundingBoxes drops it: a digit cut in half may read as another class. Called by
    ``v2.Compose`` with ``(image, target)``; randomness from torch's global generator (seeded per sample).
    """

    def __init__(self, size: int, min_visibility: float = 0.5) -> None:
        self.size, self.min_visibility = size, min_visibility

    def __call__(self, image: tv_tensors.Image, target: dict[str, Any]) -> tuple[tv_tensors.Image, dict[str, Any]]:
        h, w = image.shape[-2:]
        ch, cw = min(h, self.size), min(w, self.size)
        if (ch, cw) == (h, w):
            return image, target
        top = int(torch.randint(h - ch + 1, ()))
        left = int(torch.randint(w - cw + 1, ()))
        boxes = target["boxes"]
        before = areas(TF.clamp_bounding_boxes(boxes))
        cropped = TF.crop(boxes, top, left, ch, cw)  # shifts and clamps to the crop
        hidden = areas(cropped) < self.min_visibility * before
        if hidden.any():
            corners = cropped.as_subclass(torch.Tensor).clone()
            corners[hidden, 2:] = corners[hidden, :2]  # empty: removed by SanitizeBoundingBoxes
            cropped = tv_tensors.wrap(corners, like=cropped)
        return TF.crop(image, top, left, ch, cw), {**target, "boxes": cropped}


class PadTo:
    """Pad right and bottom to ``size`` x ``size`` with 0 (after Normalize: the mean colour), so box
    coordinates do not move; records the unpadded ``(h, w)`` as ``target["size"]``. (``v2.Pad`` takes
    fixed amounts; the amounts here depend on each image's size.)"""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: tv_tensors.Image, target: dict[str, Any]) -> tuple[tv_tensors.Image, dict[str, Any]]:
        h, w = image.shape[-2:]
        padding = [0, 0, max(self.size - w, 0), max(self.size - h, 0)]  # left, top, right, bottom
        target = {**target, "size": (int(h), int(w)), "boxes": TF.pad(target["boxes"], padding)}
        return TF.pad(image, padding, fill=0.0), target


def detection_transforms(
    train: bool,
    size: int,
    scale_range: tuple[float, float] = (0.5, 1.5),
    hflip: float = 0.5,
    color_jitter: bool = True,
    min_visibility: float = 0.5,
    preset: str = "letterbox",
) -> v2.Compose:
    """Box-aware transforms ``(PIL image, {"boxes": BoundingBoxes, "labels": Tensor}) -> (image, target)``.
    ``preset`` "gluoncv": :func:`gluoncv_transforms` (``scale_range`` and ``min_visibility`` unused);
    "letterbox", described here:

    Output: a float image [3, size, size] normalised with ImageNet mean/std, the picture in the top-left
    ``target["size"] = (h, w)`` and zeros (the mean colour) right and bottom; XYXY boxes in its pixels.

    train: large-scale jitter as in "Simple Copy-Paste" (resize so the image fits ``size`` x ``size``
    times a factor in ``scale_range``, then a random crop of at most ``size`` x ``size`` where it is
    larger; boxes less than ``min_visibility`` inside are dropped), horizontal flip with probability
    ``hflip`` (use 0 for digits: mirrored digits are not digits), photometric distortion (brightness,
    contrast, saturation, hue, channel order: torchvision's SSD recipe), pad.
    eval: resize so the longest side is ``size`` (aspect kept), pad.
    Both end with SanitizeBoundingBoxes: boxes under 1 px wide or tall go, with their labels.
    torchvision.transforms.v2 does all the box arithmetic; only the crop and the pad are written here.
    """
    if preset == "gluoncv":
        return gluoncv_transforms(train, size, hflip, color_jitter)
    if preset != "letterbox":
        raise UserError(f"augment must be letterbox or gluoncv, got '{preset}'")
    if not 0 < scale_range[0] <= scale_range[1]:
        raise UserError(f"scale_range must be 0 < low <= high, got {scale_range}")
    steps: list[Callable] = [v2.ToImage()]
    if train:
        steps += [
            v2.ScaleJitter((size, size), scale_range=tuple(scale_range), antialias=True),
            RandomCropAtMost(size, min_visibility),
        ]
        if hflip > 0:
            steps.append(v2.RandomHorizontalFlip(hflip))
        if color_jitter:
            steps.append(v2.RandomPhotometricDistort(p=0.5))
    else:
        steps.append(v2.Resize(None, max_size=size, antialias=True))
    steps += [
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=1.0),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        PadTo(size),
    ]
    return v2.Compose(steps)


# GluonCV resizes with one of OpenCV's nearest, bilinear, area, bicubic, Lanczos at random; PIL has all
# five (BOX is area averaging), so the preset keeps the PIL image until after the resize.
RESIZE_MODES = (
    v2.InterpolationMode.NEAREST,
    v2.InterpolationMode.BILINEAR,
    v2.InterpolationMode.BOX,
    v2.InterpolationMode.BICUBIC,
    v2.InterpolationMode.LANCZOS,
)


def training_transforms(cfg: Any) -> Callable[[int], Callable]:
    """The training transforms at an input size (``cfg``: recipes/yolo.py's Config): every batch's images are
    transformed at the size MultiScaleBatchSampler chose for it (GluonCV's RandomTransformDataLoader)."""
    return functools.partial(
        detection_transforms,
        True,
        scale_range=tuple(cfg.scale_range),
        hflip=cfg.hflip,
        color_jitter=cfg.color_jitter,
        min_visibility=cfg.min_visibility,
        preset=cfg.augment,
    )


def decode_side(cfg: Any) -> int:
    """The shorter side camera-size JPEGs are decoded at for training: as far as the largest size times the scale
    jitter's zoom still finds its pixels (letterbox); GluonCV's crops zoom further: 0, decoded in full."""
    return math.ceil(max([cfg.img_size, *cfg.multiscale]) * cfg.scale_range[1]) if cfg.augment == "letterbox" else 0


def gluoncv_transforms(train: bool, size: int, hflip: float = 0.5, color_jitter: bool = True) -> v2.Compose:
    """GluonCV's YOLOv3 transforms (``YOLO3DefaultTrainTransform`` / ``YOLO3DefaultValTransform``), with
    torchvision.transforms.v2's box-aware ops doing every step: ``(PIL image, target) -> (image, target)``.

    Output: a float image [3, size, size] normalised with ImageNet mean/std, the picture stretched to
    the square (aspect not kept, no padding: ``target["size"]`` is (size, size)); XYXY boxes in its pixels.

    train, in GluonCV's order: colour distortion (``color_jitter``); with probability 0.5 a zoom-out
    onto a canvas 1-4x the image's sides filled with the mean colour (``v2.RandomZoomOut`` = GluonCV's
    ``random_expand``); SSD's IoU-constrained crop (``v2.RandomIoUCrop``: no crop, or a crop of 0.3-1x
    the sides, aspect 1/2-2, reaching IoU 0.1 / 0.3 / 0.5 / 0.7 / 0.9 / any with a box, 50 trials; boxes
    whose centre leaves the crop are dropped; GluonCV asks the IoU of every box, torchvision, as SSD, of
    one); resize to size x size with a random one of :data:`RESIZE_MODES`; horizontal flip (``hflip``).
    eval: resize to size x size (bilinear). Both end with SanitizeBoundingBoxes (boxes under 1 px go).
    """
    steps: list[Callable] = []
    if train:
        if color_jitter:
            # GluonCV's random_color_distort, each step with probability 0.5; not v2.RandomPhotometricDistort,
            # whose random channel swap GluonCV does not do (docs/yolo.md, "Augmentation and multi-scale")
            def maybe(jitter: v2.ColorJitter) -> v2.RandomApply:
                return v2.RandomApply([jitter], p=0.5)

            contrast = maybe(v2.ColorJitter(contrast=(0.5, 1.5)))
            saturation_hue = [
                maybe(v2.ColorJitter(saturation=(0.5, 1.5))),
                maybe(v2.ColorJitter(hue=0.05)),
            ]  # +-18 degrees
            steps += [
                maybe(v2.ColorJitter(brightness=(0.875, 1.125))),
                v2.RandomChoice([v2.Compose([contrast, *saturation_hue]), v2.Compose([*saturation_hue, contrast])]),
            ]
        fill = tuple(round(255 * m) for m in IMAGENET_MEAN)  # the mean colour: 0 after Normalize
        steps += [
            v2.RandomZoomOut(fill=fill, side_range=(1.0, 4.0), p=0.5),
            v2.RandomIoUCrop(sampler_options=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0], trials=50),
            v2.RandomChoice([v2.Resize((size, size), interpolation=mode) for mode in RESIZE_MODES]),
        ]
        if hflip > 0:
            steps.append(v2.RandomHorizontalFlip(hflip))
        steps.append(v2.ToImage())
    else:
        steps += [v2.ToImage(), v2.Resize((size, size), antialias=True)]
    steps += [
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=1.0),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]
    return v2.Compose(steps)


# ============================================================================================
# Mosaic: four training samples around one point, a zoomed window of them
# ============================================================================================
def mosaic(
    pieces: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]],
    s: int,
    rng: Any,
    zoom: tuple[float, float] = (1.0, 1.0),
    min_visibility: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """YOLOv4/v5's mosaic: four ``pieces`` (image [3, s, s] letterboxed top-left, XYXY boxes [N, 4] in its pixels,
    the unpadded (h, w)) around the centre of a 2s x 2s canvas, each with a corner at the centre (no padding
    between them), then a window of side s / z (``z`` drawn from ``zoom``; at most the canvas) whose centre lies
    within s/2 of the canvas's, resized to s x s: z < 1 shows whole large objects smaller, z > 1 a closer part.

    Returns the image [3, s, s], every piece's boxes moved into it [sum N, 4] and which of them are kept: a box the
    window cuts to less than ``min_visibility`` of its area, or under 2 px, is dropped. ``rng``: ``random.Random``."""
    canvas = torch.zeros(3, 2 * s, 2 * s)  # 0 = the mean colour after normalisation
    moved = []
    for q, (image, boxes, (h, w)) in enumerate(pieces):  # top-left, top-right, bottom-left, bottom-right
        y, x = (s - h if q < 2 else s), (s - w if q % 2 == 0 else s)
        canvas[:, y : y + h, x : x + w] = image[:, :h, :w]
        moved.append(boxes + torch.tensor([x, y, x, y], dtype=boxes.dtype))
    side = min(2 * s, round(s / (rng.uniform(*zoom) if zoom[0] < zoom[1] else zoom[0])))
    x0, y0 = (min(max(0, round(s - side / 2 + rng.uniform(-s / 2, s / 2))), 2 * s - side) for _ in range(2))
    boxes = torch.cat(moved)
    before = areas(boxes) * (s / side) ** 2
    boxes = (boxes - torch.tensor([x0, y0, x0, y0], dtype=boxes.dtype)).clamp(0, side) * (s / side)
    kept = (areas(boxes) >= min_visibility * before.clamp(min=1e-6)) & (boxes[:, 2:] - boxes[:, :2] >= 2).all(1)
    window = canvas[:, y0 : y0 + side, x0 : x0 + side]
    if side != s:
        window = torch.nn.functional.interpolate(window[None], (s, s), mode="bilinear", antialias=side > s)[0]
    return window.contiguous(), boxes, kept


# ============================================================================================
# Multi-scale: the size of each batch, passed to the dataset with every key
# ============================================================================================
def multiscale_size(sizes: list[int], every: int, seed: int, epoch: int, batch: int) -> int:
    """The input size of a process's ``batch``-th batch of ``epoch``: one of ``sizes``, drawn anew every
    ``every`` batches from ``(seed, epoch, batch // every)`` alone (a stream of its own: ``spawn_key``)."""
    group = batch // every
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, group], spawn_key=(0x5CA1E,)))
    return sizes[int(rng.integers(len(sizes)))]


class MultiScaleBatchSampler(EpochBatchSampler):
    """:class:`common.loaders.EpochBatchSampler` whose keys also carry the batch's input size:
    ``(epoch, index, size)``, the size from :func:`multiscale_size`, so that the dataset transforms
    every image of a batch (and its mosaic and mixup partners) at that size, as GluonCV's
    ``RandomTransformDataLoader`` does; resampling a finished batch would blur upscaled pictures and
    alias downscaled ones.

    The size depends on ``(seed, epoch, b // num_processes)`` for global batch ``b``: process ``r``
    gets batches ``r, r + W, ...``, so all processes use the same size at each step, and the sizes do
    not depend on the process count, the workers or where a resumed run starts.
    """

    def __init__(
        self, size: int, batch_size: int, sizes: list[int], every: int, seed: int = 0, num_processes: int = 1
    ) -> None:
        if not sizes or every < 1:
            raise UserError(f"multi-scale needs sizes and multiscale_every of at least 1, got {sizes} and {every}")
        super().__init__(size, batch_size, True, seed, True, num_processes)
        self.sizes, self.every = list(sizes), every

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        for b, keys in enumerate(super().__iter__()):
            size = multiscale_size(self.sizes, self.every, self.seed, self.epoch, b // self.num_processes)
            yield [(*key, size) for key in keys]


# ============================================================================================
# Anchors: k-means on the training boxes' widths and heights
# ============================================================================================
def kmeans_anchors(boxes_wh: np.ndarray, k: int, seed: int = 0, iterations: int = 300) -> np.ndarray:
    """``k`` anchor (w, h) pairs (k, 2), sorted by area, by k-means on box widths and heights
    (``boxes_wh`` (N, 2), pixels) with distance 1 - IoU of boxes sharing a corner (YOLOv2): large
    boxes do not dominate as with Euclidean distance. Centres start at k-means++ picks and move to
    the median of their members."""
    wh = np.asarray(boxes_wh, np.float64).reshape(-1, 2)
    wh = wh[(wh > 0).all(1)]
    if len(np.unique(wh, axis=0)) < k:
        raise UserError(f"{len(wh)} boxes ({len(np.unique(wh, axis=0))} distinct sizes) are too few for {k} anchors")

    def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # (N, 2), (K, 2) -> (N, K)
        inter = np.minimum(a[:, None, 0], b[None, :, 0]) * np.minimum(a[:, None, 1], b[None, :, 1])
        return inter / (a[:, None].prod(-1) + b[None].prod(-1) - inter)

    rng = np.random.default_rng(seed)
    centres = wh[[rng.integers(len(wh))]]
    while len(centres) < k:  # k-means++: the next centre far (in 1 - IoU) from the chosen ones
        distance = (1 - iou(wh, centres).max(1)) ** 2
        centres = np.concatenate([centres, wh[[rng.choice(len(wh), p=distance / distance.sum())]]])
    assignment = None
    for _ in range(iterations):
        new = iou(wh, centres).argmax(1)
        if assignment is not None and np.array_equal(new, assignment):
            break
        assignment = new
        centres = np.stack(
            [np.median(wh[assignment == j], 0) if (assignment == j).any() else centres[j] for j in range(k)]
        )
    return centres[np.argsort(centres.prod(1))]
