"""Image classification with any timm model, on HuggingFace Accelerate.

Trains ``timm.create_model(cfg.model)`` with timm's transforms, Mixup/CutMix, label smoothing and
optimizer factory (no weight decay on biases and norms), per-step warmup + cosine learning rate,
gradient clipping and accumulation, optional model EMA, and reports top-1/top-5 gathered exactly
across processes. The best weights (raw or EMA, by top-1) are saved as safetensors that
``timm.create_model(cfg.model, num_classes=K, checkpoint_path=".../best.safetensors")`` loads.

Launch (defaults = the built-in digits demo):

    accelerate launch recipes/classifier.py
    accelerate launch recipes/classifier.py --config configs/classifier/cifar10_resnet50.yaml
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 recipes/classifier.py   # 2 CPU processes

Expected: the default run (resnet18 at 32 px, 12 epochs) reaches about 98-99 % top-1 on the
360 held-out digits in about 2 minutes on 2 CPU cores; see the README for measured figures.
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
import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup
from timm.optim import create_optimizer_v2

from common import UserError
from common.artifacts.export import export
from common.artifacts.figures import per_class_line, plot_confusion_matrix, save_table_csv
from common.budget import Length
from common.config import MAX_COUNT, MAX_EPOCHS, MAX_SIDE, RunConfig, arg, timm_optimizers
from common.console import cli_main, own_files
from common.data.classification import ClassificationDataset, load_classification, with_label_fraction
from common.data.image_cache import image_caches
from common.data.images import needed_side
from common.data.scan import without_unreadable
from common.ema import ModelEma
from common.loaders import eval_loader_for, train_loader_for
from common.loop import Loop
from common.models import average_bn_statistics, create_timm_model, fsdp_units, mark_fsdp_blocks, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values
from common.trackers import log_table
from common.weights import (
    config_with_weights,
    kept_weights,
    load_backbone,
    read_metadata,
    save_weights,
    weights_metadata,
)

with own_files("classifier_"):  # its own files, beside this one: python -m common.vendor copies them with it
    from classifier_inference import MODEL_FIELDS, export_files, predict, trained_model, write_model_folder
    from classifier_model import (
        BlockProbe,
        create_criterion,
        create_transforms,
        data_config,
    )  # DINO's probe head, timm's transforms


# ============================================================================================
# Config (defaults: the built-in digits demo)
# ============================================================================================
@dataclass
class Config(RunConfig):
    # fmt: off
    # data
    data: str = arg("digits", "built-in name, local folder (imagefolder / saved dataset) or hub name")
    train_fraction: float = arg(1.0, "a seeded fraction of the training images, stratified by class (the rest unused)",
        gt=0, le=1, note="1 trains on every image")
    image_column: str = arg("", "the column holding the images; empty: detected (the first Image column)")
    label_column: str = arg("", "the column holding the class labels; empty: detected (a ClassLabel, or label)")
    img_size: int = arg(32, "training and evaluation resolution (pixels)", ge=8, le=MAX_SIDE)
    crop_pct: float = arg(1.0, "eval: resize to img_size / crop_pct, then centre crop (ImageNet: 0.875 for convnets)",
        gt=0, le=1)
    scale: list[float] = arg([0.6, 1.0], "RandomResizedCrop area range (timm: 0.08, 1)", gt=0, le=1)
    ratio: list[float] = arg([0.75, 1.3333], "RandomResizedCrop aspect range, w / h", gt=0)
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must not be mirrored",
        ge=0, le=1)
    color_jitter: float = arg(0.0, "brightness, contrast and saturation jitter strength (0: off; timm turns "
        "it off under auto_augment)", ge=0)
    auto_augment: str = arg("", "timm AutoAugment / RandAugment policy, e.g. rand-m9-mstd0.5-inc1 (empty: off)")
    reprob: float = arg(0.0, "random erasing probability (0: off; DeiT: 0.25)", ge=0, le=1)
    remode: Literal["pixel", "rand", "const"] = arg("pixel", "random erasing fill: per-pixel normal noise (timm and "
        "DeiT's default), one random colour per box, or zeros")
    recount: int = arg(1, "random erasing boxes per image", ge=1, le=256)
    interpolation: Literal["bicubic", "bilinear", "nearest", "lanczos", "box", "hamming"] = arg("bicubic",
        "resampling filter of the training crop and the evaluation resize")
    mean: list[float] = arg([], "input normalisation per RGB channel (0..1 pixels), with std; empty: what "
        "--init_backbone was trained with (DINO's backbones: ImageNet's), else the timm model's default")
    std: list[float] = arg([], "input normalisation standard deviation per RGB channel; see mean", gt=0)
    aug_repeats: int = arg(1, "repeated augmentation (DeiT: 3): each image this many times per epoch, differently "
        "augmented, on different processes; the epoch keeps its length (1: off)", ge=1, le=256)
    mixup: float = arg(0.0, "Mixup alpha (0: off; DeiT: 0.8); Mixup and CutMix need an even batch_size", ge=0)
    cutmix: float = arg(0.0, "CutMix alpha (0: off; DeiT: 1.0)", ge=0)
    mixup_prob: float = arg(1.0, "probability that a batch is mixed at all (when mixup or cutmix is on)", ge=0, le=1)
    mixup_switch_prob: float = arg(0.5, "probability of CutMix rather than Mixup for a batch when both are on",
        ge=0, le=1)
    smoothing: float = arg(0.1, "label smoothing: the target's weight spread over the other classes (0: off)",
        ge=0, lt=1)
    bce_loss: bool = arg(False, "binary cross-entropy per class (timm's BinaryCrossEntropy; ResNet strikes back, DeiT "
        "III) instead of softmax cross-entropy; Mixup/CutMix and smoothing targets as with cross-entropy")
    bce_target_thresh: float = arg(0.0, ">0: BCE targets binarised at this threshold (timm's --bce-target-thresh)",
        ge=0, le=1)
    # model
    model: str = arg("resnet18", "any timm model name (timm.list_models())")
    model_kwargs: dict = arg({}, "extra timm.create_model arguments, e.g. {depth: 4}")
    pretrained: bool = arg(False, "timm's hub weights (needs network)")
    init_backbone: str = arg("", "safetensors of the same timm model to start from (a DINO teacher backbone, another "
        "classifier's weights); the head starts new where the file has none or one of another size")
    linear_probe: bool = arg(False, "train only the classifier head; the backbone stays frozen, in eval mode")
    probe_blocks: int = arg(0, "with linear_probe on a ViT, DINO's linear evaluation: the head reads the [CLS] tokens "
        "of the last this many blocks, concatenated (DINO: 4 for ViT-S/16, 1 with "
        "probe_avgpool for ViT-B); 0: pooled", ge=0, le=1024)
    probe_avgpool: bool = arg(False, "with probe_blocks: also the last block's mean patch token (avgpool_patchtokens)")
    drop_rate: float = arg(0.0, "dropout before the classifier head", ge=0, lt=1)
    drop_path_rate: float = arg(0.0, "stochastic depth rate (DeiT-S: 0.1; 0 for small convnets)", ge=0, lt=1)
    bn_momentum: float = arg(0.0, "0: the model's default (PyTorch convention: weight of the new batch)", ge=0, le=1)
    bn_momentum_end: float = arg(0.0, ">0: anneal bn_momentum to this by epochs (cosine)", ge=0, le=1)
    channels_last: bool = arg(False, "channels_last memory format: faster convnets on GPUs with tensor cores")
    sync_bn: bool = arg(False, "several CUDA processes: batch-norm statistics over the global batch (SyncBatchNorm); "
        "otherwise each process's running statistics are averaged over the processes before every evaluation")
    # optimization
    epochs: int = arg(12, "training epochs")
    batch_size: int = arg(64, "images per process and micro-step: global batch = this x processes x grad_accum_steps")
    eval_batch_size: int = arg(0, "evaluation images per process; 0: batch_size (the shapes training compiled)",
        ge=0, le=MAX_COUNT)
    grad_accum_switch_epoch: int = arg(0, ">0: from this epoch on, accumulate grad_accum_steps_after_switch",
        ge=0, le=MAX_EPOCHS)
    grad_accum_steps_after_switch: int = arg(0, "grad_accum_steps from grad_accum_switch_epoch on (0: no switch)",
        ge=0, le=MAX_COUNT)
    opt: str = arg("adamw", "any timm optimizer name: sgd, adamw, lamb, lars, ... (biases and "
        "norms get no weight decay)", choices=timm_optimizers)
    lr: float = arg(8e-3, "peak learning rate per lr_batch images: the run peaks at lr x global batch / lr_batch "
        "(global batch = batch_size x processes x grad_accum_steps), so it follows the number of GPUs; see lr_scale")
    lr_batch: int = arg(256, "the global batch lr is written for (timm's and DeiT's 256)")
    lr_scale: Literal["linear", "sqrt"] = arg("linear", "how the peak follows the global batch: linear (Goyal et al., "
        "DeiT, DINO) or sqrt, lr x sqrt(global batch / lr_batch), which timm's train.py uses for adam*/lamb: port a "
        "timm --lr-base for those optimizers with sqrt")
    min_lr: float = arg(1e-5, "learning rate at the end of the cosine, linear and poly schedules (not scaled)", ge=0)
    warmup_lr: float = arg(1e-5, "learning rate at step 0, rising linearly to the peak over warmup_epochs (not scaled)",
        ge=0)
    warmup_epochs: float = arg(2.0, "linear warmup length in epochs (fractions allowed)")
    sched: Literal["cosine", "linear", "step", "poly", "constant"] = arg("cosine", "learning rate after warmup: to "
        "min_lr (cosine, linear; poly = linear here), x decay_rate at decay_milestones (step), or constant")
    decay_milestones: list[int] = arg([], "epochs, for sched=step", ge=0, le=MAX_EPOCHS)
    decay_rate: float = arg(0.1, "factor on the learning rate at each of decay_milestones (sched=step)", ge=0, le=1)
    weight_decay: float = arg(0.05, "decoupled for AdamW, L2 for SGD; biases and norms get none")
    momentum: float = arg(0.9, "SGD momentum (and the other timm optimizers that take one)", ge=0, lt=1)
    layer_decay: float = arg(0.0, ">0: timm layer-wise lr decay (ViT fine-tuning)", ge=0, le=1)
    clip_grad: float = arg(0.0, ">0: clip the global gradient norm to this")
    ema_decay: float = arg(0.0, ">0: keep a model EMA and evaluate it too (e.g. 0.9998)", ge=0, lt=1)
    ema_warmup: bool = arg(True, "the EMA decay ramps as min(ema_decay, (1 + step) / (10 + "
        "step)), so the init fades fast")
    # run
    checkpoint_every: int = arg(200, "save a checkpoint every this many optimizer steps; also at the end")
    # evaluation and prediction with saved weights (the model fields default to the file's saved config)
    eval_only: bool = arg(False, "evaluate --weights on the evaluation split (top-1/top-5, "
        "per-class accuracy), no training")
    predict: str = arg("", "an image or a folder of images: with --weights, write predictions.csv (top-5 class names "
        "and probabilities per image); no dataset needed")
    # fmt: on


# ============================================================================================
# Model: any timm classifier, or DINO's probe on a ViT's blocks (recipes/classifier_model.py)
# ============================================================================================
def create_model(cfg: Config, num_classes: int, notes: list[str] | None = None) -> torch.nn.Module:
    """The run's timm model; the weights it starts from (pretrained, init_backbone) are named in ``notes``."""
    notes = [] if notes is None else notes
    if cfg.probe_blocks > 0 and not cfg.linear_probe:
        raise UserError("probe_blocks is DINO's linear evaluation: it needs --linear_probe")
    if cfg.probe_blocks > 0 and cfg.push_to_hub:  # checked before training: the push would find no folder
        raise UserError("a probe on blocks is not a timm model and writes no model folder: drop --push_to_hub")
    # transformers build their position embeddings for img_size; convnets take no such argument
    model = create_timm_model(
        cfg.model,
        {"img_size": cfg.img_size},
        pretrained=cfg.pretrained,
        num_classes=0 if cfg.probe_blocks else num_classes,
        drop_rate=cfg.drop_rate,
        drop_path_rate=cfg.drop_path_rate,
        notes=notes,
        **cfg.model_kwargs,
    )
    if cfg.init_backbone:  # timm's checkpoint filter first; the head starts new (common/weights.py)
        notes.append(load_backbone(model, cfg.init_backbone))
    if cfg.probe_blocks > 0:
        model = BlockProbe(model, cfg.probe_blocks, cfg.probe_avgpool, num_classes)
    if cfg.bn_momentum > 0:
        set_bn_momentum(model, cfg.bn_momentum)
    if cfg.linear_probe:  # timm's optimizer factory leaves parameters without gradients out
        model.requires_grad_(False)
        model.get_classifier().requires_grad_(True)
    return model


