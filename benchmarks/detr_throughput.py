"""DETR training throughput: recipes/detr.py against a loop written as DETR's reference writes it.

What is measured
    Training throughput (images/s) of the same model, data, batch, optimizer, loss and learning-rate
    schedule, two ways, alternated in one process (reference, recipe, recipe, reference, ...):

    reference  a plain PyTorch loop shaped like facebookresearch/detr's ``train_one_epoch``: the
               recipe module's own ``create_model`` and ``create_criterion`` (same initial weights:
               the seed is set as the recipe's Run sets it), the recipe's data pipeline
               (``DetectionDataset`` + ``data_transforms``, ``train_loader_for``, ``detr_collate``,
               same ``--num_workers``), ``torch.optim.AdamW`` on the same two parameter groups (backbone
               at ``lr_backbone``), the lr written every step, ``clip_grad_norm_``, fp32 always, and,
               every step as the reference does: the box count read with ``.item()`` before the loss,
               a distributed reduce of the loss dict (``all_reduce`` when a process group exists, a
               no-op in one process as in the reference) and ``.item()`` of the total and of every term
               (its MetricLogger takes host floats).
    recipe     ``recipes/detr.py``'s real ``main(argv)``, called in-process: Accelerate's prepared model,
               optimizer and loaders, ``--mixed_precision`` as given, on-device meters and the
               non-finite guard (no ``.item()`` in the loop; the matcher's one copy of the stacked cost
               matrices to the host is the only synchronisation). Its throughput is read back from the
               run's ``metrics.jsonl`` (``train/images_per_s`` and ``train/s_per_step``).

    Timing as in ``benchmarks/overhead.py``: host wall clock over intervals of ``--log_every`` steps,
    each closed by a device synchronisation; the first interval (loader start-up) is warm-up and
    skipped; the recipe's final evaluation and checkpoint fall outside its intervals. Reported: the
    median of each side over ``--repeats`` runs and the ratio recipe / reference, and as a check
    against bursts of load from other processes the medians over all timed intervals pooled. The mean
    loss of the last interval of each side is printed too: same initial weights, data order and
    schedule, so in fp32 they agree closely.

Run (offline; CPU defaults = the recipe's built-in demo config, a few minutes on 1 core with --num_workers 0):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/detr_throughput.py --num_workers 0
    # GPU, the issue's setting: DETR-R50 at 800 px, batch 8, bf16 (digits scenes upscaled to 800 px)
    python benchmarks/detr_throughput.py --device cuda --mixed_precision bf16 --batch_size 8 \\
        --num_workers 8 -- --model resnet50 --model_kwargs "{}" --out_index -1 --scales 800 --max_size 1333 \\
        --d_model 256 --enc_layers 6 --dec_layers 6 --dim_feedforward 2048 --dropout 0.1 --num_queries 100 \\
        --lr 1e-4 --lr_backbone 1e-5 --warmup_epochs 0

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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  same folder: machine line, timing helpers, alternation, recipe import


def reduce_dict(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's ``utils.reduce_dict``: the mean over processes (nothing to do in one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values
    names = sorted(values)
    stacked = torch.stack([values[k] for k in names])
    dist.all_reduce(stacked)
    return dict(zip(names, stacked / dist.get_world_size()))


# --------------------------------------------------------------------------------------------
# The reference-style loop
# --------------------------------------------------------------------------------------------
def reference_run(args: argparse.Namespace, recipe: ModuleType, cfg: Any, device: torch.device) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from common.detection import DetectionDataset, load_detection

    data = load_detection(cfg.data, cfg.train_split, cfg.eval_split, seed=cfg.seed)
    train_set = DetectionDataset(data.train, recipe.data_transforms(cfg, True), cfg.seed)
    loader, sampler = recipe.train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1,
                                              collate_fn=recipe.detr_collate)
    set_seed(cfg.seed)  # as the recipe's Run does before building the model: same initial weights
    model = recipe.create_model(cfg, len(data.classes)).to(device).train()
    criterion = recipe.create_criterion(cfg, len(data.classes)).to(device)
    weight_dict = criterion.weight_dict
    backbone = [p for p in model.backbone.parameters() if p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": rest, "lr": cfg.lr}, {"params": backbone, "lr": cfg.lr_backbone}],
                                  lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(loader)
    drop_epoch = cfg.lr_drop_epochs or -(-2 * cfg.epochs // 3)
    lr = recipe.schedule("step", 1.0, 0.0, args.steps, round(cfg.warmup_epochs * steps_per_epoch), 0.0,
                         [drop_epoch * steps_per_epoch], 0.1)  # a factor on each group's base lr

    def train_step(step: int, batch: Any) -> float:
        batch_images, mask, targets = batch
        batch_images, mask = batch_images.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)} for t in targets]
        for group, base in zip(optimizer.param_groups, (cfg.lr, cfg.lr_backbone)):
            group["lr"] = base * float(lr[step])
        outputs = model(batch_images, mask)
        # the reference reads the batch's box count on the host (num_boxes ... .item()) in its criterion
        torch.as_tensor(float(sum(len(t["labels"]) for t in targets)), device=device).item()
        loss_dict = criterion(outputs, targets)
        loss = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
        reduced = reduce_dict(loss_dict)  # for logging, every step
        scaled = {k: v * weight_dict[k] for k, v in reduced.items() if k in weight_dict}
        loss_value = sum(scaled.values()).item()
        logged = {k: v.item() for k, v in {**reduced, **scaled}.items()}  # MetricLogger.update takes floats
        del logged
        optimizer.zero_grad()
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        return loss_value

    result = overhead.timed_loop(args, device, loader, sampler, train_step)
    del loader, sampler  # stops persistent workers before the other side runs
    return result


# --------------------------------------------------------------------------------------------
# Main: the recipe side is overhead.detector_recipe_run, the recipe's real main()
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, float]:
    args = overhead.detector_args(__doc__, argv, batch_size=16)
    # the DETR loop is what is compared: no backbone pre-training stage before the recipe's side (the
    # bare side starts from create_model's random weights too); a later flag on the command line wins
    args.recipe_args = ["--pretrain_crops_epochs", "0", *args.recipe_args]
    recipe = overhead.load_recipe("detr")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = recipe.parse_config(recipe.Config, overhead.detector_recipe_argv(args))  # the very config the recipe side runs

    with tempfile.TemporaryDirectory(prefix="detr-bench-") as work:
        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "reference":
                return reference_run(args, recipe, cfg, device)
            return overhead.detector_recipe_run(args, recipe, Path(work) / f"recipe-{r}")

        results = overhead.alternate(args, ("reference", "recipe"), run_side, abba=True)
    return overhead.report_ratio(results, [
        f"model {cfg.model} {cfg.model_kwargs} (level {cfg.out_index}), d_model {cfg.d_model}, {cfg.enc_layers}+"
        f"{cfg.dec_layers} layers, {cfg.num_queries} queries, scales {cfg.scales}, max_size {cfg.max_size}, batch "
        f"{args.batch_size}, {args.device}, data {cfg.data}, {args.num_workers} workers",
        f"precision: recipe {args.mixed_precision}, reference fp32"], args, device)


if __name__ == "__main__":
    main()
