"""Classifier: recipes/classifier.py against a bare PyTorch loop, side by side (the recipe's overhead).

bare    the loop a PyTorch tutorial writes, on the recipe's model (``create_model``, same initial weights)
        and data (the config's dataset, the recipe's ``create_transforms`` of recipes/classifier_model.py
        and reduced decoding, ``ClassificationDataset``, ``train_loader_for``): ``torch.optim.AdamW`` over
        timm's no-weight-decay groups (fused on CUDA, as the recipe) at the recipe's peak lr, constant,
        ``CrossEntropyLoss``, ``torch.autocast`` (and a ``GradScaler`` for fp16); no sync.
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

import timing  # same folder; puts the repository root and recipes/ on sys.path


def bare_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed
    from timm.optim import param_groups_weight_decay

    from classifier_model import create_transforms  # beside the recipe (timing puts recipes/ on sys.path)
    from common.data.classification import ClassificationDataset, load_classification
    from common.data.images import needed_side
    from common.loaders import train_loader_for

    device = torch.device(args.device)
    data = load_classification(
        cfg.data, cfg.image_column, cfg.label_column, cfg.train_split, cfg.eval_split, seed=cfg.seed
    )
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = recipe.create_model(cfg, len(data.classes)).to(device, memory_format=memory_format).train()
    train_tf, _ = create_transforms(cfg, model)
    side = needed_side(cfg.img_size, cfg.scale[0], cfg.ratio)  # as the recipe: JPEGs decoded reduced for the crop
    train_set = ClassificationDataset(data.train, data.image_column, data.label_column, train_tf, cfg.seed, side)
    loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1)
    fused = {"fused": True} if device.type == "cuda" else {}
    lr = cfg.peak_lr(1)  # the recipe's peak: lr carried from lr_batch images to the batch
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, cfg.weight_decay), lr=lr, **fused)
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
