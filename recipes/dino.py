"""DINO self-supervised learning (Caron et al., 2021) with any timm backbone, on HuggingFace Accelerate.

A student sees 2 global and N local crops of each image; a teacher, an EMA of the student, sees
the 2 global crops. The student is trained to match the teacher's centred, sharpened softmax
over a K-dimensional projection (cross-entropy, all pairs of different views). Nothing uses
labels except the weighted kNN evaluation of the teacher's backbone features.

Launch (defaults = the built-in demo on `digits_ssl`: one digit repeated 4-6 times on a 32 px canvas):

    accelerate launch recipes/dino.py
    accelerate launch --config_file configs/accelerate/multi_gpu_bf16.yaml recipes/dino.py \\
        --config configs/dino/imagenet_vit_small.yaml
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 recipes/dino.py --batch_size 32

The built-in demo (docs/dino.md): a half-width resnet10t, 8 epochs (352 steps of 64 images) in
5 minutes on 2 CPU cores; the teacher's kNN top-1 on the 1,080 held-out images goes from 23.2 %
(the step-0 network) to 57.4 %, where raw pixels reach 25.3 %.
The teacher backbone is exported as `teacher_backbone.safetensors` for recipes/classifier.py
(`--init_backbone`, with `--linear_probe` for a linear probe).
"""

from __future__ import annotations

import random
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
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.utils import set_seed
from PIL import Image, ImageFilter, ImageOps
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn
from torchvision import transforms as T

from common import UserError
from common.artifacts.export import export
from common.budget import Length
from common.config import MAX_COUNT, MAX_EPOCHS, MAX_SIDE, RunConfig, arg
from common.console import cli_main, own_files
from common.data.classification import ClassificationDataset, load_classification
from common.data.image_cache import image_caches
from common.data.images import needed_side
from common.data.scan import without_unreadable
from common.detection.data import detection_images
from common.ema import ema_update_
from common.loaders import train_loader_for
from common.loop import Loop
from common.models import average_bn_statistics, create_timm_model, sync_batchnorm
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups
from common.weights import config_with_weights, is_onnx, save_weights, weights_metadata

with own_files("dino_"):  # DINO's own files, beside this one: python -m common.vendor copies them with it
    from dino_inference import export_files, load_teacher_backbone, predict, write_model_folder  # what a run ships
    from dino_knn import eval_transform, evaluate, knn_loaders, knn_metrics  # the kNN evaluation and its pictures
    from dino_model import DINOHead, MultiCropWrapper, create_teacher  # the head, the multi-crop wrapper


