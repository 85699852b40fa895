"""YOLO training throughput: recipes/yolo.py against a bare PyTorch loop, side by side.

What is measured
    Training throughput (images/s) of the same model, data, batch, optimizer, schedule and EMA,
    two ways, alternated in one process (bare, recipe, recipe, bare, bare, ...):

    bare    a plain loop as the usual YOLO training scripts write it: the recipe module's own
            ``create_model`` with the same anchors (``anchors_for``: the config's or k-means) and
            the same initial weights (seeded as the recipe's Run seeds), the recipe's data pipeline
            (``YoloTrainSet`` over ``DetectionDataset`` with ``detection_transforms``,
            ``train_loader_for``, ``train_collate``, same ``--num_workers``), ``torch.optim.AdamW``
            or ``SGD`` on the same parameter groups, the lr written into the groups every step,
            ``yolo_loss``, ``clip_grad_norm_`` when the config clips, the same ``ModelEma`` update,
            fp32 always, and ``loss.item()`` every step (what a loop that prints its loss does).
    recipe  ``recipes/yolo.py``'s real ``main(argv)``, called in-process: Accelerate's prepared
            model, optimizer and loader, ``--mixed_precision`` as given, multi-scale when the
            config has it (the bare side trains at ``img_size`` only, so compare without it),
            on-device meters and the non-finite guard (no ``.item()`` in the loop), progress bar
            and stop checks. Export and evaluation are off. Its throughput is read back from the
            run's ``metrics.jsonl`` (``train/images_per_s``, ``train/s_per_step``).

    Timing as in ``benchmarks/overhead.py``: host wall clock over intervals of ``--log_every``
    steps, each closed by a device synchronisation; the first interval is warm-up and skipped.
    Reported: the median images/s of each side over ``--repeats`` runs and the ratio recipe /
    bare, and as a check against bursts of load from other processes the medians over all timed
    intervals pooled. In fp32 the two sides' last-interval losses agree closely (same weights,
    data order and schedule; not bit for bit, the recipe sums its loss terms in another order).

Run (offline; CPU defaults = the recipe's built-in demo config, about 4 minutes on 1 core):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/yolo_throughput.py --num_workers 0
    # GPU: the COCO config's model at 416 px, batch 64, bf16 (digits scenes upscaled)
    python benchmarks/yolo_throughput.py --device cuda --mixed_precision bf16 --batch_size 64 \\
        --num_workers 8 -- --config configs/yolo/coco_cspdarknet53.yaml --img_size 416 --multiscale "[]"

Everything after ``--`` goes to the recipe's config (and so to both sides).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  same folder: machine line, timing helpers, alternation, recipe import


# --------------------------------------------------------------------------------------------
# The bare loop
# --------------------------------------------------------------------------------------------
def bare_run(args: argparse.Namespace, recipe: ModuleType, cfg: Any, device: torch.device) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from common.data import train_loader_for
    from common.detection import DetectionDataset, load_detection
    from common.ema import ModelEma

    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    train_tf = recipe.detection_transforms(True, cfg.img_size, scale_range=tuple(cfg.scale_range), hflip=cfg.hflip,
                                           color_jitter=cfg.color_jitter)
    train_set = recipe.YoloTrainSet(DetectionDataset(data.train, train_tf, cfg.seed), cfg.img_size, cfg.mosaic,
                                    cfg.mixup, cfg.epochs - cfg.no_aug_epochs, cfg.seed)
    loader, sampler = train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1,
                                       collate_fn=recipe.train_collate)
    set_seed(cfg.seed)  # as the recipe's Run does before building the model: same initial weights
    model = recipe.create_model(cfg, len(data.classes), recipe.anchors_for(cfg, data.train)).to(device).train()
    groups = recipe.weight_decay_groups(model, cfg.weight_decay)
    if cfg.opt == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    if ema is not None:
        ema.module.to(device)
    steps_per_epoch = len(loader)
    lr = recipe.schedule(cfg.sched, cfg.lr, cfg.min_lr, args.steps, round(cfg.warmup_epochs * steps_per_epoch),
                         cfg.warmup_lr, [m * steps_per_epoch for m in cfg.decay_milestones], cfg.decay_rate)
    size = cfg.img_size

    def train_step(step: int, batch: Any) -> float:
        batch_images, targets = batch
        batch_images = batch_images.to(device, non_blocking=True)
        targets = {k: v.to(device, non_blocking=True) for k, v in targets.items()}
        for group in optimizer.param_groups:
            group["lr"] = float(lr[step])
        losses = recipe.yolo_loss(model, model(batch_images), targets, size, size, cfg.ignore_iou, cfg.label_smoothing)
        loss = sum(losses.values())
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        if ema is not None:
            ema.update(model, step + 1)
        return loss.item()  # the host sync every step

    result = overhead.timed_loop(args, device, loader, sampler, train_step)
    del loader, sampler  # stops persistent workers before the other side runs
    return result


# --------------------------------------------------------------------------------------------
# Main: the recipe side is overhead.detector_recipe_run, the recipe's real main()
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, float]:
    args = overhead.detector_args(__doc__, argv, batch_size=16)
    recipe = overhead.load_recipe("yolo")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = recipe.parse_config(recipe.Config, overhead.detector_recipe_argv(args) + ["--export", "false"])

    with tempfile.TemporaryDirectory(prefix="yolo-bench-") as work:
        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "bare":
                return bare_run(args, recipe, cfg, device)
            return overhead.detector_recipe_run(args, recipe, Path(work) / f"recipe-{r}", ["--export", "false"])

        results = overhead.alternate(args, ("bare", "recipe"), run_side, abba=True)
    return overhead.report_ratio(results, [
        f"model {cfg.model} {cfg.model_kwargs}, neck {cfg.neck_channels}, {3 * cfg.anchors_per_level} anchors, "
        f"{cfg.img_size} px{' (recipe multi-scale ' + str(cfg.multiscale) + ')' if cfg.multiscale else ''}, "
        f"batch {args.batch_size}, {args.device}, data {cfg.data}, {args.num_workers} workers",
        f"precision: recipe {args.mixed_precision}, bare fp32; EMA {cfg.ema_decay}, clip {cfg.clip_grad}"], args, device)


if __name__ == "__main__":
    main()
