"""Faster R-CNN: a two-stage detector from torchvision's building blocks, on HuggingFace Accelerate.

Stage one, the region proposal network (RPN), slides a small convolution over every level of a
feature pyramid (FPN on a timm ``features_only`` backbone, or torchvision's resnet50-FPN /
mobilenet-v3-FPN presets) and scores a few anchors per position for "object or not" and a box
correction. The best proposals after NMS go to stage two: RoIAlign cuts a fixed-size feature patch
per proposal from the pyramid level that suits its size, and a small MLP head classifies it into
background + C classes and refines its box per class. Four losses, each logged and weighted by
``loss_weights``: RPN objectness (BCE), RPN box regression (smooth L1), RoI classification (CE),
RoI box regression (smooth L1). torchvision does the anchor matching, sampling and box coding;
recipes/faster_rcnn_model.py wires the blocks (and holds ``detect``), this file trains them. The
transforms, the list collate and the aspect-ratio batch sampler are in recipes/faster_rcnn_data.py;
loading a trained model back, prediction, export and the model folder in recipes/faster_rcnn_inference.py.

Training as torchvision's and seamseg's references train it: SGD with momentum and weight decay
(none on biases and norms), linear warmup, then step drops at epoch milestones or poly decay, per
step; batches grouped by aspect ratio (torchvision's 8 groups); training images without boxes left
out; optional frozen early backbone stages and frozen batch norm; fp16/bf16 and gradient clipping
through Accelerate. Evaluation is COCO mAP (common/detection/coco_eval.py); the best weights by mAP@0.5 are
kept.

Launch (defaults = the built-in ``digits_det`` scenes, a thin resnet10t from scratch at 96 px):

    accelerate launch recipes/faster_rcnn.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/faster_rcnn.py \\
        --config configs/faster_rcnn/coco_r50_fpn_26ep.yaml

Expected (defaults, measured): mAP@0.5 0.941 (mAP 0.675) on the 400 held-out scenes after 2 epochs,
about 2 minutes wall on one CPU core; the README's recipe table has the details.
"""

from __future__ import annotations

import dataclasses
import sys
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

import numpy as np
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
from common.detection.masks import has_masks, objects_with_masks
from common.detection.outputs import ap_per_class_line, report_evaluation
from common.loaders import eval_loader_for, loader_kwargs
from common.loop import Loop
from common.models import average_bn_statistics, fsdp_units, mark_fsdp_blocks, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups
from common.weights import config_with_weights, kept_weights, save_weights, weights_metadata

with own_files("faster_rcnn_"):  # its own files, beside this one: python -m common.vendor copies them with it
    from faster_rcnn_data import AspectRatioBatchSampler, data_transforms, has_boxes, list_collate  # its data helpers
    from faster_rcnn_inference import export_files, predict, trained_model, write_model_folder  # what a run ships
    from faster_rcnn_model import LOSS_NAMES, PRESET_STAGES, PRESETS, create_model, detect  # its model, detections