# ============================================================================================
# Config (defaults: the built-in demo)
# ============================================================================================
@dataclass
class Config(RunConfig):
    # fmt: off
    # data
    data: str = arg("digits_ssl", "built-in name, local folder or hub name; labels are optional (a folder of plain "
        "image files trains), used only by the kNN evaluation")
    image_column: str = arg("", "the column holding the images; empty: detected (the first Image column)")
    label_column: str = arg("", "the column holding the labels, used by the kNN evaluation only; empty: detected")
    train_split: str = arg("train", "the split to train on, also the kNN memory bank")
    eval_split: str = arg("", "the split the kNN evaluation classifies; empty: validation/val/valid/test, "
        "else a seeded 10 % of train")
    knn_data: str = arg("", "a labelled set for the kNN evaluation (any source the classifier takes; its training "
        "split is the bank, its evaluation split the queries); empty: data itself when it has labels, else no kNN")
    global_size: int = arg(32, "global crop size in pixels (224 for ImageNet)", ge=8, le=MAX_SIDE)
    local_size: int = arg(16, "local crop size in pixels (96 for ImageNet)", ge=8, le=MAX_SIDE)
    local_crops: int = arg(6, "number of local crops per image (10 for ImageNet; 0: the 2 global crops only)",
        ge=0, le=64)
    global_scale: list[float] = arg([0.4, 1.0], "global crops' RandomResizedCrop area range (reference: 0.4, 1.0)",
        gt=0, le=1)
    local_scale: list[float] = arg([0.05, 0.4], "local crops' RandomResizedCrop area range (reference: 0.05, 0.4)",
        gt=0, le=1)
    hflip: float = arg(0.0, "horizontal flip probability: 0.5 for natural images; digits must not be mirrored",
        ge=0, le=1)
    blur_radius: list[float] = arg([0.1, 0.6], "PIL Gaussian radius, px ([0.1, 2] at 224)", ge=0)
    color_jitter: list[float] = arg([0.4, 0.4, 0.2, 0.1], "brightness, contrast, saturation, hue of the colour jitter "
        "applied with probability 0.8 (reference); where colour tells images apart, raise the last two so that "
        "views must match by shape", ge=0, le=1)
    grayscale: float = arg(0.2, "probability that a crop is turned grey (reference: 0.2)", ge=0, le=1)
    # model
    model: str = arg("resnet10t", "any timm model (convnet or ViT); the demo: half width "
        "(model_kwargs), 1.2 M parameters")
    model_kwargs: dict = arg({"channels": [32, 64, 128, 256]}, "extra timm.create_model arguments; the demo halves "
        "resnet10t's stage widths")
    drop_path_rate: float = arg(0.1, "stochastic depth of the student backbone (reference: 0.1)", ge=0, lt=1)
    out_dim: int = arg(1024, "K, prototypes of the projection head (65536 for ImageNet)", ge=1, le=MAX_COUNT)
    head_hidden_dim: int = arg(512, "hidden width of the projection head's MLP (2048 for ImageNet)", ge=1, le=MAX_COUNT)
    head_bottleneck_dim: int = arg(256, "the head's bottleneck, L2-normalised before the last layer (reference: 256)",
        ge=1, le=MAX_COUNT)
    norm_last_layer: bool = arg(True, "fix the last layer's weight norm (stable); False is often better with ViT-S")
    head_use_bn: bool = arg(True, "BatchNorm after the head's hidden layers (the reference's "
        "use_bn_in_head; False for ViT)")
    # loss
    warmup_teacher_temp: float = arg(0.04, "teacher temperature at the start, linear to teacher_temp over "
        "warmup_teacher_temp_epochs (reference: 0.04)", gt=0)
    teacher_temp: float = arg(0.04, "teacher softmax temperature after warmup (reference: "
        "0.04; above 0.07 is unstable)", gt=0)
    warmup_teacher_temp_epochs: int = arg(0, "teacher temperature warmup, epochs (reference: 0; "
        "30 with teacher_temp 0.07)", ge=0, le=MAX_EPOCHS)
    student_temp: float = arg(0.1, "student softmax temperature (reference: 0.1)", gt=0)
    center_momentum: float = arg(0.9, "EMA momentum of the centre subtracted from the teacher's "
        "outputs (reference: 0.9)", ge=0, le=1)
    # optimization
    epochs: int = arg(8, "training epochs")
    batch_size: int = arg(64, "images per process (each gives 2 + local_crops crops)")
    opt: Literal["adamw", "sgd"] = arg("adamw", "adamw (ViT), or sgd with momentum 0.9 (the "
        "reference's ResNet-50 setting)")
    lr: float = arg(1.6e-2, "peak learning rate for a global batch of lr_batch images, carried to the run's global "
        "batch by lr_scale (5e-4 per 256 for ViT-S/16 on ImageNet)")
    lr_batch: int = arg(256, "the global batch lr is written for (256: the reference's per-256 rule)")
    lr_scale: Literal["linear", "sqrt"] = arg("linear", "linear: peak = lr x global batch / lr_batch, as the reference")
    min_lr: float = arg(1e-5, "learning rate at the end of the cosine (reference: 1e-6)", ge=0)
    warmup_epochs: float = arg(1.0, "linear learning-rate warmup from 0, epochs (reference: 10)")
    weight_decay: float = arg(0.04, "cosine from this to weight_decay_end; none on biases and norms (reference: 0.04)")
    weight_decay_end: float = arg(0.4, "weight decay at the end of the cosine (reference: 0.4)", ge=0)
    clip_grad: float = arg(3.0, "clip each parameter's gradient norm to this (0: off; reference: 3.0)")
    freeze_last_layer: int = arg(0, "epochs during which the last layer gets no gradient (1 on ImageNet)",
        ge=0, le=MAX_EPOCHS)
    momentum_teacher: float = arg(0.95, "teacher EMA momentum, cosine to 1 (0.996 on ImageNet: 0.95 lets the "
        "demo's 360-step teacher move)", ge=0, le=1)
    compile: bool = arg(False, "torch.compile the student through Accelerate (inductor)")
    # evaluation
    knn_k: list[int] = arg([20], "neighbours that vote in the weighted kNN evaluation: the first gives "
        "knn/teacher_top1, the others knn/teacher_top1_k<k> (reference eval_knn: 10, 20, 100, 200)", ge=1, le=MAX_COUNT)
    knn_temperature: float = arg(0.07, "the kNN votes weigh exp(cosine similarity / this) (reference: 0.07)", gt=0)
    knn_train_limit: int = arg(0, ">0: at most this many memory-bank images (seeded subset)", ge=0)
    knn_resize: int = arg(0, "kNN images: shorter side resized to this, then centre-cropped to global_size (reference: "
        "256 for 224); 0: resized straight to global_size", ge=0, le=MAX_SIDE)
    knn_pixel_size: int = arg(32, "the raw-pixel kNN baseline compares images area-resized to this side, px",
        ge=1, le=512)
    knn_pixel_limit: int = arg(20000, "the raw-pixel baseline's bank: at most this many images "
        "(seeded); 0: no baseline", ge=0)
    weights: str = arg("", "a backbone this recipe saved (teacher_backbone.safetensors, its model folder, a checkpoint "
        "folder: the student's; model.onnx for predict), for eval_only, export and predict")
    predict: str = arg("", "an image or a folder of images: with --weights, write each one's backbone features "
        "(features.npy, rows named in features.csv) to the run folder")
    eval_only: bool = arg(False, "the kNN evaluation of --weights on the labelled data, no "
        "training (metrics.jsonl only)")
    plot_images: int = arg(4, "evaluation images drawn under plots/ at each evaluation: their nearest neighbours in "
        "the kNN bank, and for ViTs the [CLS] attention over them (0: none)", ge=0, le=64)
    # run
    eval_every: int = arg(1, "evaluate every this many epochs; also at step 0 (eval_at_start) and at the end")
    eval_at_start: bool = arg(True, "the kNN of the untrained teacher (and of raw pixels) before the first step: "
        "the baseline the learned features are compared to; false: straight to training")
    # fmt: on


