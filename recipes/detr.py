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
(common/detection/coco_eval.py); the best weights by mAP@0.5 are kept. No NMS: the set loss removes duplicates.

DETR starts from a pretrained backbone (ImageNet weights at scale, ``pretrained``). Without network
the backbone is first pre-trained on the training set's own ground-truth boxes (``pretrain_crops_*``):
every box cut out with a little context, resized to a small square and classified by the backbone
plus a linear head; the head is then dropped. From random weights the demo's DETR finds the boxes
but never learns the classes within its budget (docs/detr.md).

Beside this file, one concern each: recipes/detr_data.py (DETR's augmentation and collate),
recipes/detr_model.py (DETR, HungarianMatcher, SetCriterion, postprocess, detect), recipes/detr_pretrain.py
(the box-crop pre-training), recipes/detr_checkpoint.py (DETR checkpoints for ``init_weights``),
recipes/detr_inference.py (the trained model loaded back, prediction, export, the model folder). This
file builds them from its Config and runs the loop; a copy of the recipe takes them all.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

try:  # the shared package, installed once with `pip install -e <checkout>` (README, "Install")
    import common  # noqa: F401
except ModuleNotFoundError:
    print(
        "error: this recipe needs the package common/: run `pip install -e <cv-recipes checkout>` once", file=sys.stderr
    )
    sys.exit(2)


import numpy as np
import timm
import torch
from accelerate.utils import set_seed
from torch import nn

from common import UserError
from common.artifacts.export import export
from common.budget import Length
from common.config import MAX_COUNT, MAX_EPOCHS, MAX_SIDE, RunConfig, arg
from common.console import cli_main, own_files
from common.data.classification import with_label_fraction
from common.data.image_cache import image_caches
from common.data.scan import without_unreadable
from common.detection.coco_eval import CocoEvaluator, EvalDetails
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, DetectionDataset, load_detection
from common.detection.outputs import ap_per_class_line, report_evaluation
from common.loaders import eval_loader_for, train_loader_for
from common.loop import Loop
from common.models import (
    average_bn_statistics,
    create_timm_model,
    freeze_stages,
    fsdp_units,
    mark_fsdp_blocks,
    sync_batchnorm,
)
from common.run import Run
from common.schedules import schedule, set_group_values
from common.weights import config_with_weights, kept_weights, load_backbone, save_weights, weights_metadata

with own_files("detr_"):  # DETR's own files, beside this one: python -m common.vendor copies them with it
    from detr_checkpoint import load_init_weights  # DETR's checkpoint reader
    from detr_data import data_transforms, detr_collate  # DETR's augmentation and collate
    from detr_inference import export_files, predict, trained_model, write_model_folder  # what a run ships
    from detr_model import DETR, HungarianMatcher, SetCriterion, detect  # DETR's model, loss and detections
    from detr_pretrain import pretrain_backbone  # the backbone pre-training on box crops

# The three weighted loss terms (loss_weights names them without "loss_"; matcher_costs follows this order).
LOSS_TERMS = ("loss_ce", "loss_bbox", "loss_giou")
LOSS_WEIGHTS = {"ce": 2.0, "bbox": 5.0, "giou": 2.0}  # the demo's; DETR's are 1, 5, 2


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
    scales: list[int] = arg([96], "shorter side, px: one drawn per training image; eval at the last "
        "(DETR: 480..800 step 32)", ge=1, le=MAX_SIDE)
    max_size: int = arg(96, "longer side at most, px (DETR: 1333)", ge=1, le=MAX_SIDE)
    crop: float = arg(0.0, "probability of DETR's crop branch: resize to crop_resize, random crop of crop_size, "
        "resize to scales (DETR: 0.5)", ge=0, le=1)
    crop_resize: list[int] = arg([72, 84, 96], "shorter side before the crop, px (DETR: 400, 500, 600)",
        ge=1, le=MAX_SIDE)
    crop_size: list[int] = arg([64, 96], "crop width and height drawn in [min, max] px (DETR: 384, 600)",
        ge=1, le=MAX_SIDE)
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must not be mirrored",
        ge=0, le=1)
    num_workers: int = arg(-1, "DataLoader worker processes per training process; -1: the cores available per process, "
        "at most 8 (common.loaders.auto_workers); 0: load in the main process")
    # model: backbone -> 1x1 projection -> encoder -> decoder -> heads
    model: str = arg("resnet10t", "any timm model with features_only (DETR: resnet50)")
    model_kwargs: dict = arg({"channels": [32, 64, 128, 256], "stem_width": 16, "output_stride": 8},
        "extra timm.create_model arguments; the demo: resnet10t at half width, its last stage dilated (DETR-DC5's "
        "trick): stride 8, a 12 x 12 map at 96 px")
    out_index: int = arg(3, "the backbone level the transformer reads (timm's feature index; -1 = the last)",
        ge=-8, le=8)
    pretrained: bool = arg(False, "timm's ImageNet weights for the backbone (needs network)")
    frozen_bn: bool = arg(False, "backbone batch norm as fixed affine layers (DETR does so with pretrained weights)")
    freeze_at: int = arg(0, "backbone levels whose weights never train: 0 none, 1 the stem, 2 the stem and the first "
        "stage (DETR: 2, its resnet50 trains layer2-4 only); frozen weights stay out of the optimizer", ge=0, le=8)
    init_backbone: str = arg("", "safetensors of the same timm model (e.g. classifier.py's best.safetensors) for the "
        "backbone; keys it does not use (head, later stages) are ignored")
    init_weights: str = arg("", "the whole detector from a DETR checkpoint: the reference's COCO-trained .pth "
        "(detr-r50-e632da11.pth), transformers' facebook/detr-resnet-50 model.safetensors, or this recipe's own "
        "safetensors; the model fields must match it (DETR-R50: resnet50, out_index -1, d_model 256, 6 + 6 layers, 8 "
        "heads, dim_feedforward 2048, 100 queries). The class head is kept for COCO classes (the rows of their ids) "
        "and for the file's own classes, else made anew (docs/detr.md)")
    # backbone pre-training on the training set's own boxes, before DETR: what stands in for ImageNet weights
    # without network (skipped with pretrained, init_backbone or init_weights weights, and when resuming)
    pretrain_crops_epochs: int = arg(6, "epochs of classifying every ground-truth box, cut out, with "
        "backbone + linear head (0: off)", ge=0, le=MAX_EPOCHS)
    pretrain_crops_size: int = arg(32, "crop side, px (digits_det's digits are 12-47 px tall)", ge=8, le=MAX_SIDE)
    pretrain_crops_margin: float = arg(0.15, "context around each box, a fraction of its longer side", ge=0, le=10)
    pretrain_crops_shift: float = arg(0.1, "the crop window moves by up to this fraction of its side (x and y)",
        ge=0, le=1)
    pretrain_crops_lr: float = arg(2e-3, "peak AdamW learning rate of the pre-training: 1 "
        "warmup epoch, then cosine to 0", ge=0)
    pretrain_crops_batch_size: int = arg(64, "crops per process", ge=1, le=MAX_COUNT)
    # transformer and heads
    d_model: int = arg(128, "transformer width (DETR: 256)", ge=4, le=MAX_COUNT)
    nheads: int = arg(8, "attention heads; d_model must be a multiple of it (DETR: 8)", ge=1, le=1024)
    enc_layers: int = arg(3, "encoder layers (DETR: 6)", ge=0, le=1024)
    dec_layers: int = arg(3, "decoder layers, each with its own auxiliary loss (DETR: 6)", ge=1, le=1024)
    dim_feedforward: int = arg(512, "hidden width of each layer's feed-forward MLP (DETR: 2048)", ge=1, le=MAX_COUNT)
    dropout: float = arg(0.0, "dropout in the transformer (DETR: 0.1)", ge=0, lt=1)
    num_queries: int = arg(16, "object queries, the most objects per image (DETR: 100; digits_det has at most 6)",
        ge=1, le=MAX_COUNT)
    aux_loss: bool = arg(True, "the losses after every decoder layer, not only the last (DETR: true)")
    # loss
    matcher_costs: list[float] = arg([2.0, 5.0, 2.0], "Hungarian matching cost weights: class, L1, GIoU (DETR: 1, 5, "
        "2; Deformable DETR weighs the class 2, which teaches the demo its classes sooner)")
    loss_weights: dict = arg(dict(LOSS_WEIGHTS), "each loss term's weight by name: ce, bbox (L1), "
        "giou (those not given: the default's; DETR: 1, 5, 2; the class 2 as in the costs)")
    eos_coef: float = arg(0.1, "cross-entropy weight of the no-object class (DETR: 0.1)", ge=0, le=1)
    # optimization
    epochs: int = arg(12, "training epochs (after pretrain_crops_epochs)")
    lr: float = arg(5e-4, "peak learning rate of the transformer and heads for a global batch of lr_batch images, "
        "carried to the run's global batch by lr_scale (DETR: 1e-4 at 64 images; a small model "
        "from scratch takes more)")
    lr_batch: int = arg(16, "the global batch lr and lr_backbone are written for (the demo's: "
        "batch_size 16, 1 process)")
    lr_scale: Literal["linear", "sqrt"] = arg("sqrt", "sqrt: peak = lr x sqrt(global batch / lr_batch), timm's rule "
        "for adam-type optimizers; linear: x global batch / lr_batch. lr_backbone is carried by the same factor")
    lr_backbone: float = arg(2.5e-4, "peak learning rate of the backbone at lr_batch images (DETR: 1e-5 for its "
        "ImageNet one); here half of lr for the crop-pretrained one, which must learn whole scenes after 32 px "
        "crops (5e-4 from scratch)", ge=0)
    weight_decay: float = arg(1e-4, "AdamW weight decay, on every parameter as in DETR (DETR: 1e-4)")
    warmup_epochs: float = arg(1.0, "linear learning-rate warmup from 0, epochs (DETR: none)")
    lr_drop_epochs: int = arg(0, "the lr (both groups) drops x0.1 after this epoch; 0: at 2/3 of "
        "epochs (DETR: 200 of 300)", ge=0, le=MAX_EPOCHS)
    clip_grad: float = arg(0.1, "clip the global gradient norm to this (0: off; DETR: 0.1)")
    compile: bool = arg(False, "torch.compile the model through Accelerate (inductor); the matcher stays eager")
    # evaluation
    plot_images: int = arg(4, "evaluation images drawn with ground truth and predictions in "
        "plots/detections.png (0: none)", ge=0, le=64)
    best_metric: Literal["map_50", "map", "map_50_11pt"] = arg("map_50", "what best.safetensors follows: mAP@0.5, "
        "COCO's mAP@[.5:.95] (map; the COCO and VOC configs) or VOC07's 11-point mAP@0.5")
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    eval_only: bool = arg(False, "evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in "
        "the dataset's category ids), no training")
    predict: str = arg("", "an image or a folder of images: with --weights, write detections.json and the images with "
        "their boxes drawn (predictions/) in the run folder; no dataset needed")
    predict_score: float = arg(0.5, "predict: detections scoring below this are neither written nor drawn (DETR's 100 "
        "queries each answer, most with a low score)", ge=0, le=1)
    predict_scores: bool = arg(False, "predict: end each row of labels/<image>.txt with its score (Ultralytics' "
        "--save_conf form, for labelling tools); without, rows class cx cy w h, which Ultralytics trains on")
    # run
    eval_every: int = arg(5, "evaluate every this many epochs; also at the end")
    # fmt: on


