"""Single-stage YOLO detection with any timm backbone, on HuggingFace Accelerate.

A timm ``features_only`` backbone's last three levels (strides 8, 16 and 32 unless ``out_indices`` says
otherwise) feed one of two heads (``--head``):

- ``free`` (the default; recipes/yolo_free.py): a path-aggregation neck and, per level, a box branch that
  predicts each side's distance from the cell's centre as a distribution over 16 bins and a class branch.
  Each box takes the 10 cells inside it whose predictions align best (score^0.5 x IoU^6, TOOD's task-aligned
  assignment); losses: CIoU and distribution focal loss on the boxes, BCE against IoU-aware soft class targets.
- ``anchor`` (recipes/yolo_model.py): YOLOv3's feature pyramid with A anchors per cell (3 in YOLOv3). With
  ``anchor_rule gluoncv`` each box goes to the one anchor of best shape in its centre's cell (GluonCV's
  objectness, centre, scale and class losses, predictions overlapping a box above ``ignore_iou`` not punished);
  with ``yolov5`` to every anchor within 4x its shape in that cell and its two nearest neighbours (CIoU box
  loss, IoU objectness targets).

Beside it: yolo_data.py (transforms, multi-scale sampler, k-means anchors), yolo_inference.py (the trained model
loaded back, prediction, export, the model folder).

Training as GluonCV trains YOLOv3: per-step warmup then cosine (or step) learning rate, SGD or AdamW, no weight
decay on biases and norms, model EMA, mosaic and mixup off for the last epochs, multi-scale batches, gradient
accumulation, fp16/bf16, clipping. Evaluation is COCO mAP (common/detection/coco_eval.py); the best weights by
mAP are kept and exported (``torch.export``, ONNX), both checked against the eager model.

Launch (defaults = the built-in ``digits_det`` scenes, cs3darknet_s at 96 px, the free head at strides 4/8/16:
at 8/16/32 a 12-47 px digit is 1-3 cells, too coarse to tell digits apart; docs/yolo.md):

    accelerate launch recipes/yolo.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/yolo.py \\
        --config configs/yolo/voc_darknet53.yaml

Expected: see the README's recipe table for measured figures (mAP@0.5 on the held-out scenes).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

try:  # the shared package, installed once with `pip install -e <checkout>` (README, "Install")
    import common  # noqa: F401
except ModuleNotFoundError:
    print(
        "error: this recipe needs the package common/: run `pip install -e <cv-recipes checkout>` once", file=sys.stderr
    )
    sys.exit(2)

import random

import numpy as np
import torch
from accelerate.utils import set_seed

from common import UserError
from common.artifacts.export import export
from common.budget import Length
from common.config import MAX_COUNT, MAX_EPOCHS, MAX_SIDE, RunConfig, arg
from common.console import cli_main, own_files
from common.data.classification import with_label_fraction
from common.data.image_cache import image_caches
from common.data.scan import without_unreadable
from common.detection.coco_eval import CocoEvaluator, EvalDetails
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, DetectionDataset, collate, load_detection
from common.detection.outputs import ap_per_class_line, report_evaluation
from common.ema import ModelEma
from common.loaders import KeyedDataset, eval_loader_for, loader_kwargs, sample_seed, shared_count
from common.loop import Loop
from common.models import average_bn_statistics, create_timm_model, fsdp_units, mark_fsdp_blocks, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups
from common.weights import config_with_weights, kept_weights, load_backbone, save_weights, weights_metadata

with own_files("yolo_"):  # YOLO's own files, beside this one: python -m common.vendor copies them with it
    from yolo_data import (  # its data helpers
        MultiScaleBatchSampler,
        decode_side,
        detection_transforms,
        kmeans_anchors,
        mosaic,
        training_transforms,
    )
    from yolo_free import FREE_LOSS_WEIGHTS, SMALL_BACKBONES, YOLOFree, free_loss, small_backbone  # the free head
    from yolo_inference import export_files, predict, trained_model, write_model_folder  # what a run ships
    from yolo_model import LOSS_TERMS, YOLOV5_LOSS_WEIGHTS, YOLOv3, detect, yolo_loss, yolov5_loss  # anchor head


# ============================================================================================
# Config (defaults: the built-in demo)
# ============================================================================================
@dataclass
class Config(RunConfig):
    # fmt: off
    # data
    data: str = arg("digits_det", "built-in name, COCO-json folder, or hub dataset with an `objects` column")
    train_fraction: float = arg(1.0, "a seeded fraction of the training images (the rest unused)", gt=0, le=1,
        note="1 trains on every image")
    img_size: int = arg(96, "training (before multi-scale) and evaluation size, pixels; a multiple of 32",
        ge=32, le=MAX_SIDE)
    multiscale: list[int] = arg([], "training sizes, px, one drawn every multiscale_every steps, e.g. [320, 352, ..., "
        "608]; multiples of 32 (empty: img_size only); every image of a batch is transformed at its batch's size "
        "(GluonCV's RandomTransformDataLoader), not resampled afterwards", ge=32, le=MAX_SIDE)
    multiscale_every: int = arg(10, "optimizer steps between two multi-scale size draws (GluonCV: 10 batches)", ge=1)
    augment: Literal["letterbox", "gluoncv"] = arg("letterbox", "training transforms. letterbox: scale jitter, crop, "
        "pad to the square, aspect kept (the demo); gluoncv: GluonCV's YOLOv3 preset: colour, zoom-out up to 4x, SSD's "
        "IoU crop, stretch to the square with a random interpolation, flip (evaluation stretches too)")
    scale_range: list[float] = arg([0.75, 1.25], "random rescale factors [low, high] before the crop/pad (large-scale "
        "jitter; augment=letterbox only)", gt=0)
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must not be mirrored",
        ge=0, le=1)
    color_jitter: bool = arg(True, "letterbox: torchvision's photometric distortion (SSD's), with probability 0.5; "
        "gluoncv: GluonCV's colour distortion")
    mosaic: float = arg(0.0, "probability that a training image is a 4-image mosaic (0.5 at scale; the "
        "demo's 8 epochs are too few)", ge=0, le=1)
    mosaic_scale: list[float] = arg([0.5, 1.5], "zoom [low, high] of the mosaic's window (YOLOv5's affine scale): "
        "below 1 whole large objects, smaller", gt=0, le=16)
    min_visibility: float = arg(0.5, "a box cut by a crop or the mosaic's window to less than this share of its "
        "area is dropped (0.1 for large objects: a part of an animal is still one; a half digit may be another)",
        ge=0, le=1)
    mixup: float = arg(0.0, "probability that a training image is mixed with another (GluonCV: Beta(1.5, 1.5))",
        ge=0, le=1)
    no_aug_epochs: int = arg(2, "mosaic and mixup are off for the last N epochs", ge=0, le=MAX_EPOCHS)
    # model
    model: str = arg("cs3darknet_s", "any timm model with features_only (darknet53 / cspdarknet53 at scale), or "
        "cs3darknet_xs (timm's CSPDarknet at half cs3darknet_s's width: with head free, yolov8n's compute or less)")
    head: Literal["anchor", "free"] = arg("free", "free: a PAN neck, an anchor-free head (box sides as distributions, "
        "task-aligned positives; yolo_free.py), fast on few objects per photo; anchor: YOLOv3's (anchor_rule)")
    anchor_rule: Literal["gluoncv", "yolov5"] = arg("gluoncv", "head anchor: gluoncv gives each box one positive, "
        "the anchor of best shape in its centre's cell (centre BCE, scale L1); yolov5 gives it every anchor within "
        "4x its shape, in its cell and the two nearest neighbours (CIoU box loss, IoU objectness targets)")
    model_kwargs: dict = arg({"out_indices": [1, 2, 3]}, "extra timm.create_model arguments; out_indices (1, 2, 3): "
        "strides 4, 8, 16, so that a 12-47 px digit spans 1.5-12 cells (None: timm's last three)")
    pretrained: bool = arg(False, "timm's ImageNet weights for the backbone (needs network)")
    init_backbone: str = arg("", "safetensors of the same timm model (classifier.py's best.safetensors, DINO's "
        "teacher_backbone.safetensors) for the backbone; the neck and heads stay new")
    neck_channels: int = arg(128, "widest neck level (YOLOv3: 512; head free: 256 is yolov8n's); the others are 1/2 "
        "and 1/4", ge=4, le=MAX_COUNT)
    anchors: list[list[float]] = arg([], "head anchor: anchor boxes: 3 x A [w, h] pairs in px, small to large; empty: "
        "k-means on the training boxes", gt=0)
    anchors_per_level: int = arg(1, "A, anchors per cell at each level (YOLOv3: 3); k-means finds 3 x A", ge=1, le=64)
    ignore_iou: float = arg(0.7, "gluoncv: predictions above this IoU with a truth get no objectness loss", ge=0, le=1)
    label_smoothing: bool = arg(False, "smooth the class targets by min(1/C, 1/40), as GluonCV")
    # optimization
    epochs: int = arg(8, "training epochs, the last no_aug_epochs included")
    batch_size: int = arg(16, "images per process and micro-step, all at one multiscale size; global batch = this x "
        "processes x grad_accum_steps")
    opt: Literal["adamw", "sgd"] = arg("adamw", "adamw, or sgd with momentum (GluonCV: sgd, lr 1e-3 per 64 images)")
    lr: float = arg(4e-3, "peak learning rate for a global batch of lr_batch images, carried to the run's "
        "global batch by lr_scale")
    lr_batch: int = arg(16, "the global batch lr is written for (the demo's: batch_size 16, 1 process)")
    lr_scale: Literal["linear", "sqrt"] = arg("sqrt", "sqrt: peak = lr x sqrt(global batch / lr_batch), timm's rule "
        "for adam-type optimizers; linear (peak = lr x global batch / lr_batch) with opt sgd, as GluonCV")
    min_lr: float = arg(1e-5, "learning rate at the end of the cosine, linear and poly schedules", ge=0)
    warmup_lr: float = arg(1e-5, "learning rate at step 0, rising linearly to the peak over warmup_epochs", ge=0)
    warmup_epochs: float = arg(1.0, "linear warmup length in epochs (fractions allowed)")
    sched: Literal["cosine", "step", "linear", "poly", "constant"] = arg("cosine", "learning rate after warmup: cosine "
        "to min_lr (GluonCV), x decay_rate at decay_milestones (step), linear (poly = linear here), constant")
    decay_milestones: list[int] = arg([], "epochs, for sched=step", ge=0, le=MAX_EPOCHS)
    decay_rate: float = arg(0.1, "factor on the learning rate at each of decay_milestones (sched=step)", ge=0, le=1)
    weight_decay: float = arg(5e-4, "biases and norms get none (GluonCV: 5e-4)")
    momentum: float = arg(0.9, "SGD momentum (GluonCV: 0.9)", ge=0, lt=1)
    clip_grad: float = arg(10.0, "clip the global gradient norm to this (0: off)")
    ema_decay: float = arg(0.999, "model EMA decay (0: off); the EMA is what is evaluated, kept and exported",
        ge=0, lt=1)
    # evaluation and export
    conf_threshold: float = arg(0.01, "scores below are dropped before NMS", ge=0, le=1)
    nms_iou: float = arg(0.45, "NMS drops a box overlapping a higher-scoring one of its class above this IoU",
        ge=0, le=1)
    max_detections: int = arg(100, "detections kept per image after NMS", ge=1, le=MAX_COUNT)
    plot_images: int = arg(4, "evaluation images drawn with ground truth and predictions in "
        "plots/detections.png (0: none)", ge=0, le=64)
    best_metric: Literal["map_50", "map", "map_50_11pt"] = arg("map_50", "what best.safetensors follows: mAP@0.5, "
        "COCO's mAP@[.5:.95] (map; the COCO and VOC configs) or VOC07's 11-point mAP@0.5")
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    eval_only: bool = arg(False, "evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in "
        "the dataset's category ids), no training")
    predict: str = arg("", "an image or a folder of images: with --weights, write detections.json and the images with "
        "their boxes drawn (predictions/) in the run folder; no dataset needed")
    predict_score: float = arg(0.3, "predict: detections scoring below this are neither written nor drawn", ge=0, le=1)
    predict_scores: bool = arg(False, "predict: end each row of labels/<image>.txt with its score (Ultralytics' "
        "--save_conf form, for labelling tools); without, rows class cx cy w h, which Ultralytics trains on")
    # run
    eval_every: int = arg(2, "evaluate every this many epochs; also at the end")
    # fmt: on


# ============================================================================================
# Data: box-aware transforms (recipes/yolo_data.py), then the method's own mosaic and mixup
# ============================================================================================
class YoloTrainSet(KeyedDataset):
    """Training samples, each a plain, a 4-image mosaic or a mixed-up image, decided by the
    sample's own seeded random numbers, so resume and process count do not change a batch.

    Keys: ``(epoch, index, size)`` from :class:`MultiScaleBatchSampler`, ``size`` being the batch's input
    size, at which every piece of the sample (mosaic and mixup partners included) is transformed;
    ``(epoch, index)`` or a plain index: at ``size`` (a :class:`common.loaders.KeyedDataset` whose third key
    is the input size, not a repeat: no repeated augmentation here). ``base`` transforms at ``size``;
    ``transform_at(s)`` gives the training transforms at another size ``s``, over ``base``'s rows, decoded
    images and count of replaced images.

    A mosaic (yolo_data.mosaic): the sample's image and three drawn from its seed, a window zoomed by
    ``mosaic_scale``; boxes it cuts below ``min_visibility`` dropped. Every target gets per-box ``weights``:
    1, or the mixup ratio of the image the box came from (GluonCV weights the objectness and box losses of a
    mixed box by its ratio), and ``dropped``: the boxes of all its pieces lost to their transforms or to the
    mosaic window, each counted once.
    """

    def __init__(
        self,
        base: DetectionDataset,
        size: int,
        mosaic: float,
        mixup: float,
        aug_epochs: int,
        seed: int,
        transform_at: Callable[[int], Callable] | None = None,
        mosaic_scale: tuple[float, float] = (1.0, 1.0),
        min_visibility: float = 0.5,
    ) -> None:
        self.base, self.size, self.mosaic, self.mixup = base, size, mosaic, mixup
        self.zoom, self.visible = tuple(mosaic_scale), min_visibility  # the mosaic's window (yolo_data.mosaic)
        self.seed, self.transform_at = seed, transform_at
        # the epochs with mosaic and mixup: the run's length sets it (a budget's plan, after the workers started)
        self._aug_epochs = shared_count()
        self.aug_epochs = aug_epochs
        self._at_size = {size: base}  # a DetectionDataset per input size, made on first use (in each worker)

    @property
    def aug_epochs(self) -> int:
        return self._aug_epochs.value

    @aug_epochs.setter
    def aug_epochs(self, epochs: int) -> None:
        self._aug_epochs.value = epochs

    def __len__(self) -> int:
        return len(self.base)

    def _item(self, epoch: int, index: int, size: int):
        """One image decoded and transformed at ``size``: image, boxes, labels, weights (1), dropped, (h, w)."""
        if size not in self._at_size:
            if self.transform_at is None:
                raise ValueError(f"input size {size} asked of a YoloTrainSet made for {self.size} only")
            base = self.base  # the same rows: its decoded images (--cache_images), one count of those replaced
            self._at_size[size] = DetectionDataset(
                base.ds, self.transform_at(size), base.seed, base.shorter, base.cache, base.replaced
            )
        image, target = self._at_size[size][(epoch, index)]
        boxes = target["boxes"].as_subclass(torch.Tensor).float()
        return image, boxes, target["labels"], torch.ones(len(boxes)), target["dropped"], target["size"]

    def __getitem__(self, key: int | tuple[int, int] | tuple[int, int, int]):
        key = key if isinstance(key, tuple) else (0, key)
        epoch, index, size = key if len(key) == 3 else (*key, self.size)
        rng = random.Random(sample_seed(self.seed, epoch, index) + 1)  # a stream apart from the base transforms
        if epoch < self.aug_epochs and rng.random() < self.mosaic:  # the sample's image is the mosaic's first piece
            pieces = [self._item(epoch, i, size) for i in [index] + [rng.randrange(len(self)) for _ in range(3)]]
            image, boxes, kept = mosaic([(p[0], p[1], p[5]) for p in pieces], size, rng, self.zoom, self.visible)
            labels, weights = torch.cat([p[2] for p in pieces])[kept], torch.cat([p[3] for p in pieces])[kept]
            boxes, dropped = boxes[kept], sum(p[4] for p in pieces) + int((~kept).sum())
        else:
            image, boxes, labels, weights, dropped, _ = self._item(epoch, index, size)
        if epoch < self.aug_epochs and rng.random() < self.mixup:
            other = self._item(epoch, rng.randrange(len(self)), size)
            ratio = float(np.random.default_rng(rng.randrange(2**32)).beta(1.5, 1.5))
            image = ratio * image + (1 - ratio) * other[0]
            boxes, labels = torch.cat([boxes, other[1]]), torch.cat([labels, other[2]])
            weights = torch.cat([weights * ratio, other[3] * (1 - ratio)])
            dropped += other[4]
        return image, {"boxes": boxes, "labels": labels, "weights": weights, "dropped": dropped}


def train_collate(batch):
    """Images [B, 3, s, s] and dense targets: boxes [B, M, 4] (xyxy px), labels [B, M] and weights
    [B, M], weight 0 marking padding, M the batch's largest box count (at least 1); host ints
    ``num_boxes`` and ``dropped`` (boxes lost to crops) for the log. Built in the worker processes,
    so the training step never loops over images on the host."""
    images = torch.stack([image for image, _ in batch])
    m = max(1, max(len(t["boxes"]) for _, t in batch))
    boxes, labels, weights = (
        torch.zeros(len(batch), m, 4),
        torch.zeros(len(batch), m, dtype=torch.long),
        torch.zeros(len(batch), m),
    )
    for b, (_, t) in enumerate(batch):
        n = len(t["boxes"])
        boxes[b, :n], labels[b, :n], weights[b, :n] = t["boxes"], t["labels"], t["weights"]
    return images, {
        "boxes": boxes,
        "labels": labels,
        "weights": weights,
        "num_boxes": sum(len(t["boxes"]) for _, t in batch),
        "dropped": sum(t["dropped"] for _, t in batch),
    }


# ============================================================================================
# Model: either head on a timm backbone; head anchor's anchors from the config or k-means
# ============================================================================================
def anchors_for(cfg: Config, train: Any) -> torch.Tensor | None:
    """[3 * A, 2] anchor (w, h) px at img_size, small to large: the config's, or k-means on the training boxes
    (each image's longer side resized to img_size, as the transforms do); None for the free head."""
    if cfg.head == "free":
        return None
    if cfg.anchors:
        return torch.tensor(cfg.anchors, dtype=torch.float32)
    wh = [
        (w * cfg.img_size / max(iw, ih), h * cfg.img_size / max(iw, ih))
        for objects, iw, ih in zip(train["objects"], train["width"], train["height"])
        for _, _, w, h in objects["bbox"]
    ]
    found = kmeans_anchors(np.array(wh, dtype=np.float64), 3 * cfg.anchors_per_level, seed=cfg.seed)
    return torch.tensor(found, dtype=torch.float32)


def create_model(
    cfg: Config, num_classes: int, anchors: torch.Tensor | None, notes: list[str] | None = None
) -> YOLOv3 | YOLOFree:
    """The detector (``anchors``: head anchor's, else None); the weights its backbone starts from
    (pretrained, init_backbone) are named in ``notes``."""
    notes = [] if notes is None else notes
    if cfg.model in SMALL_BACKBONES:  # built here from timm's blocks; no pretrained weights exist
        backbone = small_backbone(cfg.model, pretrained=cfg.pretrained, **cfg.model_kwargs)
    else:
        backbone = create_timm_model(
            cfg.model, features_only=True, pretrained=cfg.pretrained, notes=notes, **cfg.model_kwargs
        )
    if cfg.init_backbone:
        notes.append(load_backbone(backbone, cfg.init_backbone))
    if len(backbone.feature_info.channels()) < 3:
        raise UserError(f"model '{cfg.model}' gives fewer than 3 feature levels; YOLO needs three (strides 8, 16, 32)")
    if cfg.head == "free":
        return YOLOFree(backbone, num_classes, cfg.neck_channels, prior_size=cfg.img_size)
    return YOLOv3(backbone, num_classes, anchors, cfg.neck_channels, rule=cfg.anchor_rule)


def loss_of(cfg: Config, accelerator=None) -> tuple[Callable[..., dict[str, torch.Tensor]], dict[str, float]]:
    """The head's loss ``(model, raw, targets, height, width) -> terms`` and each term's weight in the total."""
    if cfg.head == "free":  # YOLOv8's gains; the loss's normaliser averaged over the processes
        mean = (lambda x: accelerator.reduce(x, "mean")) if accelerator is not None else None  # noqa: E731
        return lambda m, raw, t, h, w: free_loss(m, raw, t, h, w, mean), dict(FREE_LOSS_WEIGHTS)
    if cfg.anchor_rule == "yolov5":  # YOLOv5's gains
        return yolov5_loss, dict(YOLOV5_LOSS_WEIGHTS)
    gluoncv = lambda m, raw, t, h, w: yolo_loss(m, raw, t, h, w, cfg.ignore_iou, cfg.label_smoothing)  # noqa: E731
    return gluoncv, dict.fromkeys(LOSS_TERMS, 1.0)  # GluonCV: all equal


# ============================================================================================
# Evaluation (detect and its NMS: recipes/yolo_model.py)
# ============================================================================================
def evaluate(
    model: YOLOv3, eval_loader, evaluator: CocoEvaluator, accelerator, cfg: Config
) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/detection/coco_eval.py); boxes go to the evaluator in original-image pixels."""
    was_training = model.training  # the EMA copy stays in eval mode, the trained model goes back to train
    model.eval()
    average_bn_statistics(model, accelerator)  # each process's BN statistics saw its own batches: their mean
    found = detect(model, eval_loader, accelerator, cfg.conf_threshold, cfg.nms_iou, cfg.max_detections)
    results = evaluator.evaluate(found, accelerator, details=True)
    model.train(was_training)
    return results


# the fields that define the model: --weights restores them from the file's saved config (the anchors
# are in the weights)
MODEL_FIELDS = (
    "model",
    "model_kwargs",
    "img_size",
    "augment",
    "head",
    "anchor_rule",
    "neck_channels",
    "anchors_per_level",
    "conf_threshold",
    "nms_iou",
    "max_detections",
)
# weights saved before the recipe had a choice of heads are the anchor head's, trained with GluonCV's rule
BEFORE_HEADS = {"head": "anchor", "anchor_rule": "gluoncv"}


# ============================================================================================
# Training
# ============================================================================================
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS, older=BEFORE_HEADS)
    if any(s % 32 for s in [cfg.img_size, *cfg.multiscale]):
        raise UserError("img_size and every multiscale size must be multiples of 32 (the largest stride)")
    if cfg.anchors and cfg.head == "free":
        raise UserError("anchors are the anchor head's (--head anchor); the free head predicts boxes without them")
    if cfg.anchors and (len(cfg.anchors) % 3 or any(len(a) != 2 for a in cfg.anchors)):
        raise UserError(
            "anchors must be 3 x A [w, h] pairs in pixels (A per level), small to large (or empty: k-means)"
        )
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if cfg.predict:  # detections.json and pictures for the images it names (recipes/yolo_inference.py)
        return predict(cfg, run, create_model)
    if cfg.export and cfg.weights and not cfg.eval_only:  # --export --weights W: W's export, no data read
        model, meta = trained_model(cfg, create_model)
        return export(run, lambda folder: export_files(model, cfg, meta, folder, run.recipe))

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    run.note(*data.notes)  # how the folder was read, where it says (a VOC folder's turned photos)
    # every image checked once before the first step: unreadable ones (and their boxes) are left out and listed
    data = without_unreadable(
        data, "image", accelerator, cfg.bad_images, cfg.num_workers, cfg.batch_size, run.dir, train=not cfg.eval_only
    ).into(run)  # its banner lines, and bad_images.txt where some are left out
    if not cfg.eval_only:  # --train_fraction: a seeded share of the labelled images
        data, fraction_line = with_label_fraction(data, cfg.train_fraction, cfg.seed)
        run.note(fraction_line)
    # what every weights file records: classes, the dataset's ids, the input normalisation (common/weights.py)
    saved_as = {"classes": data.classes, "recipe": run.recipe, "category_ids": data.category_ids}
    saved_as["normalization"] = (IMAGENET_MEAN, IMAGENET_STD)
    run.weights_metadata = weights_metadata(cfg, **saved_as)  # every checkpoint is weights too (common/weights.py)
    num_classes = len(data.classes)
    eval_tf = detection_transforms(False, cfg.img_size, preset=cfg.augment)
    evaluator = CocoEvaluator(data.eval, data.classes, run.interruptible)  # a stop ends COCO's scoring at once
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, cfg.img_size)  # large JPEGs: reduced to the letterbox
        eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=collate)
        model, eval_loader = accelerator.prepare(trained_model(cfg, create_model, data)[0], eval_loader)
        metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator, cfg)
        return report_evaluation(run, metrics, details, data, cfg.plot_images, 0, final=True)
    transform_at = training_transforms(cfg)  # the training transforms at each batch's input size
    largest = decode_side(cfg)  # camera-size JPEGs decoded reduced (letterbox) or in full (GluonCV's crops)
    # --cache_images: each image decoded once, at the side its dataset decodes it (common/data/image_cache.py)
    (train_cache, eval_cache), cache_line = image_caches(
        cfg.cache_images, cfg.num_workers, (data.train, "image", largest), (data.eval, "image", cfg.img_size)
    )
    run.note(cache_line)
    train_set = YoloTrainSet(
        DetectionDataset(data.train, transform_at(cfg.img_size), cfg.seed, largest, train_cache),
        cfg.img_size,
        cfg.mosaic,
        cfg.mixup,
        cfg.epochs - cfg.no_aug_epochs,
        cfg.seed,
        transform_at,
        cfg.mosaic_scale,
        cfg.min_visibility,
    )
    eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, cfg.img_size, eval_cache)  # reduced to the letterbox
    eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=collate)
    sampler = MultiScaleBatchSampler(
        len(train_set),
        cfg.batch_size,
        cfg.multiscale or [cfg.img_size],
        cfg.multiscale_every * cfg.grad_accum_steps,
        cfg.seed,
        accelerator.num_processes,
    )
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=sampler, collate_fn=train_collate, **loader_kwargs(cfg.num_workers)
    )

    # ---- model: head anchor's anchors from the config, or k-means on the training boxes at img_size ------
    anchors = anchors_for(cfg, data.train)
    if anchors is not None and not cfg.anchors:
        run.print(
            "anchors (k-means on the training boxes, px at img_size): "
            + " ".join(f"{w:.0f}x{h:.0f}" for w, h in anchors.tolist())
        )
    model = create_model(cfg, num_classes, anchors, run.notes)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch

    # ---- optimizer and schedules (no weight decay on biases and norms) --------------------------
    groups = weight_decay_groups(model, cfg.weight_decay)
    peak = cfg.peak_lr(accelerator.num_processes)  # lr carried from lr_batch images to the global batch
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    if cfg.opt == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=peak, **fused)
    else:
        optimizer = torch.optim.SGD(groups, lr=peak, momentum=cfg.momentum, **fused)
    if cfg.ema_decay > 0 and accelerator.distributed_type.name == "FSDP":
        raise UserError("model EMA keeps a full replica and cannot follow FSDP's sharded weights; set --ema_decay 0")
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    mark_fsdp_blocks(model)  # FSDP: each repeated block its own shard unit (configs/accelerate/fsdp.yaml)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if units := fsdp_units(model):  # FSDP: the root and the blocks marked above
        run.print(f"fsdp: {units} modules sharded (fully_shard units, the root included)")
    if ema is not None:
        ema.module.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)
    unwrapped = accelerator.unwrap_model(model)

    def lay_out(length: Length) -> dict[str, np.ndarray]:
        """The learning rate per step over the run's length."""
        warmup, milestones = length.at(cfg.warmup_epochs), [length.at(m) for m in cfg.decay_milestones]
        lr = schedule(cfg.sched, peak, cfg.min_lr, length.steps, warmup, cfg.warmup_lr, milestones, cfg.decay_rate)
        return {"lr": lr}

    loss_fn, weight_dict = loss_of(cfg, accelerator)  # the head's loss; the total is the sum of weight x term

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, lay_out, len(eval_set), data.classes, train_set.base.replaced)
    set_seed(cfg.seed, device_specific=True)  # from here each process draws its own random numbers (dropout)
    loop.resume()  # model, optimizer, EMA, ... and the generators from --resume's checkpoint: where it stopped
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()  # mosaic and mixup until the run's last no_aug_epochs share (its length now: a budget's refit)
        train_set.aug_epochs = loop.length.epochs - math.ceil(loop.length.in_epochs(cfg.no_aug_epochs))
        for images, targets in loop.batches():
            height, width = images.shape[-2:]  # this batch's multi-scale size (MultiScaleBatchSampler)
            lr = loop.value("lr")
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    raw = model(images)  # [B, N, 5 + C] (head anchor), [B, N, 4 * 16 + C] (head free)
                losses = loss_fn(unwrapped, raw, targets, height, width)
                loss = sum(losses[k] * w for k, w in weight_dict.items())
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.clip_grad > 0:
                    meters.update(grad_norm=accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            loop.record(  # meters and the non-finite guard, on the device
                loss, losses, len(images), boxes=targets["num_boxes"], dropped_boxes=targets["dropped"]
            )
            if not accelerator.sync_gradients:  # still accumulating gradients
                continue
            loop.end_step()
            if ema is not None:
                ema.update(unwrapped, loop.step)
            if loop.log_due():
                loop.log_train(lr=lr)
            if loop.stop_requested():  # SIGTERM/SIGINT/SIGUSR1 on any process: checkpoint, then end the run
                loop.save_checkpoint()
                return loop.stop(results)
            if loop.checkpoint_due():
                loop.save_checkpoint()

        # ---- evaluation and best weights (the EMA when there is one) -----------------------------
        if loop.eval_due():
            with loop.evaluation():  # a loss gone non-finite stops the run here; a stop signal: a checkpoint
                net = ema.module if ema is not None else model
                metrics, details = evaluate(net, run.progress(eval_loader, "eval"), evaluator, accelerator, cfg)
                improved = loop.update_best(cfg.best_metric, metrics[cfg.best_metric])
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
                if improved:
                    weights = ema.module.state_dict() if ema is not None else accelerator.get_state_dict(model)
                    if accelerator.is_main_process:
                        save_weights(weights, run.dir / "best.safetensors", cfg, **saved_as)
        if loop.checkpoint_due():  # every checkpoint_every steps, and after the last epoch
            loop.save_checkpoint()

    # ---- saving and export ------------------------------------------------------------------------
    final = ema.module.state_dict() if ema is not None else accelerator.get_state_dict(model)  # a collective under FSDP
    if accelerator.is_main_process:
        save_weights(final, run.dir / "final.safetensors", cfg, **saved_as)
        # what leaves the project is the best (evaluated) weights. A step that fails is one line after the
        # summary with the command that redoes it; the steps after it still run.
        sizes, kept = (len(train_set), len(eval_set)), kept_weights(run.dir)
        with run.guarded("model folder"):  # <run>/model, what --push_to_hub uploads at the run's finish
            write_model_folder(run, cfg, data.classes, sizes, loop.best_for_card(cfg.best_metric))
        if cfg.export:
            with run.guarded("export", run.export_command(kept)):
                model_kept, meta = trained_model(dataclasses.replace(cfg, weights=str(kept)), create_model)
                write = lambda folder: export_files(model_kept, cfg, meta, folder, run.recipe)  # noqa: E731
                results.update(export(run, write, loop.step))
    if details is not None:  # the last evaluation's AP per class: one line, the table in a file
        run.print(ap_per_class_line(details, run.plots_dir))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