# ============================================================================================
# Data: multi-crop augmentation, exactly as the reference's DataAugmentationDINO
# ============================================================================================
class RandomGaussianBlur:
    def __init__(self, p: float, radius: tuple[float, float]) -> None:
        self.p, self.radius = p, radius

    def __call__(self, img: Image.Image) -> Image.Image:
        if random.random() >= self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.radius)))


class RandomSolarize:
    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return ImageOps.solarize(img) if random.random() < self.p else img


class MultiCrop:
    """PIL image -> [global 1, global 2, local 1, ..., local N] normalised tensors.

    Blur probability 1.0 / 0.1 / 0.5 (global 1 / global 2 / locals); solarization 0.2 on global 2.
    """

    def __init__(self, cfg: Config) -> None:
        bicubic = T.InterpolationMode.BICUBIC
        flip_color = T.Compose(
            [
                T.RandomHorizontalFlip(p=cfg.hflip),
                T.RandomApply([T.ColorJitter(*cfg.color_jitter)], p=0.8),
                T.RandomGrayscale(p=cfg.grayscale),
            ]
        )
        normalize = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
        radius = tuple(cfg.blur_radius)
        g_crop = T.RandomResizedCrop(cfg.global_size, scale=tuple(cfg.global_scale), interpolation=bicubic)
        self.global1 = T.Compose([g_crop, flip_color, RandomGaussianBlur(1.0, radius), normalize])
        self.global2 = T.Compose([g_crop, flip_color, RandomGaussianBlur(0.1, radius), RandomSolarize(0.2), normalize])
        self.local = T.Compose(
            [
                T.RandomResizedCrop(cfg.local_size, scale=tuple(cfg.local_scale), interpolation=bicubic),
                flip_color,
                RandomGaussianBlur(0.5, radius),
                normalize,
            ]
        )
        self.local_crops = cfg.local_crops

    def __call__(self, img: Image.Image) -> list[torch.Tensor]:
        return [self.global1(img), self.global2(img)] + [self.local(img) for _ in range(self.local_crops)]


# ============================================================================================
# Model: backbone + projection head (their modules in dino_model.py), run once per resolution group
# ============================================================================================
def create_backbone(cfg: Config) -> nn.Module:
    # ViTs: built for the global size, position embeddings interpolated for the local crops
    return create_timm_model(
        cfg.model,
        {"img_size": cfg.global_size, "dynamic_img_size": True},
        num_classes=0,
        drop_path_rate=cfg.drop_path_rate,
        **cfg.model_kwargs,
    )