# ============================================================================================
# Data: DETR's augmentation (multi-scale resize, random size crop) with torchvision v2 and targets as
# DETR's loss wants them, normalised (cx, cy, w, h): recipes/detr_data.py; the datasets are built in main()
# ============================================================================================


# ============================================================================================
# Model: backbone -> projection + sine positions -> transformer -> class and box heads
# (the modules: recipes/detr_model.py; the box-crop pre-training: recipes/detr_pretrain.py)
# ============================================================================================
def create_model(cfg: Config, num_classes: int, backbone: nn.Module | None = None) -> DETR:
    """DETR for ``num_classes`` object classes (no-object is one more), around ``backbone`` (default:
    a new :func:`create_backbone`); ``freeze_at`` and ``frozen_bn`` freeze its first stages and its batch
    norm here, after any pre-training."""
    backbone = create_backbone(cfg) if backbone is None else backbone
    freeze_stages(backbone, cfg.freeze_at)
    if cfg.frozen_bn:
        backbone = timm.layers.freeze_batch_norm_2d(backbone)  # BatchNorm2d -> FrozenBatchNorm2d
    return DETR(
        backbone,
        num_classes,
        num_queries=cfg.num_queries,
        d_model=cfg.d_model,
        nheads=cfg.nheads,
        enc_layers=cfg.enc_layers,
        dec_layers=cfg.dec_layers,
        dim_feedforward=cfg.dim_feedforward,
        dropout=cfg.dropout,
        aux_loss=cfg.aux_loss,
    )


