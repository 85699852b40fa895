"""Faster R-CNN: a two-stage detector from torchvision's building blocks, on HuggingFace Accelerate.

Stage one, the region proposal network (RPN), slides a small convolution over every level of a
feature pyramid (FPN on a timm ``features_only`` backbone, or torchvision's resnet50-FPN /
mobilenet-v3-FPN presets) and scores a few anchors per position for "object or not" and a box
correction. The best proposals after NMS go to stage two: RoIAlign cuts a fixed-size feature patch
per proposal from the pyramid level that suits its size, and a small MLP head classifies it into
background + C classes and refines its box per class. Four losses, each logged and weighted by
``loss_weights``: RPN objectness (BCE), RPN box regression (smooth L1), RoI classification (CE),
RoI box regression (smooth L1). torchvision does the anchor matching, sampling and box coding;
this file wires the blocks and trains them.

Training as torchvision's and seamseg's references train it: SGD with momentum and weight decay
(none on biases and norms), linear warmup, then step drops at epoch milestones or poly decay, per
step; batches grouped by aspect ratio (torchvision's 8 groups); training images without boxes left
out; optional frozen early backbone stages and frozen batch norm; fp16/bf16 and gradient clipping
through Accelerate. Evaluation is COCO mAP (common/coco_eval.py); the best weights by mAP@0.5 are
kept.

Launch (defaults = the built-in ``digits_det`` scenes, a thin resnet10t from scratch at 96 px):

    accelerate launch recipes/faster_rcnn.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/faster_rcnn.py \\
        --config configs/faster_rcnn/coco_r50_fpn_26ep.yaml

Expected (defaults, measured): mAP@0.5 0.941 (mAP 0.675) on the 400 held-out scenes after 2 epochs,
about 2 minutes wall on one CPU core; the README's recipe table has the details.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

try:  # the shared package, installed once with `pip install -e <checkout>` (README, "Quickstart")
    import common  # noqa: F401
except ModuleNotFoundError:
    print(
        "error: this recipe needs the package common/: run `pip install -e <cv-recipes checkout>` once", file=sys.stderr
    )
    sys.exit(2)

import inspect

import timm
import torch
import torchvision
from torch import nn
from torchvision.models import MobileNet_V3_Large_Weights, ResNet50_Weights
from torchvision.models.detection.faster_rcnn import FasterRCNN, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import AnchorGenerator, RegionProposalNetwork, RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.transforms import v2

from common import UserError
from common.boxes import rescale_boxes
from common.coco_eval import CocoEvaluator, EvalDetails
from common.config import MAX_COUNT, MAX_EPOCHS, MAX_SIDE, RunConfig, to_dict
from common.console import cli_main
from common.data import with_label_fraction
from common.detection import IMAGENET_MEAN, IMAGENET_STD, DetectionDataset, load_detection, prediction_batches
from common.detection_outputs import check_classes, per_class_text, report_evaluation, save_predictions
from common.export import OnnxModel, export, export_model, is_onnx
from common.export_check import Detections, photos
from common.image_cache import cache_images
from common.loaders import EpochBatchSampler, eval_loader_for, loader_kwargs, sample_seed
from common.loop import Loop, steps_total
from common.model_folder import write_detector_folder
from common.models import (
    average_bn_statistics,
    create_timm_model,
    freeze_stages,
    fsdp_units,
    hub_offline,
    mark_fsdp_blocks,
    sync_batchnorm,
)
from common.run import Run
from common.scan import without_unreadable
from common.schedules import schedule, set_group_values, weight_decay_groups
from common.weights import (
    config_with_weights,
    kept_weights,
    load_backbone,
    load_state,
    load_weights,
    read_metadata,
    save_weights,
    weights_metadata,
)

# torchvision's Faster R-CNN presets (model = one of these names, each built by its own function) -> the ImageNet
# weights --pretrained_backbone gives the preset's backbone: IMAGENET1K_V1, which torchvision's reference trained the
# resnet50 and mobilenet presets' COCO weights from (references/detection/README.md, --weights-backbone; 37.0 box AP
# for fasterrcnn_resnet50_fpn), not "DEFAULT", now the later, stronger V2 classifiers. fasterrcnn_resnet50_fpn_v2's
# COCO weights were trained from random init (400 epochs, large-scale jitter); V1 is what torchvision's own
# pretrained_backbone=True gives it.
PRESETS = {
    "fasterrcnn_resnet50_fpn": ResNet50_Weights.IMAGENET1K_V1,
    "fasterrcnn_resnet50_fpn_v2": ResNet50_Weights.IMAGENET1K_V1,
    "fasterrcnn_mobilenet_v3_large_fpn": MobileNet_V3_Large_Weights.IMAGENET1K_V1,
    "fasterrcnn_mobilenet_v3_large_320_fpn": MobileNet_V3_Large_Weights.IMAGENET1K_V1,
}
# A preset's backbone stages as torchvision counts them for trainable_backbone_layers (the stem is one): a resnet's
# stem and layer1-4; a MobileNetV3's first convolution (with the block after it), its four stride-2 stages and its last
# convolution
PRESET_STAGES = {name: 6 if "mobilenet" in name else 5 for name in PRESETS}
# The RPN and RoI sampling budgets of a timm backbone whose fields are left empty / 0: the demo's, sized for at most
# 6 objects per 96 px scene. A preset left so keeps torchvision's own (FasterRCNN's defaults: 2000 / 1000 proposals
# per level before NMS and per image after it, [train, eval]; 256 anchors and 512 proposals sampled per image;
# the 320 preset evaluates with 150 / 150).
TIMM_BUDGETS = {
    "rpn_pre_nms_top_n": [200, 200],
    "rpn_post_nms_top_n": [100, 100],
    "rpn_batch_size_per_image": 128,
    "box_batch_size_per_image": 32,
}
# The four losses as torchvision names them -> as this recipe names and logs them; loss_weights
# follow this order. Each is already a mean: RPN objectness BCE over the sampled anchors, RPN box
# smooth-L1 (beta 1/9) summed over positive anchors / sampled anchors, RoI cross-entropy over the
# sampled proposals, RoI box smooth-L1 (beta 1/9) summed over positives / sampled proposals.
LOSS_NAMES = {
    "loss_objectness": "loss_rpn_objectness",
    "loss_rpn_box_reg": "loss_rpn_box",
    "loss_classifier": "loss_roi_classifier",
    "loss_box_reg": "loss_roi_box",
}


# ============================================================================================
# Config (defaults: the built-in demo)
# ============================================================================================
@dataclass
class Config(RunConfig):
    # data
    data: str = "digits_det"  # built-in name, COCO-json folder, or hub dataset with an `objects` column
    train_fraction: float = 1.0  # a seeded fraction of the training images (the rest unused)
    hflip: float = 0.0  # horizontal flip probability: 0.5 for natural images; digits must not be mirrored
    color_jitter: bool = False  # torchvision's photometric distortion (SSD), p = 0.5
    num_workers: int = -1  # DataLoader worker processes per training process; -1: the cores available per process,
    #   at most 8 (common.loaders.auto_workers); 0: load in the main process
    aspect_ratio_group_factor: int = 3  # k: batches of one aspect-ratio group, width / height cut at
    #   2 ** linspace(-1, 1, 2k + 1) into 2k + 2 groups (torchvision's --aspect-ratio-group-factor; 3: 8 groups);
    #   0: landscape or portrait; -1: no grouping
    keep_empty: bool = False  # keep training images without boxes as negatives; false drops them, as torchvision's
    #   reference does: no box, or only boxes at most 1 px wide or high, or only crowd regions (never targets)
    # model: backbone -> FPN -> RPN -> RoIAlign -> box head
    model: str = "resnet10t"  # a timm model (features_only), or a torchvision preset (PRESETS)
    model_kwargs: dict = field(default_factory=lambda: {"channels": [32, 64, 128, 256], "stem_width": 16})  # extra
    #   timm.create_model arguments; the demo: resnet10t at half width
    pretrained: bool = False  # timm: ImageNet backbone; presets: COCO weights (both need network)
    pretrained_backbone: bool = False  # presets only: ImageNet backbone weights
    init_backbone: str = ""  # timm models: safetensors of the same timm model (classifier.py's best.safetensors,
    #   DINO's teacher_backbone.safetensors) for the backbone; the FPN, RPN and box head stay new
    out_indices: list[int] = field(default_factory=lambda: [1, 2, 3])  # timm feature levels (1 = stride 4)
    fpn_channels: int = 48  # FPN width at every level (torchvision: 256)
    extra_pool: bool = False  # one more FPN level by max-pooling the coarsest (torchvision's "pool")
    anchor_sizes: list[list[float]] = field(default_factory=lambda: [[12, 18], [24, 36], [48, 72]])  # px, per FPN
    #   level, as many at each; empty: 8 x stride
    aspect_ratios: list[float] = field(default_factory=lambda: [1.0, 2.0])  # height / width, at every level
    min_size: list[int] = field(default_factory=lambda: [96])  # shorter side, px; several: one drawn per training
    #   image, eval at the last
    max_size: int = 96  # longer side at most, px
    rpn_pre_nms_top_n: list[int] = field(default_factory=list)  # proposals per level before NMS, [train, eval];
    #   empty: the model's own: a preset's torchvision values (2000, 1000), a timm backbone's 200, 200 (the demo's)
    rpn_post_nms_top_n: list[int] = field(default_factory=list)  # proposals per image after NMS, [train, eval];
    #   empty: the model's own: a preset's torchvision values (2000, 1000; the 320 preset evaluates with 150), a
    #   timm backbone's 100, 100 (the demo's)
    rpn_batch_size_per_image: int = 0  # anchors sampled per image for the RPN losses; 0: the model's own: a preset's
    #   torchvision value (256), a timm backbone's 128 (the demo's)
    roi_size: int = 7  # RoIAlign output side, cells (timm backbones; the presets keep torchvision's 7)
    roi_sampling_ratio: int = 1  # bilinear samples per cell side (timm backbones; the presets keep torchvision's 2;
    #   the CPU backward is slow)
    box_head_dim: int = 256  # the two-layer MLP head's width (timm backbones; the presets keep torchvision's 1024)
    box_batch_size_per_image: int = 0  # proposals sampled per image for the RoI losses; 0: the model's own: a
    #   preset's torchvision value (512), a timm backbone's 32 (the demo's)
    box_score_thresh: float = 0.05  # detections scoring below this are dropped (torchvision: 0.05)
    box_nms_thresh: float = 0.5  # per-class NMS IoU of the final detections (torchvision: 0.5)
    box_detections_per_img: int = 100  # detections kept per image (torchvision: 100)
    freeze_at: int = 0  # frozen backbone stages, stem counted as 1 (Detectron2 convention; COCO: 2)
    frozen_bn: bool = False  # backbone batch norm as fixed affine layers (with pretrained weights)
    loss_weights: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0])  # rpn objectness, rpn box,
    #   roi classifier, roi box
    # optimization
    epochs: int = 2  # training epochs
    batch_size: int = 8  # images per process and micro-step: global batch = this x processes x grad_accum_steps
    lr: float = 0.02  # peak SGD learning rate (torchvision: 0.02 for 16 images; here 8: more steps in 2 epochs
    #   did better)
    momentum: float = 0.9  # SGD momentum (torchvision: 0.9)
    weight_decay: float = 1e-4  # biases and norms get none (torchvision: 1e-4)
    warmup_epochs: float = 0.5  # linear warmup from lr x warmup_factor, epochs (fractions allowed)
    warmup_factor: float = 0.001  # the warmup starts at lr x this
    sched: Literal["poly", "step"] = "poly"  # poly (seamseg; to 0 at the end) or step (drops at decay_milestones)
    decay_milestones: list[int] = field(default_factory=list)  # epochs, for sched=step
    decay_rate: float = 0.1  # factor on the learning rate at each of decay_milestones (sched=step)
    poly_power: float = 0.9  # lr = lr x (1 - progress) ** this after warmup, for sched=poly (seamseg: 0.9)
    clip_grad: float = 10.0  # clip the global gradient norm to this (0: off)
    compile: bool = False  # torch.compile the whole model through Accelerate (inductor); graph breaks at NMS and
    #   sampling
    # evaluation
    plot_images: int = 4  # evaluation images drawn with ground truth and predictions in plots/detections.png (0: none)
    best_metric: Literal["map_50", "map", "map_50_11pt"] = "map_50"  # what best.safetensors follows: mAP@0.5,
    #   COCO's mAP@[.5:.95] (map; the COCO and VOC configs) or VOC07's 11-point mAP@0.5
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    eval_only: bool = False  # evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in the
    #   dataset's category ids), no training
    predict: str = ""  # an image or a folder of images: with --weights, write detections.json and the images with
    #   their boxes drawn (predictions/) in the run folder; no dataset needed
    predict_score: float = 0.3  # predict: detections scoring below this are neither written nor drawn
    # run
    eval_every: int = 2  # evaluate every this many epochs; also at the end

    # the legal values of the numeric fields (common.config.RunConfig.ranges has the shared ones'; loss_weights
    # is checked in check_config)
    ranges: ClassVar[dict[str, str]] = {
        "(0, 1]; 1 trains on every image": "train_fraction",
        "[0, 1]": "hflip box_score_thresh box_nms_thresh predict_score warmup_factor decay_rate",
        "[-1, 16]": "aspect_ratio_group_factor",
        "[0, 8]": "out_indices freeze_at",
        f"[1, {MAX_COUNT}]": "fpn_channels box_head_dim box_detections_per_img rpn_pre_nms_top_n rpn_post_nms_top_n",
        f"[0, {MAX_COUNT}]": "rpn_batch_size_per_image box_batch_size_per_image",
        "(0, inf)": "anchor_sizes aspect_ratios",
        f"[1, {MAX_SIDE}]": "min_size max_size",
        "[1, 64]": "roi_size roi_sampling_ratio",
        "[0, 1)": "momentum",
        "[0, inf)": "poly_power",
        f"[0, {MAX_EPOCHS}]": "decay_milestones",
        "[0, 64]": "plot_images",
    }


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


def list_collate(batch):
    """A list of images (sizes may differ) and a list of targets: ``boxes`` [N_i, 4] XYXY px,
    ``labels`` [N_i] with 0 = background (so class c is c + 1), plus what evaluation needs."""
    images = [image for image, _ in batch]
    targets = [
        {**t, "boxes": t["boxes"].as_subclass(torch.Tensor).float(), "labels": t["labels"] + 1} for _, t in batch
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


# ============================================================================================
# Model: (transform) -> backbone + FPN -> RPN -> RoI heads
# ============================================================================================
class TimmFPN(nn.Module):
    """A timm ``features_only`` backbone and torchvision's FPN: ``[B, 3, H, W] -> OrderedDict`` of
    ``[B, fpn_channels, H / s, W / s]`` for the strides s of ``out_indices`` (plus one coarser
    max-pooled level with ``extra_pool``). ``out_channels`` is what the RPN and RoI heads read."""

    def __init__(self, body: nn.Module, fpn_channels: int, extra_pool: bool) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(
            body.feature_info.channels(), fpn_channels, LastLevelMaxPool() if extra_pool else None
        )
        self.out_channels = fpn_channels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(self.body(x))))


class ExactResize(GeneralizedRCNNTransform):
    """torchvision's transform with each image's resized size computed in integers: the shorter side to
    ``min_size`` unless the longer would pass ``max_size`` (then the longer to ``max_size``), the other
    side rounded down exactly. torchvision computes the scale in float64 when eager and in float32 in a
    traced graph, which round one pixel apart on about one photo size in six (750 x 1000 -> 800 or 799
    rows), and a graph that resizes to another size finds other boxes and scores."""

    @classmethod
    def like(cls, transform: GeneralizedRCNNTransform) -> ExactResize:
        return cls(transform.min_size, transform.max_size, transform.image_mean, transform.image_std)

    def resize(self, image: torch.Tensor, target: dict | None = None) -> tuple[torch.Tensor, dict | None]:
        if self.training and self._skip_resize:
            return image, target
        size = self.torch_choice(self.min_size) if self.training else self.min_size[-1]
        sides = torch._shape_as_tensor(image)[-2:]  # (h, w), int64: traced as the graph's input shape
        short, long = sides.min(), sides.max()
        by_short = size * long <= self.max_size * short
        new = sides * torch.where(by_short, size, self.max_size) // torch.where(by_short, short, long)
        new = [new[0], new[1]] if torch.jit.is_tracing() else new.tolist()  # the graph keeps them symbolic
        out = nn.functional.interpolate(image[None], size=new, mode="bilinear", align_corners=False)[0]
        if target is not None:
            target["boxes"] = resize_boxes(target["boxes"], image.shape[-2:], out.shape[-2:])
        return out, target


class TwoStageDetector(nn.Module):
    """Faster R-CNN as one forward, so that DDP sees every parameter's gradient:

    training ``(images, targets) -> {loss_rpn_objectness, loss_rpn_box, loss_roi_classifier, loss_roi_box}``;
    eval ``images -> [{boxes [K, 4] XYXY in the input image's pixels, labels [K] (1..C), scores [K]}]``.
    ``images``: a list of [3, H_i, W_i] in 0..1.
    """

    def __init__(
        self, transform: GeneralizedRCNNTransform, backbone: nn.Module, rpn: RegionProposalNetwork, roi_heads: RoIHeads
    ) -> None:
        super().__init__()
        self.transform, self.backbone, self.rpn, self.roi_heads = transform, backbone, rpn, roi_heads
        # The box regressions leave their heads in fp32 whatever the autocast: torchvision's BoxCoder casts
        # anchors and proposals to the regression's dtype, and bf16 pixel coordinates are multiples of
        # 2 px from 256, 4 px from 512 and 8 px from 1024 (so bf16 evaluation would round every box).
        for head in (rpn.head, roi_heads.box_predictor):
            head.register_forward_hook(_float_outputs)
        # Anchors in fp32 whatever the autocast: torchvision's AnchorGenerator builds them in the features' dtype
        rpn.anchor_generator.register_forward_pre_hook(_fp32_grid)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        original_sizes = [tuple(image.shape[-2:]) for image in images]
        # resize (min_size / max_size), normalise (ImageNet mean/std), pad to a multiple of 32: an
        # ImageList of [B, 3, H, W] with each image's resized size; target boxes are resized with it
        batch, targets = self.transform(images, targets)
        features = self.backbone(batch.tensors)  # level name -> [B, F, H / s, W / s]
        proposals, rpn_losses = self.rpn(batch, features, targets)  # per image [post_nms_top_n, 4] px
        detections, roi_losses = self.roi_heads(features, proposals, batch.image_sizes, targets)
        if self.training:
            return {LOSS_NAMES[k]: v for k, v in {**rpn_losses, **roi_losses}.items()}
        return self.transform.postprocess(detections, batch.image_sizes, original_sizes)  # back to input px


class Exported(nn.Module):
    """What is exported: one image ``[3, H, W]`` (0..1, any size; the model resizes and normalises it) ->
    ``boxes [K, 4]`` XYXY in its pixels, ``scores [K]``, ``labels [K]`` (0..C-1), NMS inside the graph."""

    def __init__(self, model: TwoStageDetector) -> None:
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        found = self.model([image])[0]
        return found["boxes"], found["scores"], found["labels"] - 1


def _fp32_grid(module: nn.Module, inputs: tuple[Any, list[torch.Tensor]]) -> tuple[Any, list[torch.Tensor]]:
    """Forward pre-hook of the AnchorGenerator: each feature map [B, F, h, w] handed over as an fp32 view of
    one zero of that shape (no copy), since the generator reads only the maps' shapes, dtype and device."""
    image_list, features = inputs
    return image_list, [f.new_zeros((), dtype=torch.float32).expand(f.shape) for f in features]


def _float_outputs(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: the module's tensors (alone or in tuples and lists) returned as fp32."""
    if isinstance(output, torch.Tensor):
        return output.float()
    return type(output)(_float_outputs(module, inputs, o) for o in output)


def budgets(cfg: Config, own: dict[str, Any]) -> dict[str, int]:
    """The RPN and RoI sampling budgets as FasterRCNN's keywords (``rpn_pre_nms_top_n_train``, ...): each
    field that is set, else its value in ``own`` (TIMM_BUDGETS), else none (a preset keeps torchvision's)."""
    value = {k: getattr(cfg, k) or own.get(k) for k in TIMM_BUDGETS}
    out = {k: value[k] for k in ("rpn_batch_size_per_image", "box_batch_size_per_image") if value[k]}
    for k in ("rpn_pre_nms_top_n", "rpn_post_nms_top_n"):
        if value[k]:
            out.update({f"{k}_train": value[k][0], f"{k}_test": value[k][1]})
    return out


def preset_model(cfg: Config, num_classes: int, notes: list[str]) -> TwoStageDetector:
    """A torchvision preset (``cfg.model`` in PRESETS): its own backbone + FPN, heads sized as torchvision
    sizes them, for ``num_classes`` object classes (background is one more)."""
    box_kwargs = dict(
        box_score_thresh=cfg.box_score_thresh,
        box_nms_thresh=cfg.box_nms_thresh,
        box_detections_per_img=cfg.box_detections_per_img,
    )
    builder = getattr(torchvision.models.detection, cfg.model)
    # FasterRCNN passes unknown keywords on to its transform, which ignores them: check them here
    known = set(inspect.signature(FasterRCNN).parameters) | {"size_divisible", "fixed_size"}
    if set(cfg.model_kwargs) - known:
        raise UserError(
            f"model_kwargs {sorted(set(cfg.model_kwargs) - known)} do not fit {cfg.model}: the presets take "
            "torchvision's FasterRCNN arguments (--model_kwargs {} for none)"
        )
    downloads = [torchvision.models.get_model_weights(cfg.model).DEFAULT] if cfg.pretrained else []
    downloads += [PRESETS[cfg.model]] if cfg.pretrained_backbone else []
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    missing = [w.url for w in downloads if not (cache / Path(w.url).name).is_file()]
    flag = "--pretrained" if cfg.pretrained else "--pretrained_backbone"
    if missing and hub_offline():  # say so now, not after urllib's retries
        raise UserError(
            f"{flag}: torchvision's weights {', '.join(missing)} are not in {cache} and HF_HUB_OFFLINE is "
            f"set: download them there once with network, or train without {flag}"
        )
    try:
        m = builder(
            weights="DEFAULT" if cfg.pretrained else None,
            weights_backbone=PRESETS[cfg.model] if cfg.pretrained_backbone else None,
            num_classes=91 if cfg.pretrained else num_classes + 1,
            trainable_backbone_layers=PRESET_STAGES[cfg.model] - cfg.freeze_at
            if cfg.pretrained or cfg.pretrained_backbone
            else None,
            min_size=tuple(cfg.min_size),
            max_size=cfg.max_size,
            **budgets(cfg, {}),
            **box_kwargs,
            **cfg.model_kwargs,
        )
    except TypeError as e:
        raise UserError(
            f"model_kwargs {cfg.model_kwargs} do not fit {cfg.model} ({e}); "
            "the presets take torchvision's FasterRCNN arguments (--model_kwargs {} for none)"
        ) from None
    except OSError as e:  # urllib's URLError: no network, or a proxy in the way
        raise UserError(
            f"{flag}: torchvision's weights {', '.join(missing)} could not be downloaded to {cache} "
            f"({type(e).__name__}); download them there once with network, or train without {flag}"
        ) from None
    if cfg.anchor_sizes:  # the preset's anchors replaced; a new RPN head when the count per position changes
        m.rpn.anchor_generator = AnchorGenerator(
            tuple(tuple(s) for s in cfg.anchor_sizes), (tuple(cfg.aspect_ratios),) * len(cfg.anchor_sizes)
        )
        per_position = m.rpn.anchor_generator.num_anchors_per_location()[0]
        if m.rpn.head.cls_logits.out_channels != per_position:
            m.rpn.head = RPNHead(m.backbone.out_channels, per_position)
    for weights in downloads:  # named in the start banner
        which = "--pretrained" if cfg.pretrained and weights == downloads[0] else "--pretrained_backbone"
        notes.append(f"{which.lstrip('-')}: torchvision's {weights} ({Path(weights.url).name})")
    if cfg.pretrained:  # COCO's 91-way predictor -> ours
        m.roi_heads.box_predictor = FastRCNNPredictor(m.roi_heads.box_predictor.cls_score.in_features, num_classes + 1)
    if cfg.frozen_bn:  # the presets freeze it themselves whenever they load weights
        m.backbone.body = timm.layers.freeze_batch_norm_2d(m.backbone.body)
    return TwoStageDetector(ExactResize.like(m.transform), m.backbone, m.rpn, m.roi_heads)


def timm_model(cfg: Config, num_classes: int, notes: list[str]) -> TwoStageDetector:
    """A timm ``features_only`` backbone under TimmFPN, with this recipe's RPN and RoI heads, for
    ``num_classes`` object classes (background is one more)."""
    try:
        body = create_timm_model(
            cfg.model,
            also=f" or a torchvision preset ({', '.join(PRESETS)})",
            features_only=True,
            out_indices=tuple(cfg.out_indices),
            pretrained=cfg.pretrained,
            notes=notes,
            **cfg.model_kwargs,
        )
    except (IndexError, TypeError) as e:
        raise UserError(
            f"model '{cfg.model}' does not take out_indices {cfg.out_indices} and model_kwargs {cfg.model_kwargs}: {e}"
        ) from None
    if cfg.init_backbone:  # before freezing: frozen batch norm takes the loaded statistics
        notes.append(load_backbone(body, cfg.init_backbone))
    freeze_stages(body, cfg.freeze_at)
    if cfg.frozen_bn:
        body = timm.layers.freeze_batch_norm_2d(body)  # BatchNorm2d -> FrozenBatchNorm2d
    backbone = TimmFPN(body, cfg.fpn_channels, cfg.extra_pool)
    strides = body.feature_info.reduction() + ([2 * body.feature_info.reduction()[-1]] if cfg.extra_pool else [])
    sizes = [tuple(s) for s in cfg.anchor_sizes] or [(8 * s,) for s in strides]
    if len(sizes) != len(strides) or len({len(s) for s in sizes}) != 1:
        raise UserError(
            f"anchor_sizes must give one list of sizes per FPN level, as many at each (the RPN "
            f"head is shared); the FPN has {len(strides)} levels (strides {strides}), got {cfg.anchor_sizes}"
        )
    anchors = AnchorGenerator(tuple(sizes), (tuple(cfg.aspect_ratios),) * len(sizes))
    budget = budgets(cfg, TIMM_BUDGETS)
    rpn = RegionProposalNetwork(
        anchors,
        RPNHead(cfg.fpn_channels, anchors.num_anchors_per_location()[0]),
        fg_iou_thresh=0.7,
        bg_iou_thresh=0.3,
        batch_size_per_image=budget["rpn_batch_size_per_image"],
        positive_fraction=0.5,
        nms_thresh=0.7,
        pre_nms_top_n=dict(training=budget["rpn_pre_nms_top_n_train"], testing=budget["rpn_pre_nms_top_n_test"]),
        post_nms_top_n=dict(training=budget["rpn_post_nms_top_n_train"], testing=budget["rpn_post_nms_top_n_test"]),
    )
    levels = [str(i) for i in range(len(cfg.out_indices))]  # RoIAlign reads the FPN levels, not "pool"
    roi_heads = RoIHeads(
        MultiScaleRoIAlign(levels, cfg.roi_size, cfg.roi_sampling_ratio),
        TwoMLPHead(cfg.fpn_channels * cfg.roi_size**2, cfg.box_head_dim),
        FastRCNNPredictor(cfg.box_head_dim, num_classes + 1),
        fg_iou_thresh=0.5,
        bg_iou_thresh=0.5,
        batch_size_per_image=budget["box_batch_size_per_image"],
        positive_fraction=0.25,
        bbox_reg_weights=None,
        score_thresh=cfg.box_score_thresh,
        nms_thresh=cfg.box_nms_thresh,
        detections_per_img=cfg.box_detections_per_img,
    )
    # the order of min_size matters: training draws one per image, evaluation uses the last
    transform = ExactResize(tuple(cfg.min_size), cfg.max_size, IMAGENET_MEAN, IMAGENET_STD)
    return TwoStageDetector(transform, backbone, rpn, roi_heads)


def create_model(cfg: Config, num_classes: int, notes: list[str] | None = None) -> TwoStageDetector:
    """The detector for ``num_classes`` object classes (background is one more); the weights it starts from
    (pretrained, pretrained_backbone, init_backbone) are named in ``notes``."""
    notes = [] if notes is None else notes
    if cfg.model in PRESETS:
        return preset_model(cfg, num_classes, notes)
    return timm_model(cfg, num_classes, notes)


# ============================================================================================
# Evaluation and saving
# ============================================================================================
def detect(model: nn.Module | OnnxModel, loader, accelerator) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader``, per image: ``image_id`` and the detections (``boxes`` XYXY in the original
    image's pixels, ``scores``, ``labels`` as class indices 0..C-1); the model in eval mode, or its ONNX
    export (one image at a time)."""
    for images, targets in loader:
        if isinstance(model, OnnxModel):
            detections = [dict(zip(("boxes", "scores", "labels"), model(image))) for image in images]
        else:
            with torch.no_grad(), accelerator.autocast():
                detections = [{**d, "labels": d["labels"] - 1} for d in model(images)]  # boxes in the input's pixels
        yield [
            {
                "image_id": t["image_id"],
                "boxes": rescale_boxes(d["boxes"], t["size"], t["orig_size"]),
                "scores": d["scores"],
                "labels": d["labels"],
            }
            for d, t in zip(detections, targets)
        ]


def evaluate(
    model: nn.Module, eval_loader, evaluator: CocoEvaluator, accelerator
) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/coco_eval.py); boxes go to the evaluator in original-image pixels."""
    was_training = model.training
    model.eval()
    average_bn_statistics(model, accelerator)  # each process's BN statistics saw its own batches: their mean
    results = evaluator.evaluate(detect(model, eval_loader, accelerator), accelerator, details=True)
    model.train(was_training)
    return results


# the fields that define the model: --weights restores them from the file's saved config
MODEL_FIELDS = (
    "model",
    "model_kwargs",
    "out_indices",
    "fpn_channels",
    "extra_pool",
    "anchor_sizes",
    "aspect_ratios",
    "min_size",
    "max_size",
    "rpn_pre_nms_top_n",
    "rpn_post_nms_top_n",
    "roi_size",
    "roi_sampling_ratio",
    "box_head_dim",
    "box_score_thresh",
    "box_nms_thresh",
    "box_detections_per_img",
    "frozen_bn",
)


def trained_model(cfg: Config, data: Any = None) -> tuple[nn.Module, dict[str, Any]]:
    """The detector of ``cfg.weights`` (eval mode) and the file's metadata (classes, category ids),
    which must be those of ``data`` when given."""
    state, meta = load_weights(cfg.weights, "detector")
    check_classes(cfg.weights, meta, data)
    plain = dataclasses.replace(cfg, pretrained=False, pretrained_backbone=False, init_backbone="")
    model = create_model(plain, len(meta["classes"]))
    return load_state(model, state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: Config, run: Run) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model (or ONNX file) on the images ``cfg.predict`` names."""
    if is_onnx(cfg.weights):
        model, meta = OnnxModel(cfg.weights), read_metadata(cfg.weights)
    else:
        model, meta = trained_model(cfg)
        model = model.to(run.accelerator.device)
    # one image at a time, as the ONNX file takes them: a batch pads its images to its largest, which
    # changes the features near their borders, so batched detections depend on an image's companions
    table, batches = prediction_batches(
        run, cfg.predict, data_transforms(False, 0.0, False), list_collate, 1, cfg.num_workers
    )
    found = detect(model, batches, run.accelerator)
    return save_predictions(
        run, found, table, meta, cfg.predict_score, cfg.predict, ("box_score_thresh", cfg.box_score_thresh)
    )


def export_files(
    model: nn.Module, cfg: Config, meta: dict[str, Any], folder: Path, recipe: str, image: torch.Tensor | None = None
) -> dict[str, float]:
    """``model.onnx`` in ``folder`` (TorchScript exporter: NMS has outputs of data-dependent size, which
    torch.export cannot trace): one image [3, H, W] in 0..1, any size -> boxes [K, 4] XYXY in its pixels,
    scores [K], labels [K]; checked against eager (detections above box_score_thresh) on ``image`` (default:
    a synthetic picture) resized to each of common.export_check.CHECK_SIZES (upscaled small ones, large ones, odd
    aspect ratios)."""
    saved = weights_metadata(cfg, meta["classes"], recipe, meta["category_ids"], (IMAGENET_MEAN, IMAGENET_STD))
    saved["preprocessing"] = json.dumps({"inside the graph": "resize (min_size, max_size), ImageNet mean and std"})
    checks = [{"image": picture} for picture in photos(image)]
    if image is None:  # traced at the size the graph resizes to (a trace follows the example's branches)
        image = torch.rand(3, cfg.min_size[-1], cfg.min_size[-1] * 4 // 3, generator=torch.Generator().manual_seed(0))
    names, spatial = ["boxes", "scores", "labels"], {"image": {1: "height", 2: "width"}}
    read = Detections(lambda out: [tuple(out)], cfg.box_score_thresh, cfg.box_detections_per_img)
    return export_model(Exported(model), {"image": image}, names, folder, saved, spatial, True, checks, detections=read)


# ============================================================================================
# Training
# ============================================================================================
def check_config(cfg: Config) -> None:
    """Values that would fail deep inside torchvision, as one clear error before anything is made
    (the anchors are checked against the backbone's levels in ``timm_model``)."""
    if cfg.init_backbone and cfg.model in PRESETS:
        raise UserError(
            f"init_backbone takes a timm model's weights; '{cfg.model}' is a torchvision preset "
            "(its backbone weights: --pretrained_backbone)"
        )
    if len(cfg.loss_weights) != 4 or any(w < 0 for w in cfg.loss_weights):
        raise UserError(
            f"loss_weights must be 4 non-negative numbers (rpn objectness, rpn box, roi classifier, "
            f"roi box), got {cfg.loss_weights}"
        )
    # each number's own range was checked while parsing (Config.ranges): here, how they go together
    if not cfg.min_size or cfg.max_size < max(cfg.min_size):
        raise UserError(
            f"min_size must be one or more positive sizes no larger than max_size ({cfg.max_size}), got {cfg.min_size}"
        )
    for name in ("rpn_pre_nms_top_n", "rpn_post_nms_top_n"):
        value = getattr(cfg, name)
        if value and len(value) != 2:
            raise UserError(f"{name} takes two positive numbers [train, eval], or [] for the model's own; got {value}")
    stages = PRESET_STAGES.get(cfg.model, 5)
    if cfg.freeze_at > stages:
        raise UserError(f"freeze_at must be 0..{stages} for {cfg.model}, got {cfg.freeze_at}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    check_config(cfg)
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if cfg.predict:
        return predict(cfg, run)
    if cfg.export and cfg.weights and not cfg.eval_only:  # --export --weights W: W's export, no data read
        model, meta = trained_model(cfg)
        return export(run, lambda folder: export_files(model, cfg, meta, folder, run.recipe))

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    # every image checked once before the first step: unreadable ones (and their boxes) are left out and listed
    data = without_unreadable(run, data, "image", train=not cfg.eval_only)
    data = with_label_fraction(run, data)  # --train_fraction: a seeded share of the labelled images
    # what every weights file records: classes, the dataset's ids, the input normalisation (common/weights.py)
    saved_as = {"classes": data.classes, "recipe": run.recipe, "category_ids": data.category_ids}
    saved_as["normalization"] = (IMAGENET_MEAN, IMAGENET_STD)
    num_classes = len(data.classes)
    # camera-size JPEGs decoded reduced, as far as the model's resize to min_size still finds its pixels
    eval_set = DetectionDataset(data.eval, data_transforms(False, 0.0, False), cfg.seed, max(cfg.min_size))
    eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=list_collate)
    evaluator = CocoEvaluator(data.eval, data.classes)
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        model, eval_loader = accelerator.prepare(trained_model(cfg, data)[0], eval_loader)
        metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
        return report_evaluation(run, metrics, details, data, cfg.plot_images, 0, final=True)
    if not cfg.keep_empty:  # as torchvision's reference: only images with a box to learn (has_boxes)
        keep = [i for i, objects in enumerate(data.train["objects"]) if has_boxes(objects)]
        if not keep:
            raise UserError(
                f"no training image of '{cfg.data}' has a box to learn (crowd regions and boxes at most "
                "1 px wide or high do not count); --keep_empty true trains on them as negatives"
            )
        if len(keep) < len(data.train):
            run.print(
                f"training on {len(keep)} of {len(data.train)} images: {len(data.train) - len(keep)} without a "
                "box to learn left out (--keep_empty true keeps them)"
            )
            data.train = data.train.select(keep)
    train_set = DetectionDataset(
        data.train, data_transforms(True, cfg.hflip, cfg.color_jitter), cfg.seed, max(cfg.min_size)
    )
    cache_images(run, train_set, eval_set)  # --cache_images: each image decoded once (common/image_cache.py)
    aspect = [w / h for w, h in zip(data.train["width"], data.train["height"])]  # from the table: nothing decoded
    sampler = AspectRatioBatchSampler(
        aspect, cfg.batch_size, cfg.seed, True, accelerator.num_processes, cfg.aspect_ratio_group_factor
    )
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=sampler, collate_fn=list_collate, **loader_kwargs(cfg.num_workers)
    )

    # ---- model -------------------------------------------------------------------------------
    model = create_model(cfg, num_classes, run.notes)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch
    weight_dict = dict(zip(LOSS_NAMES.values(), cfg.loss_weights))  # the total loss: sum of weight x term

    # ---- optimizer and schedules (SGD; no weight decay on biases and norms) ----------------------
    groups = weight_decay_groups(model, cfg.weight_decay)  # frozen stages stay out
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **fused)
    mark_fsdp_blocks(model)  # FSDP: each repeated block its own shard unit (configs/accelerate/fsdp.yaml)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if units := fsdp_units(model):  # FSDP: the root and the blocks marked above
        run.print(f"fsdp: {units} modules sharded (fully_shard units, the root included)")

    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    total_steps = steps_total(cfg.epochs, steps_per_epoch, cfg.max_steps)
    # poly decays to 0 at the last step (seamseg); step drops by decay_rate at each milestone epoch
    lr_values = schedule(
        cfg.sched,
        cfg.lr,
        0.0,
        total_steps,
        round(cfg.warmup_epochs * steps_per_epoch),
        cfg.lr * cfg.warmup_factor,
        [m * steps_per_epoch for m in cfg.decay_milestones],
        cfg.decay_rate,
        cfg.poly_power,
    )

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, total_steps, len(eval_set), data.classes)
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()
        for images, targets in loop.batches():
            lr = float(lr_values[loop.step])
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    losses = model(images, targets)  # the four terms, each a mean
                loss = sum(losses[k] * w for k, w in weight_dict.items())
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.clip_grad > 0:
                    meters.update(grad_norm=accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            run.guard.observe(loop.step + 1, {"loss": loss, **{k: losses[k] for k in weight_dict}})
            meters.update(n=len(images), loss=loss, **losses)
            meters.images(
                len(images),
                boxes=sum(len(t["boxes"]) for t in targets),  # shapes: no device sync
                dropped_boxes=sum(t["dropped"] for t in targets),
            )
            if not loop.optimizer_stepped():
                continue
            if loop.log_due():
                loop.log_train(lr=lr)

        # ---- evaluation and best weights ---------------------------------------------------------
        if loop.eval_due():
            metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
            improved = loop.improved(cfg.best_metric, metrics[cfg.best_metric])
            # metrics.jsonl, trackers, plots/ and predictions.json (COCO results, the dataset's ids)
            results = report_evaluation(
                run,
                metrics,
                details,
                data,
                cfg.plot_images,
                loop.step,
                {f"best/{cfg.best_metric}": loop.best(cfg.best_metric)},
                epoch,
            )
            weights = accelerator.get_state_dict(model) if improved else None  # a collective under FSDP
            if improved and accelerator.is_main_process:
                save_weights(weights, run.dir / "best.safetensors", cfg, **saved_as)
    if loop.stopped:
        return results

    # ---- saving -----------------------------------------------------------------------------------
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:  # the last weights; what leaves the project: the best (evaluated) ones
        save_weights(weights, run.dir / "final.safetensors", cfg, **saved_as)
        sizes = (len(train_set), len(eval_set))
        # a step that fails is one line after the summary with the command that redoes it; the next still runs
        with run.guarded("model folder"):
            write_detector_folder(run, to_dict(cfg), data.classes, sizes, loop.best_for_card(cfg.best_metric))
    if cfg.export and accelerator.is_main_process:
        with run.guarded("export", run.export_command(kept_weights(run.dir))):
            kept, meta = trained_model(dataclasses.replace(cfg, weights=str(kept_weights(run.dir))))
            write = lambda folder: export_files(kept, cfg, meta, folder, run.recipe, eval_set[0][0])  # noqa: E731
            results.update(export(run, write, loop.step))
    if details is not None:  # the last evaluation's AP per class (also plots/per_class_ap.csv)
        run.print(per_class_text(details))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