# the loss terms' default weights, by the names loss_weights takes (LOSS_NAMES without "loss_")
LOSS_WEIGHTS = {name.removeprefix("loss_"): 1.0 for name in LOSS_NAMES.values()}


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
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must not be mirrored",
        ge=0, le=1)
    color_jitter: bool = arg(False, "torchvision's photometric distortion (SSD), p = 0.5")
    num_workers: int = arg(-1, "DataLoader worker processes per training process; -1: the cores available per process, "
        "at most 8 (common.loaders.auto_workers); 0: load in the main process")
    aspect_ratio_group_factor: int = arg(3, "k: batches of one aspect-ratio group, width / height cut at 2 ** "
        "linspace(-1, 1, 2k + 1) into 2k + 2 groups (torchvision's --aspect-ratio-group-factor; 3: 8 groups); 0: "
        "landscape or portrait; -1: no grouping", ge=-1, le=16)
    keep_empty: bool = arg(False, "keep training images without boxes as negatives; false drops them, as torchvision's "
        "reference does: no box, or only boxes at most 1 px wide or high, or only crowd regions (never targets)")
    # model: backbone -> FPN -> RPN -> RoIAlign -> box head
    model: str = arg("resnet10t", "a timm model (features_only), or a torchvision preset (PRESETS)")
    model_kwargs: dict = arg({"channels": [32, 64, 128, 256], "stem_width": 16}, "extra timm.create_model arguments; "
        "the demo: resnet10t at half width")
    pretrained: bool = arg(False, "timm: ImageNet backbone; presets: COCO weights (both need network)")
    pretrained_backbone: bool = arg(False, "presets only: ImageNet backbone weights")
    init_backbone: str = arg("", "timm models: safetensors of the same timm model (classifier.py's best.safetensors, "
        "DINO's teacher_backbone.safetensors) for the backbone; the FPN, RPN and box head stay new")
    out_indices: list[int] = arg([1, 2, 3], "timm feature levels (1 = stride 4)", ge=0, le=8)
    fpn_channels: int = arg(48, "FPN width at every level (torchvision: 256)", ge=1, le=MAX_COUNT)
    extra_pool: bool = arg(False, "one more FPN level by max-pooling the coarsest (torchvision's \"pool\")")
    anchor_sizes: list[list[float]] = arg([[12, 18], [24, 36], [48, 72]], "px, per FPN level, as many "
        "at each; empty: they follow the model: a timm backbone's 8 x each level's stride, a preset's own scaled by "
        "the last min_size over the side they are sized for (800 px; the 320 preset's 320)", gt=0)
    aspect_ratios: list[float] = arg([1.0, 2.0], "height / width, at every level", gt=0)
    min_size: list[int] = arg([96], "shorter side, px; several: one drawn per training image, eval at the last",
        ge=1, le=MAX_SIDE)
    max_size: int = arg(96, "longer side at most, px", ge=1, le=MAX_SIDE)
    rpn_pre_nms_top_n: list[int] = arg([], "proposals per level before NMS, [train, eval]; empty: the model's own: a "
        "preset's torchvision values (2000, 1000), a timm backbone's 200, 200 (the demo's)", ge=1, le=MAX_COUNT)
    rpn_post_nms_top_n: list[int] = arg([], "proposals per image after NMS, [train, eval]; empty: the model's own: a "
        "preset's torchvision values (2000, 1000; the 320 preset evaluates with 150), a timm "
        "backbone's 100, 100 (the demo's)", ge=1, le=MAX_COUNT)
    rpn_batch_size_per_image: int = arg(0, "anchors sampled per image for the RPN losses; 0: the model's own: a "
        "preset's torchvision value (256), a timm backbone's 128 (the demo's)", ge=0, le=MAX_COUNT)
    roi_size: int = arg(7, "RoIAlign output side, cells (timm backbones; the presets keep torchvision's 7)",
        ge=1, le=64)
    roi_sampling_ratio: int = arg(1, "bilinear samples per cell side (timm backbones; the presets keep torchvision's "
        "2; the CPU backward is slow)", ge=1, le=64)
    box_head_dim: int = arg(256, "the two-layer MLP head's width (timm backbones; the presets keep torchvision's 1024)",
        ge=1, le=MAX_COUNT)
    box_batch_size_per_image: int = arg(0, "proposals sampled per image for the RoI losses; 0: the model's own: a "
        "preset's torchvision value (512), a timm backbone's 32 (the demo's)", ge=0, le=MAX_COUNT)
    box_score_thresh: float = arg(0.05, "detections scoring below this are dropped (torchvision: 0.05)", ge=0, le=1)
    box_nms_thresh: float = arg(0.5, "per-class NMS IoU of the final detections (torchvision: 0.5)", ge=0, le=1)
    box_detections_per_img: int = arg(100, "detections kept per image (torchvision: 100)", ge=1, le=MAX_COUNT)
    freeze_at: int = arg(0, "frozen backbone stages, stem counted as 1 (Detectron2 convention; COCO: 2)", ge=0, le=8)
    frozen_bn: bool = arg(False, "backbone batch norm as fixed affine layers (with pretrained weights)")
    masks: bool = arg(False, "instance segmentation: Mask R-CNN's mask head on the same RoIs (needs data with masks: "
        "COCO polygons or RLE, Ultralytics segment labels, VOC SegmentationObject PNGs); mask mAP beside box mAP")
    mask_head_dim: int = arg(64, "the mask head's four convolutions' width (timm backbones; torchvision: 256, which "
        "the presets keep)", ge=1, le=MAX_COUNT)
    loss_weights: dict = arg(dict(LOSS_WEIGHTS), "each loss term's weight in the total, by name (those not given: "
        "1; mask only with --masks), e.g. --loss_weights '{mask: 2}'")
    # optimization
    epochs: int = arg(2, "training epochs")
    batch_size: int = arg(8, "images per process and micro-step: global batch = this x processes x grad_accum_steps")
    lr: float = arg(0.02, "peak SGD learning rate for a global batch of lr_batch images, carried to the run's global "
        "batch by lr_scale (torchvision: 0.02 for 16 images; here for 8: more steps in 2 epochs did better)")
    lr_batch: int = arg(8, "the global batch lr is written for (the demo's: batch_size 8, 1 process)")
    lr_scale: Literal["linear", "sqrt"] = arg("linear", "linear: peak = lr x global batch / lr_batch, torchvision's "
        "rule for SGD; sqrt: x the square root of that ratio")
    momentum: float = arg(0.9, "SGD momentum (torchvision: 0.9)", ge=0, lt=1)
    weight_decay: float = arg(1e-4, "biases and norms get none (torchvision: 1e-4)")
    warmup_epochs: float = arg(0.5, "linear warmup from the peak x warmup_factor, epochs (fractions allowed)")
    warmup_factor: float = arg(0.001, "the warmup starts at the peak x this", ge=0, le=1)
    sched: Literal["poly", "step"] = arg("poly", "poly (seamseg; to 0 at the end) or step (drops at decay_milestones)")
    decay_milestones: list[int] = arg([], "epochs, for sched=step", ge=0, le=MAX_EPOCHS)
    decay_rate: float = arg(0.1, "factor on the learning rate at each of decay_milestones (sched=step)", ge=0, le=1)
    poly_power: float = arg(0.9, "lr = peak x (1 - progress) ** this after warmup, for sched=poly (seamseg: 0.9)", ge=0)
    clip_grad: float = arg(10.0, "clip the global gradient norm to this (0: off)")
    compile: bool = arg(False, "torch.compile the whole model through Accelerate (inductor); graph "
        "breaks at NMS and sampling")
    # evaluation
    plot_images: int = arg(4, "evaluation images drawn with ground truth and predictions in "
        "plots/detections.png (0: none)", ge=0, le=64)
    best_metric: Literal["map_50", "map", "map_50_11pt", "mask_map_50", "mask_map"] = arg("map_50", "what "
        "best.safetensors follows: mAP@0.5, COCO's mAP@[.5:.95] (map; the COCO and VOC configs), VOC07's 11-point "
        "mAP@0.5, or with --masks the masks' mAP@0.5 or mAP@[.5:.95]")
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    eval_only: bool = arg(False, "evaluate --weights on the evaluation split (COCO mAP, pictures, predictions.json in "
        "the dataset's category ids), no training")
    predict: str = arg("", "an image or a folder of images: with --weights, write detections.json and the images with "
        "their boxes drawn (predictions/) in the run folder; no dataset needed")
    predict_score: float = arg(0.3, "predict: detections scoring below this are neither written nor drawn", ge=0, le=1)
    predict_scores: bool = arg(False, "predict: end each row of labels/<image>.txt with its score (Ultralytics' "
        "--save_conf form, for labelling tools); without, rows class cx cy w h, which Ultralytics trains on")
    predict_mask_pngs: bool = arg(False, "predict, with masks: each image's masks also as one PNG under masks/ (pixel "
        "value = the detection's number in detections.json, from 1; 0: none)")
    # run
    eval_every: int = arg(2, "evaluate every this many epochs; also at the end")
    # fmt: on


