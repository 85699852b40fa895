"""DINO: recipes/dino.py against a loop written as the DINO reference code writes it, side by side.

reference  ``main_dino.py``'s ``train_one_epoch`` as written (facebookresearch/dino), on the recipe's
           student and teacher (``create_student``, ``create_teacher`` of recipes/dino_model.py), ``DINOLoss``,
           data (``MultiCrop``, reduced decoding), peak lr and schedules: ``AdamW(foreach=False)`` (one
           parameter at a time, as in its era), lr and weight decay written every step,
           ``isfinite(loss.item())``, ``clip_gradients`` (a Python loop, one ``.item()`` per parameter),
           ``cancel_gradients_last_layer``, the teacher EMA as a Python loop, ``synchronize()`` and
           ``loss.item()`` every step; fp32, or on CUDA under
           mixed precision fp16 autocast + ``GradScaler`` (the reference's ``--use_fp16``; no bf16).
recipe     its ``main()``: fused AdamW on CUDA, foreach clipping and EMA, no per-step sync, optional
           ``--compile`` (this side only); its step-0 and final kNN evaluations fall outside the timing.
An image = its 2 global + N local crops. Target: recipe / reference >= 1.3 on a GPU, >= 1 on CPU. The
last-interval losses agree (on CPU in fp32 to 4 decimals). ``--synthetic``: random ``global_size``-px
JPEGs instead of digits, still multi-cropped by the loader workers (watch the data wait).
Timing and report: benchmarks/timing.py. Reproduce benchmarks/RESULTS.md (offline; defaults: the demo
model on ``digits``, batch 32, 1 worker, 4 repeats of 20 steps; about 3.5 minutes on 2 CPU cores):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/dino_throughput.py --repeats 6
    python benchmarks/dino_throughput.py --device cuda --synthetic --model vit_small_patch16_224 \\
        --model_kwargs "{}" --global_size 224 --local_size 96 --local_crops 10 --batch_size 64 \\
        --out_dim 65536 --mixed_precision bf16
"""

from __future__ import annotations

import argparse
import math

import torch

import timing  # same folder; puts the repository root and recipes/ on sys.path


def clip_gradients(model: torch.nn.Module, clip: float) -> None:  # the reference's utils.clip_gradients
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            param_norm.item()  # it collects the norms as host floats
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:  # a host-device synchronisation per parameter
                p.grad.data.mul_(clip_coef)


def reference_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed

    from common.data.classification import ClassificationDataset, load_classification
    from common.data.images import needed_side
    from common.detection.data import detection_images
    from common.loaders import train_loader_for
    from common.schedules import schedule, weight_decay_groups
    from dino_model import create_teacher  # beside the recipe (timing puts recipes/ on sys.path)

    device = torch.device(args.device)
    data = detection_images(cfg.data, cfg.train_split, cfg.seed) or load_classification(
        cfg.data, cfg.image_column, cfg.label_column, cfg.train_split, cfg.eval_split, seed=cfg.seed, labels=False
    )  # as the recipe: unlabelled images
    crops = [(cfg.global_size, cfg.global_scale[0]), (cfg.local_size, cfg.local_scale[0])]
    side = max(needed_side(size, scale, (3 / 4, 4 / 3)) for size, scale in crops)  # as the recipe decodes
    train_set = ClassificationDataset(
        data.train, data.image_column, data.label_column, recipe.MultiCrop(cfg), cfg.seed, side
    )
    data_loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1)
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    student = recipe.create_student(cfg).to(device)
    teacher = create_teacher(student)  # "no backpropagation through the teacher", no drop path
    dino_loss = recipe.DINOLoss(
        cfg.out_dim,
        2 + cfg.local_crops,
        cfg.warmup_teacher_temp,
        cfg.teacher_temp,
        cfg.warmup_teacher_temp_epochs,
        cfg.epochs,
        cfg.student_temp,
        cfg.center_momentum,
    )
    dino_loss.to(device)
    groups = weight_decay_groups(student, cfg.weight_decay)  # = utils.get_params_groups
    optimizer = (
        torch.optim.AdamW(groups, foreach=False)
        if cfg.opt == "adamw"
        else torch.optim.SGD(groups, lr=0, momentum=0.9, foreach=False)
    )
    fp16_scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda" and cfg.mixed_precision != "no")
    steps_per_epoch = len(data_loader)
    lr_schedule = schedule("cosine", cfg.peak_lr(1), cfg.min_lr, args.steps, round(cfg.warmup_epochs * steps_per_epoch))
    wd_schedule = schedule("cosine", cfg.weight_decay, cfg.weight_decay_end, args.steps)
    momentum_schedule = schedule("cosine", cfg.momentum_teacher, 1.0, args.steps)
    student.train()
    teacher.train()  # the reference never puts its teacher in eval mode

    def train_step(it: int, batch) -> tuple[float, int]:
        crops, epoch = batch[0], it // steps_per_epoch
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = float(lr_schedule[it])
            if i == 0:  # only the first group is regularized
                param_group["weight_decay"] = float(wd_schedule[it])
        crops = [im.to(device, non_blocking=True) for im in crops]
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16_scaler.is_enabled()):
            teacher_output = teacher(crops[:2])  # only the 2 global views pass through the teacher
            student_output = student(crops)
            loss = dino_loss(student_output, teacher_output, epoch)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"reference loop: loss is {loss.item()} at step {it}")
        optimizer.zero_grad()
        fp16_scaler.scale(loss).backward()  # the reference's two branches (with and without fp16) in one
        fp16_scaler.unscale_(optimizer)  # unscale the gradients in place before clipping
        if cfg.clip_grad:
            clip_gradients(student, cfg.clip_grad)
        if epoch < cfg.freeze_last_layer:  # cancel_gradients_last_layer
            for n, p in student.named_parameters():
                if "last_layer" in n:
                    p.grad = None
        fp16_scaler.step(optimizer)
        fp16_scaler.update()
        with torch.no_grad():  # EMA update for the teacher
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss.item(), len(crops[0])  # metric_logger.update(loss=loss.item())

    return timing.timed_loop(args, data_loader, train_step)


def main(argv: list[str] | None = None) -> dict[str, float]:
    return timing.compare(
        "dino",
        "reference",
        reference_run,
        __doc__,
        argv,
        steps=(20, 120),
        log_every=(5, 20),
        repeats=4,
        show=("model", "model_kwargs", "global_size", "local_size", "local_crops", "out_dim"),
        note="reference: fp32, or fp16 + GradScaler under mixed precision on cuda",
        defaults=("--data", "digits", "--batch_size", "32", "--knn_train_limit", "64", "--plot_images", "0"),
        synthetic="global_size",
        target=(1.0, 1.3),
    )


if __name__ == "__main__":
    main()