def input_normalization(cfg: Config) -> tuple[Config, str]:
    """``cfg`` with ``mean`` / ``std`` set to the normalisation ``init_backbone`` was trained with (its
    metadata) where the config leaves them empty, and a line for the console: the normalisation taken
    from the file, or a warning that an explicit one differs from it ('' when there is nothing to say).
    A backbone fed inputs normalised for another model sees them scaled and shifted: a DINO ViT trained
    on ImageNet's statistics, probed with timm's ViT default (0.5, 0.5), gets about half its input range."""
    if len(cfg.mean) != len(cfg.std) or len(cfg.mean) not in (0, 3):  # their values: their fields' ranges
        raise UserError(f"mean and std are 3 values each (R, G, B), or both empty: got mean {cfg.mean}, std {cfg.std}")
    if not cfg.init_backbone or not Path(cfg.init_backbone).is_file():
        return cfg, ""
    meta = read_metadata(cfg.init_backbone)
    mean, std = meta["mean"], meta["std"]
    if mean is None and meta["recipe"] == "dino":  # a file saved before files recorded it: dino.py uses ImageNet's
        mean, std = list(IMAGENET_DEFAULT_MEAN), list(IMAGENET_DEFAULT_STD)
    if mean is None or std is None:
        return cfg, ""
    text = f"mean {_rounded(mean)}, std {_rounded(std)}"
    if not cfg.mean:
        return dataclasses.replace(cfg, mean=mean, std=std), f"inputs normalised as init_backbone was trained: {text}"
    if _rounded(cfg.mean) != _rounded(mean) or _rounded(cfg.std) != _rounded(std):
        return cfg, (
            f"warning: init_backbone '{cfg.init_backbone}' was trained on inputs normalised with {text}; "
            f"this run uses mean {_rounded(cfg.mean)}, std {_rounded(cfg.std)} as --mean/--std say"
        )
    return cfg, ""


