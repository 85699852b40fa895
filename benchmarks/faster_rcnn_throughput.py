"""Faster R-CNN: recipes/faster_rcnn.py against a bare PyTorch loop, side by side.

bare    a plain loop on the recipe's model (``create_model`` of recipes/faster_rcnn_model.py, same initial
        weights), data (its training images, ``data_transforms``, ``AspectRatioBatchSampler``,
        ``list_collate`` of recipes/faster_rcnn_data.py), parameter groups and lr schedule: ``SGD``, the lr
        written every step, the plain sum of the four losses, ``clip_grad_norm_``, fp32, ``loss.item()`` every
        step.
recipe  its ``main()``: Accelerate, the config's precision and loss weights, on-device meters and guard.
In fp32 the last-interval losses agree closely (torchvision's samplers draw from the global RNG, which the
sides seed alike but do not consume identically). Timing and report: benchmarks/timing.py.
Reproduce benchmarks/RESULTS.md (offline; the demo config, 4 repeats of 60 steps; 3 minutes on 1 core):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline taskset -c 1 python benchmarks/faster_rcnn_throughput.py --num_workers 0
    # GPU: resnet50-FPN at 800 px, batch 8, bf16 (digits scenes upscaled to 800 px)
    python benchmarks/faster_rcnn_throughput.py --device cuda --mixed_precision bf16 --batch_size 8 \\
        --num_workers 8 -- --model fasterrcnn_resnet50_fpn --anchor_sizes "[]" --min_size 800 --max_size 1333 \\
        --fpn_channels 256 --rpn_pre_nms_top_n 2000,1000 --rpn_post_nms_top_n 2000,1000 \\
        --rpn_batch_size_per_image 256 --box_batch_size_per_image 512 --roi_sampling_ratio 2 --lr 0.01
"""

from __future__ import annotations

import argparse

import torch

import timing  # same folder; puts the repository root and recipes/ on sys.path


def bare_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed

    from common.detection.data import DetectionDataset, load_detection
    from common.loaders import loader_kwargs
    from common.schedules import schedule, weight_decay_groups
    from faster_rcnn_data import AspectRatioBatchSampler, data_transforms, has_boxes, list_collate  # beside the recipe
    from faster_rcnn_model import create_model

    device = torch.device(args.device)
    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    if not cfg.keep_empty:  # as the recipe: only images with a box to learn
        data.train = data.train.select([i for i, o in enumerate(data.train["objects"]) if has_boxes(o)])
    train_tf = data_transforms(True, cfg.hflip, cfg.color_jitter)
    train_set = DetectionDataset(data.train, train_tf, cfg.seed, max(cfg.min_size))  # decoded reduced, as the recipe
    aspect = [w / h for w, h in zip(data.train["width"], data.train["height"])]
    sampler = AspectRatioBatchSampler(aspect, cfg.batch_size, cfg.seed, True, 1, cfg.aspect_ratio_group_factor)
    loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=sampler, collate_fn=list_collate, **loader_kwargs(cfg.num_workers)
    )
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    model = create_model(cfg, len(data.classes)).to(device).train()
    peak = cfg.peak_lr(1)  # as the recipe: lr carried from lr_batch images to the batch
    optimizer = torch.optim.SGD(weight_decay_groups(model, cfg.weight_decay), lr=peak, momentum=cfg.momentum)
    spe = len(loader)
    lr = schedule(
        cfg.sched,
        peak,
        0.0,
        args.steps,
        round(cfg.warmup_epochs * spe),
        peak * cfg.warmup_factor,
        [m * spe for m in cfg.decay_milestones],
        cfg.decay_rate,
        cfg.poly_power,
    )

    def train_step(step: int, batch) -> tuple[float, int]:
        images = [im.to(device, non_blocking=True) for im in batch[0]]
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in batch[1]]
        for group in optimizer.param_groups:
            group["lr"] = float(lr[step])
        loss = sum(model(images, targets).values())
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        return loss.item(), len(images)

    return timing.timed_loop(args, loader, train_step)


def main(argv: list[str] | None = None) -> dict[str, float]:
    return timing.compare(
        "faster_rcnn",
        "bare",
        bare_run,
        __doc__,
        argv,
        steps=(60, 120),
        log_every=(10, 20),
        repeats=4,
        show=("model", "model_kwargs", "fpn_channels", "min_size", "max_size"),
        note="bare fp32",
        last=("--plot_images", "0"),
    )


if __name__ == "__main__":
    main()