# ============================================================================================
# Evaluation and saving
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


def mask_line(data: Any, masks: bool, name: str) -> str:
    """The banner line about masks: with ``masks``, how many objects of each split have one (an object without one
    learns its box as its mask); the error where a split has none; without, a hint where the data has them."""
    if not masks and not (has_masks(data.train) or has_masks(data.eval)):  # box-only data: nothing to count
        return ""
    counts = {split: objects_with_masks(getattr(data, split)) for split in ("train", "eval")}
    if not masks:
        have = sum(n for n, _ in counts.values())
        return f"  masks     '{name}' has {have:,} object masks; --masks true segments them" if have else ""
    for split, (n, total) in counts.items():
        if n == 0:
            raise UserError(
                f"--masks true: the {'training' if split == 'train' else 'evaluation'} split of '{name}' has no "
                f"object masks ({total:,} objects, boxes only); masks come from COCO polygons or RLE, Ultralytics "
                "segment labels or VOC SegmentationObject PNGs (docs/data.md)"
            )
    shown = ", ".join(f"{split} {n:,} of {total:,}" for split, (n, total) in counts.items())
    missing = any(n < total for n, total in counts.values())
    return f"  masks     {shown} objects{' (the others learn their box as their mask)' * missing}"


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
    "masks",
    "mask_head_dim",
)


