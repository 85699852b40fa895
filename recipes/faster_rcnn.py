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
step; batches grouped by aspect ratio; optional frozen early backbone stages and frozen batch
norm; fp16/bf16 and gradient clipping through Accelerate. Evaluation is COCO mAP
(common/coco_eval.py); the best weights by mAP@0.5 are kept.

Launch (defaults = the built-in ``digits_det`` scenes, a thin resnet10t from scratch at 96 px):

    accelerate launch recipes/faster_rcnn.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/faster_rcnn.py \\
        --config configs/faster_rcnn/coco_r50_fpn_1x.yaml

Expected (defaults, measured): mAP@0.5 0.937 (mAP 0.678) on the 400 held-out scenes after 2 epochs,
about 2 minutes wall on one CPU core; the README's recipe table has the details.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

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

import inspect

import timm
import torch
import torchvision
from torch import nn
from torchvision.models.detection.faster_rcnn import FasterRCNN, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import AnchorGenerator, RegionProposalNetwork, RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.transforms import v2

from common import UserError
from common.boxes import rescale_boxes
from common.coco_eval import CocoEvaluator, EvalDetails
from common.config import parse_config
from common.console import cli_main
from common.loaders import EpochBatchSampler, eval_loader_for, loader_kwargs, sample_seed
from common.detection import IMAGENET_MEAN, IMAGENET_STD, DetectionDataset, load_detection
from common.detection_figures import per_class_text, save_evaluation_figures
from common.loop import Loop, steps_total
from common.models import create_timm_model, save_weights, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups

# torchvision's Faster R-CNN presets (model = one of these names), each built by its own function.
PRESETS = ("fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "fasterrcnn_mobilenet_v3_large_fpn",
           "fasterrcnn_mobilenet_v3_large_320_fpn")