def create_backbone(cfg: Config, notes: list[str] | None = None) -> nn.Module:
    """The timm ``features_only`` backbone giving the one level DETR reads, with the weights that
    ``pretrained`` or ``init_backbone`` name (random otherwise; named in ``notes``)."""
    notes = [] if notes is None else notes
    try:
        backbone = create_timm_model(
            cfg.model,
            features_only=True,
            out_indices=(cfg.out_index,),
            pretrained=cfg.pretrained,
            notes=notes,
            **cfg.model_kwargs,
        )
    except (IndexError, TypeError) as e:
        raise UserError(
            f"model '{cfg.model}' does not take out_index {cfg.out_index} and model_kwargs {cfg.model_kwargs}: {e}"
        ) from None
    if cfg.init_backbone:
        notes.append(load_backbone(backbone, cfg.init_backbone))
    return backbone


# ============================================================================================
# Loss: Hungarian matching, then cross-entropy (no-object down-weighted), L1 and GIoU per layer
# (HungarianMatcher and SetCriterion: recipes/detr_model.py)
# ============================================================================================
def loss_weights(cfg: Config) -> list[float]:
    """The weights of LOSS_TERMS, in their order: the config's by name over the defaults."""
    given = {**LOSS_WEIGHTS, **cfg.loss_weights}
    return [float(given[k.removeprefix("loss_")]) for k in LOSS_TERMS]


