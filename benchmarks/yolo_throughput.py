"""YOLO: recipes/yolo.py against a bare PyTorch loop, side by side.

bare    the loop the usual YOLO training scripts write, on the recipe's model (``create_model`` with the
        same head, anchors and initial weights), data (``training_transforms`` of recipes/yolo_data.py,
        ``YoloTrainSet``, ``train_collate``), loss (the head's, ``loss_of`` of recipes/yolo.py, terms weighted),
        parameter groups, peak lr and schedule: ``AdamW`` (or SGD), the lr written every step,
        ``clip_grad_norm_``, the same ``ModelEma``, fp32, and ``loss.item()`` every step.
recipe  its ``main()``: Accelerate, the config's precision and multi-scale (the bare side trains at
        ``img_size`` only: compare without it), on-device meters and guard (no per-step sync); no export.
In fp32 the last-interval losses agree closely. Timing and report: benchmarks/timing.py.
Reproduce benchmarks/RESULTS.md (offline; the demo config, 4 repeats of 60 steps; 7 minutes on 1 core):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline taskset -c 0 python benchmarks/yolo_throughput.py --num_workers 0
    # GPU: the COCO config's model at 416 px, batch 64, bf16 (digits scenes upscaled)
    python benchmarks/yolo_throughput.py --device cuda --mixed_precision bf16 --batch_size 64 \\
        --num_workers 8 -- --config configs/yolo/coco_cspdarknet53.yaml --img_size 416 --multiscale "[]"
"""

from __future__ import annotations

import argparse

import torch

import timing  # same folder; puts the repository root and recipes/ on sys.path


def bare_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed

    from common.detection.data import DetectionDataset, load_detection
    from common.ema import ModelEma
    from common.loaders import train_loader_for
    from common.schedules import schedule, weight_decay_groups
    from yolo_data import decode_side, training_transforms  # beside the recipe (timing puts recipes/ on sys.path)

    device = torch.device(args.device)
    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    transform_at = training_transforms(cfg)  # the recipe's training transforms at an input size
    largest = decode_side(cfg)  # JPEGs decoded reduced as the recipe decodes them
    train_set = recipe.YoloTrainSet(
        DetectionDataset(data.train, transform_at(cfg.img_size), cfg.seed, largest),
        cfg.img_size,
        cfg.mosaic,
        cfg.mixup,
        cfg.epochs - cfg.no_aug_epochs,
        cfg.seed,
        transform_at,
    )
    loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1, collate_fn=recipe.train_collate)
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    model = recipe.create_model(cfg, len(data.classes), recipe.anchors_for(cfg, data.train)).to(device).train()
    loss_fn, weight_dict = recipe.loss_of(cfg)  # the head's loss and its terms' weights, one process
    groups = weight_decay_groups(model, cfg.weight_decay)
    peak = cfg.peak_lr(1)  # as the recipe: lr carried from lr_batch images to the batch
    optimizer = (
        torch.optim.AdamW(groups, lr=peak)
        if cfg.opt == "adamw"
        else torch.optim.SGD(groups, lr=peak, momentum=cfg.momentum)
    )
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    spe = len(loader)
    lr = schedule(
        cfg.sched,
        peak,
        cfg.min_lr,
        args.steps,
        round(cfg.warmup_epochs * spe),
        cfg.warmup_lr,
        [m * spe for m in cfg.decay_milestones],
        cfg.decay_rate,
    )

    def train_step(step: int, batch) -> tuple[float, int]:
        images = batch[0].to(device, non_blocking=True)
        targets = {k: batch[1][k].to(device, non_blocking=True) for k in ("boxes", "labels", "weights")}
        for group in optimizer.param_groups:
            group["lr"] = float(lr[step])
        losses = loss_fn(model, model(images), targets, cfg.img_size, cfg.img_size)
        loss = sum(losses[k] * w for k, w in weight_dict.items())
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        if ema is not None:
            ema.update(model, step + 1)
        return loss.item(), len(images)

    return timing.timed_loop(args, loader, train_step)


def main(argv: list[str] | None = None) -> dict[str, float]:
    return timing.compare(
        "yolo",
        "bare",
        bare_run,
        __doc__,
        argv,
        steps=(60, 120),
        log_every=(10, 20),
        repeats=4,
        show=(
            "model",
            "model_kwargs",
            "head",
            "neck_channels",
            "anchors_per_level",
            "img_size",
            "multiscale",
            "ema_decay",
            "clip_grad",
        ),
        note="bare fp32",
        last=("--export", "false", "--plot_images", "0"),
    )


if __name__ == "__main__":
    main()