# The four losses as torchvision names them -> as this recipe names and logs them; loss_weights
# follow this order. Each is already a mean: RPN objectness BCE over the sampled anchors, RPN box
# smooth-L1 (beta 1/9) summed over positive anchors / sampled anchors, RoI cross-entropy over the
# sampled proposals, RoI box smooth-L1 (beta 1/9) summed over positives / sampled proposals.
LOSS_NAMES = {"loss_objectness": "loss_rpn_objectness", "loss_rpn_box_reg": "loss_rpn_box",
              "loss_classifier": "loss_roi_classifier", "loss_box_reg": "loss_roi_box"}


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
    hflip: float = 0.0  # horizontal flip probability: 0.5 for natural images; digits must not be mirrored
    color_jitter: bool = False  # torchvision's photometric distortion (SSD), p = 0.5
    num_workers: int = 1  # DataLoader worker processes per training process (0: load in the main process)
    # model: backbone -> FPN -> RPN -> RoIAlign -> box head
    model: str = "resnet10t"  # a timm model (features_only), or a torchvision preset (PRESETS)
    model_kwargs: dict = field(default_factory=lambda: {"channels": [32, 64, 128, 256], "stem_width": 16})  # extra
        # timm.create_model arguments; the demo: resnet10t at half width
    pretrained: bool = False  # timm: ImageNet backbone; presets: COCO weights (both need network)
    pretrained_backbone: bool = False  # presets only: ImageNet backbone weights
    out_indices: list[int] = field(default_factory=lambda: [1, 2, 3])  # timm feature levels (1 = stride 4)
    fpn_channels: int = 48  # FPN width at every level (torchvision: 256)
    extra_pool: bool = False  # one more FPN level by max-pooling the coarsest (torchvision's "pool")
    anchor_sizes: list[list[float]] = field(default_factory=lambda: [[12, 18], [24, 36], [48, 72]])  # px, per FPN
        # level, as many at each; empty: 8 x stride
    aspect_ratios: list[float] = field(default_factory=lambda: [1.0, 2.0])  # height / width, at every level
    min_size: list[int] = field(default_factory=lambda: [96])  # shorter side, px; several: one drawn per training
        # image, eval at the last
    max_size: int = 96  # longer side at most, px
    rpn_pre_nms_top_n: list[int] = field(default_factory=lambda: [200, 200])  # proposals per level before NMS,
        # [train, eval] (torchvision: 2000, 1000)
    rpn_post_nms_top_n: list[int] = field(default_factory=lambda: [100, 100])  # proposals per image after NMS,
        # [train, eval] (torchvision: 2000, 1000)
    rpn_batch_size_per_image: int = 128  # anchors sampled for the RPN losses (torchvision: 256)
    roi_size: int = 7  # RoIAlign output side, cells (torchvision: 7)
    roi_sampling_ratio: int = 1  # bilinear samples per cell side (torchvision: 2; the CPU backward is slow)
    box_head_dim: int = 256  # the two-layer MLP head's width (torchvision: 1024)
    box_batch_size_per_image: int = 32  # proposals sampled for the RoI losses (torchvision: 512)
    box_score_thresh: float = 0.05  # detections scoring below this are dropped (torchvision: 0.05)
    box_nms_thresh: float = 0.5  # per-class NMS IoU of the final detections (torchvision: 0.5)
    box_detections_per_img: int = 100  # detections kept per image (torchvision: 100)
    freeze_at: int = 0  # frozen backbone stages, stem counted as 1 (Detectron2 convention; COCO: 2)
    frozen_bn: bool = False  # backbone batch norm as fixed affine layers (with pretrained weights)
    loss_weights: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0])  # rpn objectness, rpn box,
        # roi classifier, roi box
    # optimization
    epochs: int = 2  # training epochs
    max_steps: int = 0  # >0: stop after this many optimizer steps
    batch_size: int = 8  # images per process and micro-step: global batch = this x processes x grad_accum_steps
    grad_accum_steps: int = 1  # micro-batches accumulated into each optimizer step
    lr: float = 0.02  # peak SGD learning rate (torchvision: 0.02 for 16 images; here 8: more steps in 2 epochs
        # did better)
    momentum: float = 0.9  # SGD momentum (torchvision: 0.9)
    weight_decay: float = 1e-4  # biases and norms get none (torchvision: 1e-4)
    warmup_epochs: float = 0.5  # linear warmup from lr x warmup_factor, epochs (fractions allowed)
    warmup_factor: float = 0.001  # the warmup starts at lr x this
    sched: Literal["poly", "step"] = "poly"  # poly (seamseg; to 0 at the end) or step (drops at decay_milestones)
    decay_milestones: list[int] = field(default_factory=list)  # epochs, for sched=step
    decay_rate: float = 0.1  # factor on the learning rate at each of decay_milestones (sched=step)
    poly_power: float = 0.9  # lr = lr x (1 - progress) ** this after warmup, for sched=poly (seamseg: 0.9)
    clip_grad: float = 10.0  # clip the global gradient norm to this (0: off)
    mixed_precision: Literal["", "no", "fp16", "bf16"] = ""  # no: fp32; empty: as `accelerate launch` says
    tf32: bool = True  # CUDA: TF32 tensor-core matmuls and convolutions, and cudnn.benchmark autotuning (false:
        # full fp32 precision and a fixed convolution algorithm)
    compile: bool = False  # torch.compile the whole model through Accelerate (inductor); graph breaks at NMS and
        # sampling
    # evaluation
    plot_images: int = 4  # evaluation images drawn with ground truth and predictions in plots/detections.png (0: none)
    best_metric: Literal["map_50", "map"] = "map_50"  # what best.safetensors follows: mAP@0.5, or COCO's
        # mAP@[.5:.95] (map; the COCO and VOC configs)
    # run
    output_dir: str = ""  # the run folder; empty: runs/<recipe file name>/<config name>
    seed: int = 0  # seeds data order, augmentation and initialisation
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
    targets = [{**t, "boxes": t["boxes"].as_subclass(torch.Tensor).float(), "labels": t["labels"] + 1}
               for _, t in batch]
    return images, targets


