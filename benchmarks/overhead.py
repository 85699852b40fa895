"""Classifier: recipes/classifier.py against a bare PyTorch loop, side by side (the recipe's overhead).

bare    the loop a PyTorch tutorial writes, on the recipe's model (``create_model``, same initial weights)
        and data (the config's dataset and transforms, ``ClassificationDataset``, ``train_loader_for``):
        ``torch.optim.AdamW`` over timm's no-weight-decay groups (fused on CUDA, as the recipe) at a
        constant lr, ``CrossEntropyLoss``, ``torch.autocast`` (and a ``GradScaler`` for fp16); no sync.
recipe  its ``main()``: Accelerate's prepared model, optimizer and loader, the per-step lr, meters,
        non-finite guard, progress bar, stop checks. Target: recipe / bare >= 0.97 (images/s).
``--synthetic`` (default on CUDA, where 32-px digits starve the GPU): random ``img_size``-px JPEGs,
still decoded and augmented by the loader workers: a high data wait means the ratio says little.
Timing and report: benchmarks/timing.py. Reproduce benchmarks/RESULTS.md (offline; resnet18 at 32 px,
batch 64, digits, 1 worker, 1 thread on 2 cores, 5 repeats of 30 steps; about 3 minutes):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/overhead.py
    python benchmarks/overhead.py --device cuda --synthetic --model resnet50 --img_size 224 --batch_size 256 \\
        --mixed_precision bf16 --channels_last
"""

from __future__ import annotations

import argparse

import torch

import timing  # same folder; puts the repository root on sys.path


def bare_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed
    from timm.data import create_transform, resolve_data_config
    from timm.optim import param_groups_weight_decay

    from common.data import ClassificationDataset, load_classification
    from common.loaders import train_loader_for

    device = torch.device(args.device)
    data = load_classification(
        cfg.data, cfg.image_column, cfg.label_column, cfg.train_split, cfg.eval_split, seed=cfg.seed
    )
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = recipe.create_model(cfg, len(data.classes)).to(device, memory_format=memory_format).train()
    data_cfg = resolve_data_config(
        {"input_size": (3, cfg.img_size, cfg.img_size), "crop_pct": cfg.crop_pct, "interpolation": cfg.interpolation},
        model=model,
    )
    train_tf = create_transform(
        **data_cfg,
        is_training=True,
        scale=tuple(cfg.scale),
        ratio=tuple(cfg.ratio),
        hflip=cfg.hflip,
        color_jitter=cfg.color_jitter or None,
        auto_augment=cfg.auto_augment or None,
        re_prob=cfg.reprob,
    )
    train_set = ClassificationDataset(data.train, data.image_column, data.label_column, train_tf, cfg.seed)
    loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, cfg.weight_decay), lr=cfg.lr, **fused)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.smoothing)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)

    def train_step(step: int, batch) -> tuple[torch.Tensor, int]:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = criterion(model(x.contiguous(memory_format=memory_format)), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), len(x)

    return timing.timed_loop(args, loader, train_step)


def main(argv: list[str] | None = None) -> dict[str, float]:
    return timing.compare(
        "classifier",
        "bare",
        bare_run,
        __doc__,
        argv,
        steps=(30, 200),
        log_every=(5, 20),
        repeats=5,
        show=("model", "img_size", "channels_last"),
        defaults=("--smoothing", "0"),
        synthetic="img_size",
        target=(0.97, 0.97),
    )


if __name__ == "__main__":
    main()