def create_criterion(cfg: Config, num_classes: int) -> SetCriterion:
    """The matcher and criterion with this config's costs and weights (auxiliary layers weighted alike)."""
    matcher = HungarianMatcher(*cfg.matcher_costs)
    weights = loss_weights(cfg)
    weight_dict = dict(zip(LOSS_TERMS, weights))
    if cfg.aux_loss:
        weight_dict.update({f"{k}_{i}": w for i in range(cfg.dec_layers - 1) for k, w in zip(LOSS_TERMS, weights)})
    return SetCriterion(num_classes, matcher, weight_dict, cfg.eos_coef, ["labels", "boxes", "cardinality"])


# ============================================================================================
# Evaluation (detect: recipes/detr_model.py)
# ============================================================================================
def evaluate(
    model: nn.Module, eval_loader, evaluator: CocoEvaluator, accelerator
) -> tuple[dict[str, float], EvalDetails]:
    """COCO mAP over the evaluation split, and the pass's details (per-class AP, PR curves, confusion,
    predictions: common/detection/coco_eval.py); boxes go to the evaluator in original-image pixels."""
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
    "out_index",
    "frozen_bn",
    "scales",
    "max_size",
    "d_model",
    "nheads",
    "enc_layers",
    "dec_layers",
    "dim_feedforward",
    "num_queries",
    "aux_loss",
)