class AspectRatioBatchSampler(EpochBatchSampler):
    """EpochBatchSampler whose batches hold only landscape (width >= height) or only portrait images,
    so that a batch padded to its largest image wastes little (torchvision's group_by_aspect_ratio).

    Each epoch: one seeded permutation of all indices (a function of ``(seed, epoch)`` only), split
    by orientation keeping that order, cut into batches per group, and the batches of both groups
    shuffled together with the same generator. With ``drop_last`` every group's incomplete batch is
    dropped and the epoch ends at the last complete round of ``num_processes`` batches, so Accelerate
    hands every process the same number of full batches (process ``r`` of ``W``: batches ``r, r + W,
    ...``) and ``skip_first_batches`` resumes exactly. Without ``drop_last`` (one process) every
    index comes exactly once per epoch, the groups' last batches being smaller.
    """

    def __init__(self, aspect_ratios: Sequence[float], batch_size: int, seed: int = 0, drop_last: bool = True,
                 num_processes: int = 1) -> None:
        super().__init__(len(aspect_ratios), batch_size, True, seed, drop_last, num_processes)
        self.landscape = [float(r) >= 1.0 for r in aspect_ratios]  # width / height of each image
        if drop_last and len(self) == 0:
            raise UserError(f"no orientation group of the training split fills {num_processes} batches of "
                            f"{batch_size}; lower --batch_size")

    def __len__(self) -> int:
        groups = (sum(self.landscape), self.size - sum(self.landscape))
        if self.drop_last:
            return sum(n // self.batch_size for n in groups) // self.num_processes * self.num_processes
        return sum(-(-n // self.batch_size) for n in groups)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1))
        order = torch.randperm(self.size, generator=generator).tolist()
        batches: list[list[int]] = []
        for landscape in (True, False):
            members = [i for i in order if self.landscape[i] == landscape]
            batches += [members[k:k + self.batch_size] for k in range(0, len(members), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        batches = [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]
        for batch in batches[:len(self)]:
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
        self.fpn = FeaturePyramidNetwork(body.feature_info.channels(), fpn_channels,
                                         LastLevelMaxPool() if extra_pool else None)
        self.out_channels = fpn_channels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(self.body(x))))


class TwoStageDetector(nn.Module):
    """Faster R-CNN as one forward, so that DDP sees every parameter's gradient:

    training ``(images, targets) -> {loss_rpn_objectness, loss_rpn_box, loss_roi_classifier, loss_roi_box}``;
    eval ``images -> [{boxes [K, 4] XYXY in the input image's pixels, labels [K] (1..C), scores [K]}]``.
    ``images``: a list of [3, H_i, W_i] in 0..1.
    """

    def __init__(self, transform: GeneralizedRCNNTransform, backbone: nn.Module, rpn: RegionProposalNetwork,
                 roi_heads: RoIHeads) -> None:
        super().__init__()
        self.transform, self.backbone, self.rpn, self.roi_heads = transform, backbone, rpn, roi_heads
        # The box regressions leave their heads in fp32 whatever the autocast: torchvision's BoxCoder casts
        # anchors and proposals to the regression's dtype, and bf16 pixel coordinates are multiples of
        # 2 px from 256, 4 px from 512 and 8 px from 1024 (so bf16 evaluation would round every box).
        for head in (rpn.head, roi_heads.box_predictor):
            head.register_forward_hook(_float_outputs)

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


def _float_outputs(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: the module's tensors (alone or in tuples and lists) returned as fp32."""
    if isinstance(output, torch.Tensor):
        return output.float()
    return type(output)(_float_outputs(module, inputs, o) for o in output)


def freeze_stages(body: nn.Module, freeze_at: int) -> None:
    """Freeze a timm features_only backbone's modules up to and including the one that gives
    feature level ``freeze_at - 1`` of all its levels (level 0 is the stem of a resnet): their weights
    get no gradient (their batch norm statistics still move unless ``frozen_bn``)."""
    if freeze_at <= 0:
        return
    levels = body.feature_info.info  # every level, not only out_indices
    if freeze_at > len(levels):
        raise UserError(f"freeze_at {freeze_at}: model has only {len(levels)} stages")
    last = levels[freeze_at - 1]["module"].split(".")[0]
    for name, child in body.named_children():
        for p in child.parameters():
            p.requires_grad_(False)
        if name == last:
            return


def create_model(cfg: Config, num_classes: int) -> TwoStageDetector:
    """The detector for ``num_classes`` object classes (background is one more)."""
    rpn_kwargs = dict(rpn_pre_nms_top_n_train=cfg.rpn_pre_nms_top_n[0], rpn_pre_nms_top_n_test=cfg.rpn_pre_nms_top_n[1],
                      rpn_post_nms_top_n_train=cfg.rpn_post_nms_top_n[0], rpn_post_nms_top_n_test=cfg.rpn_post_nms_top_n[1],
                      rpn_batch_size_per_image=cfg.rpn_batch_size_per_image)
    box_kwargs = dict(box_batch_size_per_image=cfg.box_batch_size_per_image, box_score_thresh=cfg.box_score_thresh,
                      box_nms_thresh=cfg.box_nms_thresh, box_detections_per_img=cfg.box_detections_per_img)
    if cfg.model in PRESETS:  # torchvision's own backbone + FPN, heads sized as torchvision sizes them
        builder = getattr(torchvision.models.detection, cfg.model)
        # FasterRCNN passes unknown keywords on to its transform, which ignores them: check them here
        known = set(inspect.signature(FasterRCNN).parameters) | {"size_divisible", "fixed_size"}
        if set(cfg.model_kwargs) - known:
            raise UserError(f"model_kwargs {sorted(set(cfg.model_kwargs) - known)} do not fit {cfg.model}: the presets take "
                            "torchvision's FasterRCNN arguments (--model_kwargs {} for none)")
        try:
            m = builder(weights="DEFAULT" if cfg.pretrained else None,
                        weights_backbone="DEFAULT" if cfg.pretrained_backbone else None,
                        num_classes=91 if cfg.pretrained else num_classes + 1,
                        trainable_backbone_layers=5 - cfg.freeze_at if cfg.pretrained or cfg.pretrained_backbone else None,
                        min_size=tuple(cfg.min_size), max_size=cfg.max_size, **rpn_kwargs, **box_kwargs,
                        **cfg.model_kwargs)
        except TypeError as e:
            raise UserError(f"model_kwargs {cfg.model_kwargs} do not fit {cfg.model} ({e}); "
                            "the presets take torchvision's FasterRCNN arguments (--model_kwargs {} for none)") from None
        if cfg.anchor_sizes:  # the preset's anchors replaced; a new RPN head when the count per position changes
            m.rpn.anchor_generator = AnchorGenerator(tuple(tuple(s) for s in cfg.anchor_sizes),
                                                     (tuple(cfg.aspect_ratios),) * len(cfg.anchor_sizes))
            per_position = m.rpn.anchor_generator.num_anchors_per_location()[0]
            if m.rpn.head.cls_logits.out_channels != per_position:
                m.rpn.head = RPNHead(m.backbone.out_channels, per_position)
        if cfg.pretrained:  # COCO's 91-way predictor -> ours
            m.roi_heads.box_predictor = FastRCNNPredictor(m.roi_heads.box_predictor.cls_score.in_features, num_classes + 1)
        if cfg.frozen_bn:  # the presets freeze it themselves whenever they load weights
            m.backbone.body = timm.layers.freeze_batch_norm_2d(m.backbone.body)
        model = TwoStageDetector(m.transform, m.backbone, m.rpn, m.roi_heads)
    else:
        try:
            body = create_timm_model(cfg.model, also=f" or a torchvision preset ({', '.join(PRESETS)})",
                                     features_only=True, out_indices=tuple(cfg.out_indices),
                                     pretrained=cfg.pretrained, **cfg.model_kwargs)
        except (IndexError, TypeError) as e:
            raise UserError(f"model '{cfg.model}' does not take out_indices {cfg.out_indices} "
                            f"and model_kwargs {cfg.model_kwargs}: {e}") from None
        freeze_stages(body, cfg.freeze_at)
        if cfg.frozen_bn:
            body = timm.layers.freeze_batch_norm_2d(body)  # BatchNorm2d -> FrozenBatchNorm2d
        backbone = TimmFPN(body, cfg.fpn_channels, cfg.extra_pool)
        strides = body.feature_info.reduction() + ([2 * body.feature_info.reduction()[-1]] if cfg.extra_pool else [])
        sizes = [tuple(s) for s in cfg.anchor_sizes] or [(8 * s,) for s in strides]
        if len(sizes) != len(strides) or len({len(s) for s in sizes}) != 1:
            raise UserError(f"anchor_sizes must give one list of sizes per FPN level, as many at each (the RPN "
                            f"head is shared); the FPN has {len(strides)} levels (strides {strides}), got {cfg.anchor_sizes}")
        anchors = AnchorGenerator(tuple(sizes), (tuple(cfg.aspect_ratios),) * len(sizes))
        rpn = RegionProposalNetwork(
            anchors, RPNHead(cfg.fpn_channels, anchors.num_anchors_per_location()[0]),
            fg_iou_thresh=0.7, bg_iou_thresh=0.3, batch_size_per_image=cfg.rpn_batch_size_per_image,
            positive_fraction=0.5, nms_thresh=0.7,
            pre_nms_top_n=dict(training=cfg.rpn_pre_nms_top_n[0], testing=cfg.rpn_pre_nms_top_n[1]),
            post_nms_top_n=dict(training=cfg.rpn_post_nms_top_n[0], testing=cfg.rpn_post_nms_top_n[1]))
        levels = [str(i) for i in range(len(cfg.out_indices))]  # RoIAlign reads the FPN levels, not "pool"
        roi_heads = RoIHeads(
            MultiScaleRoIAlign(levels, cfg.roi_size, cfg.roi_sampling_ratio),
            TwoMLPHead(cfg.fpn_channels * cfg.roi_size ** 2, cfg.box_head_dim),
            FastRCNNPredictor(cfg.box_head_dim, num_classes + 1),
            fg_iou_thresh=0.5, bg_iou_thresh=0.5, batch_size_per_image=cfg.box_batch_size_per_image,
            positive_fraction=0.25, bbox_reg_weights=None, score_thresh=cfg.box_score_thresh,
            nms_thresh=cfg.box_nms_thresh, detections_per_img=cfg.box_detections_per_img)
        # the order of min_size matters: training draws one per image, evaluation uses the last
        transform = GeneralizedRCNNTransform(tuple(cfg.min_size), cfg.max_size, IMAGENET_MEAN, IMAGENET_STD)
        model = TwoStageDetector(transform, backbone, rpn, roi_heads)
    return model


# ============================================================================================
# Evaluation and saving
# ============================================================================================
@torch.no_grad()
def evaluate(model: nn.Module, eval_loader, evaluator: CocoEvaluator, accelerator) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/coco_eval.py); boxes go to the evaluator in original-image pixels."""
    was_training = model.training
    model.eval()

    def batches():  # consumed by the evaluator as the loader yields
        for images, targets in eval_loader:
            with accelerator.autocast():
                detections = model(images)
            yield [{"image_id": t["image_id"], "boxes": rescale_boxes(d["boxes"], t["size"], t["orig_size"]),
                    "scores": d["scores"], "labels": d["labels"] - 1} for d, t in zip(detections, targets)]

    results = evaluator.evaluate(batches(), accelerator, details=True)
    model.train(was_training)
    return results


# ============================================================================================
# Training
# ============================================================================================
def check_config(cfg: Config) -> None:
    """Values that would fail deep inside torchvision, as one clear error before anything is made
    (the anchors are checked against the backbone's levels in ``create_model``)."""
    if len(cfg.loss_weights) != 4 or any(w < 0 for w in cfg.loss_weights):
        raise UserError(f"loss_weights must be 4 non-negative numbers (rpn objectness, rpn box, roi classifier, "
                        f"roi box), got {cfg.loss_weights}")
    if not cfg.min_size or min(cfg.min_size) <= 0 or cfg.max_size < max(cfg.min_size):
        raise UserError(f"min_size must be one or more positive sizes no larger than max_size ({cfg.max_size}), "
                        f"got {cfg.min_size}")
    if len(cfg.rpn_pre_nms_top_n) != 2 or len(cfg.rpn_post_nms_top_n) != 2:
        raise UserError("rpn_pre_nms_top_n and rpn_post_nms_top_n take [train, eval]")
    if not 0 <= cfg.freeze_at <= 5:
        raise UserError(f"freeze_at must be 0..5, got {cfg.freeze_at}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = parse_config(Config, argv)
    check_config(cfg)
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    num_classes = len(data.classes)
    train_set = DetectionDataset(data.train, data_transforms(True, cfg.hflip, cfg.color_jitter), cfg.seed)
    eval_set = DetectionDataset(data.eval, data_transforms(False, 0.0, False), cfg.seed)
    aspect = [w / h for w, h in zip(data.train["width"], data.train["height"])]  # from the table: nothing decoded
    sampler = AspectRatioBatchSampler(aspect, cfg.batch_size, cfg.seed, True, accelerator.num_processes)
    train_loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=list_collate,
                                               **loader_kwargs(cfg.num_workers))
    eval_loader = eval_loader_for(eval_set, 2 * cfg.batch_size, cfg.num_workers, collate_fn=list_collate)
    evaluator = CocoEvaluator(data.eval, data.classes)

    # ---- model -------------------------------------------------------------------------------
    model = create_model(cfg, num_classes)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch
    weight_dict = dict(zip(LOSS_NAMES.values(), cfg.loss_weights))  # the total loss: sum of weight x term

    # ---- optimizer and schedules (SGD; no weight decay on biases and norms) ----------------------
    groups = weight_decay_groups(model, cfg.weight_decay)  # frozen stages stay out
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **fused)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    total_steps = steps_total(cfg.epochs, steps_per_epoch, cfg.max_steps)
    # poly decays to 0 at the last step (seamseg); step drops by decay_rate at each milestone epoch
    lr_values = schedule(cfg.sched, cfg.lr, 0.0, total_steps, round(cfg.warmup_epochs * steps_per_epoch),
                         cfg.lr * cfg.warmup_factor, [m * steps_per_epoch for m in cfg.decay_milestones],
                         cfg.decay_rate, cfg.poly_power)

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
            meters.images(len(images), boxes=sum(len(t["boxes"]) for t in targets),  # shapes: no device sync
                          dropped_boxes=sum(t["dropped"] for t in targets))
            if not loop.optimizer_stepped():
                continue
            if loop.step % cfg.log_every == 0:
                loop.log_train(lr=lr)

        # ---- evaluation and best weights ---------------------------------------------------------
        if loop.eval_due():
            metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
            results = {f"eval/{k}": v for k, v in metrics.items()}
            improved = loop.improved(cfg.best_metric, results[f"eval/{cfg.best_metric}"])
            results[f"best/{cfg.best_metric}"] = loop.best(cfg.best_metric)
            run.log({**results, "epoch": epoch}, loop.step)
            pictures = {}  # PR curves, confusion matrix, per-class AP (CSV), detections on the first images
            if accelerator.is_main_process:
                pictures = save_evaluation_figures(details, run.plots_dir, data.eval, cfg.plot_images,
                                                   wandb_run=run.wandb_run(), step=loop.step)
            run.log_plots(loop.step, **pictures)  # and the training curves
            weights = accelerator.get_state_dict(model) if improved else None  # a collective under FSDP
            if improved and accelerator.is_main_process:
                save_weights(weights, run.dir / "best.safetensors", cfg, data.classes, run.recipe)
    if loop.stopped:
        return results

    # ---- saving -----------------------------------------------------------------------------------
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_weights(weights, run.dir / "final.safetensors", cfg, data.classes, run.recipe)
    if details is not None:  # the last evaluation's AP per class (also plots/per_class_ap.csv)
        run.print(per_class_text(details))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