def _rounded(values: list[float]) -> list[float]:
    return [round(float(v), 4) for v in values]


def set_bn_momentum(model: torch.nn.Module, momentum: float) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.momentum = momentum


# ============================================================================================
# Evaluation: top-1 / top-5 and the confusion matrix, exact across processes and uneven last batches
# ============================================================================================
@torch.no_grad()
def evaluate(
    model: torch.nn.Module, eval_loader, accelerator, num_classes: int, channels_last: bool
) -> tuple[dict[str, float], torch.Tensor]:
    """Top-1 / top-5 accuracy (%; top-5 with more than 5 classes) and mean loss, and the confusion matrix
    [true, predicted] (counts, CPU)."""
    model.eval()
    k = min(5, num_classes)
    hits, losses = [], []
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.long, device=accelerator.device)
    for images, targets in eval_loader:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with accelerator.autocast():
            logits = model(images)
        loss = F.cross_entropy(logits.float(), targets, reduction="none")
        topk = logits.topk(k, dim=1).indices
        # gather_for_metrics drops the samples Accelerate duplicated to even out the last batch.
        topk, targets, loss = accelerator.gather_for_metrics((topk, targets, loss))
        match = topk == targets[:, None]  # [B, k]
        hits.append(torch.stack([match[:, 0], match.any(dim=1)], dim=1).float())
        losses.append(loss)
        confusion += torch.bincount(targets * num_classes + topk[:, 0], minlength=num_classes * num_classes)
    acc1, acc5 = (torch.cat(hits).mean(dim=0) * 100).tolist()
    metrics = {"top1": acc1, "top5": acc5, "loss": torch.cat(losses).mean().item()}
    if num_classes <= 5:  # every class is in the top 5: always 100 %, nothing to report
        del metrics["top5"]
    return metrics, confusion.view(num_classes, num_classes).cpu()


