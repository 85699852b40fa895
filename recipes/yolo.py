"""YOLOv3-style single-stage detection with any timm backbone, on HuggingFace Accelerate.

A timm ``features_only`` backbone feeds a YOLOv3 feature pyramid (top-down, upsample + concat)
that predicts, at the backbone's last three levels (strides 8, 16 and 32 unless ``out_indices``
says otherwise), A anchors per cell (3 in YOLOv3): box centre offsets, log box sizes relative to
the anchor, objectness and per-class scores. Each ground-truth box is assigned to the one anchor
(of all 3 * A) whose shape fits it best, in the cell that holds its centre; predictions
that already overlap a ground truth (IoU > ``ignore_iou``) are not punished for objectness. The
four losses are GluonCV's: objectness BCE, centre BCE, scale L1 and class BCE, box terms weighted
by ``2 - w*h`` (box area over image area) so small boxes count more.

Training as GluonCV trains YOLOv3: warmup then cosine (or step) learning rate per step, SGD with
momentum or AdamW, no weight decay on biases and norms, model EMA, mosaic and mixup that switch
off for the last epochs, multi-scale batches, gradient accumulation, fp16/bf16, clipping.
Evaluation is COCO mAP (common/coco_eval.py); the best weights by mAP are kept; the final model is
exported with ``torch.export`` and to ONNX, and both are checked against the eager model.

Launch (defaults = the built-in ``digits_det`` scenes, cs3darknet_s at 96 px, strides 4/8/16, one
anchor per level: digits of 12-47 px are 1-3 cells at strides 8/16/32, too coarse for a cell's
features to say which digit sits in it; see the README):

    accelerate launch recipes/yolo.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/yolo.py \\
        --config configs/yolo/voc_darknet53.yaml

Expected: see the README's recipe table for measured figures (mAP@0.5 on the held-out scenes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

for _root in Path(__file__).resolve().parents:  # find common/ (README, "Layout")
    if (_root / "common" / "__init__.py").is_file():
        if str(_root) not in sys.path:
            sys.path.insert(0, str(_root))
        break
else:  # a copy outside the repository: common/ must be installed
    import importlib.util

    if importlib.util.find_spec("common") is None:
        sys.exit("error: this recipe needs the cv-recipes package common/: run `pip install -e <cv-recipes folder>` "
                 "once (README, \"Your own recipe\")")

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import batched_nms, clip_boxes_to_image

from common import UserError
from common.boxes import rescale_boxes
from common.coco_eval import CocoEvaluator, EvalDetails
from common.console import cli_main
from common.detection import DetectionDataset, collate, load_detection
from common.detection_figures import per_class_text
from common.detection_outputs import check_classes, prediction_batches, report_evaluation, save_predictions
from common.ema import ModelEma
from common.loaders import eval_loader_for, loader_kwargs, sample_seed
from common.loop import Loop, steps_total
from common.models import config_with_weights, create_timm_model, load_state, load_weights, save_weights, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups
from recipes.yolo_data import (MultiScaleBatchSampler, detection_transforms,  # YOLO's own helpers, beside this file
                               kmeans_anchors)

# YOLOv3's COCO anchors (w, h) in pixels of a 416 px input, small to large; GluonCV uses them as they are at every input size.
COCO_ANCHORS = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
LOSS_TERMS = ("loss_obj", "loss_center", "loss_scale", "loss_cls")  # what yolo_loss returns


# ============================================================================================
# Config (defaults: the built-in demo)
# ============================================================================================
@dataclass
class Config:
    config: str = ""  # the YAML file this run was read from (set by --config)
    # data
    data: str = "digits_det"  # built-in name, COCO-json folder, or hub dataset with an `objects` column
    train_split: str = "train"  # the split to train on
    eval_split: str = ""  # the split to evaluate on; empty: validation/val/valid/test, else a seeded 10 % of train
    img_size: int = 96  # training (before multi-scale) and evaluation size, pixels; a multiple of 32
    multiscale: list[int] = field(default_factory=list)  # training sizes, px, one drawn every multiscale_every steps,
        # e.g. [320, 352, ..., 608]; multiples of 32 (empty: img_size only); every image of a batch is transformed
        # at its batch's size (GluonCV's RandomTransformDataLoader), not resampled afterwards
    multiscale_every: int = 10  # optimizer steps between two multi-scale size draws (GluonCV: 10 batches)
    augment: Literal["letterbox", "gluoncv"] = "letterbox"  # training transforms. letterbox: scale jitter, crop,
        # pad to the square, aspect kept (the demo); gluoncv: GluonCV's YOLOv3 preset: colour, zoom-out up to 4x,
        # SSD's IoU crop, stretch to the square with a random interpolation, flip (evaluation stretches too)
    scale_range: list[float] = field(default_factory=lambda: [0.75, 1.25])  # random rescale factors [low, high]
        # before the crop/pad (large-scale jitter; augment=letterbox only)
    hflip: float = 0.0  # horizontal flip probability: 0.5 for natural images; digits must not be mirrored
    color_jitter: bool = True  # letterbox: torchvision's photometric distortion (SSD's), with probability 0.5;
        # gluoncv: GluonCV's colour distortion
    mosaic: float = 0.0  # probability that a training image is a 4-image mosaic (0.5 at scale; the demo's 8 epochs
        # are too few)
    mixup: float = 0.0  # probability that a training image is mixed with another (GluonCV: Beta(1.5, 1.5))
    no_aug_epochs: int = 2  # mosaic and mixup are off for the last N epochs
    num_workers: int = 2  # DataLoader worker processes per training process (0: load in the main process)
    # model
    model: str = "cs3darknet_s"  # any timm model with features_only (darknet53 / cspdarknet53 at scale)
    model_kwargs: dict = field(default_factory=lambda: {"out_indices": [1, 2, 3]})  # extra timm.create_model
        # arguments; out_indices (1, 2, 3): strides 4, 8, 16, so that a 12-47 px digit spans 1.5-12 cells (None:
        # timm's last three)
    pretrained: bool = False  # timm's ImageNet weights for the backbone (needs network)
    neck_channels: int = 128  # widest neck level (YOLOv3: 512); the others are 1/2 and 1/4
    anchors: list[list[float]] = field(default_factory=list)  # anchor boxes: 3 x A [w, h] pairs in px, small to
        # large; empty: k-means on the training boxes
    anchors_per_level: int = 1  # A, anchors per cell at each level (YOLOv3: 3); k-means finds 3 x A
    ignore_iou: float = 0.7  # predictions overlapping a ground truth above this get no objectness loss
    label_smoothing: bool = False  # smooth the class targets by min(1/C, 1/40), as GluonCV
    # optimization
    epochs: int = 8  # training epochs, the last no_aug_epochs included
    max_steps: int = 0  # >0: stop after this many optimizer steps
    batch_size: int = 16  # images per process and micro-step: global batch = this x processes x grad_accum_steps
    grad_accum_steps: int = 1  # micro-batches accumulated into each optimizer step
    opt: Literal["adamw", "sgd"] = "adamw"  # adamw, or sgd with momentum (GluonCV: sgd, lr 1e-3 per 64 images)
    lr: float = 4e-3  # peak learning rate (not scaled by batch size)
    min_lr: float = 1e-5  # learning rate at the end of the cosine, linear and poly schedules
    warmup_lr: float = 1e-5  # learning rate at step 0, rising linearly to lr over warmup_epochs
    warmup_epochs: float = 1.0  # linear warmup length in epochs (fractions allowed)
    sched: Literal["cosine", "step", "linear", "poly", "constant"] = "cosine"  # learning rate after warmup:
        # cosine to min_lr (GluonCV), x decay_rate at decay_milestones (step), linear (poly = linear here), constant
    decay_milestones: list[int] = field(default_factory=list)  # epochs, for sched=step
    decay_rate: float = 0.1  # factor on the learning rate at each of decay_milestones (sched=step)
    weight_decay: float = 5e-4  # biases and norms get none (GluonCV: 5e-4)
    momentum: float = 0.9  # SGD momentum (GluonCV: 0.9)
    clip_grad: float = 10.0  # clip the global gradient norm to this (0: off)
    ema_decay: float = 0.999  # model EMA decay (0: off); the EMA is what is evaluated, kept and exported
    mixed_precision: Literal["", "no", "fp16", "bf16"] = ""  # no: fp32; empty: as `accelerate launch` says
    tf32: bool = True  # CUDA: TF32 tensor-core matmuls and convolutions, and cudnn.benchmark autotuning (false:
        # full fp32 precision and a fixed convolution algorithm)
    compile: bool = False  # torch.compile through Accelerate (inductor); the first steps are slow while it compiles
    # evaluation and export
    conf_threshold: float = 0.01  # scores below are dropped before NMS
    nms_iou: float = 0.45  # NMS drops a box overlapping a higher-scoring one of its class above this IoU
    max_detections: int = 100  # detections kept per image after NMS
    plot_images: int = 4  # evaluation images drawn with ground truth and predictions in plots/detections.png (0: none)
    best_metric: Literal["map_50", "map", "map_50_11pt"] = "map_50"  # what best.safetensors follows: mAP@0.5,
        # COCO's mAP@[.5:.95] (map; the COCO and VOC configs) or VOC07's 11-point mAP@0.5
    export: bool = True  # torch.export (.pt2) and ONNX of the final model, each checked against eager
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    weights: str = ""  # a weights file this recipe saved (best.safetensors), for eval_only and predict
    eval_only: bool = False  # evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in the
        # dataset's category ids), no training
    predict: str = ""  # an image or a folder of images: with --weights, write predictions.json and the images with
        # their boxes drawn (predictions/) in the run folder; no dataset needed
    predict_score: float = 0.3  # predict: detections scoring below this are neither written nor drawn
    # run
    output_dir: str = ""  # the run folder; empty: runs/<recipe file name>/<config name>
    seed: int = 0  # seeds data order, augmentation, multi-scale sizes and initialisation
    log_every: int = 20  # log training metrics every this many optimizer steps
    eval_every: int = 2  # evaluate every this many epochs; also at the end
    checkpoint_every: int = 500  # save a checkpoint every this many optimizer steps; also at the end
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are deleted
    resume: str = ""  # auto (the run folder's newest complete checkpoint), a checkpoint folder, or empty (afresh)
    report_to: Literal["wandb", "tensorboard", "none"] = "wandb"  # tracker; wandb logs offline without credentials;
        # metrics.jsonl is written in every case
    project: str = ""  # tracker project; empty: $WANDB_PROJECT, else the recipe's file name
    run_name: str = ""  # tracker run name; empty: $WANDB_NAME, else the run folder's name
    log_weights: bool = False  # wandb: upload the final and best weights as W&B model artifacts at the end


# ============================================================================================
# Data: box-aware transforms (recipes/yolo_data.py), then the method's own mosaic and mixup
# ============================================================================================
class YoloTrainSet(torch.utils.data.Dataset):
    """Training samples, each a plain, a 4-image mosaic or a mixed-up image, decided by the
    sample's own seeded random numbers, so resume and process count do not change a batch.

    Keys: ``(epoch, index, size)`` from :class:`MultiScaleBatchSampler`, ``size`` being the batch's input
    size, at which every piece of the sample (mosaic and mixup partners included) is transformed;
    ``(epoch, index)`` or a plain index: at ``size``. ``base`` transforms at ``size``; ``transform_at(s)``
    gives the training transforms at another size ``s``.

    Every target gets per-box ``weights``: 1, or the mixup ratio of the image the box came from
    (GluonCV weights the objectness and box losses of a mixed box by its ratio), and ``dropped``: the
    boxes of all its pieces lost to their transforms or to the mosaic window, each counted once.
    """

    def __init__(self, base: DetectionDataset, size: int, mosaic: float, mixup: float, aug_epochs: int,
                 seed: int, transform_at: Callable[[int], Callable] | None = None) -> None:
        self.base, self.size, self.mosaic, self.mixup, self.aug_epochs = base, size, mosaic, mixup, aug_epochs
        self.seed, self.transform_at = seed, transform_at
        self._at_size = {size: base}  # a DetectionDataset per input size, made on first use (in each worker)

    def __len__(self) -> int:
        return len(self.base)

    def _item(self, epoch: int, index: int, size: int):
        """One image decoded and transformed at ``size``: image, boxes, labels, weights (1), dropped."""
        if size not in self._at_size:
            if self.transform_at is None:
                raise ValueError(f"input size {size} asked of a YoloTrainSet made for {self.size} only")
            self._at_size[size] = DetectionDataset(self.base.ds, self.transform_at(size), self.base.seed)
        image, target = self._at_size[size][(epoch, index)]
        boxes = target["boxes"].as_subclass(torch.Tensor).float()
        return image, boxes, target["labels"], torch.ones(len(boxes)), target["dropped"]

    def __getitem__(self, key: int | tuple[int, int] | tuple[int, int, int]):
        key = key if isinstance(key, tuple) else (0, key)
        epoch, index, size = key if len(key) == 3 else (*key, self.size)
        rng = random.Random(sample_seed(self.seed, epoch, index) + 1)  # a stream apart from the base transforms
        if epoch < self.aug_epochs and rng.random() < self.mosaic:  # the sample's image is the mosaic's first piece
            image, boxes, labels, weights, dropped = self._mosaic(
                epoch, [index] + [rng.randrange(len(self)) for _ in range(3)], size, rng)
        else:
            image, boxes, labels, weights, dropped = self._item(epoch, index, size)
        if epoch < self.aug_epochs and rng.random() < self.mixup:
            other = self._item(epoch, rng.randrange(len(self)), size)
            ratio = float(np.random.default_rng(rng.randrange(2**32)).beta(1.5, 1.5))
            image = ratio * image + (1 - ratio) * other[0]
            boxes, labels = torch.cat([boxes, other[1]]), torch.cat([labels, other[2]])
            weights = torch.cat([weights * ratio, other[3] * (1 - ratio)])
            dropped += other[4]
        return image, {"boxes": boxes, "labels": labels, "weights": weights, "dropped": dropped}

    def _mosaic(self, epoch: int, indices: list[int], s: int, rng: random.Random):
        """Four images at size s in the quadrants of a 2s x 2s canvas, then a random s x s window of it.
        Boxes are clipped to the window; a box that keeps less than 40 % of its area is dropped (a digit
        cut in half is no longer that digit)."""
        canvas = torch.zeros(3, 2 * s, 2 * s)  # 0 = the mean colour after normalisation
        all_boxes, all_labels, all_weights, dropped = [], [], [], 0
        for q, i in enumerate(indices):
            image, boxes, labels, weights, lost = self._item(epoch, i, s)
            h, w = image.shape[-2:]
            oy, ox = (q // 2) * s, (q % 2) * s
            canvas[:, oy:oy + h, ox:ox + w] = image[:, :s, :s]
            all_boxes.append(boxes + torch.tensor([ox, oy, ox, oy], dtype=boxes.dtype))
            all_labels.append(labels)
            all_weights.append(weights)
            dropped += lost
        x0, y0 = rng.randrange(s // 2, s + 1), rng.randrange(s // 2, s + 1)  # the window always meets all four
        x0, y0 = x0 - s // 2, y0 - s // 2
        boxes, labels, weights = torch.cat(all_boxes), torch.cat(all_labels), torch.cat(all_weights)
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        boxes = (boxes - torch.tensor([x0, y0, x0, y0], dtype=boxes.dtype)).clamp(0, s)
        kept = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) >= 0.4 * area.clamp(min=1e-6)
        kept &= (boxes[:, 2] - boxes[:, 0] >= 2) & (boxes[:, 3] - boxes[:, 1] >= 2)
        dropped += int((~kept).sum())
        return canvas[:, y0:y0 + s, x0:x0 + s].clone(), boxes[kept], labels[kept], weights[kept], dropped


def train_collate(batch):
    """Images [B, 3, s, s] and dense targets: boxes [B, M, 4] (xyxy px), labels [B, M] and weights
    [B, M], weight 0 marking padding, M the batch's largest box count (at least 1); host ints
    ``num_boxes`` and ``dropped`` (boxes lost to crops) for the log. Built in the worker processes,
    so the training step never loops over images on the host."""
    images = torch.stack([image for image, _ in batch])
    m = max(1, max(len(t["boxes"]) for _, t in batch))
    boxes, labels, weights = torch.zeros(len(batch), m, 4), torch.zeros(len(batch), m, dtype=torch.long), torch.zeros(len(batch), m)
    for b, (_, t) in enumerate(batch):
        n = len(t["boxes"])
        boxes[b, :n], labels[b, :n], weights[b, :n] = t["boxes"], t["labels"], t["weights"]
    return images, {"boxes": boxes, "labels": labels, "weights": weights,
                    "num_boxes": sum(len(t["boxes"]) for _, t in batch), "dropped": sum(t["dropped"] for _, t in batch)}


# ============================================================================================
# Model: timm backbone -> YOLOv3 feature pyramid -> 3 scales x A anchors x (4 + 1 + C)
# ============================================================================================
def conv_bn(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1, inplace=True))


def yolo_block(cin: int, c: int) -> nn.Sequential:
    """YOLOv3's five alternating 1x1 / 3x3 convolutions before each output."""
    return nn.Sequential(conv_bn(cin, c, 1), conv_bn(c, 2 * c, 3), conv_bn(2 * c, c, 1), conv_bn(c, 2 * c, 3),
                         conv_bn(2 * c, c, 1))


