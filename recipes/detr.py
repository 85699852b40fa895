"""DETR: end-to-end set-prediction detection with a transformer, on HuggingFace Accelerate.

A timm ``features_only`` backbone gives one feature map (stride 32 for resnet50 as in the paper;
any timm model and level), a 1x1 convolution projects it to ``d_model`` channels, and a 2-D sine
position encoding (computed from the padding mask, so padded pixels do not stretch it) is added to
queries and keys in every attention layer. A post-norm transformer encoder reads the flattened map;
a decoder turns ``num_queries`` learned object queries into as many predictions: a class out of
C + 1 (the last is "no object") and a normalised box (cx, cy, w, h) from a 3-layer MLP. Padding
masks from the collate reach the encoder, the decoder's cross-attention and the position encoding.

Training is set prediction: the Hungarian algorithm (scipy) matches predictions to ground truth one
to one at the lowest cost -p(class) + 5 L1 + 2 (-GIoU); matched predictions learn their box (L1 +
GIoU, normalised by the number of boxes over all processes) and class, the rest learn "no object"
(cross-entropy weight ``eos_coef``). Every decoder layer gets the same losses (auxiliary losses),
each matched on its own. AdamW with a tenth of the learning rate for the backbone, one step drop,
gradient clipping at 0.1, DETR's multi-scale resize and random crop. Evaluation is COCO mAP
(common/coco_eval.py); the best weights by mAP@0.5 are kept. No NMS: the set loss removes duplicates.

DETR starts from a pretrained backbone (ImageNet weights at scale, ``pretrained``). Without network
the backbone is first pre-trained on the training set's own ground-truth boxes (``pretrain_crops_*``):
every box cut out with a little context, resized to a small square and classified by the backbone
plus a linear head; the head is then dropped. From random weights the demo's DETR finds the boxes
but never learns the classes within its budget (README, "DETR").

Launch (defaults = the built-in ``digits_det`` scenes, a half-width resnet10t at 96 px read at stride
8 and pre-trained for 6 epochs on 32 px crops of the training boxes, then a 3 + 3-layer transformer
of width 128 with 16 queries, 12 epochs):

    accelerate launch recipes/detr.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/detr.py \\
        --config configs/detr/coco_r50.yaml

Expected (defaults, measured): see the README's recipe table (mAP@0.5 on the 400 held-out scenes).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

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


import numpy as np
import safetensors.torch
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF
from tqdm.auto import tqdm

from common import UserError
from common.boxes import crop_box
from common.coco_eval import CocoEvaluator, EvalDetails
from common.console import cli_main
from common.data import decode_image
from common.detection import IMAGENET_MEAN, IMAGENET_STD, DetectionData, DetectionDataset, collate, load_detection
from common.detection_figures import per_class_text
from common.detection_outputs import check_classes, prediction_batches, report_evaluation, save_predictions
from common.loaders import eval_loader_for, sample_seed, train_loader_for
from common.loop import Loop, steps_total
from common.meters import Meters, prefixed
from common.models import (config_with_weights, create_timm_model, freeze_stages, load_state, load_weights,
                           save_weights, sync_batchnorm)
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups
from recipes.detr_checkpoint import load_init_weights  # DETR's checkpoint reader, beside this file

# The three weighted loss terms, in the order of loss_weights (and, for the costs, of matcher_costs).
LOSS_TERMS = ("loss_ce", "loss_bbox", "loss_giou")


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
    scales: list[int] = field(default_factory=lambda: [96])  # shorter side, px: one drawn per training image;
        # eval at the last (DETR: 480..800 step 32)
    max_size: int = 96  # longer side at most, px (DETR: 1333)
    crop: float = 0.0  # probability of DETR's crop branch: resize to crop_resize, random crop of crop_size,
        # resize to scales (DETR: 0.5)
    crop_resize: list[int] = field(default_factory=lambda: [72, 84, 96])  # shorter side before the crop, px
        # (DETR: 400, 500, 600)
    crop_size: list[int] = field(default_factory=lambda: [64, 96])  # crop width and height drawn in [min, max] px
        # (DETR: 384, 600)
    hflip: float = 0.0  # horizontal flip probability: 0.5 for natural images; digits must not be mirrored
    num_workers: int = 1  # DataLoader worker processes per training process (0: load in the main process)
    # model: backbone -> 1x1 projection -> encoder -> decoder -> heads
    model: str = "resnet10t"  # any timm model with features_only (DETR: resnet50)
    model_kwargs: dict = field(default_factory=lambda: {"channels": [32, 64, 128, 256], "stem_width": 16,
                                                         "output_stride": 8})  # extra timm.create_model arguments;
        # the demo: resnet10t at half width, its last stage dilated (DETR-DC5's trick): stride 8, a 12 x 12 map at 96 px
    out_index: int = 3  # the backbone level the transformer reads (timm's feature index; -1 = the last)
    pretrained: bool = False  # timm's ImageNet weights for the backbone (needs network)
    frozen_bn: bool = False  # backbone batch norm as fixed affine layers (DETR does so with pretrained weights)
    freeze_at: int = 0  # backbone levels whose weights never train: 0 none, 1 the stem, 2 the stem and the first
        # stage (DETR: 2, its resnet50 trains layer2-4 only); frozen weights stay out of the optimizer
    init_backbone: str = ""  # safetensors of the same timm model (e.g. classifier.py's best.safetensors) for the
        # backbone; keys it does not use (head, later stages) are ignored
    init_weights: str = ""  # the whole detector from a DETR checkpoint: the reference's COCO-trained .pth
        # (detr-r50-e632da11.pth), transformers' facebook/detr-resnet-50 model.safetensors, or this recipe's own
        # safetensors; the model fields must match it (DETR-R50: resnet50, out_index -1, d_model 256, 6 + 6
        # layers, 8 heads, dim_feedforward 2048, 100 queries). The class head is kept for COCO classes (the rows
        # of their ids) and for the file's own classes, else made anew (docs/detr.md)
    # backbone pre-training on the training set's own boxes, before DETR: what stands in for ImageNet weights
    # without network (skipped with pretrained, init_backbone or init_weights weights, and when resuming)
    pretrain_crops_epochs: int = 6  # epochs of classifying every ground-truth box, cut out, with backbone + linear
        # head (0: off)
    pretrain_crops_size: int = 32  # crop side, px (digits_det's digits are 12-47 px tall)
    pretrain_crops_margin: float = 0.15  # context around each box, a fraction of its longer side
    pretrain_crops_shift: float = 0.1  # the crop window moves by up to this fraction of its side (x and y)
    pretrain_crops_lr: float = 2e-3  # peak AdamW learning rate of the pre-training: 1 warmup epoch, then cosine to 0
    pretrain_crops_batch_size: int = 64  # crops per process
    # transformer and heads
    d_model: int = 128  # transformer width (DETR: 256)
    nheads: int = 8  # attention heads; d_model must be a multiple of it (DETR: 8)
    enc_layers: int = 3  # encoder layers (DETR: 6)
    dec_layers: int = 3  # decoder layers, each with its own auxiliary loss (DETR: 6)
    dim_feedforward: int = 512  # hidden width of each layer's feed-forward MLP (DETR: 2048)
    dropout: float = 0.0  # dropout in the transformer (DETR: 0.1)
    num_queries: int = 16  # object queries, the most objects per image (DETR: 100; digits_det has at most 6)
    aux_loss: bool = True  # the losses after every decoder layer, not only the last (DETR: true)
    # loss
    matcher_costs: list[float] = field(default_factory=lambda: [2.0, 5.0, 2.0])  # Hungarian matching cost weights:
        # class, L1, GIoU (DETR: 1, 5, 2; Deformable DETR weighs the class 2, which teaches the demo its classes sooner)
    loss_weights: list[float] = field(default_factory=lambda: [2.0, 5.0, 2.0])  # loss weights: CE, L1, GIoU
        # (DETR: 1, 5, 2; the class 2 as in the costs)
    eos_coef: float = 0.1  # cross-entropy weight of the no-object class (DETR: 0.1)
    # optimization
    epochs: int = 12  # training epochs (after pretrain_crops_epochs)
    max_steps: int = 0  # >0: stop after this many optimizer steps
    batch_size: int = 16  # images per process and micro-step: global batch = this x processes x grad_accum_steps
    grad_accum_steps: int = 1  # micro-batches accumulated into each optimizer step
    lr: float = 5e-4  # peak learning rate of the transformer and heads (DETR: 1e-4; a small model from scratch
        # takes more)
    lr_backbone: float = 2.5e-4  # peak learning rate of the backbone (DETR: 1e-5 for its ImageNet one); here half of
        # lr for the crop-pretrained one, which must learn whole scenes after 32 px crops (5e-4 from scratch)
    weight_decay: float = 1e-4  # AdamW weight decay, on every parameter as in DETR (DETR: 1e-4)
    warmup_epochs: float = 1.0  # linear learning-rate warmup from 0, epochs (DETR: none)
    lr_drop_epochs: int = 0  # the lr (both groups) drops x0.1 after this epoch; 0: at 2/3 of epochs
        # (DETR: 200 of 300)
    clip_grad: float = 0.1  # clip the global gradient norm to this (0: off; DETR: 0.1)
    mixed_precision: Literal["", "no", "fp16", "bf16"] = ""  # no: fp32; empty: as `accelerate launch` says
    tf32: bool = True  # CUDA: TF32 tensor-core matmuls and convolutions, and cudnn.benchmark autotuning (false:
        # full fp32 precision and a fixed convolution algorithm)
    compile: bool = False  # torch.compile the model through Accelerate (inductor); the matcher stays eager
    # evaluation
    plot_images: int = 4  # evaluation images drawn with ground truth and predictions in plots/detections.png (0: none)
    best_metric: Literal["map_50", "map", "map_50_11pt"] = "map_50"  # what best.safetensors follows: mAP@0.5,
        # COCO's mAP@[.5:.95] (map; the COCO and VOC configs) or VOC07's 11-point mAP@0.5
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    weights: str = ""  # a weights file this recipe saved (best.safetensors), for eval_only and predict
    eval_only: bool = False  # evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in the
        # dataset's category ids), no training
    predict: str = ""  # an image or a folder of images: with --weights, write predictions.json and the images with
        # their boxes drawn (predictions/) in the run folder; no dataset needed
    predict_score: float = 0.5  # predict: detections scoring below this are neither written nor drawn (DETR's
        # 100 queries each answer, most with a low score)
    # run
    output_dir: str = ""  # the run folder; empty: runs/<recipe file name>/<config name>
    seed: int = 0  # seeds data order, augmentation and initialisation
    log_every: int = 20  # log training metrics every this many optimizer steps
    eval_every: int = 5  # evaluate every this many epochs; also at the end
    checkpoint_every: int = 500  # save a checkpoint every this many optimizer steps; also at the end
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are deleted
    resume: str = ""  # auto (the run folder's newest complete checkpoint), a checkpoint folder, or empty (afresh)
    report_to: Literal["wandb", "tensorboard", "none"] = "wandb"  # tracker; wandb logs offline without credentials;
        # metrics.jsonl is written in every case
    project: str = ""  # tracker project; empty: $WANDB_PROJECT, else the recipe's file name
    run_name: str = ""  # tracker run name; empty: $WANDB_NAME, else the run folder's name
    log_weights: bool = False  # wandb: upload the final and best weights as W&B model artifacts at the end


# ============================================================================================
# Data: DETR's augmentation (multi-scale resize, random size crop) with torchvision v2; targets
# as DETR's loss wants them: normalised (cx, cy, w, h)
# ============================================================================================
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


def data_transforms(cfg: Config, train: bool) -> v2.Compose:
    """Box-aware ``(PIL image, {"boxes", "labels"}) -> (normalised float image [3, H, W], target)``,
    no padding (the collate pads each batch to its largest image and returns the padding mask).

    train: horizontal flip, then with probability ``crop`` DETR's crop branch, else a resize of the
    shorter side to one of ``scales`` (longer side at most ``max_size``). eval: the last scale.
    """
    steps: list = [v2.ToImage()]
    if train:
        if cfg.hflip > 0:
            steps.append(v2.RandomHorizontalFlip(cfg.hflip))
        resize = v2.RandomShortestSize(cfg.scales, cfg.max_size, antialias=True)  # DETR's RandomResize(scales, max_size)
        if cfg.crop > 0:
            cropped = v2.Compose([v2.RandomShortestSize(cfg.crop_resize, antialias=True),
                                  RandomSizeCrop(*cfg.crop_size), resize])
            steps.append(v2.RandomChoice([resize, cropped], p=[1 - cfg.crop, cfg.crop]))
        else:
            steps.append(resize)
    else:
        steps.append(v2.RandomShortestSize([cfg.scales[-1]], cfg.max_size, antialias=True))  # one choice: deterministic
    steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=1.0),
              v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


def detr_collate(batch):
    """common/detection's collate (images [B, 3, H, W] padded right and bottom, mask [B, H, W] True
    on padding), with each target's ``boxes`` as normalised (cx, cy, w, h) [N, 4] of the image's own
    unpadded ``size`` (DETR's convention: the padding is not part of the image). Runs in the workers."""
    images, mask, targets = collate(batch)
    for t in targets:
        h, w = t["size"]
        boxes = box_convert(t["boxes"].as_subclass(torch.Tensor).float(), "xyxy", "cxcywh")
        t["boxes"] = boxes / torch.tensor([w, h, w, h], dtype=torch.float32)
    return images, mask, targets


# ============================================================================================
# Model: backbone -> projection + sine positions -> transformer -> class and box heads
# ============================================================================================
def sine_position_encoding(mask: torch.Tensor, d_model: int, temperature: float = 10000.0) -> torch.Tensor:
    """DETR's 2-D sine encoding: ``mask`` [B, H, W] (True = padding) -> [B, H, W, d_model].

    Each pixel's row and column are counted over valid pixels only, normalised to (0, 2 pi] by the
    image's own extent, and each encoded by d_model / 2 sines and cosines of geometric frequencies;
    the first half of the channels is y, the second x.
    """
    valid = (~mask).float()
    y = valid.cumsum(1)
    x = valid.cumsum(2)
    y = y / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = x / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    half = d_model // 2
    dim_t = temperature ** (2 * (torch.arange(half, device=mask.device) // 2) / half)
    pos_x, pos_y = x[..., None] / dim_t, y[..., None] / dim_t  # [B, H, W, half]
    pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3)


class EncoderLayer(nn.Module):
    """Post-norm (as in the paper) self-attention + feed-forward; positions added to queries and keys
    only, never to the values. Tensors [B, N, d]."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, src: torch.Tensor, pos: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        q = k = src + pos
        src = self.norm1(src + self.drop1(self.self_attn(q, k, src, key_padding_mask=padding, need_weights=False)[0]))
        return self.norm2(src + self.drop2(self.ff(src)))


class DecoderLayer(nn.Module):
    """Post-norm self-attention among the queries, cross-attention to the encoder's memory,
    feed-forward. ``query_pos`` (the learned object queries) is added to the queries of both
    attentions, ``pos`` (the sine encoding) to the memory's keys."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2, self.drop3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor,
                padding: torch.Tensor | None) -> torch.Tensor:
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.drop1(self.self_attn(q, k, tgt, need_weights=False)[0]))
        attended = self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=padding, need_weights=False)[0]
        tgt = self.norm2(tgt + self.drop2(attended))
        return self.norm3(tgt + self.drop3(self.ff(tgt)))