def per_class_accuracy(confusion: torch.Tensor, classes: list[str]) -> list[dict]:
    """Rows of (class, images, accuracy %) from a confusion matrix [true, predicted]."""
    totals = confusion.sum(dim=1)
    return [
        {"class": name, "images": int(n), "accuracy": float(confusion[i, i] * 100 / n) if n else float("nan")}
        for i, (name, n) in enumerate(zip(classes, totals.tolist()))
    ]


# ============================================================================================
# Training
# ============================================================================================
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    cfg, normalization_note = input_normalization(cfg)  # before the run folder exists: a bad value writes nothing
    if cfg.bn_momentum_end > 0 and (cfg.bn_momentum <= 0 or cfg.compile):
        raise UserError(
            "bn_momentum_end needs bn_momentum > 0, and cannot be combined with compile "
            "(each new momentum value would force torch.compile to recompile)"
        )
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    run.note(normalization_note)
    accelerator = run.accelerator
    if cfg.predict:  # predictions.csv for the images it names (recipes/classifier_inference.py)
        return predict(cfg, run, create_model)
    if cfg.export and cfg.weights and not cfg.eval_only:  # --export --weights W: W's export, no data read
        model, classes = trained_model(cfg, create_model)
        return export(run, lambda folder: export_files(model, cfg, classes, folder, run.recipe))

    # ---- data ------------------------------------------------------------------------------
    with accelerator.main_process_first():  # the main process fills the datasets cache first
        data = load_classification(
            cfg.data, cfg.image_column, cfg.label_column, cfg.train_split, cfg.eval_split, seed=cfg.seed
        )
    column = data.image_column  # the undecoded images
    # every image checked once before the first step: unreadable ones are left out and listed (common/data/scan.py)
    data = without_unreadable(
        data, column, accelerator, cfg.bad_images, cfg.num_workers, cfg.batch_size, run.dir, train=not cfg.eval_only
    ).into(run)  # its banner lines, and bad_images.txt where some are left out
    if not cfg.eval_only:  # --train_fraction: a seeded share of the labels
        data, fraction_line = with_label_fraction(data, cfg.train_fraction, cfg.seed, data.label_column)
        run.note(fraction_line)
    num_classes = len(data.classes)

    # ---- model -----------------------------------------------------------------------------
    if cfg.eval_only:
        model, trained_classes = trained_model(cfg, create_model)
        if trained_classes != data.classes:
            raise UserError(
                f"weights '{cfg.weights}' were trained on classes {trained_classes[:5]}... "
                f"({len(trained_classes)}); '{cfg.data}' has {data.classes[:5]}... ({num_classes})"
            )
    else:
        model = create_model(cfg, num_classes, run.notes)
    if cfg.sync_bn:
        model = sync_batchnorm(model, accelerator)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    train_tf, eval_tf = create_transforms(cfg, model)
    data_cfg = data_config(cfg, model)  # the weights files record the normalisation, for whoever starts from them
    saved_as = {"classes": data.classes, "recipe": run.recipe, "normalization": (data_cfg["mean"], data_cfg["std"])}
    run.weights_metadata = weights_metadata(cfg, **saved_as)  # every checkpoint is weights too (common/weights.py)
    # camera-size JPEGs decoded reduced, as far as the crops still find img_size pixels (common/data/images.py)
    sides = needed_side(cfg.img_size, cfg.scale[0], cfg.ratio), needed_side(cfg.img_size, crop_pct=data_cfg["crop_pct"])
    # --cache_images: each image decoded once, at the side its dataset decodes it (common/data/image_cache.py)
    (train_cache, eval_cache), cache_line = image_caches(
        cfg.cache_images, cfg.num_workers, (data.train, column, sides[0]), (data.eval, column, sides[1])
    )
    run.note(cache_line)
    train_set = ClassificationDataset(data.train, column, data.label_column, train_tf, cfg.seed, sides[0], train_cache)
    eval_set = ClassificationDataset(data.eval, column, data.label_column, eval_tf, cfg.seed, sides[1], eval_cache)
    train_loader = train_loader_for(
        train_set, cfg.batch_size, cfg.seed, cfg.num_workers, accelerator.num_processes, repeats=cfg.aug_repeats
    )
    eval_loader = eval_loader_for(eval_set, cfg.eval_batch_size or cfg.batch_size, cfg.num_workers)

    # ---- evaluation only: the saved weights on the evaluation split -------------------------------
    if cfg.eval_only:
        model, eval_loader = accelerator.prepare(model, eval_loader)
        run.begin()
        metrics, confusion = evaluate(
            model, run.progress(eval_loader, "eval"), accelerator, num_classes, cfg.channels_last
        )
        results = {f"eval/{k}": v for k, v in metrics.items()}
        run.log(results, 0)
        picture = None
        if accelerator.is_main_process:
            rows = per_class_accuracy(confusion, data.classes)
            save_table_csv(rows, run.dir / "per_class_accuracy.csv")  # and a tracker table; the console: one line
            log_table(accelerator, cfg.report_to, "eval/accuracy_per_class", rows, 0)
            run.print(per_class_line("accuracy per class", rows, "accuracy", run.dir / "per_class_accuracy.csv"))
            picture = plot_confusion_matrix(
                confusion.numpy(),
                data.classes,
                run.plots_dir / "confusion_matrix.png",
                f"{Path(cfg.weights).name}: top-1 {results['eval/top1']:.2f} %",
            )
        run.log_plots(0, confusion_matrix=picture)
        run.finish()
        return results

    # ---- loss --------------------------------------------------------------------------------
    mixup_fn = None
    if cfg.mixup > 0 or cfg.cutmix > 0:
        if cfg.batch_size % 2:
            raise UserError("Mixup/CutMix pair samples within a batch: batch_size must be even")
        mixup_fn = Mixup(
            mixup_alpha=cfg.mixup,
            cutmix_alpha=cfg.cutmix,
            prob=cfg.mixup_prob,
            switch_prob=cfg.mixup_switch_prob,
            label_smoothing=cfg.smoothing,
            num_classes=num_classes,
        )
    criterion = create_criterion(cfg, mixed=mixup_fn is not None)  # recipes/classifier_model.py
    weight_dict = {"loss_cls": 1.0}  # the total loss: sum of weight x term (a new term: one more entry)

    # ---- optimizer and schedules --------------------------------------------------------------
    # timm's factory puts biases and norm parameters in a group with weight_decay 0 (and, with
    # layer_decay, writes per-group lr_scale that set_group_values honours).
    fused = {"fused": True} if accelerator.device.type == "cuda" and cfg.opt in ("adamw", "adam", "sgd") else {}
    optimizer = create_optimizer_v2(
        model,
        opt=cfg.opt,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        layer_decay=cfg.layer_decay or None,
        **fused,
    )
    if cfg.ema_decay > 0 and accelerator.distributed_type.name == "FSDP":
        raise UserError("model EMA keeps a full replica and cannot follow FSDP's sharded weights; set --ema_decay 0")

    mark_fsdp_blocks(model)  # FSDP: each repeated block its own shard unit (configs/accelerate/fsdp.yaml)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if units := fsdp_units(model):  # FSDP: the root and the blocks marked above
        run.print(f"fsdp: {units} modules sharded (fully_shard units, the root included)")
    unwrapped = accelerator.unwrap_model(model)
    ema = None
    if cfg.ema_decay > 0:  # copied from the prepared model: DDP has broadcast process 0's weights to all
        ema = ModelEma(unwrapped, cfg.ema_decay, cfg.ema_warmup)
        accelerator.register_for_checkpointing(ema)

    def accum_steps(epoch: int) -> int:
        switched = 0 < cfg.grad_accum_switch_epoch <= epoch and cfg.grad_accum_steps_after_switch > 0
        return cfg.grad_accum_steps_after_switch if switched else cfg.grad_accum_steps

    def steps_in_epoch(epoch: int) -> int:  # Accelerate steps at the end of the loader even mid-accumulation
        return math.ceil(len(train_loader) / accum_steps(epoch))

    peak = cfg.peak_lr(accelerator.num_processes)  # lr carried from lr_batch images to the global batch

    def lay_out(length: Length) -> dict[str, np.ndarray]:
        """The learning rate per step over the run's length (a --max_time plan's, once planned)."""
        milestones = [length.at(m) for m in cfg.decay_milestones]
        warmup = length.at(cfg.warmup_epochs)
        return {
            "lr": schedule(cfg.sched, peak, cfg.min_lr, length.steps, warmup, cfg.warmup_lr, milestones, cfg.decay_rate)
        }

    # ---- training loop (resumes where a checkpoint left off) -----------------------------------
    loop = Loop(run, train_loader, lay_out, len(eval_set), data.classes, train_set.replaced, steps_in_epoch)
    set_seed(cfg.seed, device_specific=True)  # from here each process draws its own random numbers (dropout)
    loop.resume()  # model, optimizer, EMA, ... and the generators from --resume's checkpoint: where it stopped
    meters, results = loop.meters, {}
    for epoch in loop.epochs():
        accelerator.gradient_accumulation_steps = accum_steps(epoch)
        if cfg.bn_momentum_end > 0:
            set_bn_momentum(
                unwrapped,
                cfg.bn_momentum_end
                + (cfg.bn_momentum - cfg.bn_momentum_end)
                * 0.5
                * (1 + math.cos(math.pi * epoch / max(loop.length.epochs - 1, 1))),
            )
        model.train()
        if cfg.linear_probe:  # frozen features: batch-norm statistics must not drift either
            model.eval()
            unwrapped.get_classifier().train()
        for images, targets in loop.batches():
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            soft_targets = targets
            if mixup_fn is not None:
                images, soft_targets = mixup_fn(images, targets)
            lr = loop.value("lr")
            set_group_values(optimizer, "lr", lr)

            with accelerator.accumulate(model):
                logits = model(images)
                losses = {"loss_cls": criterion(logits, soft_targets)}
                loss = sum(losses[k] * w for k, w in weight_dict.items())
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.clip_grad > 0:
                    meters.update(grad_norm=accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            loop.record(loss, losses, len(images))  # meters and the non-finite guard, on the device
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

        # ---- evaluation and best weights (raw or EMA, by top-1) ----------------------------------
        if loop.eval_due():
            with loop.evaluation():  # a loss gone non-finite stops the run here; a stop signal: a checkpoint
                if not cfg.sync_bn:  # each process's BN statistics saw its own batches: evaluate their mean
                    average_bn_statistics(unwrapped, accelerator)
                    if ema is not None:
                        average_bn_statistics(ema.module, accelerator)
                metrics, confusion = evaluate(
                    model, run.progress(eval_loader, "eval"), accelerator, num_classes, cfg.channels_last
                )
                results = {f"eval/{k}": v for k, v in metrics.items()}
                candidates = [(results["eval/top1"], "raw", confusion)]
                if ema is not None:
                    metrics, confusion = evaluate(
                        ema.module, run.progress(eval_loader, "eval ema"), accelerator, num_classes, cfg.channels_last
                    )
                    results.update({f"eval_ema/{k}": v for k, v in metrics.items()})
                    candidates.append((results["eval_ema/top1"], "ema", confusion))
                top1, which, confusion = max(candidates, key=lambda c: c[0])
                improved = loop.update_best("top1", top1)
                results["best/top1"] = loop.best("top1")
                run.log({**results, "epoch": epoch}, loop.step)
                picture = None
                if accelerator.is_main_process:  # the evaluated model's (the better of raw and EMA) mistakes
                    picture = plot_confusion_matrix(
                        confusion.numpy(),
                        data.classes,
                        run.plots_dir / "confusion_matrix.png",
                        f"{which} model, step {loop.step}: top-1 {top1:.2f} %",
                    )
                run.log_plots(loop.step, confusion_matrix=picture)  # and the training curves
                if improved:
                    weights = accelerator.get_state_dict(model) if which == "raw" else ema.module.state_dict()
                    if accelerator.is_main_process:
                        save_weights(weights, run.dir / "best.safetensors", cfg, **saved_as)
        if loop.checkpoint_due():  # every checkpoint_every steps, and after the last epoch
            loop.save_checkpoint()

    # ---- saving ---------------------------------------------------------------------------------
    final = accelerator.get_state_dict(model)
    weights = [run.dir / "best.safetensors", run.dir / "final.safetensors"]
    if accelerator.is_main_process:
        save_weights(final, weights[1], cfg, **saved_as)
        if ema is not None:
            weights.append(run.dir / "final_ema.safetensors")
            save_weights(ema.module.state_dict(), weights[2], cfg, **saved_as)
        # what leaves the project is the best (evaluated) weights: a timm folder and the exports. A step that
        # fails is one line after the summary with the command that redoes it; the steps after it still run.
        kept = kept_weights(run.dir)
        shared, _ = trained_model(dataclasses.replace(cfg, weights=str(kept)), create_model)
        if not cfg.probe_blocks:  # a probe on blocks is not a timm model
            with run.guarded("model folder"):  # recipes/classifier_inference.py; --push_to_hub uploads it
                best, sizes = loop.best_for_card("top1", " (%)"), (len(train_set), len(eval_set))
                run.print(
                    write_model_folder(shared, cfg, data.classes, data_cfg, run.dir / "model", run.recipe, sizes, best)
                )
        if cfg.export:
            with run.guarded("export", run.export_command(kept)):
                write = lambda folder: export_files(shared, cfg, data.classes, folder, run.recipe)  # noqa: E731
                results.update(export(run, write, loop.step))
    loop.finish(results, weights)  # the summary; the weights as W&B artifacts with --log_weights
    return results


if __name__ == "__main__":
    cli_main(main)
