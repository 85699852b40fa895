"""DINO training throughput: recipes/dino.py against a loop written as the DINO reference code, side by side.

What is measured
    Training throughput (images/s, an image = its 2 global + N local crops) of the same student
    and teacher, loss, batch, schedules and data, two ways, alternated in one process
    (reference, recipe, recipe, reference, reference, ...):

    reference  a loop written the way facebookresearch/dino ``main_dino.py`` ``train_one_epoch``
               is: the recipe module's own ``create_student`` (backbone, ``DINOHead``, ``MultiCropWrapper``),
               ``DINOLoss`` and ``weight_decay_groups`` (so model and loss are identical), the teacher a
               copy of the student without drop path and with ``requires_grad = False``; plain
               ``torch.optim.AdamW`` (``foreach=False``: one parameter at a time, as the AdamW of
               the reference's era);
               a Python loop writing lr and weight decay into the param groups every step;
               ``math.isfinite(loss.item())`` every step; ``utils.clip_gradients`` (a Python loop
               over parameters, ``p.grad.data.norm(2)``, ``.item()``, ``if clip_coef < 1``: one
               host-device synchronisation per parameter); ``cancel_gradients_last_layer``; the
               teacher EMA as a Python loop ``param_k.data.mul_(m).add_((1 - m) * param_q.data)``;
               ``torch.cuda.synchronize()`` and ``loss.item()`` for the metric logger every step.
               Precision: fp32; on CUDA with ``--mixed_precision fp16`` or ``bf16``, fp16 autocast
               with a ``GradScaler`` (the reference's default ``--use_fp16 true``; it has no bf16).
    recipe     ``recipes/dino.py``'s real ``main(argv)``, called in-process: Accelerate's prepared
               student/optimizer/loader, fused AdamW on CUDA, foreach per-parameter clipping and
               foreach EMA, on-device meters and non-finite guard (no per-step host sync),
               optional ``torch.compile`` (``--compile``: the recipe side only; the reference is
               eager). Its throughput is read back from the run folder's ``metrics.jsonl``
               (``train/images_per_s``, ``train/s_per_step`` of ``common/meters.Meters``).

    Both sides consume the same data. Default: the built-in ``digits`` through the recipe's own
    pipeline (``ClassificationDataset`` with the recipe's ``MultiCrop`` transform,
    ``common.data.train_loader_for``, same ``--num_workers``; the recipe is run with
    ``--data digits``). ``--synthetic`` (meant for GPU runs, where the digits loader would be the
    bottleneck): a few pre-generated random crop batches already on the device, through the same
    single-process DataLoader on both sides; for the recipe the benchmark rebinds the name
    ``train_loader_for`` inside the imported recipe module (the file is not changed), as
    ``benchmarks/overhead.py`` does, and fails if the recipe never called it.

    Timing as in ``benchmarks/overhead.py``: host wall clock over intervals of ``--log_every``
    steps, each closed by a device synchronisation; the first interval (loader start-up, first
    iterations, compilation) is warm-up and skipped. The recipe's step-0 kNN baselines, final kNN
    evaluation, checkpoint and weight saving fall outside its intervals (``--knn_train_limit 64``
    and ``--attention_images 0`` keep them short). A run's images/s = images / seconds over its
    timed intervals. Reported: the median of each side over ``--repeats`` runs, the ratio
    recipe / reference (target >= 1.3 on a GPU, >= 1 on CPU), and as a check against bursts of
    load from other processes the medians over all timed intervals pooled and the median of the
    per-repeat ratios (each recipe run over the adjacent reference run of the same repeat). The
    mean loss of the last interval of each side is printed too: same initial weights, data order
    and schedules, so it agrees closely (on CPU in fp32 to the 4 printed decimals; not necessarily bit for bit, as
    clipping and EMA are computed differently, and on CUDA the two sides' precisions differ).

Run (offline; about 3.5 minutes on 2 busy CPU cores with the defaults):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/dino_throughput.py
    python benchmarks/dino_throughput.py --device cuda --synthetic --model vit_small_patch16_224 \\
        --model_kwargs "{}" --global_size 224 --local_size 96 --local_crops 10 --batch_size 64 \\
        --out_dim 65536 --mixed_precision bf16          # reference side: fp16 + GradScaler

Threads: ``torch.set_num_threads(--threads)`` before each side (default: the CPU cores left after
the DataLoader workers, at least 1).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  same folder: machine line, synthetic loader, rebinding, signal handlers

TARGET = {"cuda": 1.3, "cpu": 1.0}
KNN_TRAIN_LIMIT = 64  # the recipe's kNN memory bank: its step-0 and final evaluations stay short


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line; also parsed into the Config that the reference side uses."""
    return ["--data", "digits", "--report_to", "none", "--model", args.model, "--model_kwargs", args.model_kwargs,
            "--global_size", str(args.global_size), "--local_size", str(args.local_size),
            "--local_crops", str(args.local_crops), "--batch_size", str(args.batch_size), "--out_dim", str(args.out_dim),
            "--head_hidden_dim", str(args.head_hidden_dim), "--max_steps", str(args.steps),
            "--log_every", str(args.log_every), "--eval_every", "1000", "--epochs", "1000",
            "--checkpoint_every", "100000", "--attention_images", "0", "--knn_train_limit", str(KNN_TRAIN_LIMIT),
            "--num_workers", str(args.num_workers), "--mixed_precision", args.mixed_precision,
            "--compile", str(args.compile).lower(), "--opt", "adamw"]  # the reference side is AdamW