class MLP(nn.Sequential):
    """``layers`` linear layers with ReLU between them (DETR's box head: 3 layers)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, layers: int) -> None:
        dims = [d_in] + [d_hidden] * (layers - 1)
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        super().__init__(*blocks, nn.Linear(dims[-1], d_out))


class DETR(nn.Module):
    """``(images [B, 3, H, W], mask [B, H, W] True on padding) -> {"pred_logits": [B, Q, C + 1],
    "pred_boxes": [B, Q, 4] normalised (cx, cy, w, h) of each image's unpadded extent, "aux_outputs":
    [{"pred_logits", "pred_boxes"}] for decoder layers 1 .. L-1}`` (DETR's output format)."""

    def __init__(self, backbone: nn.Module, num_classes: int, cfg: Config) -> None:
        super().__init__()
        d = cfg.d_model
        self.backbone = backbone
        self.input_proj = nn.Conv2d(backbone.feature_info.channels()[-1], d, 1)
        self.query_embed = nn.Embedding(cfg.num_queries, d)
        self.encoder = nn.ModuleList(EncoderLayer(d, cfg.nheads, cfg.dim_feedforward, cfg.dropout) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(d, cfg.nheads, cfg.dim_feedforward, cfg.dropout) for _ in range(cfg.dec_layers))
        self.decoder_norm = nn.LayerNorm(d)  # applied to every decoder layer's output (all feed the heads)
        self.class_embed = nn.Linear(d, num_classes + 1)
        self.bbox_embed = MLP(d, d, 4, 3)
        self.aux_loss = cfg.aux_loss
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Xavier-uniform for the transformer's matrices, as DETR initialises its transformer."""
        for module in (self.encoder, self.decoder):
            for p in module.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> dict:
        feature = self.backbone(images)[-1]  # [B, C_b, h, w]
        # the padding mask at the feature's resolution (nearest, as DETR)
        mask = F.interpolate(mask[:, None].float(), size=feature.shape[-2:]).bool()[:, 0]  # [B, h, w]
        src = self.input_proj(feature).flatten(2).transpose(1, 2)  # [B, h*w, d]
        pos = sine_position_encoding(mask, src.shape[-1]).flatten(1, 2).to(src.dtype)  # [B, h*w, d]
        padding = mask.flatten(1)  # [B, h*w]
        memory = src
        for layer in self.encoder:
            memory = layer(memory, pos, padding)
        query_pos = self.query_embed.weight[None].expand(len(images), -1, -1)  # [B, Q, d]
        tgt = torch.zeros_like(query_pos)
        hidden = []
        for layer in self.decoder:
            tgt = layer(tgt, memory, pos, query_pos, padding)
            hidden.append(self.decoder_norm(tgt))
        hs = torch.stack(hidden)  # [L, B, Q, d]
        logits = self.class_embed(hs)
        # boxes in fp32 whatever the autocast: a bf16 fraction of the image is off by up to 1/256 of it
        with torch.autocast(hs.device.type, enabled=False):
            boxes = self.bbox_embed(hs.float()).sigmoid()
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])]
        return out


