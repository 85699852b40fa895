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
import statistics
import sys
import tempfile
import time
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


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line; also parsed into the Config that the reference side uses."""
    return [*args.recipe_args, "--report_to", "none", "--batch_size", str(args.batch_size),
            "--max_steps", str(args.steps), "--log_every", str(args.log_every), "--epochs", "1000",
            "--eval_every", "100000", "--checkpoint_every", "10000000", "--plot_images", "0",
            "--num_workers", str(args.num_workers), "--mixed_precision", args.mixed_precision]


def summarise(intervals: list[tuple[float, int, float, float]]) -> dict[str, Any]:
    """(seconds, images, mean loss, seconds waiting for data) per interval -> images/s and the rest."""
    seconds = sum(t for t, _, _, _ in intervals)
    return {"images_per_s": sum(n for _, n, _, _ in intervals) / seconds, "seconds": seconds,
            "data_wait": sum(w for _, _, _, w in intervals) / seconds,
            "interval_rates": [n / t for t, n, _, _ in intervals], "final_loss": intervals[-1][2]}


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

    step, images, loss_sum, data_seconds = 0, 0, 0.0, 0.0
    intervals: list[tuple[float, int, float, float]] = []
    start = time.perf_counter()
    for epoch in range(10**6):
        sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for batch_images, mask, targets in loader:
            data_seconds += time.perf_counter() - tick
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
            loss_sum += loss_value
            step += 1
            images += len(batch_images)
            if step % args.log_every == 0:
                overhead.sync(device)
                now = time.perf_counter()
                intervals.append((now - start, images, loss_sum / args.log_every, data_seconds))
                start, images, loss_sum, data_seconds = now, 0, 0.0, 0.0
            if step == args.steps:
                break
            tick = time.perf_counter()
        if step == args.steps:
            break
    del loader, sampler  # stops persistent workers before the other side runs
    return summarise(intervals[1:])


# --------------------------------------------------------------------------------------------
# The recipe's real main()
# --------------------------------------------------------------------------------------------
def recipe_run(args: argparse.Namespace, recipe: ModuleType, out_dir: Path) -> dict[str, Any]:
    timed = overhead.timed_recipe_intervals(args, recipe, recipe_argv(args) + ["--output_dir", str(out_dir)],
                                            out_dir, None)
    intervals = []
    for r in timed:
        seconds = r["train/s_per_step"] * args.log_every  # every logged interval is log_every steps
        intervals.append((seconds, r["train/images_per_s"] * seconds, r["train/loss"], r["train/data_wait"] * seconds))
    return summarise(intervals)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, default=16, help="per step (the recipe's default: 16)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run, warm-up included (0: 40 on cpu, 120 on cuda)")
    p.add_argument("--log_every", type=int, default=0, help="steps per timed interval, the first is warm-up (0: 10 on cpu, 20 on cuda)")
    p.add_argument("--repeats", type=int, default=4, help="reference/recipe pairs, in ABBA order")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader workers (both sides)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores minus workers, at least 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no", help="the recipe's precision (reference: fp32)")
    p.add_argument("--verbose", action="store_true", help="show the recipe's own output")
    args = p.parse_args(argv)
    args.recipe_args = recipe_args
    cuda = args.device == "cuda"
    args.steps = args.steps or (120 if cuda else 40)
    args.log_every = args.log_every or (20 if cuda else 10)
    if args.steps % args.log_every or args.steps < 2 * args.log_every:
        p.error("--steps must be a multiple of --log_every and at least 2 x --log_every")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.threads <= 0:
        args.threads = max(1, overhead.cores() - args.num_workers)
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.device == "cpu":  # else the recipe's Accelerator picks a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["ACCELERATE_USE_CPU"] = "1"
    recipe = overhead.load_recipe("detr")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = recipe.parse_config(recipe.Config, recipe_argv(args))  # the very config the recipe side runs

    with tempfile.TemporaryDirectory(prefix="detr-bench-") as work:
        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "reference":
                return reference_run(args, recipe, cfg, device)
            return recipe_run(args, recipe, Path(work) / f"recipe-{r}")

        results = overhead.alternate(args, ("reference", "recipe"), run_side, abba=True)

    ref = statistics.median(x["images_per_s"] for x in results["reference"])
    rec = statistics.median(x["images_per_s"] for x in results["recipe"])
    pooled = {side: statistics.median(v for x in xs for v in x["interval_rates"]) for side, xs in results.items()}
    n_intervals = len(results["reference"][0]["interval_rates"])
    print()
    print(f"model {cfg.model} {cfg.model_kwargs} (level {cfg.out_index}), d_model {cfg.d_model}, {cfg.enc_layers}+"
          f"{cfg.dec_layers} layers, {cfg.num_queries} queries, scales {cfg.scales}, max_size {cfg.max_size}, batch "
          f"{args.batch_size}, {args.device}, data {cfg.data}, {args.num_workers} workers")
    print(f"precision: recipe {args.mixed_precision}, reference fp32; {args.repeats} repeats in ABBA order, each of "
          f"{args.steps} steps: {args.log_every} warm-up, then {n_intervals} timed intervals of {args.log_every}")
    print(f"machine: {overhead.machine(device, args.threads)}")
    runs = {side: ", ".join(f"{x['images_per_s']:.1f}" for x in xs) for side, xs in results.items()}
    print(f"reference {ref:9.1f} img/s   runs: {runs['reference']}")
    print(f"recipe    {rec:9.1f} img/s   runs: {runs['recipe']}")
    print(f"ratio     {rec / ref:9.3f}         recipe / reference")
    print(f"check: medians over all {n_intervals * args.repeats} timed intervals: reference {pooled['reference']:.1f}, "
          f"recipe {pooled['recipe']:.1f} img/s, ratio {pooled['recipe'] / pooled['reference']:.3f}")
    return {"reference": ref, "recipe": rec, "ratio": rec / ref, "ratio_intervals": pooled["recipe"] / pooled["reference"]}


if __name__ == "__main__":
    main()