class YOLOv3(nn.Module):
    """``forward(images [B, 3, H, W]) -> raw [B, N, 5 + C]``, N = sum over the 3 levels (large stride
    first) of H_l * W_l * A, ordered (level, y, x, anchor); the 5 are (tx, ty, tw, th, objectness).
    ``anchors`` [3 * A, 2] px, small to large (A anchors per level, 3 in YOLOv3)."""

    def __init__(self, backbone: nn.Module, num_classes: int, anchors: torch.Tensor, neck_channels: int) -> None:
        super().__init__()
        self.backbone, self.num_classes = backbone, num_classes
        c3, c4, c5 = backbone.feature_info.channels()[-3:]
        self.strides = backbone.feature_info.reduction()[-3:][::-1]  # [32, 16, 8]: the order of the outputs
        c = [neck_channels, neck_channels // 2, neck_channels // 4]
        self.num_anchors = a = len(anchors) // 3  # per level
        self.register_buffer("anchors", anchors.float().view(3, a, 2).flip(0).contiguous())  # large-stride level first
        self.blocks = nn.ModuleList([yolo_block(c5, c[0]), yolo_block(c4 + c[1], c[1]), yolo_block(c3 + c[2], c[2])])
        self.transitions = nn.ModuleList([conv_bn(c[0], c[1], 1), conv_bn(c[1], c[2], 1)])
        self.outputs = nn.ModuleList([nn.Sequential(conv_bn(ci, 2 * ci, 3), nn.Conv2d(2 * ci, a * (5 + num_classes), 1))
                                      for ci in c])
        self._tables: dict[tuple, dict[str, torch.Tensor]] = {}  # see tables()
        for out in self.outputs:  # start with objectness ~0.01 so the first steps are not all false positives,
            bias = out[-1].bias.view(a, 5 + num_classes)  # and class probabilities at the 1/C prior, so the
            nn.init.constant_(bias[:, 4], -4.6)  # first steps go to telling digits apart, not to learning the prior
            nn.init.constant_(bias[:, 5:], -math.log(max(num_classes - 1, 1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c3, c4, c5 = self.backbone(images)[-3:]
        route, outs = None, []
        for level, feature in enumerate((c5, c4, c3)):
            if route is not None:
                route = F.interpolate(self.transitions[level - 1](route), size=feature.shape[-2:], mode="nearest")
                feature = torch.cat([route, feature], dim=1)
            route = self.blocks[level](feature)
            out = self.outputs[level](route)  # [B, A * (5 + C), H, W]
            b, _, h, w = out.shape
            a = self.num_anchors
            outs.append(out.view(b, a, 5 + self.num_classes, h, w).permute(0, 3, 4, 1, 2).reshape(b, h * w * a, -1))
        return torch.cat(outs, dim=1)

    def level_shapes(self, height: int, width: int) -> list[tuple[int, int]]:
        """(H_l, W_l) of each output for an input of this size (host ints: no device sync)."""
        return [(math.ceil(height / s), math.ceil(width / s)) for s in self.strides]

    def tables(self, height: int, width: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Constant tensors for an input size, made once per size and device (multi-scale training
        uses a few sizes), so a training step copies nothing from the host:
        per prediction ``cells`` [N, 2] (cell corner x, y), ``strides`` [N, 1] px, ``anchors`` [N, 2] px;
        per level ``level_offsets``, ``level_w``, ``level_h``, ``level_strides`` [3]."""
        key = (height, width, str(device))
        if key in self._tables and not torch.compiler.is_compiling():
            return self._tables[key]
        shapes = self.level_shapes(height, width)
        cells, strides, anchors, k = [], [], [], self.num_anchors
        for (h, w), s, a in zip(shapes, self.strides, self.anchors):
            y, x = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            cells.append(torch.stack([x, y], dim=-1).view(h * w, 1, 2).expand(h * w, k, 2).reshape(-1, 2).float())
            strides.append(torch.full((h * w * k, 1), float(s), device=device))
            anchors.append(a.view(1, k, 2).expand(h * w, k, 2).reshape(-1, 2))
        offsets = np.cumsum([0] + [h * w * k for h, w in shapes])[:-1].tolist()
        table = {"cells": torch.cat(cells), "strides": torch.cat(strides), "anchors": torch.cat(anchors),
                 "level_offsets": torch.tensor(offsets, device=device),
                 "level_w": torch.tensor([w for _, w in shapes], device=device),
                 "level_h": torch.tensor([h for h, _ in shapes], device=device),
                 "level_strides": torch.tensor(self.strides, dtype=torch.float32, device=device)}
        if not torch.compiler.is_compiling():  # traced tensors must not outlive the trace
            self._tables[key] = table
        return table

    def decode(self, raw: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """raw [B, N, 5 + C] -> boxes [B, N, 4] (xyxy px of the input) and scores [B, N, C]
        (objectness x class probability)."""
        t = self.tables(height, width, raw.device)
        raw = raw.float()
        xy = (raw[..., :2].sigmoid() + t["cells"]) * t["strides"]
        wh = raw[..., 2:4].clamp(max=8.0).exp() * t["anchors"]  # clamp: exp must not overflow early in training
        boxes = torch.cat([xy - wh / 2, xy + wh / 2], dim=-1)
        return boxes, raw[..., 4:5].sigmoid() * raw[..., 5:].sigmoid()


class Exported(nn.Module):
    """What is exported: images -> (boxes [B, N, 4] px, scores [B, N, C]); NMS stays outside (see
    ``postprocess``), so the graph has static shapes."""

    def __init__(self, model: YOLOv3) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.decode(self.model(images), images.shape[-2], images.shape[-1])


def anchors_for(cfg: Config, train: Any) -> torch.Tensor:
    """[3 * A, 2] anchor (w, h) in pixels at img_size, small to large: the config's, or k-means on
    the training boxes (each image resized so that its longer side is img_size, as the transforms do)."""
    if cfg.anchors:
        return torch.tensor(cfg.anchors, dtype=torch.float32)
    wh = [(w * cfg.img_size / max(iw, ih), h * cfg.img_size / max(iw, ih))
          for objects, iw, ih in zip(train["objects"], train["width"], train["height"])
          for _, _, w, h in objects["bbox"]]
    return torch.tensor(kmeans_anchors(np.array(wh, dtype=np.float64), 3 * cfg.anchors_per_level, seed=cfg.seed),
                        dtype=torch.float32)


def create_model(cfg: Config, num_classes: int, anchors: torch.Tensor) -> YOLOv3:
    backbone = create_timm_model(cfg.model, features_only=True, pretrained=cfg.pretrained, **cfg.model_kwargs)
    if len(backbone.feature_info.channels()) < 3:
        raise UserError(f"model '{cfg.model}' gives fewer than 3 feature levels; YOLO needs three (strides 8, 16, 32)")
    return YOLOv3(backbone, num_classes, anchors, cfg.neck_channels)


# ============================================================================================
# Loss: GluonCV's YOLOv3 target assignment and four losses
# ============================================================================================
def batch_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of xyxy boxes a [B, N, 4] and b [B, M, 4] -> [B, N, M] (torchvision's box_iou is 2-D only)."""
    lt = torch.maximum(a[:, :, None, :2], b[:, None, :, :2])
    rb = torch.minimum(a[:, :, None, 2:], b[:, None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    return inter / (area_a[:, :, None] + area_b[:, None, :] - inter).clamp(min=1e-9)


@torch.no_grad()
def assign_targets(model: YOLOv3, gt_boxes: torch.Tensor, gt_labels: torch.Tensor, gt_weights: torch.Tensor,
                   height: int, width: int) -> dict[str, torch.Tensor]:
    """Each ground truth -> the one anchor (of all 3 * A) with the best shape IoU (both centred at 0),
    in the cell of its level that holds its centre. Shapes: gt_* [B, M(, 4)], weight 0 = padding.

    Returns dense targets over the N predictions: ``obj`` [B, N] (the box's mixup weight at assigned
    anchors, else 0), ``center`` [B, N, 2] (offset in the cell, 0..1), ``scale`` [B, N, 2]
    (log(size / anchor)), ``box_weight`` [B, N] (2 - w*h / (W*H)), ``cls`` [B, N] (class index).
    When two boxes claim the same anchor of the same cell, one of them wins (as in GluonCV).
    """
    b, m = gt_labels.shape
    a = model.num_anchors
    n = sum(h * w * a for h, w in model.level_shapes(height, width))  # host ints
    table = model.tables(height, width, gt_boxes.device)
    all_anchors = model.anchors.view(3 * a, 2)  # level-major (large stride first), A per level
    wh = (gt_boxes[..., 2:] - gt_boxes[..., :2]).clamp(min=1.0)  # [B, M, 2]
    centre = (gt_boxes[..., 2:] + gt_boxes[..., :2]) / 2
    inter = torch.minimum(wh[..., None, :], all_anchors).prod(-1)  # [B, M, 3A]
    shape_iou = inter / (wh.prod(-1)[..., None] + all_anchors.prod(-1) - inter)
    best = shape_iou.argmax(-1)  # [B, M]
    level, k = best // a, best % a
    strides = table["level_strides"][level]  # [B, M]
    grid_w, grid_h = table["level_w"][level], table["level_h"][level]
    cell = (centre / strides[..., None]).floor().long()
    cx, cy = torch.minimum(cell[..., 0].clamp(min=0), grid_w - 1), torch.minimum(cell[..., 1].clamp(min=0), grid_h - 1)
    index = table["level_offsets"][level] + (cy * grid_w + cx) * a + k
    index = torch.where(gt_weights > 0, index, torch.full_like(index, n))  # padding -> a spare slot, dropped below
    rows = torch.arange(b, device=gt_boxes.device)[:, None].expand(b, m)

    def scatter(values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        out = torch.full((b, n + 1, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
        out[rows, index] = values
        return out[:, :n]

    return {
        "obj": scatter(gt_weights),
        "center": scatter(centre / strides[..., None] - torch.stack([cx, cy], -1).float()),
        "scale": scatter(torch.log(wh / all_anchors[best])),
        "box_weight": scatter(2.0 - wh.prod(-1) / (height * width)),
        "cls": scatter(gt_labels),
    }


def yolo_loss(model: YOLOv3, raw: torch.Tensor, targets: dict[str, torch.Tensor], height: int, width: int,
              ignore_iou: float, label_smoothing: bool) -> dict[str, torch.Tensor]:
    """The four YOLOv3 losses, each summed over predictions and averaged over images.

    raw [B, N, 5 + C]; targets from the collate: boxes [B, M, 4], labels [B, M], weights [B, M].
    """
    t = assign_targets(model, targets["boxes"], targets["labels"], targets["weights"], height, width)
    raw = raw.float()
    batch = raw.shape[0]
    positive = t["obj"] > 0  # [B, N]
    with torch.no_grad():  # ignore: negatives whose predicted box already overlaps a ground truth well
        boxes, _ = model.decode(raw.detach(), height, width)
        iou = batch_iou(boxes, targets["boxes"]).masked_fill(targets["weights"][:, None, :] <= 0, 0.0)
        ignored = (iou.amax(-1) > ignore_iou) & ~positive
    obj_weight = torch.where(positive, t["obj"], (~ignored).float())
    obj = F.binary_cross_entropy_with_logits(raw[..., 4], positive.float(), weight=obj_weight, reduction="sum")
    box_w = (t["obj"] * t["box_weight"])[..., None]  # mixup ratio x (2 - wh) at positives, 0 elsewhere
    center = F.binary_cross_entropy_with_logits(raw[..., :2], t["center"], weight=box_w.expand(-1, -1, 2), reduction="sum")
    scale = (F.l1_loss(raw[..., 2:4], t["scale"], reduction="none") * box_w).sum()
    num_classes = raw.shape[-1] - 5
    cls_t = F.one_hot(t["cls"], num_classes).float()
    if label_smoothing:
        eps = min(1.0 / num_classes, 1.0 / 40)
        cls_t = cls_t * (1 - eps) + (1 - cls_t) * eps
    cls = F.binary_cross_entropy_with_logits(raw[..., 5:], cls_t, weight=t["obj"][..., None].expand_as(cls_t),
                                             reduction="sum")
    return {"loss_obj": obj / batch, "loss_center": center / batch, "loss_scale": scale / batch,
            "loss_cls": cls / batch}


# ============================================================================================
# Evaluation helpers: NMS post-processing
# ============================================================================================
@torch.no_grad()
def postprocess(boxes: torch.Tensor, scores: torch.Tensor, conf: float, iou: float, max_det: int) -> list[dict]:
    """Per image: every (box, class) with score > conf, class-wise NMS, the top ``max_det``.
    boxes [B, N, 4], scores [B, N, C] -> [{boxes [K, 4], scores [K], labels [K]}]."""
    results = []
    for bx, sc in zip(boxes, scores):
        idx, cls = (sc > conf).nonzero(as_tuple=True)
        s = sc[idx, cls]
        top = s.topk(min(len(s), 10 * max_det)).indices  # bounded NMS cost early in training
        idx, cls, s = idx[top], cls[top], s[top]
        keep = batched_nms(bx[idx], s, cls, iou)[:max_det]
        results.append({"boxes": bx[idx[keep]], "scores": s[keep], "labels": cls[keep]})
    return results


@torch.no_grad()
def detect(model: YOLOv3, loader, accelerator, cfg: Config) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader``, per image: ``image_id`` and the detections (``boxes`` XYXY in the original
    image's pixels, clipped to it, ``scores``, ``labels`` as class indices 0..C-1); the model in eval mode."""
    unwrapped = accelerator.unwrap_model(model)
    for images, _, targets in loader:
        with accelerator.autocast():
            raw = model(images)
        boxes, scores = unwrapped.decode(raw, images.shape[-2], images.shape[-1])  # fp32
        predictions = postprocess(boxes, scores, cfg.conf_threshold, cfg.nms_iou, cfg.max_detections)
        for p, t in zip(predictions, targets):  # letterbox padding and cells at the border reach past the image
            p["boxes"] = clip_boxes_to_image(rescale_boxes(p["boxes"], t["size"], t["orig_size"]), t["orig_size"])
            p["image_id"] = t["image_id"]
        yield predictions


def evaluate(model: YOLOv3, eval_loader, evaluator: CocoEvaluator, accelerator, cfg: Config) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/coco_eval.py); boxes go to the evaluator in original-image pixels."""
    was_training = model.training  # the EMA copy stays in eval mode, the trained model goes back to train
    model.eval()
    results = evaluator.evaluate(detect(model, eval_loader, accelerator, cfg), accelerator, details=True)
    model.train(was_training)
    return results


# the fields that define the model: --weights restores them from the file's saved config (the anchors
# are in the weights)
MODEL_FIELDS = ("model", "model_kwargs", "img_size", "augment", "neck_channels", "anchors_per_level", "conf_threshold",
                "nms_iou", "max_detections")


def trained_model(cfg: Config, data: Any = None) -> tuple[YOLOv3, dict[str, Any]]:
    """The YOLO of ``cfg.weights`` (eval mode) and the file's metadata (classes, category ids), which
    must be those of ``data`` when given."""
    state, meta = load_weights(cfg.weights, "YOLO", tensors=["anchors"])
    check_classes(cfg.weights, meta, data)
    anchors = state["anchors"].flip(0).reshape(-1, 2)  # stored large-stride level first; create_model takes small first
    model = create_model(dataclasses.replace(cfg, pretrained=False), len(meta["classes"]), anchors)
    return load_state(model, state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: Config, run: Run) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model on the images ``cfg.predict`` names."""
    model, meta = trained_model(cfg)
    transform = detection_transforms(False, cfg.img_size, preset=cfg.augment)  # as the evaluation saw images
    table, batches = prediction_batches(run, cfg.predict, transform, collate, 2 * cfg.batch_size, cfg.num_workers)
    found = detect(model.to(run.accelerator.device), batches, run.accelerator, cfg)
    return save_predictions(run, found, table, meta, cfg.predict_score, cfg.predict)


def export_and_check(model: YOLOv3, images: torch.Tensor, folder: Path) -> dict[str, float]:
    """torch.export (model.pt2) and ONNX (model.onnx) of images -> (boxes, scores), each run on
    ``images`` and compared with the eager model. Returns the largest absolute differences."""
    wrapper = Exported(model).eval().cpu()
    images = images.cpu().float()
    with torch.no_grad():
        expected = wrapper(images)
    batch = torch.export.Dim("batch", min=1, max=1024)
    # traced with 2 images whatever was given: from an example batch of 1, torch.export would
    # specialise the batch dimension to 1 and refuse to keep it dynamic
    example = images[torch.arange(2) % len(images)]
    program = torch.export.export(wrapper, (example,), dynamic_shapes={"images": {0: batch}})
    torch.export.save(program, str(folder / "model.pt2"))
    reloaded = torch.export.load(str(folder / "model.pt2")).module()
    with torch.no_grad():
        got = reloaded(images)
    diffs = {"export/torch_export_max_abs_diff": max(float((g - e).abs().max()) for g, e in zip(got, expected))}
    try:
        import onnxruntime
    except ImportError:
        return diffs
    # ONNX from the same exported program (torch.onnx's dynamo exporter; needs onnx and onnxscript)
    torch.onnx.export(program, (example,), str(folder / "model.onnx"), input_names=["images"],
                      output_names=["boxes", "scores"], dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": images.numpy()})
    diffs["export/onnx_max_abs_diff"] = max(float(np.abs(g - e.numpy()).max()) for g, e in zip(got, expected))
    return diffs


# ============================================================================================
# Training
# ============================================================================================
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    if any(s % 32 for s in [cfg.img_size, *cfg.multiscale]):
        raise UserError("img_size and every multiscale size must be multiples of 32 (the largest stride)")
    if cfg.anchors and (len(cfg.anchors) % 3 or any(len(a) != 2 for a in cfg.anchors)):
        raise UserError("anchors must be 3 x A [w, h] pairs in pixels (A per level), small to large (or empty: k-means)")
    if not cfg.anchors and cfg.anchors_per_level < 1:
        raise UserError(f"anchors_per_level must be at least 1, got {cfg.anchors_per_level}")
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if cfg.predict:
        return predict(cfg, run)

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    num_classes = len(data.classes)
    eval_set = DetectionDataset(data.eval, detection_transforms(False, cfg.img_size, preset=cfg.augment), cfg.seed)
    eval_loader = eval_loader_for(eval_set, 2 * cfg.batch_size, cfg.num_workers, collate_fn=collate)
    evaluator = CocoEvaluator(data.eval, data.classes)
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        model, eval_loader = accelerator.prepare(trained_model(cfg, data)[0], eval_loader)
        metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator, cfg)
        return report_evaluation(run, metrics, details, data, cfg.plot_images, 0, final=True)
    # the training transforms at an input size: every batch's images are transformed at the size
    # MultiScaleBatchSampler chose for it (GluonCV's RandomTransformDataLoader)
    transform_at = functools.partial(detection_transforms, True, scale_range=tuple(cfg.scale_range), hflip=cfg.hflip,
                                     color_jitter=cfg.color_jitter, preset=cfg.augment)
    train_set = YoloTrainSet(DetectionDataset(data.train, transform_at(cfg.img_size), cfg.seed), cfg.img_size,
                             cfg.mosaic, cfg.mixup, cfg.epochs - cfg.no_aug_epochs, cfg.seed, transform_at)
    sampler = MultiScaleBatchSampler(len(train_set), cfg.batch_size, cfg.multiscale or [cfg.img_size],
                                     cfg.multiscale_every * cfg.grad_accum_steps, cfg.seed, accelerator.num_processes)
    train_loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=train_collate,
                                               **loader_kwargs(cfg.num_workers))

    # ---- model: anchors from the config, or k-means on the training boxes at img_size -----------
    anchors = anchors_for(cfg, data.train)
    if not cfg.anchors:
        run.print("anchors (k-means on the training boxes, px at img_size): "
                  + " ".join(f"{w:.0f}x{h:.0f}" for w, h in anchors.tolist()))
    model = create_model(cfg, num_classes, anchors)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch

    # ---- optimizer and schedules (no weight decay on biases and norms) --------------------------
    groups = weight_decay_groups(model, cfg.weight_decay)
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    if cfg.opt == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, **fused)
    else:
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **fused)
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if ema is not None:
        ema.module.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)
    unwrapped = accelerator.unwrap_model(model)

    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    total_steps = steps_total(cfg.epochs, steps_per_epoch, cfg.max_steps)
    lr_values = schedule(cfg.sched, cfg.lr, cfg.min_lr, total_steps, round(cfg.warmup_epochs * steps_per_epoch),
                         cfg.warmup_lr, [m * steps_per_epoch for m in cfg.decay_milestones], cfg.decay_rate)
    weight_dict = dict.fromkeys(LOSS_TERMS, 1.0)  # the total loss: sum of weight x term (GluonCV: all equal)

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, total_steps, len(eval_set), data.classes)
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()
        for images, targets in loop.batches():
            height, width = images.shape[-2:]  # this batch's multi-scale size (MultiScaleBatchSampler)
            lr = float(lr_values[loop.step])
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    raw = model(images)  # [B, N, 5 + C]
                losses = yolo_loss(unwrapped, raw, targets, height, width, cfg.ignore_iou, cfg.label_smoothing)
                loss = sum(losses[k] * w for k, w in weight_dict.items())
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.clip_grad > 0:
                    meters.update(grad_norm=accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            run.guard.observe(loop.step + 1, {"loss": loss, **{k: losses[k] for k in weight_dict}})
            meters.update(n=len(images), loss=loss, **losses)
            meters.images(len(images), boxes=targets["num_boxes"], dropped_boxes=targets["dropped"])
            if not loop.optimizer_stepped():
                continue
            if ema is not None:
                ema.update(unwrapped, loop.step)
            if loop.step % cfg.log_every == 0:
                loop.log_train(lr=lr)

        # ---- evaluation and best weights (the EMA when there is one) -----------------------------
        if loop.eval_due():
            net = ema.module if ema is not None else model
            metrics, details = evaluate(net, run.progress(eval_loader, "eval"), evaluator, accelerator, cfg)
            improved = loop.improved(cfg.best_metric, metrics[cfg.best_metric])
            # metrics.jsonl, trackers, plots/ and predictions.json (COCO results, the dataset's ids)
            results = report_evaluation(run, metrics, details, data, cfg.plot_images, loop.step,
                                        {f"best/{cfg.best_metric}": loop.best(cfg.best_metric)}, epoch)
            if improved:
                weights = ema.module.state_dict() if ema is not None else accelerator.get_state_dict(model)
                if accelerator.is_main_process:
                    save_weights(weights, run.dir / "best.safetensors", cfg, data.classes, run.recipe,
                                 data.category_ids)
    if loop.stopped:
        return results

    # ---- saving and export ------------------------------------------------------------------------
    final = ema.module if ema is not None else unwrapped
    if accelerator.is_main_process:
        save_weights(final.state_dict(), run.dir / "final.safetensors", cfg, data.classes, run.recipe, data.category_ids)
        if cfg.export:
            images = torch.stack([eval_set[i][0] for i in range(min(2, len(eval_set)))])
            diffs = export_and_check(final, images, run.dir)
            run.log(diffs, loop.step)
            results.update(diffs)
            if max(diffs.values()) > 1e-3:
                raise RuntimeError(f"an exported model disagrees with the eager one: {diffs}")
    if details is not None:  # the last evaluation's AP per class (also plots/per_class_ap.csv)
        run.print(per_class_text(details))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