def create_model(cfg: Config, num_classes: int, backbone: nn.Module | None = None) -> DETR:
    """DETR for ``num_classes`` object classes (no-object is one more), around ``backbone`` (default:
    a new :func:`create_backbone`); ``freeze_at`` and ``frozen_bn`` freeze its first stages and its batch
    norm here, after any pre-training."""
    backbone = create_backbone(cfg) if backbone is None else backbone
    freeze_stages(backbone, cfg.freeze_at)
    if cfg.frozen_bn:
        backbone = timm.layers.freeze_batch_norm_2d(backbone)  # BatchNorm2d -> FrozenBatchNorm2d
    return DETR(backbone, num_classes, cfg)


def create_backbone(cfg: Config) -> nn.Module:
    """The timm ``features_only`` backbone giving the one level DETR reads, with the weights that
    ``pretrained`` or ``init_backbone`` name (random otherwise)."""
    try:
        backbone = create_timm_model(cfg.model, features_only=True, out_indices=(cfg.out_index,),
                                     pretrained=cfg.pretrained, **cfg.model_kwargs)
    except (IndexError, TypeError) as e:
        raise UserError(f"model '{cfg.model}' does not take out_index {cfg.out_index} "
                        f"and model_kwargs {cfg.model_kwargs}: {e}") from None
    if cfg.init_backbone:
        load_backbone(backbone, cfg.init_backbone)
    return backbone