def create_student(cfg: Config) -> MultiCropWrapper:
    """The student: ``cfg.model`` as backbone under the projection head (the teacher is a copy)."""
    backbone = create_backbone(cfg)
    return MultiCropWrapper(
        backbone,
        DINOHead(
            backbone.num_features,
            cfg.out_dim,
            cfg.head_hidden_dim,
            cfg.head_bottleneck_dim,
            cfg.norm_last_layer,
            cfg.head_use_bn,
        ),
    )


# ============================================================================================
# Loss: the reference's DINOLoss, constructor and call shape kept
# ============================================================================================
class DINOLoss(nn.Module):
    def __init__(
        self,
        out_dim: int,
        ncrops: int,
        warmup_teacher_temp: float,
        teacher_temp: float,
        warmup_teacher_temp_epochs: int,
        nepochs: int,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.warmup_teacher_temp, self.teacher_temp = warmup_teacher_temp, teacher_temp
        self.set_epochs(warmup_teacher_temp_epochs, nepochs)

    def set_epochs(self, warmup_teacher_temp_epochs: int, nepochs: int) -> None:
        """The per-epoch teacher temperature over ``nepochs``: linear warmup, then constant (a budgeted run's
        plan lays it out again for the epochs it holds)."""
        self.teacher_temp_schedule = np.concatenate(
            (
                np.linspace(self.warmup_teacher_temp, self.teacher_temp, warmup_teacher_temp_epochs),
                np.ones(max(nepochs - warmup_teacher_temp_epochs, 1)) * self.teacher_temp,
            )
        )

    def forward(self, student_output: torch.Tensor, teacher_output: torch.Tensor, epoch: int) -> torch.Tensor:
        """student_output: [ncrops*B, K], teacher_output: [2*B, K] (global crops), crop-major."""
        student_out = (student_output.float() / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[min(epoch, len(self.teacher_temp_schedule) - 1)]
        teacher_out = F.softmax((teacher_output.float() - self.center) / temp, dim=-1).detach().chunk(2)
        total, pairs = 0.0, 0
        for iq, q in enumerate(teacher_out):
            for v, s in enumerate(student_out):
                if v == iq:  # the same view: skip
                    continue
                total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                pairs += 1
        self.update_center(teacher_output)
        return total / pairs

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """EMA of the teacher's raw outputs, averaged over every process's batch."""
        batch_center = teacher_output.float().sum(dim=0, keepdim=True)
        count = len(teacher_output)  # a host int: no host-to-device copy
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(batch_center)
            count *= dist.get_world_size()
        self.center.mul_(self.center_momentum).add_(batch_center / count, alpha=1 - self.center_momentum)


# ============================================================================================
# Optimisation helpers
# ============================================================================================
@torch.no_grad()
def clip_gradients_per_param(params: list[nn.Parameter], clip: float) -> torch.Tensor:
    """Scale each parameter's gradient to norm <= clip, separately (the reference's clip_gradients), with
    no host sync. Returns the largest gradient norm before clipping (a device scalar, for logging).

    CUDA's fused foreach multiply needs operands of equal shapes: a list of 0-dim scales would send
    ``_foreach_mul_`` down its one-kernel-per-tensor path. So each parameter's scale is expanded to its
    gradient's shape in one flat buffer (one concatenation; memory: one more copy of the gradients),
    and the multiply runs as one foreach call over same-shaped pairs."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch.stack(torch._foreach_norm(grads))  # [P]
    scale = (clip / (norms + 1e-6)).clamp_(max=1.0).to(grads[0].dtype)
    sizes = [g.numel() for g in grads]  # host ints: no synchronisation
    flat = torch.cat([s.expand(n) for s, n in zip(scale.unbind(), sizes)])  # [sum of numels]
    torch._foreach_mul_(grads, [f.view_as(g) for f, g in zip(flat.split(sizes), grads)])
    return norms.max()


# ============================================================================================
# Training
# ============================================================================================
MODEL_FIELDS = ("model", "model_kwargs", "global_size")  # what --weights restores from the file's saved config


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = config_with_weights(Config, argv, MODEL_FIELDS)
    if cfg.global_size < cfg.local_size:  # each number's own range was checked while parsing
        raise UserError("need global_size >= local_size")
    if len(cfg.color_jitter) != 4 or cfg.color_jitter[3] > 0.5:
        raise UserError(
            f"color_jitter needs brightness, contrast, saturation, hue (hue <= 0.5), got {cfg.color_jitter}"
        )
    if not cfg.knn_k:
        raise UserError(f"knn_k needs one or more neighbour counts >= 1, got {cfg.knn_k}")
    run = Run(cfg, Path(__file__).stem)  # runs/<this file's name>/..., the Accelerator, the seeds (common/run.py)
    accelerator = run.accelerator
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED"):  # before anything is written
        raise UserError(
            f"DINO's teacher is an EMA of the whole student and needs its full weights on every "
            f"process; {accelerator.distributed_type.name} shards them: launch with plain data "
            "parallelism (configs/accelerate/multi_gpu_bf16.yaml)"
        )

    if cfg.predict:  # --predict PATH --weights W: the backbone's features of each image, no data read
        backbone = None if is_onnx(cfg.weights) else load_teacher_backbone(create_backbone(cfg), cfg.weights, cfg.model)
        return predict(backbone, cfg, run, eval_transform(cfg.global_size, cfg.knn_resize))
    if cfg.export and cfg.weights and not cfg.eval_only:  # --export --weights W: W as ONNX, no data read
        backbone = load_teacher_backbone(create_backbone(cfg), cfg.weights, cfg.model)
        return export(run, lambda folder: export_files(backbone, cfg, folder, run.recipe))

    # ---- data: unlabelled images train; a labelled set (data itself, or knn_data) evaluates ---------
    with accelerator.main_process_first():
        # a detection set's images (built-in or COCO-json folder) train as unlabelled images, boxes unused
        data = detection_images(cfg.data, cfg.train_split, cfg.seed) or load_classification(
            cfg.data, cfg.image_column, cfg.label_column, cfg.train_split, cfg.eval_split, seed=cfg.seed, labels=False
        )
        knn_set = load_classification(cfg.knn_data, seed=cfg.seed) if cfg.knn_data else data
    # every image checked once before the first step: unreadable ones are left out and listed (common/data/scan.py)
    settings = accelerator, cfg.bad_images, cfg.num_workers, cfg.batch_size, run.dir  # what the scan reads
    # .into(run): each scan's banner lines, and bad_images.txt where some are left out
    checked = without_unreadable(data, data.image_column, *settings, train=not cfg.eval_only).into(run)
    knn_set = checked if knn_set is data else without_unreadable(knn_set, knn_set.image_column, *settings).into(run)
    data = checked
    if not knn_set.classes:
        knn_set = None
        if cfg.eval_only:
            raise UserError(f"eval_only needs labels: '{cfg.data}' has none; name a labelled set with --knn_data")
    # camera-size JPEGs decoded reduced, as far as every crop still finds its pixels (common/data/images.py)
    crops = [(cfg.global_size, cfg.global_scale[0]), (cfg.local_size, cfg.local_scale[0])]
    side = max(needed_side(size, scale, (3 / 4, 4 / 3)) for size, scale in crops)  # torchvision's default ratio
    # --cache_images: each image decoded once, at that side (common/data/image_cache.py)
    (train_cache,), cache_line = image_caches(cfg.cache_images, cfg.num_workers, (data.train, data.image_column, side))
    run.note(cache_line)
    columns = data.image_column, data.label_column
    train_set = ClassificationDataset(data.train, *columns, MultiCrop(cfg), cfg.seed, side, train_cache)
    train_loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, accelerator.num_processes)
    if knn_set is not None:  # each process reads its own share of the bank and of the queries
        bank_set, query_set, bank_loader, query_loader, pixel_loader, cache_line = knn_loaders(
            cfg, knn_set, accelerator.process_index, accelerator.num_processes
        )
        run.note(cache_line)  # --cache_images: the bank's and the queries' images decoded once

    # ---- model: the student; the teacher is copied from it once prepared (the same on every process) --
    student = create_student(cfg)
    student = sync_batchnorm(student, accelerator)  # several GPUs: BN statistics over the global batch

    # ---- loss ----------------------------------------------------------------------------------
    ncrops = 2 + cfg.local_crops
    dino_loss = DINOLoss(
        cfg.out_dim,
        ncrops,
        cfg.warmup_teacher_temp,
        cfg.teacher_temp,
        cfg.warmup_teacher_temp_epochs,
        cfg.epochs,
        cfg.student_temp,
        cfg.center_momentum,
    )
    weight_dict = {"loss_dino": 1.0}  # the total loss: sum of weight x term (DINOv2's KoLeo: one more entry)

    # ---- optimizer -------------------------------------------------------------------------------
    fused = {"fused": True} if accelerator.device.type == "cuda" else {}
    groups = weight_decay_groups(student, cfg.weight_decay)  # lr and decay: per step; none for biases and norms
    optimizer = (
        torch.optim.AdamW(groups, lr=cfg.lr, **fused)
        if cfg.opt == "adamw"
        else torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, **fused)
    )

    # ---- prepare; then the teacher, a copy of the prepared student (DDP has broadcast process 0's weights)
    student, optimizer, train_loader = accelerator.prepare(student, optimizer, train_loader)
    unwrapped = accelerator.unwrap_model(student)
    teacher = create_teacher(unwrapped)
    dino_loss.to(accelerator.device)
    accelerator.register_for_checkpointing(teacher)
    accelerator.register_for_checkpointing(dino_loss)  # the centre is training state
    student_params = list(unwrapped.parameters())
    teacher_params = list(teacher.parameters())
    last_layer_params = list(unwrapped.head.last_layer.parameters())

    # ---- schedules: one value per optimizer step over the run's length (a --max_time plan's, once planned)
    peak = cfg.peak_lr(accelerator.num_processes)  # lr carried from lr_batch images to the global batch

    def lay_out(length: Length) -> dict[str, np.ndarray]:
        """lr, weight decay and the teacher's momentum per step (the teacher temperature: per epoch, below)."""
        return {
            "lr": schedule("cosine", peak, cfg.min_lr, length.steps, length.at(cfg.warmup_epochs)),
            "weight_decay": schedule("cosine", cfg.weight_decay, cfg.weight_decay_end, length.steps),
            "momentum": schedule("cosine", cfg.momentum_teacher, 1.0, length.steps),
        }

    # ---- evaluation only: the kNN of a saved backbone --------------------------------------------
    if cfg.eval_only:
        load_teacher_backbone(teacher.backbone, cfg.weights, cfg.model)
        run.begin()
        results, pictures = evaluate(
            teacher.backbone, bank_set, query_set, bank_loader, query_loader, knn_set.classes, cfg, run
        )
        run.log(results, 0)
        run.log_plots(0, **pictures)
        run.finish()
        return results

    # ---- resume, or the step-0 baselines ---------------------------------------------------------
    # every checkpoint is weights too (common/weights.py): the student's backbone, with teacher_backbone's metadata
    normalization = (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    run.weights_metadata = weights_metadata(cfg, recipe=run.recipe, normalization=normalization) | {"part": "backbone."}
    loop = Loop(
        run,
        train_loader,
        lay_out,
        len(query_set) if knn_set else None,
        knn_set.classes if knn_set else None,
        train_set.replaced,
    )
    set_seed(cfg.seed, device_specific=True)  # from here each process draws its own random numbers (dropout)
    loop.resume()  # student, teacher, centre, optimizer and the generators from --resume's checkpoint
    meters = loop.meters
    if knn_set is None and "baseline" not in loop.extra:
        run.print(f"no kNN evaluation: '{cfg.data}' has no labels; name a labelled set with --knn_data")
    if "baseline" not in loop.extra:  # kept in every checkpoint, so a resumed run does not redo them
        baseline: dict[str, float] = {}
        if knn_set is not None and cfg.eval_at_start:
            bank = f"{len(bank_set):,} bank and {len(query_set):,} query images"
            run.print(f"step-0 kNN evaluation (the untrained baseline; --eval_at_start false skips it): {bank}")
            with loop.evaluation():  # the step-0 evaluation's seconds: time/eval_s at step 0; a stop ends the run
                if cfg.knn_pixel_limit > 0:
                    baseline.update(
                        knn_metrics(None, "raw_pixels", pixel_loader, query_loader, len(knn_set.classes), cfg, run)[0]
                    )
                step0, pictures = evaluate(
                    teacher.backbone, bank_set, query_set, bank_loader, query_loader, knn_set.classes, cfg, run
                )
                baseline.update({k.replace("teacher", "step0"): v for k, v in step0.items()})
                run.log(baseline, 0)
                run.log_plots(0, **pictures)
        loop.extra["baseline"] = baseline
    results: dict[str, float] = dict(loop.extra.get("results", loop.extra["baseline"]))

    # ---- training loop ---------------------------------------------------------------------------
    teacher.train()
    for epoch in loop.epochs():
        student.train()  # the teacher temperature's warmup over the run's length now (a budget's refit changes it)
        dino_loss.set_epochs(round(loop.length.in_epochs(cfg.warmup_teacher_temp_epochs)), loop.length.epochs)
        for crops, _ in loop.batches():
            lr, weight_decay, momentum = loop.value("lr"), loop.value("weight_decay"), loop.value("momentum")
            set_group_values(optimizer, "lr", lr)
            set_group_values(optimizer, "weight_decay", weight_decay)  # the no-decay group stays 0

            with accelerator.accumulate(student):
                with torch.no_grad(), accelerator.autocast():
                    teacher_out = teacher(crops[:2])  # [2B, K]: global crops only
                student_out = student(crops)  # [ncrops*B, K]
                losses = {"loss_dino": dino_loss(student_out, teacher_out, epoch)}
                loss = sum(losses[k] * w for k, w in weight_dict.items())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.unscale_gradients()  # fp16: clip true gradients
                    if cfg.clip_grad > 0:
                        meters.update(grad_norm_max=clip_gradients_per_param(student_params, cfg.clip_grad))
                    if epoch < loop.length.in_epochs(cfg.freeze_last_layer):
                        for p in last_layer_params:
                            p.grad = None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            loop.record(loss, losses, len(crops[0]))  # meters and the non-finite guard, on the device
            if not accelerator.sync_gradients:  # still accumulating gradients
                continue
            loop.end_step()
            ema_update_(teacher_params, student_params, momentum)  # the teacher follows
            if loop.log_due():
                temps = dino_loss.teacher_temp_schedule
                loop.log_train(
                    lr=lr, weight_decay=weight_decay, momentum=momentum, teacher_temp=temps[min(epoch, len(temps) - 1)]
                )
            if loop.stop_requested():  # SIGTERM/SIGINT/SIGUSR1 on any process: checkpoint, then end the run
                loop.save_checkpoint()
                return loop.stop(results)
            if loop.checkpoint_due():
                loop.save_checkpoint()

        # ---- evaluation ------------------------------------------------------------------------
        if loop.eval_due() and knn_set is not None:
            with loop.evaluation():  # a loss gone non-finite stops the run here; a stop signal: a checkpoint
                knn, pictures = evaluate(
                    teacher.backbone, bank_set, query_set, bank_loader, query_loader, knn_set.classes, cfg, run
                )
                # kept in the checkpoint: a run resumed at its end (a model folder redone) writes its card from them
                results = loop.extra["results"] = {**loop.extra["baseline"], **knn}
                run.log({**results, "epoch": epoch}, loop.step)
                run.log_plots(loop.step, **pictures)  # and the training curves
        if loop.checkpoint_due():  # every checkpoint_every steps, and after the last epoch
            loop.save_checkpoint()

    # ---- saving: the teacher backbone, for --init_backbone, a timm folder, ONNX -----------------
    path = run.dir / "teacher_backbone.safetensors"
    average_bn_statistics(teacher.backbone, accelerator)  # every process: without a kNN at the end, still each its own
    if accelerator.is_main_process:
        normalization = (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
        save_weights(teacher.backbone.state_dict(), path, cfg, recipe=run.recipe, normalization=normalization)
        # a step that fails is one line after the summary with the command that redoes it; the next still runs
        with run.guarded("model folder"):
            sizes = (len(train_set), len(query_set) if knn_set is not None else 0)
            run.print(write_model_folder(teacher.backbone, cfg, run.dir / "model", run.recipe, sizes, results))
        if cfg.export:
            with run.guarded("export", run.export_command(path)):
                write = lambda folder: export_files(teacher.backbone, cfg, folder, run.recipe)  # noqa: E731
                results.update(export(run, write, loop.step))
    loop.finish(results, [path])  # the summary; the weights as a W&B artifact with --log_weights
    return results


if __name__ == "__main__":
    cli_main(main)