# ============================================================================================
# Training
# ============================================================================================
def check_config(cfg: Config) -> None:
    """Values that would fail deep inside the model or the loss, as one clear error before anything is made."""
    names = [k.removeprefix("loss_") for k in LOSS_TERMS]
    if set(cfg.loss_weights) - set(names) or not all(
        isinstance(w, (int, float)) and w >= 0 for w in cfg.loss_weights.values()
    ):
        raise UserError(
            f"loss_weights names non-negative weights of {', '.join(names)} (ce: the class cross-entropy, bbox: L1, "
            f"giou), e.g. --loss_weights '{{ce: 1}}'; got {cfg.loss_weights}"
        )
    if len(cfg.matcher_costs) != 3 or any(w < 0 for w in cfg.matcher_costs):
        raise UserError(f"matcher_costs must be 3 non-negative numbers (class, L1, GIoU), got {cfg.matcher_costs}")
    if not cfg.scales:  # their values, and the other numbers' ranges, were checked while parsing
        raise UserError(f"scales must be one or more positive sizes, got {cfg.scales}")
    if len(cfg.crop_size) != 2 or cfg.crop_size[0] > cfg.crop_size[1] or not cfg.crop_resize:
        raise UserError(
            f"crop_size must be [min, max] with 0 < min <= max and crop_resize not empty, got "
            f"{cfg.crop_size} and {cfg.crop_resize}"
        )
    if cfg.d_model % cfg.nheads or cfg.d_model % 4:
        raise UserError(f"d_model ({cfg.d_model}) must be a multiple of 4 and of nheads ({cfg.nheads})")
    if cfg.init_weights and cfg.init_backbone:
        raise UserError("init_weights and init_backbone both give the backbone's weights: set one of them")


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    check_config(cfg)
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if cfg.predict:  # detections.json and pictures for the images it names (recipes/detr_inference.py)
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
    eval_tf = data_transforms(cfg, False)
    evaluator = CocoEvaluator(data.eval, data.classes, run.interruptible)  # a stop ends COCO's scoring at once
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, cfg.scales[-1])
        eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=detr_collate)
        model, eval_loader = accelerator.prepare(trained_model(cfg, create_model, data)[0], eval_loader)
        metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
        return report_evaluation(run, metrics, details, data, cfg.plot_images, 0, final=True)
    # camera-size JPEGs decoded reduced, as far as the resizes (and the crop branch's) still find their pixels
    sides = max([*cfg.scales, *cfg.crop_resize]), cfg.scales[-1]
    # --cache_images: each image decoded once, at the side its dataset decodes it (common/data/image_cache.py)
    (train_cache, eval_cache), cache_line = image_caches(
        cfg.cache_images, cfg.num_workers, (data.train, "image", sides[0]), (data.eval, "image", sides[1])
    )
    run.note(cache_line)
    train_set = DetectionDataset(data.train, data_transforms(cfg, True), cfg.seed, sides[0], train_cache)
    eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, sides[1], eval_cache)
    eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=detr_collate)
    train_loader = train_loader_for(
        train_set, cfg.batch_size, cfg.seed, cfg.num_workers, accelerator.num_processes, collate_fn=detr_collate
    )

    # ---- model and loss (the backbone pre-trained on the box crops first, unless its weights come from elsewhere) ----
    backbone = create_backbone(cfg, run.notes)
    if cfg.pretrain_crops_epochs > 0:
        reason = (
            "pretrained"
            if cfg.pretrained
            else "init_backbone"
            if cfg.init_backbone
            else "init_weights"
            if cfg.init_weights
            else "resuming (the checkpoint holds the weights)"
            if run.resume_checkpoint()
            else ""
        )
        if reason:
            run.print(f"backbone pre-training on box crops skipped: {reason}")
        elif pretrain_backbone(cfg, backbone, data, run) is None:  # a stop signal: no checkpoint exists yet
            run.print(
                "stopped during the backbone pre-training, before DETR's first checkpoint: "
                "run the same command again to start over"
            )
            run.finish()
            return {}
    model = create_model(cfg, num_classes, backbone)
    if cfg.init_weights:  # the whole detector from a DETR checkpoint (a resumed run's checkpoint overrides it)
        run.note(load_init_weights(model, cfg.init_weights, data.classes, data.category_ids))
    criterion = create_criterion(cfg, num_classes).to(accelerator.device)
    weight_dict = criterion.weight_dict  # the total loss: sum of weight x term (auxiliary layers' terms too)
    model = sync_batchnorm(model, accelerator)  # several GPUs: BN statistics over the global batch

    # ---- optimizer and schedules (AdamW; the backbone at lr_backbone, weight decay on everything) ----
    backbone = [p for p in model.backbone.parameters() if p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    # the group's "lr_scale" is its factor on the scheduled lr (common.schedules.set_group_values): the backbone's
    # peak is lr_backbone carried to the global batch by the same factor as lr
    groups = [
        {"params": rest, "lr_scale": 1.0},
        {"params": backbone, "lr_scale": cfg.lr_backbone / cfg.lr if cfg.lr else 0.0},
    ]
    peak = cfg.peak_lr(accelerator.num_processes)  # lr carried from lr_batch images to the global batch
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(groups, lr=peak, weight_decay=cfg.weight_decay, **fused)
    mark_fsdp_blocks(model)  # FSDP: each repeated block its own shard unit (configs/accelerate/fsdp.yaml)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if units := fsdp_units(model):  # FSDP: the root and the blocks marked above
        run.print(f"fsdp: {units} modules sharded (fully_shard units, the root included)")

    def lay_out(length: Length) -> dict[str, np.ndarray]:
        """DETR's learning rate per step over the run's length: constant, x0.1 after lr_drop_epochs (here with an
        optional linear warmup from 0)."""
        drop = length.at(cfg.lr_drop_epochs or math.ceil(2 * cfg.epochs / 3))
        return {"lr": schedule("step", peak, 0.0, length.steps, length.at(cfg.warmup_epochs), 0.0, [drop], 0.1)}

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, lay_out, len(eval_set), data.classes, train_set.replaced)
    set_seed(cfg.seed, device_specific=True)  # from here each process draws its own random numbers (dropout)
    loop.resume()  # model, optimizer, EMA, ... and the generators from --resume's checkpoint: where it stopped
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()
        for images, mask, targets in loop.batches():
            lr = loop.value("lr")
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

            loop.record(  # meters and the non-finite guard, on the device
                loss,
                losses,
                len(images),
                boxes=sum(len(t["boxes"]) for t in targets),  # shapes: no device sync
                dropped_boxes=sum(t["dropped"] for t in targets),
            )
            if not accelerator.sync_gradients:  # still accumulating gradients
                continue
            loop.end_step()
            if loop.log_due():
                loop.log_train(lr=lr)
            if loop.stop_requested():  # SIGTERM/SIGINT/SIGUSR1 on any process: checkpoint, then end the run
                loop.save_checkpoint()
                return loop.stop(results)
            if loop.checkpoint_due():
                loop.save_checkpoint()

        # ---- evaluation and best weights ---------------------------------------------------------
        if loop.eval_due():
            with loop.evaluation():  # a loss gone non-finite stops the run here; a stop signal: a checkpoint
                metrics, details = evaluate(model, run.progress(eval_loader, "eval"), evaluator, accelerator)
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
                weights = accelerator.get_state_dict(model) if improved else None  # a collective under FSDP
                if improved and accelerator.is_main_process:
                    save_weights(weights, run.dir / "best.safetensors", cfg, **saved_as)
        if loop.checkpoint_due():  # every checkpoint_every steps, and after the last epoch
            loop.save_checkpoint()

    # ---- saving -----------------------------------------------------------------------------------
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:  # the last weights; what leaves the project: the best (evaluated) ones
        save_weights(weights, run.dir / "final.safetensors", cfg, **saved_as)
        sizes = (len(train_set), len(eval_set))
        # a step that fails is one line after the summary with the command that redoes it; the next still runs
        with run.guarded("model folder"):  # <run>/model, what --push_to_hub uploads at the run's finish
            write_model_folder(run, cfg, data.classes, sizes, loop.best_for_card(cfg.best_metric))
    if cfg.export and accelerator.is_main_process:
        with run.guarded("export", run.export_command(kept_weights(run.dir))):
            kept, meta = trained_model(dataclasses.replace(cfg, weights=str(kept_weights(run.dir))), create_model)
            write = lambda folder: export_files(kept, cfg, meta, folder, run.recipe)  # noqa: E731
            results.update(export(run, write, loop.step))
    if details is not None:  # the last evaluation's AP per class: one line, the table in a file
        run.print(ap_per_class_line(details, run.plots_dir))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