# ============================================================================================
# Training
# ============================================================================================
def check_config(cfg: Config) -> None:
    """Values that would fail deep inside torchvision, as one clear error before anything is made
    (the anchors are checked against the backbone's levels in faster_rcnn_model.timm_model)."""
    if cfg.init_backbone and cfg.model in PRESETS:
        raise UserError(
            f"init_backbone takes a timm model's weights; '{cfg.model}' is a torchvision preset "
            "(its backbone weights: --pretrained_backbone)"
        )
    unknown = set(cfg.loss_weights) - set(LOSS_WEIGHTS)
    if unknown or not all(isinstance(w, (int, float)) and w >= 0 for w in cfg.loss_weights.values()):
        raise UserError(
            f"loss_weights names non-negative weights of {', '.join(LOSS_WEIGHTS)} (those not given: 1), e.g. "
            f"--loss_weights '{{mask: 2}}'; got {cfg.loss_weights}"
        )
    if cfg.model.startswith("maskrcnn") and not cfg.masks:
        raise UserError(f"{cfg.model} segments: train it with --masks true (fasterrcnn_* for boxes alone)")
    if cfg.best_metric.startswith("mask") and not cfg.masks:
        raise UserError(f"best_metric {cfg.best_metric} is the masks' mAP: it needs --masks true")
    # each number's own range was checked while parsing: here, how they go together
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
    if cfg.predict:  # detections.json and pictures for the images it names (recipes/faster_rcnn_inference.py)
        return predict(cfg, run)
    if cfg.export and cfg.weights and not cfg.eval_only:  # --export --weights W: W's export, no data read
        model, meta = trained_model(cfg)
        return export(run, lambda folder: export_files(model, cfg, meta, folder, run.recipe))

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():
        data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    run.note(*data.notes)  # how the folder was read, where it says (a VOC folder's turned photos)
    run.note(mask_line(data, cfg.masks, cfg.data))  # --masks on data with masks, or why not
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
    # camera-size JPEGs decoded reduced, as far as the model's resize to min_size still finds its pixels
    side, eval_tf = max(cfg.min_size), data_transforms(False, 0.0, False)
    # box mAP, and with --masks mask mAP too; a stop ends COCO's scoring at once
    evaluator = CocoEvaluator(data.eval, data.classes, run.interruptible, masks=cfg.masks)
    if cfg.eval_only:  # the saved weights on the evaluation split: metrics, pictures, predictions.json
        eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, side, masks=cfg.masks)
        eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=list_collate)
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
    # --cache_images: each image decoded once, at that side (common/data/image_cache.py)
    (train_cache, eval_cache), cache_line = image_caches(
        cfg.cache_images, cfg.num_workers, (data.train, "image", side), (data.eval, "image", side)
    )
    run.note(cache_line)
    train_tf = data_transforms(True, cfg.hflip, cfg.color_jitter)
    train_set = DetectionDataset(data.train, train_tf, cfg.seed, side, train_cache, masks=cfg.masks)
    eval_set = DetectionDataset(data.eval, eval_tf, cfg.seed, side, eval_cache, masks=cfg.masks)
    eval_loader = eval_loader_for(eval_set, cfg.batch_size, cfg.num_workers, collate_fn=list_collate)
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
    weight_dict = {f"loss_{k}": v for k, v in {**LOSS_WEIGHTS, **cfg.loss_weights}.items()}  # sum of weight x term

    # ---- optimizer and schedules (SGD; no weight decay on biases and norms) ----------------------
    groups = weight_decay_groups(model, cfg.weight_decay)  # frozen stages stay out
    peak = cfg.peak_lr(accelerator.num_processes)  # lr carried from lr_batch images to the global batch
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    optimizer = torch.optim.SGD(groups, lr=peak, momentum=cfg.momentum, **fused)
    mark_fsdp_blocks(model)  # FSDP: each repeated block its own shard unit (configs/accelerate/fsdp.yaml)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if units := fsdp_units(model):  # FSDP: the root and the blocks marked above
        run.print(f"fsdp: {units} modules sharded (fully_shard units, the root included)")

    def lay_out(length: Length) -> dict[str, np.ndarray]:
        """The learning rate per step over the run's length: poly decays to 0 at the last step (seamseg); step
        drops by decay_rate at each milestone epoch."""
        milestones = [length.at(m) for m in cfg.decay_milestones]
        start, warmup = peak * cfg.warmup_factor, length.at(cfg.warmup_epochs)
        lr = schedule(cfg.sched, peak, 0.0, length.steps, warmup, start, milestones, cfg.decay_rate, cfg.poly_power)
        return {"lr": lr}

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, lay_out, len(eval_set), data.classes, train_set.replaced)
    set_seed(cfg.seed, device_specific=True)  # from here each process draws its own random numbers (dropout)
    loop.resume()  # model, optimizer, EMA, ... and the generators from --resume's checkpoint: where it stopped
    meters, results, details = loop.meters, {}, None
    for epoch in loop.epochs():
        model.train()
        for images, targets in loop.batches():
            lr = loop.value("lr")
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    losses = model(images, targets)  # the four terms (five with masks), each a mean
                loss = sum(losses[k] * weight_dict[k] for k in losses)
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
            kept, meta = trained_model(dataclasses.replace(cfg, weights=str(kept_weights(run.dir))))
            write = lambda folder: export_files(kept, cfg, meta, folder, run.recipe, eval_set[0][0])  # noqa: E731
            results.update(export(run, write, loop.step))
    if details is not None:  # the last evaluation's AP per class: one line, the table in a file
        run.print(ap_per_class_line(details, run.plots_dir))
    loop.finish(results, [run.dir / "best.safetensors", run.dir / "final.safetensors"])  # the summary
    return results


if __name__ == "__main__":
    cli_main(main)