def load_backbone(backbone: nn.Module, path: str) -> None:
    """Backbone weights from a safetensors file of the same timm model (a classifier's, or one saved
    from ``timm.create_model``): every tensor the ``features_only`` backbone has must be there with its
    shape; the rest (the classifier head, stages after ``out_index``) is ignored. Keys under
    ``backbone.`` (a DETR's own file) or ``model.`` / ``module.`` (a wrapped model's) are found too."""
    if not Path(path).is_file():
        raise UserError(f"init_backbone '{path}' does not exist")
    state = safetensors.torch.load_file(path)
    own = backbone.state_dict()
    for prefix in ("backbone.", "model.", "module."):
        if not any(k in state for k in own):
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} or state
    missing = [k for k in own if k not in state]
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or wrong:
        raise UserError(f"init_backbone '{path}' does not fit the backbone: missing {missing[:5]}, "
                        f"shape differs {wrong[:5]}")
    backbone.load_state_dict({k: state[k] for k in own})


# ============================================================================================
# Backbone pre-training on the training boxes: without network there are no ImageNet weights, and
# from random weights the demo's DETR finds the boxes but never learns the classes (README, "DETR")
# ============================================================================================
class BoxCropDataset(torch.utils.data.Dataset):
    """Every box of a normalised detection dataset as a classification sample ``(image [3, size, size]
    float normalised with the ImageNet mean and std as data_transforms does, class index)``, cut by
    ``crop_box`` (crowd regions and boxes under 1 px left out).

    ``shift`` > 0 (training): the window moves by up to that fraction of its side on each axis, drawn
    per ``(epoch, index)`` (keys as DetectionDataset's), so that the classifier does not learn that a
    digit always sits in the middle. Scenes are decoded per crop, nothing is cached: any size of
    dataset stays on disk, and DataLoader workers do the decoding.
    """

    def __init__(self, ds: Any, size: int = 32, margin: float = 0.15, shift: float = 0.0, seed: int = 0) -> None:
        self.ds, self.size, self.margin, self.shift, self.seed = ds, size, margin, shift, seed
        objects = ds.select_columns(["objects"])[:]["objects"]
        self.items = [(row, box, category) for row, o in enumerate(objects)
                      for box, category, crowd in zip(o["bbox"], o["category"], o["iscrowd"])
                      if not crowd and box[2] >= 1 and box[3] >= 1]  # (row, COCO box, class)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row, box, category = self.items[int(index)]
        image = decode_image(self.ds[row]["image"], f"row {row} of the detection dataset")
        shift = (0.0, 0.0)
        if self.shift > 0:
            shift = tuple(np.random.default_rng(sample_seed(self.seed, epoch, index)).uniform(-self.shift, self.shift, 2))
        crop = TF.to_dtype(TF.pil_to_tensor(crop_box(image, box, self.size, self.margin, shift)), torch.float32, scale=True)
        return TF.normalize(crop, IMAGENET_MEAN, IMAGENET_STD), int(category)


