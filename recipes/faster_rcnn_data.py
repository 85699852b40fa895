"""Faster R-CNN's data helpers, beside recipes/faster_rcnn.py: the box-aware transforms (images stay in 0..1 at
their own size: the model resizes, normalises and batches them), the list collate, which training images have a
box to learn, and the batch sampler that groups images by aspect ratio (torchvision's group_by_aspect_ratio.py).
Copy faster_rcnn.py and its faster_rcnn_*.py files together.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torchvision.transforms import v2

from common import UserError
from common.loaders import EpochBatchSampler, sample_seed


# ============================================================================================
# Data: images in 0..1, unnormalised and unpadded (the model's transform resizes, normalises
# and batches them); batches grouped by aspect ratio
# ============================================================================================
def data_transforms(train: bool, hflip: float, color_jitter: bool) -> v2.Compose:
    """Box-aware ``(PIL image, {"boxes", "labels"}) -> (float image [3, H, W] in 0..1, target)``.

    No resize and no normalisation here: GeneralizedRCNNTransform inside the model does both (once),
    with multi-scale training when ``min_size`` has several values. Boxes stay in the image's pixels.
    """
    steps: list = [v2.ToImage()]
    if train and hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    if train and color_jitter:
        steps.append(v2.RandomPhotometricDistort(p=0.5))
    steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=1.0), v2.ToDtype(torch.float32, scale=True)]
    return v2.Compose(steps)


def list_collate(
    batch: Sequence[tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """A list of images (sizes may differ) and a list of targets: ``boxes`` [N_i, 4] XYXY px,
    ``labels`` [N_i] with 0 = background (so class c is c + 1), ``masks`` [N_i, H_i, W_i] uint8 where the
    dataset has them, plus what evaluation needs."""
    images = [image for image, _ in batch]
    targets = [
        {**t, "boxes": t["boxes"].as_subclass(torch.Tensor).float(), "labels": t["labels"] + 1}
        | ({"masks": t["masks"].as_subclass(torch.Tensor)} if "masks" in t else {})  # uint8 [N_i, H_i, W_i]
        for _, t in batch
    ]
    return images, targets


def has_boxes(objects: dict[str, list]) -> bool:
    """Whether an image (its row's ``objects``) has a box to learn: one that is not a crowd region and is
    more than 1 px wide and high. torchvision's reference trains only on such images (coco_utils.py,
    ``_coco_remove_images_without_annotations``) except that it keeps crowd-only ones; here those go too:
    crowd regions never become targets, so such an image is as empty as one without boxes."""
    return any(w > 1 and h > 1 and not crowd for (_, _, w, h), crowd in zip(objects["bbox"], objects["iscrowd"]))


class AspectRatioBatchSampler(EpochBatchSampler):
    """EpochBatchSampler whose batches each hold images of one aspect-ratio group, so that a batch padded
    to its largest image wastes little (torchvision's group_by_aspect_ratio.py).

    Groups (``group_factor`` k, torchvision's ``--aspect-ratio-group-factor``): width / height cut at the
    2k + 1 edges ``2 ** linspace(-1, 1, 2k + 1)`` (k = 3: 0.5, 0.63, 0.79, 1, 1.26, 1.59, 2), 2k + 2
    groups, the outermost two open-ended; k = 0: portrait or landscape (the edge 1 alone); k < 0: one
    group. torchvision cuts height / width at the same edges (they are symmetric about 1), so only an
    image exactly on an edge lands in the neighbouring group there: a square one goes with the
    landscape ones here, with the portrait ones there.

    Each epoch: one seeded permutation of all indices (a function of ``(seed, epoch)`` only), split
    by group keeping that order, cut into batches per group, and the batches of all groups shuffled
    together with the same generator (torchvision's GroupedBatchSampler instead streams the
    permutation into per-group buffers and tops the last batches up with repeats). With ``drop_last``
    every group's incomplete batch is dropped and the epoch ends at the last complete round of
    ``num_processes`` batches, so Accelerate hands every process the same number of full batches
    (process ``r`` of ``W``: batches ``r, r + W, ...``) and ``skip_first_batches`` resumes exactly.
    Without ``drop_last`` (one process) every index comes exactly once per epoch, the groups' last
    batches being smaller.
    """

    def __init__(
        self,
        aspect_ratios: Sequence[float],
        batch_size: int,
        seed: int = 0,
        drop_last: bool = True,
        num_processes: int = 1,
        group_factor: int = 3,
    ) -> None:
        super().__init__(len(aspect_ratios), batch_size, True, seed, drop_last, num_processes)
        k = group_factor
        self.edges = [2 ** (j / k) for j in range(-k, k + 1)] if k > 0 else [1.0] if k == 0 else []
        self.groups = [bisect.bisect_right(self.edges, float(r)) for r in aspect_ratios]  # width / height -> group
        self.group_sizes = list(Counter(self.groups).values())  # images per non-empty group
        if drop_last and len(self) == 0:
            raise UserError(
                f"no aspect-ratio group of the training split fills {num_processes} batches of "
                f"{batch_size}; lower --batch_size or --aspect_ratio_group_factor"
            )

    def __len__(self) -> int:
        if self.drop_last:
            return sum(n // self.batch_size for n in self.group_sizes) // self.num_processes * self.num_processes
        return sum(-(-n // self.batch_size) for n in self.group_sizes)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1))
        order = torch.randperm(self.size, generator=generator).tolist()
        members: list[list[int]] = [[] for _ in range(len(self.edges) + 1)]
        for i in order:
            members[self.groups[i]].append(i)
        batches = [group[k : k + self.batch_size] for group in members for k in range(0, len(group), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        batches = [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]
        for batch in batches[: len(self)]:
            yield [(self.epoch, i) for i in batch]
