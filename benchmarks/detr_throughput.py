"""DETR: recipes/detr.py against a loop written as DETR's reference writes it, side by side.

reference  facebookresearch/detr's ``train_one_epoch`` on the recipe's model and criterion (same initial
           weights), data (``data_transforms``, ``detr_collate`` of recipes/detr_data.py) and lr schedule:
           ``AdamW`` on two groups (backbone at ``lr_backbone``, both carried from ``lr_batch`` images to the
           batch as the recipe carries them), the lr written every step, ``clip_grad_norm_``, fp32, and every
           step the box count read with ``.item()`` and ``.item()`` of the total and of every term (its
           MetricLogger).
recipe     its ``main()`` without the backbone pre-training stage: Accelerate, the config's precision,
           on-device meters and guard (the matcher's one copy of the cost matrices to the host is its sync).
In fp32 the last-interval losses agree closely. Timing and report: benchmarks/timing.py.
Reproduce benchmarks/RESULTS.md (offline; the demo config):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/detr_throughput.py --num_workers 0 --repeats 2 \\
        --steps 30 --log_every 10
    # GPU: DETR-R50 at 800 px, batch 8, bf16 (digits scenes upscaled to 800 px)
    python benchmarks/detr_throughput.py --device cuda --mixed_precision bf16 --batch_size 8 \\
        --num_workers 8 -- --model resnet50 --model_kwargs "{}" --out_index -1 --scales 800 --max_size 1333 \\
        --d_model 256 --enc_layers 6 --dec_layers 6 --dim_feedforward 2048 --dropout 0.1 --num_queries 100 \\
        --lr 1e-4 --lr_backbone 1e-5 --warmup_epochs 0
"""

from __future__ import annotations

import argparse

import torch

import timing  # same folder; puts the repository root and recipes/ on sys.path


def reference_run(args: argparse.Namespace, recipe, cfg) -> timing.Intervals:
    from accelerate.utils import set_seed

    from common.detection.data import DetectionDataset, load_detection
    from common.loaders import train_loader_for
    from common.schedules import schedule
    from detr_data import data_transforms, detr_collate  # beside the recipe (timing puts recipes/ on sys.path)

    device = torch.device(args.device)
    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    side = max([*cfg.scales, *cfg.crop_resize])  # as the recipe: JPEGs decoded reduced to its largest size
    train_set = DetectionDataset(data.train, data_transforms(cfg, True), cfg.seed, side)
    loader = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1, collate_fn=detr_collate)
    set_seed(cfg.seed)  # as the recipe's Run: the same initial weights
    model = recipe.create_model(cfg, len(data.classes)).to(device).train()
    criterion = recipe.create_criterion(cfg, len(data.classes)).to(device)
    weight_dict = criterion.weight_dict
    backbone = [p for p in model.backbone.parameters() if p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    peak = cfg.peak_lr(1)  # as the recipe: lr and lr_backbone carried from lr_batch images by one factor
    peaks = (peak, cfg.lr_backbone * peak / cfg.lr if cfg.lr else 0.0)
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": peaks[0]}, {"params": backbone, "lr": peaks[1]}],
        lr=peak,
        weight_decay=cfg.weight_decay,
    )
    spe = len(loader)
    drop = (cfg.lr_drop_epochs or -(-2 * cfg.epochs // 3)) * spe
    factor = schedule("step", 1.0, 0.0, args.steps, round(cfg.warmup_epochs * spe), 0.0, [drop], 0.1)

    def train_step(step: int, batch) -> tuple[float, int]:
        images, mask = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in batch[2]]
        for group, base in zip(optimizer.param_groups, peaks):
            group["lr"] = base * float(factor[step])
        outputs = model(images, mask)
        torch.as_tensor(float(sum(len(t["labels"]) for t in targets)), device=device).item()  # num_boxes
        loss_dict = criterion(outputs, targets)
        loss = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
        reduced = loss_dict  # utils.reduce_dict for logging, every step: an all_reduce, a no-op in one process
        scaled = {k: v * weight_dict[k] for k, v in reduced.items() if k in weight_dict}
        loss_value = sum(scaled.values()).item()
        {k: v.item() for k, v in {**reduced, **scaled}.items()}  # MetricLogger.update takes host floats
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        return loss_value, len(images)

    return timing.timed_loop(args, loader, train_step)


def main(argv: list[str] | None = None) -> dict[str, float]:
    return timing.compare(
        "detr",
        "reference",
        reference_run,
        __doc__,
        argv,
        steps=(60, 120),
        log_every=(10, 20),
        repeats=4,
        show=(
            "model",
            "model_kwargs",
            "out_index",
            "d_model",
            "enc_layers",
            "dec_layers",
            "num_queries",
            "scales",
            "max_size",
        ),
        note="reference fp32",
        defaults=("--pretrain_crops_epochs", "0"),
        last=("--plot_images", "0"),
    )


if __name__ == "__main__":
    main()
