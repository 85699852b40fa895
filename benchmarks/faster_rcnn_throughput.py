"""Faster R-CNN training throughput: recipes/faster_rcnn.py against a bare PyTorch loop, side by side.

What is measured
    Training throughput (images/s) of the same model, data, batch, optimizer and learning-rate
    schedule, two ways, alternated in one process (bare, recipe, recipe, bare, bare, ...):

    bare    a plain PyTorch loop: the recipe module's own ``create_model`` (same initial weights:
            the seed is set as the recipe's Run sets it), the recipe's data pipeline
            (``DetectionDataset`` + ``data_transforms``, ``AspectRatioBatchSampler``,
            ``list_collate``, same ``--num_workers``), ``torch.optim.SGD`` on the same parameter
            groups, the lr written into the groups every step, the plain sum of the four losses,
            ``clip_grad_norm_`` when the config clips, fp32 always, and ``loss.item()`` every step
            (what a loop that prints or checks its loss does).
    recipe  ``recipes/faster_rcnn.py``'s real ``main(argv)``, called in-process: Accelerate's
            prepared model, optimizer and loaders, ``--mixed_precision`` as given, the weighted
            loss, on-device meters and the non-finite guard (no ``.item()`` in the loop). Its
            throughput is read back from the run's ``metrics.jsonl`` (``train/images_per_s`` and
            ``train/s_per_step`` of ``common/meters.Meters``).

    Timing as in ``benchmarks/overhead.py``: host wall clock over intervals of ``--log_every``
    steps, each closed by a device synchronisation (the recipe's meters read their sums there);
    the first interval (loader start-up, first iterations) is warm-up and skipped. The recipe's
    final evaluation and checkpoint fall outside its intervals. Reported: the median of each side
    over ``--repeats`` runs and the ratio recipe / bare, and as a check against bursts of load from
    other processes the medians over all timed intervals pooled. The mean loss of the last
    interval of each side is printed too: same initial weights, data order and schedule, so in fp32
    they agree closely (torchvision's samplers draw from the global RNG, which the two sides seed
    alike but do not consume identically, so not bit for bit).

Run (offline; CPU defaults = the recipe's built-in demo config, about 3 minutes on 1 core with --num_workers 0):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/faster_rcnn_throughput.py
    # GPU, the issue's setting: resnet50-FPN at 800 px, batch 8, bf16 (digits scenes upscaled to 800 px)
    python benchmarks/faster_rcnn_throughput.py --device cuda --mixed_precision bf16 --batch_size 8 \\
        --num_workers 8 -- --model fasterrcnn_resnet50_fpn --anchor_sizes "[]" --min_size 800 --max_size 1333 \\
        --fpn_channels 256 --rpn_pre_nms_top_n 2000,1000 --rpn_post_nms_top_n 2000,1000 \\
        --rpn_batch_size_per_image 256 --box_batch_size_per_image 512 --roi_sampling_ratio 2 --lr 0.01

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

    from common.data import loader_kwargs
    from common.detection import DetectionDataset, load_detection

    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    train_set = DetectionDataset(data.train, recipe.data_transforms(True, cfg.hflip, cfg.color_jitter), cfg.seed)
    sampler = recipe.AspectRatioBatchSampler([w / h for w, h in zip(data.train["width"], data.train["height"])],
                                             cfg.batch_size, cfg.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=recipe.list_collate,
                                         **loader_kwargs(cfg.num_workers))
    set_seed(cfg.seed)  # as the recipe's Run does before building the model: same initial weights
    model = recipe.create_model(cfg, len(data.classes)).to(device).train()
    optimizer = torch.optim.SGD(recipe.weight_decay_groups(model, cfg.weight_decay), lr=cfg.lr, momentum=cfg.momentum)
    steps_per_epoch = len(loader)
    lr = recipe.schedule(cfg.sched, cfg.lr, 0.0, args.steps, round(cfg.warmup_epochs * steps_per_epoch),
                         cfg.lr * cfg.warmup_factor, [m * steps_per_epoch for m in cfg.decay_milestones],
                         cfg.decay_rate, cfg.poly_power)

    def train_step(step: int, batch: Any) -> float:
        batch_images, targets = batch
        batch_images = [im.to(device, non_blocking=True) for im in batch_images]
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
        for group in optimizer.param_groups:
            group["lr"] = float(lr[step])
        losses = model(batch_images, targets)
        loss = sum(losses.values())
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        return loss.item()  # the host sync every step

    result = overhead.timed_loop(args, device, loader, sampler, train_step)
    del loader, sampler  # stops persistent workers before the other side runs
    return result


# --------------------------------------------------------------------------------------------
# Main: the recipe side is overhead.detector_recipe_run, the recipe's real main()
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, float]:
    args = overhead.detector_args(__doc__, argv, batch_size=8)
    recipe = overhead.load_recipe("faster_rcnn")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = recipe.parse_config(recipe.Config, overhead.detector_recipe_argv(args))  # the very config the recipe side runs

    with tempfile.TemporaryDirectory(prefix="faster-rcnn-bench-") as work:
        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "bare":
                return bare_run(args, recipe, cfg, device)
            return overhead.detector_recipe_run(args, recipe, Path(work) / f"recipe-{r}")

        results = overhead.alternate(args, ("bare", "recipe"), run_side, abba=True)
    return overhead.report_ratio(results, [
        f"model {cfg.model} {cfg.model_kwargs}, FPN {cfg.fpn_channels}, min_size {cfg.min_size}, max_size "
        f"{cfg.max_size}, batch {args.batch_size}, {args.device}, data {cfg.data}, {args.num_workers} workers",
        f"precision: recipe {args.mixed_precision}, bare fp32"], args, device)


if __name__ == "__main__":
    main()