def schedules(recipe: ModuleType, cfg: Any, steps_per_epoch: int, total_steps: int):
    """lr, weight decay and teacher momentum per step, exactly as the recipe computes them."""
    lr = recipe.schedule("cosine", cfg.lr * cfg.batch_size / 256, cfg.min_lr, total_steps,
                         round(cfg.warmup_epochs * steps_per_epoch))
    wd = recipe.schedule("cosine", cfg.weight_decay, cfg.weight_decay_end, total_steps)
    momentum = recipe.schedule("cosine", cfg.momentum_teacher, 1.0, total_steps)
    return lr, wd, momentum


def synthetic_batches(args: argparse.Namespace, device: torch.device) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """A few random ([2 global + N local crops], labels) batches on the device."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(args.synthetic_batches):
        crops = [torch.randn(args.batch_size, 3, s, s, generator=g, device=device)
                 for s in [args.global_size] * 2 + [args.local_size] * args.local_crops]
        out.append((crops, torch.randint(0, 10, (args.batch_size,), generator=g, device=device)))
    return out


# --------------------------------------------------------------------------------------------
# Reference-style loop (facebookresearch/dino main_dino.py train_one_epoch, utils.clip_gradients,
# utils.cancel_gradients_last_layer)
# --------------------------------------------------------------------------------------------
def clip_gradients(model: torch.nn.Module, clip: float) -> list[float]:
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch: int, model: torch.nn.Module, freeze_last_layer: int) -> None:
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def reference_run(args: argparse.Namespace, recipe: ModuleType, cfg: Any, device: torch.device,
                  make_loader: Callable) -> dict[str, Any]:
    from accelerate.utils import set_seed

    set_seed(cfg.seed)  # as the recipe's Run does before building the model: same initial weights
    student = recipe.create_student(cfg)  # the recipe's own builder: the same model by construction
    teacher = copy.deepcopy(student)  # the reference builds it apart and loads the student's weights,
    for m in teacher.modules():  # without drop path (its default drop_path_rate is 0); as the recipe does
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
        elif isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    student, teacher = student.to(device), teacher.to(device)
    for p in teacher.parameters():
        p.requires_grad = False  # "there is no backpropagation through the teacher"
    dino_loss = recipe.DINOLoss(cfg.out_dim, 2 + cfg.local_crops, cfg.warmup_teacher_temp, cfg.teacher_temp,
                                cfg.warmup_teacher_temp_epochs, cfg.epochs, cfg.student_temp,
                                cfg.center_momentum).to(device)
    optimizer = torch.optim.AdamW(recipe.weight_decay_groups(student, cfg.weight_decay), foreach=False)  # = utils.get_params_groups
    fp16_scaler = torch.amp.GradScaler("cuda") if args.reference_precision == "fp16" else None
    data_loader, sampler = make_loader()
    lr_schedule, wd_schedule, momentum_schedule = schedules(recipe, cfg, len(data_loader), args.steps)

    student.train()
    teacher.train()  # the reference never switches its teacher to eval mode
    step, images, loss_sum, data_seconds = 0, 0, 0.0, 0.0
    intervals: list[tuple[float, int, float, float]] = []  # (seconds, images, mean loss, seconds waiting for data)
    start = time.perf_counter()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for it, (crops, _) in enumerate(data_loader):
            data_seconds += time.perf_counter() - tick
            it = len(data_loader) * epoch + it  # global training iteration
            for i, param_group in enumerate(optimizer.param_groups):
                param_group["lr"] = float(lr_schedule[it])
                if i == 0:  # only the first group is regularized
                    param_group["weight_decay"] = float(wd_schedule[it])

            crops = [im.to(device, non_blocking=True) for im in crops]
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16_scaler is not None):
                teacher_output = teacher(crops[:2])  # only the 2 global views pass through the teacher
                student_output = student(crops)
                loss = dino_loss(student_output, teacher_output, epoch)

            if not math.isfinite(loss.item()):
                raise RuntimeError(f"reference loop: loss is {loss.item()} at step {step}")

            optimizer.zero_grad()
            if fp16_scaler is None:
                loss.backward()
                if cfg.clip_grad:
                    clip_gradients(student, cfg.clip_grad)
                cancel_gradients_last_layer(epoch, student, cfg.freeze_last_layer)
                optimizer.step()
            else:
                fp16_scaler.scale(loss).backward()
                if cfg.clip_grad:
                    fp16_scaler.unscale_(optimizer)  # unscale the gradients in place
                    clip_gradients(student, cfg.clip_grad)
                cancel_gradients_last_layer(epoch, student, cfg.freeze_last_layer)
                fp16_scaler.step(optimizer)
                fp16_scaler.update()

            with torch.no_grad():  # EMA update for the teacher
                m = momentum_schedule[it]
                for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                    param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)

            overhead.sync(device)  # torch.cuda.synchronize() before the metric logger
            loss_sum += loss.item()  # metric_logger.update(loss=loss.item())
            step += 1
            images += len(crops[0])
            if step % args.log_every == 0:
                now = time.perf_counter()  # synchronised just above
                intervals.append((now - start, images, loss_sum / args.log_every, data_seconds))
                start, images, loss_sum, data_seconds = now, 0, 0.0, 0.0
            if step == args.steps:
                break
            tick = time.perf_counter()
        if step == args.steps:
            break
    del data_loader, sampler  # stops persistent workers before the other side runs
    return summarise(intervals[1:])


def summarise(intervals: list[tuple[float, int, float, float]]) -> dict[str, Any]:
    """Images/s over the timed intervals (total images / total seconds), per-interval rates, data wait."""
    seconds = sum(t for t, _, _, _ in intervals)
    return {"images_per_s": sum(n for _, n, _, _ in intervals) / seconds, "seconds": seconds,
            "data_wait": sum(w for _, _, _, w in intervals) / seconds,
            "interval_rates": [n / t for t, n, _, _ in intervals], "final_loss": intervals[-1][2]}


# --------------------------------------------------------------------------------------------
# The recipe's real main()
# --------------------------------------------------------------------------------------------
def recipe_run(args: argparse.Namespace, recipe: ModuleType, out_dir: Path, batches: list | None) -> dict[str, Any]:
    timed = overhead.timed_recipe_intervals(args, recipe, recipe_argv(args) + ["--output_dir", str(out_dir)],
                                            out_dir, batches)
    intervals = []
    for r in timed:
        seconds = r["train/s_per_step"] * args.log_every  # every logged interval is log_every steps
        intervals.append((seconds, r["train/images_per_s"] * seconds, r["train/loss"], r["train/data_wait"] * seconds))
    return summarise(intervals)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None, defaults: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=defaults.model, help="timm model name (default: the recipe's demo model)")
    p.add_argument("--model_kwargs", default=None,
                   help="YAML mapping for timm.create_model (default: the recipe's, "
                        f"{yaml.safe_dump(defaults.model_kwargs, default_flow_style=True).strip()})")
    p.add_argument("--global_size", type=int, default=defaults.global_size)
    p.add_argument("--local_size", type=int, default=defaults.local_size)
    p.add_argument("--local_crops", type=int, default=defaults.local_crops)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--out_dim", type=int, default=defaults.out_dim)
    p.add_argument("--head_hidden_dim", type=int, default=defaults.head_hidden_dim)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run, warm-up included (0: 20 on cpu, 120 on cuda)")
    p.add_argument("--log_every", type=int, default=0, help="steps per timed interval, the first is warm-up (0: 5 on cpu, 20 on cuda)")
    p.add_argument("--repeats", type=int, default=4, help="reference/recipe pairs, in ABBA order")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader workers (both sides)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores minus workers, at least 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no", help="the recipe's precision")
    p.add_argument("--reference_precision", choices=("auto", "fp32", "fp16"), default="auto",
                   help="auto: fp16 + GradScaler on cuda when --mixed_precision is fp16 or bf16, else fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile on the recipe side (the reference is eager)")
    p.add_argument("--synthetic", action="store_true", help="pre-generated random crops on the device for both sides")
    p.add_argument("--synthetic_batches", type=int, default=4, help="distinct synthetic batches, cycled")
    p.add_argument("--workdir", default="", help="keep the recipe's run folders here (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="show the recipe's own output")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.steps = args.steps or (120 if cuda else 20)
    args.log_every = args.log_every or (20 if cuda else 5)
    if args.steps % args.log_every or args.steps < 2 * args.log_every:
        p.error("--steps must be a multiple of --log_every and at least 2 x --log_every")
    if args.model_kwargs is None:
        args.model_kwargs = yaml.safe_dump(defaults.model_kwargs, default_flow_style=True).strip()
    if not isinstance(yaml.safe_load(args.model_kwargs or "{}"), dict):
        p.error(f"--model_kwargs must be a YAML mapping, got {args.model_kwargs!r}")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if not cuda and args.mixed_precision == "fp16":
        p.error("fp16 needs --device cuda (bf16 works on CPU)")
    if args.reference_precision == "auto":
        args.reference_precision = "fp16" if cuda and args.mixed_precision != "no" else "fp32"
    if args.reference_precision == "fp16" and not cuda:
        p.error("--reference_precision fp16 needs --device cuda")
    if args.threads <= 0:
        args.threads = max(1, overhead.cores() - (0 if args.synthetic else args.num_workers))
    args.synthetic_epoch = args.steps + 1  # one "epoch" covers the run: no epoch boundary inside
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    if pre.parse_known_args(argv)[0].device == "cpu":  # else the recipe's Accelerator picks a GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything (the recipe's imports) initialises CUDA
        os.environ["ACCELERATE_USE_CPU"] = "1"
    recipe = overhead.load_recipe("dino")  # its Config's defaults are the flags' defaults
    args = parse_args(argv, recipe.Config())
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = recipe.parse_config(recipe.Config, recipe_argv(args))  # the very config the recipe side runs

    batches = synthetic_batches(args, device) if args.synthetic else None
    if batches is not None:
        def make_loader():
            return overhead.synthetic_loader(batches, args.synthetic_epoch, args.batch_size)
    else:
        # The recipe's data section: digits, MultiCrop(cfg), ClassificationDataset, train_loader_for.
        data = recipe.load_classification(cfg.data, cfg.image_column, cfg.label_column, cfg.train_split,
                                          cfg.eval_split, seed=cfg.seed)
        train_set = recipe.ClassificationDataset(data.train, data.image_column, data.label_column,
                                                 recipe.MultiCrop(cfg), cfg.seed)

        def make_loader():
            return recipe.train_loader_for(train_set, cfg.batch_size, cfg.seed, cfg.num_workers, 1)

    with contextlib.ExitStack() as stack:
        work = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dino-bench-")))
        work.mkdir(parents=True, exist_ok=True)
        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "reference":
                return reference_run(args, recipe, cfg, device, make_loader)
            out = work / f"recipe-{r}"
            if out.exists():
                raise SystemExit(f"{out} exists; choose another --workdir")
            return recipe_run(args, recipe, out, batches)

        # ABBA order: neither side always runs first (after the other side's clean-up)
        results = overhead.alternate(args, ("reference", "recipe"), run_side, abba=True)

    ref = statistics.median(x["images_per_s"] for x in results["reference"])
    rec = statistics.median(x["images_per_s"] for x in results["recipe"])
    ratio = rec / ref
    pooled = {side: statistics.median(v for x in xs for v in x["interval_rates"]) for side, xs in results.items()}
    pair_ratio = statistics.median(b["images_per_s"] / a["images_per_s"]
                                   for a, b in zip(results["reference"], results["recipe"]))
    n_intervals = len(results["reference"][0]["interval_rates"])
    target = TARGET[args.device]
    ref_precision = ("fp16 autocast + GradScaler (the reference's default --use_fp16; it has no bf16)"
                     if args.reference_precision == "fp16" else "fp32")
    print()
    print(f"model {args.model} {args.model_kwargs}, crops 2 x {args.global_size} px + {args.local_crops} x "
          f"{args.local_size} px, out_dim {args.out_dim}, head hidden {args.head_hidden_dim}, batch {args.batch_size}, "
          f"{args.device}, data {'synthetic (on device)' if args.synthetic else f'digits, {args.num_workers} workers'}")
    print(f"precision: recipe {args.mixed_precision}{' + torch.compile' if args.compile else ''}, "
          f"reference {ref_precision}")
    print(f"{args.repeats} repeats in ABBA order, each of {args.steps} steps: {args.log_every} warm-up, "
          f"then {n_intervals} timed intervals of {args.log_every}")
    print(f"machine: {overhead.machine(device, args.threads)}")
    runs = {side: ", ".join(f"{x['images_per_s']:.1f}" for x in xs) for side, xs in results.items()}
    print(f"reference {ref:9.1f} img/s   runs: {runs['reference']}")
    print(f"recipe    {rec:9.1f} img/s   runs: {runs['recipe']}")
    print(f"ratio     {ratio:9.3f}         recipe / reference, target >= {target} on {args.device}: "
          f"{'ok' if ratio >= target else 'BELOW TARGET'}")
    print(f"check: medians over all {n_intervals * args.repeats} timed intervals: reference {pooled['reference']:.1f}, "
          f"recipe {pooled['recipe']:.1f} img/s, ratio {pooled['recipe'] / pooled['reference']:.3f}; "
          f"median of the {args.repeats} per-repeat ratios {pair_ratio:.3f}")
    return {"reference": ref, "recipe": rec, "ratio": ratio,
            "ratio_intervals": pooled["recipe"] / pooled["reference"], "ratio_pairs": pair_ratio}


if __name__ == "__main__":
    main()