class CropClassifier(nn.Module):
    """``images [B, 3, s, s] -> logits [B, C]``: the detector's own backbone, global average pooling of
    the level DETR reads, a linear layer. Trained on box crops, it shapes exactly the layers (and the
    dilation) the transformer will see; the head is thrown away afterwards."""

    def __init__(self, backbone: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_info.channels()[-1], num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images)[-1].mean((2, 3)))


def pretrain_backbone(cfg: Config, backbone: nn.Module, data: DetectionData, run: Run) -> dict[str, float]:
    """Train ``backbone`` in place as a classifier of the ground-truth boxes of ``data.train`` (cut out
    by BoxCropDataset with a ``pretrain_crops_margin`` of context, resized to
    ``pretrain_crops_size``, the window shifted by up to ``pretrain_crops_shift``): AdamW (no weight
    decay on biases and norms), one warmup epoch then cosine, label smoothing 0.1. The crops are split
    across processes like any training set. Top-1 on the evaluation split's boxes is logged after every
    epoch as ``pretrain/top1`` (at step 0: DETR's steps have not started); returns the last values, or
    None when a stop signal (SIGTERM/SIGINT) ended it. ``max_steps`` caps its steps as it caps DETR's."""
    accelerator = run.accelerator
    train_set = BoxCropDataset(data.train, cfg.pretrain_crops_size, cfg.pretrain_crops_margin,
                               cfg.pretrain_crops_shift, cfg.seed)
    eval_set = BoxCropDataset(data.eval, cfg.pretrain_crops_size, cfg.pretrain_crops_margin)
    if len(train_set) < cfg.pretrain_crops_batch_size * accelerator.num_processes:
        raise UserError(f"the training split has {len(train_set)} boxes to pre-train the backbone on, fewer than one "
                        f"global batch ({cfg.pretrain_crops_batch_size} x {accelerator.num_processes} processes); "
                        "lower --pretrain_crops_batch_size (or skip the pre-training: --pretrain_crops_epochs 0)")
    train_loader = train_loader_for(train_set, cfg.pretrain_crops_batch_size, cfg.seed, cfg.num_workers,
                                  accelerator.num_processes)
    eval_loader = eval_loader_for(eval_set, 2 * cfg.pretrain_crops_batch_size, cfg.num_workers)
    model = CropClassifier(backbone, len(data.classes))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.05), lr=cfg.pretrain_crops_lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total = cfg.pretrain_crops_epochs * len(train_loader)
    if cfg.max_steps > 0:  # a short run (a smoke test, say) shortens the pre-training too
        total = min(total, cfg.max_steps)
    lr_values = schedule("cosine", cfg.pretrain_crops_lr, 0.0, total, min(len(train_loader), total))
    meters = Meters(accelerator.device)
    progress = tqdm(total=total, disable=not accelerator.is_main_process, desc="pretrain backbone", dynamic_ncols=True)
    step, values, stopped = 0, {}, False
    for epoch in range(cfg.pretrain_crops_epochs):
        if step >= total or stopped:
            break
        train_loader.set_epoch(epoch)  # the prepared loader: Accelerate's counter and the sampler
        model.train()
        for images, labels in train_loader:
            set_group_values(optimizer, "lr", float(lr_values[step]))
            with accelerator.autocast():
                logits = model(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meters.update(n=len(images), loss=loss)
            step += 1
            progress.update(1)
            stopped = run.should_stop()  # every process agrees (common/run.py)
            if stopped or step >= total:
                break
        if stopped:
            break
        model.eval()
        with torch.no_grad():
            for images, labels in eval_loader:
                with accelerator.autocast():
                    predicted = model(images).argmax(-1)
                predicted, labels = accelerator.gather_for_metrics((predicted, labels))
                meters.update(n=len(labels), top1=100 * (predicted == labels).float().mean())
        values = {k: v for k, v in meters.summary(accelerator).items() if k in ("loss", "top1")}
        run.log({**prefixed(values, "pretrain"), "pretrain/epoch": epoch}, 0)
    progress.close()
    # the classifier, its optimizer and loaders leave Accelerate's lists (and the DDP wrapper its hooks
    # on the backbone): checkpoints hold DETR alone, and DETR's prepare starts afresh
    accelerator.free_memory(model, optimizer, train_loader, eval_loader)
    return None if stopped else values


# ============================================================================================
# Loss: Hungarian matching, then cross-entropy (no-object down-weighted), L1 and GIoU per layer
# ============================================================================================
class HungarianMatcher(nn.Module):
    """One-to-one assignment of predictions to targets at the lowest total cost
    ``cost_class * -p(target class) + cost_bbox * L1(boxes) + cost_giou * -GIoU(boxes)``.

    ``forward(outputs, targets)``: ``outputs`` with ``pred_logits`` [B, Q, C + 1] and ``pred_boxes``
    [B, Q, 4] (normalised cxcywh), ``targets`` a list of B dicts with ``labels`` [T_i] and ``boxes``
    [T_i, 4] (normalised cxcywh) -> a list of B pairs ``(query indices, target indices)``, int64 CPU
    tensors of length min(Q, T_i) (empty for an image without objects).
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0) -> None:
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise UserError("matcher costs cannot all be 0")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def cost(self, outputs: dict, targets: list[dict]) -> torch.Tensor:
        """[B, Q, sum T_i] on the device: every prediction against every target of the batch (the
        blocks off the diagonal are never used; one batched computation is cheaper than B small ones)."""
        logits, boxes = outputs["pred_logits"].float(), outputs["pred_boxes"].float()
        prob = logits.flatten(0, 1).softmax(-1)  # [B*Q, C + 1]
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_boxes = torch.cat([t["boxes"] for t in targets]).float()
        cost_class = -prob[:, tgt_ids]  # -p(class): 1 - p in the paper, the constant does not matter
        cost_bbox = torch.cdist(boxes.flatten(0, 1), tgt_boxes, p=1)
        cost_giou = -generalized_box_iou(box_convert(boxes.flatten(0, 1), "cxcywh", "xyxy"),
                                         box_convert(tgt_boxes, "cxcywh", "xyxy"))
        c = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        return c.view(*logits.shape[:2], -1)

    @torch.no_grad()
    def match_layers(self, layers: list[dict], targets: list[dict]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``forward`` for several outputs at once (the final layer and the auxiliary ones): their cost
        matrices are stacked and copied to the host in one ``.cpu()``. scipy needs them there, so this
        one copy is the step's only host-device synchronisation, inherent to Hungarian matching."""
        sizes = [len(t["boxes"]) for t in targets]
        costs = torch.stack([self.cost(o, targets) for o in layers]).cpu()  # [L, B, Q, sum T]
        matches = []
        for layer_cost in costs:
            pairs = []
            for i, c in enumerate(layer_cost.split(sizes, -1)):  # image i's targets, from every query of image i
                rows, cols = linear_sum_assignment(c[i].numpy())
                pairs.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
            matches.append(pairs)
        return matches

    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.match_layers([outputs], targets)[0]


class SetCriterion(nn.Module):
    """DETR's loss: match, then per layer

    - ``loss_ce``: cross-entropy over all queries, unmatched ones towards no-object (class C) with
      weight ``eos_coef``, the weighted mean (sum of weight x CE / sum of weights);
    - ``loss_bbox``: L1 of matched boxes (normalised cxcywh), summed / num_boxes;
    - ``loss_giou``: 1 - GIoU of matched boxes, summed / num_boxes;
    - logged only (no gradient): ``class_error`` (100 - accuracy of matched queries, %) and
      ``cardinality_error`` (|predicted objects - true objects| per image, predicted = not no-object).

    ``num_boxes`` is the batch's target count averaged over processes (all_reduce, at least 1), so every
    process normalises alike. Auxiliary layers' terms carry the suffix ``_i`` (``loss_ce_0`` ...).
    ``weight_dict`` names the weight of each term that enters the total; ``losses`` picks groups from
    ``labels``, ``boxes``, ``cardinality``.
    """

    def __init__(self, num_classes: int, matcher: HungarianMatcher, weight_dict: dict[str, float], eos_coef: float,
                 losses: list[str]) -> None:
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict, self.eos_coef, self.losses = (
            num_classes, matcher, weight_dict, eos_coef, losses)
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(self, outputs, targets, indices, num_boxes, log: bool = True) -> dict[str, torch.Tensor]:
        logits = outputs["pred_logits"].float()
        batch_idx, src_idx = self._src(indices, logits.device)
        matched = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)]).to(logits.device)
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        classes[batch_idx, src_idx] = matched
        out = {"loss_ce": F.cross_entropy(logits.transpose(1, 2), classes, self.empty_weight)}
        if log:
            with torch.no_grad():
                correct = (logits[batch_idx, src_idx].argmax(-1) == matched).float()
                out["class_error"] = 100 - 100 * correct.sum() / max(len(matched), 1)  # no match: 100
        return out

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes) -> dict[str, torch.Tensor]:
        logits = outputs["pred_logits"]
        count = (logits.argmax(-1) != logits.shape[-1] - 1).sum(1).float()  # [B]
        truth = torch.tensor([float(len(t["labels"])) for t in targets], device=logits.device)
        return {"cardinality_error": F.l1_loss(count, truth)}

    def loss_boxes(self, outputs, targets, indices, num_boxes) -> dict[str, torch.Tensor]:
        batch_idx, src_idx = self._src(indices, outputs["pred_boxes"].device)
        src = outputs["pred_boxes"][batch_idx, src_idx].float()  # [M, 4]
        tgt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)]).to(src.device).float()
        giou = torch.diag(generalized_box_iou(box_convert(src, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy")))
        return {"loss_bbox": F.l1_loss(src, tgt, reduction="none").sum() / num_boxes,
                "loss_giou": (1 - giou).sum() / num_boxes}

    @staticmethod
    def _src(indices, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(image index, query index) of every matched prediction, as one host-to-device copy each."""
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        return batch_idx.to(device, non_blocking=True), src_idx.to(device, non_blocking=True)

    def get_loss(self, loss: str, outputs, targets, indices, num_boxes, **kwargs) -> dict[str, torch.Tensor]:
        fns = {"labels": self.loss_labels, "cardinality": self.loss_cardinality, "boxes": self.loss_boxes}
        if loss not in fns:
            raise ValueError(f"unknown loss '{loss}', expected one of {sorted(fns)}")
        return fns[loss](outputs, targets, indices, num_boxes, **kwargs)

    def forward(self, outputs: dict, targets: list[dict]) -> dict[str, torch.Tensor]:
        device = outputs["pred_logits"].device
        layers = [outputs] + list(outputs.get("aux_outputs", []))
        matches = self.matcher.match_layers(layers, targets)  # every layer matched on its own, one host copy
        # the mean over processes of the target count: a device all-reduce, never read on the host
        num_boxes = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(num_boxes)
            num_boxes = num_boxes / dist.get_world_size()
        num_boxes = num_boxes.clamp(min=1)
        losses: dict[str, torch.Tensor] = {}
        for i, (layer, indices) in enumerate(zip(layers, matches)):
            suffix = "" if i == 0 else f"_{i - 1}"
            for loss in self.losses:
                kwargs = {"log": False} if loss == "labels" and i > 0 else {}  # class_error of the last layer only
                terms = self.get_loss(loss, layer, targets, indices, num_boxes, **kwargs)
                losses.update({k + suffix: v for k, v in terms.items()})
        return losses


def create_criterion(cfg: Config, num_classes: int) -> SetCriterion:
    """The matcher and criterion with this config's costs and weights (auxiliary layers weighted alike)."""
    matcher = HungarianMatcher(*cfg.matcher_costs)
    weight_dict = dict(zip(LOSS_TERMS, cfg.loss_weights))
    if cfg.aux_loss:
        weight_dict.update({f"{k}_{i}": w for i in range(cfg.dec_layers - 1) for k, w in zip(LOSS_TERMS, cfg.loss_weights)})
    return SetCriterion(num_classes, matcher, weight_dict, cfg.eos_coef, ["labels", "boxes", "cardinality"])


# ============================================================================================
# Evaluation and saving
# ============================================================================================
@torch.no_grad()
def postprocess(outputs: dict, orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """DETR's outputs -> per image ``{scores [Q], labels [Q], boxes [Q, 4]}``: softmax, the best class
    other than no-object per query, boxes as XYXY in the pixels of each image's original ``(h, w)``
    (``orig_sizes`` [B, 2]). Predicted boxes are fractions of the unpadded image, so the original size
    is all that is needed, whatever resize the transforms did. No NMS and no threshold."""
    prob = outputs["pred_logits"].float().softmax(-1)
    scores, labels = prob[..., :-1].max(-1)
    h, w = orig_sizes.to(prob.device, torch.float32).unbind(1)
    scale = torch.stack([w, h, w, h], 1)[:, None]  # [B, 1, 4]
    boxes = box_convert(outputs["pred_boxes"].float(), "cxcywh", "xyxy") * scale
    return [{"scores": s, "labels": l, "boxes": b} for s, l, b in zip(scores, labels, boxes)]


def detect(model: nn.Module, loader, accelerator) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader``, per image: ``image_id`` and the detections (``boxes`` XYXY in the original
    image's pixels, ``scores``, ``labels`` as class indices 0..C-1); the model in eval mode."""
    for images, mask, targets in loader:
        with torch.no_grad(), accelerator.autocast():
            outputs = model(images, mask)
        orig = torch.tensor([t["orig_size"] for t in targets])
        yield [{"image_id": t["image_id"], **d} for d, t in zip(postprocess(outputs, orig), targets)]


def evaluate(model: nn.Module, eval_loader, evaluator: CocoEvaluator, accelerator) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/coco_eval.py); boxes go to the evaluator in original-image pixels."""
    was_training = model.training
    model.eval()
    results = evaluator.evaluate(detect(model, eval_loader, accelerator), accelerator, details=True)
    model.train(was_training)
    return results


# the fields that define the model: --weights restores them from the file's saved config
MODEL_FIELDS = ("model", "model_kwargs", "out_index", "frozen_bn", "scales", "max_size", "d_model", "nheads",
                "enc_layers", "dec_layers", "dim_feedforward", "num_queries", "aux_loss")


def trained_model(cfg: Config, data: DetectionData | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The DETR of ``cfg.weights`` (eval mode) and the file's metadata (classes, category ids), which
    must be those of ``data`` when given."""
    state, meta = load_weights(cfg.weights, "detector")
    check_classes(cfg.weights, meta, data)
    plain = dataclasses.replace(cfg, pretrained=False, init_backbone="")
    return load_state(create_model(plain, len(meta["classes"])), state, cfg.weights, meta["recipe"]).eval(), meta


def predict(cfg: Config, run: Run) -> dict[str, float]:
    """``--predict``: the detections of the ``--weights`` model on the images ``cfg.predict`` names."""
    model, meta = trained_model(cfg)
    table, batches = prediction_batches(run, cfg.predict, data_transforms(cfg, False), detr_collate,
                                        2 * cfg.batch_size, cfg.num_workers)
    found = detect(model.to(run.accelerator.device), batches, run.accelerator)
    return save_predictions(run, found, table, meta, cfg.predict_score, cfg.predict)


# ============================================================================================
# Training
# ============================================================================================
def check_config(cfg: Config) -> None:
    """Values that would fail deep inside the model or the loss, as one clear error before anything is made."""
    if len(cfg.loss_weights) != 3 or any(w < 0 for w in cfg.loss_weights):
        raise UserError(f"loss_weights must be 3 non-negative numbers (CE, L1, GIoU), got {cfg.loss_weights}")
    if len(cfg.matcher_costs) != 3 or any(w < 0 for w in cfg.matcher_costs):
        raise UserError(f"matcher_costs must be 3 non-negative numbers (class, L1, GIoU), got {cfg.matcher_costs}")
    if not cfg.scales or min(cfg.scales) <= 0:
        raise UserError(f"scales must be one or more positive sizes, got {cfg.scales}")
    if len(cfg.crop_size) != 2 or not 0 < cfg.crop_size[0] <= cfg.crop_size[1] or not cfg.crop_resize:
        raise UserError(f"crop_size must be [min, max] with 0 < min <= max and crop_resize not empty, got "
                        f"{cfg.crop_size} and {cfg.crop_resize}")
    if not 0 <= cfg.crop <= 1 or not 0 <= cfg.hflip <= 1:
        raise UserError(f"crop and hflip are probabilities, got {cfg.crop} and {cfg.hflip}")
    if cfg.d_model % cfg.nheads or cfg.d_model % 4:
        raise UserError(f"d_model ({cfg.d_model}) must be a multiple of 4 and of nheads ({cfg.nheads})")
    if min(cfg.enc_layers, cfg.dec_layers - 1, cfg.num_queries - 1) < 0:
        raise UserError("enc_layers >= 0, dec_layers >= 1 and num_queries >= 1 are needed")
    if not 0 <= cfg.eos_coef <= 1:
        raise UserError(f"eos_coef must be in 0..1, got {cfg.eos_coef}")
    if cfg.init_weights and cfg.init_backbone:
        raise UserError("init_weights and init_backbone both give the backbone's weights: set one of them")


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    check_config(cfg)
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if cfg.predict:
        return predict(cfg, run)

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    num_classes = len(data.classes)
    eval_set = DetectionDataset(data.eval, data_transforms(cfg, False), cfg.seed)
    eval_loader = eval_loader_for(eval_set, 2 * cfg.batch_size, cfg.num_workers, collate_fn=detr_collate)
    evaluator = CocoEvaluator(data.eval, data.classes)
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        model, eval_loader = accelerator.prepare(trained_model(cfg, data)[0], eval_loader)
        metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
        return report_evaluation(run, metrics, details, data, cfg.plot_images, 0, final=True)
    train_set = DetectionDataset(data.train, data_transforms(cfg, True), cfg.seed)
    train_loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers,
                                  accelerator.num_processes, collate_fn=detr_collate)

    # ---- model and loss (the backbone pre-trained on the box crops first, unless its weights come from elsewhere) ----
    backbone = create_backbone(cfg)
    if cfg.pretrain_crops_epochs > 0:
        reason = ("pretrained" if cfg.pretrained else "init_backbone" if cfg.init_backbone
                  else "init_weights" if cfg.init_weights
                  else "resuming (the checkpoint holds the weights)" if run.resume_checkpoint() else "")
        if reason:
            run.print(f"backbone pre-training on box crops skipped: {reason}")
        elif pretrain_backbone(cfg, backbone, data, run) is None:  # a stop signal: no checkpoint exists yet
            run.print("stopped during the backbone pre-training, before DETR's first checkpoint: "
                      "run the same command again to start over")
            run.finish()
            return {}
    model = create_model(cfg, num_classes, backbone)
    if cfg.init_weights:  # the whole detector from a DETR checkpoint (a resumed run's checkpoint overrides it)
        run.print(load_init_weights(model, cfg.init_weights, data.classes, data.category_ids))
    criterion = create_criterion(cfg, num_classes).to(accelerator.device)
    weight_dict = criterion.weight_dict  # the total loss: sum of weight x term (auxiliary layers' terms too)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch

    # ---- optimizer and schedules (AdamW; the backbone at lr_backbone, weight decay on everything) ----
    backbone = [p for p in model.backbone.parameters() if p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    groups = [{"params": rest, "lr_scale": 1.0},
              {"params": backbone, "lr_scale": cfg.lr_backbone / cfg.lr if cfg.lr else 0.0}]
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    total_steps = steps_total(cfg.epochs, steps_per_epoch, cfg.max_steps)
    drop_epoch = cfg.lr_drop_epochs or math.ceil(2 * cfg.epochs / 3)
    # DETR: constant, x0.1 after lr_drop epochs (here with an optional linear warmup from 0)
    lr_values = schedule("step", cfg.lr, 0.0, total_steps, round(cfg.warmup_epochs * steps_per_epoch), 0.0,
                         [drop_epoch * steps_per_epoch], 0.1)

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, total_steps, len(eval_set), data.classes)
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()
        for images, mask, targets in loop.batches():
            lr = float(lr_values[loop.step])
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    outputs = model(images, mask)
                losses = criterion(outputs, targets)  # fp32: the matcher and losses cast the outputs
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
            improved = loop.improved(cfg.best_metric, metrics[cfg.best_metric])
            # metrics.jsonl, trackers, plots/ and predictions.json (COCO results, the dataset's ids)
            results = report_evaluation(run, metrics, details, data, cfg.plot_images, loop.step,
                                        {f"best/{cfg.best_metric}": loop.best(cfg.best_metric)}, epoch)
            weights = accelerator.get_state_dict(model) if improved else None  # a collective under FSDP
            if improved and accelerator.is_main_process:
                save_weights(weights, run.dir / "best.safetensors", cfg, data.classes, run.recipe, data.category_ids)
    if loop.stopped:
        return results

    # ---- saving -----------------------------------------------------------------------------------
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_weights(weights, run.dir / "final.safetensors", cfg, data.classes, run.recipe, data.category_ids)
    if details is not None:  # the last evaluation's AP per class (also plots/per_class_ap.csv)
        run.print(per_class_text(details))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
