"""Overhead of the classifier recipe's training step against a bare PyTorch loop, side by side.

What is measured
    Training throughput (images/s) of the same timm model, data, optimizer, batch size and
    precision, two ways, alternated in one process (bare, recipe, bare, recipe, ...):

    bare    a plain loop as a PyTorch tutorial writes it: ``timm.create_model``, the recipe's own
            Dataset and DataLoader construction from ``common/data.py`` (same transforms, same
            ``num_workers``), ``torch.optim.AdamW`` over timm's no-weight-decay parameter groups,
            ``CrossEntropyLoss``, ``loss.backward()``, ``optimizer.step()``, ``zero_grad``; with
            ``torch.autocast`` (and a ``GradScaler`` for fp16) under mixed precision.
    recipe  ``recipes/classifier.py``'s real ``main(argv)``, called in-process: Accelerate's
            prepared model/optimizer/loader, ``accelerator.accumulate``/``backward``, the
            per-step learning-rate write, meters, non-finite guard, progress bar, stop check.
            Its throughput is read back from the run folder's ``metrics.jsonl``
            (``train/images_per_s`` and ``train/s_per_step`` of ``common/meters.Meters``).

    Both sides are timed the same way: host wall clock over intervals of ``--log_every`` steps,
    each closed by a device synchronisation (``Meters.summary`` reads its sums with one
    ``.tolist()``; the bare loop calls ``torch.cuda.synchronize``), images counted on the host.
    The first interval (data loader start-up, first iterations) is warm-up and is skipped; the
    recipe's evaluation, checkpoint and weight saving at the end fall outside its intervals.
    A run's images/s = images / seconds over its timed intervals. Reported: the median images/s
    of each side over ``--repeats`` runs and the ratio of the medians (recipe / bare; the target
    is >= 0.97); as a check against bursts of load from other processes, also the medians over
    all timed intervals pooled.

    ``--synthetic`` (default on CUDA, where the digits loader would be the bottleneck): both sides
    consume the same pre-generated random batches that already live on the device, through the
    same single-process DataLoader. The recipe has no data option for this, so the benchmark
    rebinds the name ``train_loader_for`` inside the imported recipe module (the recipe file is
    not changed) to return that loader; everything from ``accelerator.prepare`` on is the
    recipe's own code. The recipe still loads digits for its final evaluation (untimed).

Run (offline; about 3.5 minutes on 2 CPU cores with the defaults):

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/overhead.py
    python benchmarks/overhead.py --device cuda --model resnet50 --img_size 224 --batch_size 256 \\
        --mixed_precision bf16 --channels_last      # synthetic data, 200 steps of which 20 warm-up

Threads: ``torch.set_num_threads(--threads)`` before each side (default: the CPU cores left
after the DataLoader workers, at least 1). On a busy 2-core machine 1 thread is far steadier than
2 oversubscribed ones.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import itertools
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch

ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES_SYNTHETIC = 10  # digits has 10 classes too: the recipe's head is sized from the data
TARGET = 0.97


# --------------------------------------------------------------------------------------------
# Setup shared by both sides
# --------------------------------------------------------------------------------------------
def load_recipe(name: str = "classifier") -> ModuleType:
    """Import recipes/<name>.py from its path (it puts the repository root on sys.path); the
    benchmarks of the other recipes use this too."""
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing.get_type_hints look the module up
    spec.loader.exec_module(module)
    return module


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def global_settings() -> dict[str, Any]:
    """Process-wide torch settings that would carry over from one side to the other if changed."""
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "grad_enabled": torch.is_grad_enabled()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device, threads: int) -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import accelerate
    import timm

    parts = [f"{cpu}, {cores()} cores", f"python {platform.python_version()}", f"torch {torch.__version__}", f"timm {timm.__version__}",
             f"accelerate {accelerate.__version__}", f"torch threads {threads}"]
    if device.type == "cuda":
        parts.insert(1, torch.cuda.get_device_name(device))
    return "; ".join(parts)


class _BatchList(torch.utils.data.Dataset):
    """Pre-generated batches; item ``i`` is batch ``i mod len(batches)``."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i % len(self.batches)]


class _OneByOne(torch.utils.data.Sampler):
    """Batch sampler yielding ``[0], [1], ...``; has ``set_epoch`` like the recipe's sampler."""

    def __init__(self, length: int, batch_size: int) -> None:
        self.length, self.batch_size, self.drop_last = length, batch_size, True

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[list[int]]:
        return ([i] for i in range(self.length))


def _first(items: list[Any]) -> Any:
    return items[0]


def synthetic_batches(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few random (images, labels) batches on the device, channels_last when asked."""
    g = torch.Generator(device=device).manual_seed(0)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    out = []
    for _ in range(args.synthetic_batches):
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, generator=g, device=device)
        y = torch.randint(0, NUM_CLASSES_SYNTHETIC, (args.batch_size,), generator=g, device=device)
        out.append((x.contiguous(memory_format=memory_format), y))
    return out


def synthetic_loader(batches: list, length: int, batch_size: int):
    """The DataLoader both sides consume under --synthetic (no workers: batches are already made)."""
    sampler = _OneByOne(length, batch_size)
    loader = torch.utils.data.DataLoader(_BatchList(batches, length), batch_sampler=sampler, collate_fn=_first,
                                         num_workers=0, pin_memory=False)
    return loader, sampler


# --------------------------------------------------------------------------------------------
# Bare PyTorch loop
# --------------------------------------------------------------------------------------------
def bare_run(args: argparse.Namespace, recipe: ModuleType, device: torch.device, make_loader: Callable) -> dict[str, Any]:
    import timm
    from timm.optim import param_groups_weight_decay

    defaults = recipe.Config()  # lr, weight decay, seed: the recipe's defaults, as the recipe side uses
    torch.manual_seed(defaults.seed)
    try:  # as the recipe: transformers take img_size, convnets do not
        model = timm.create_model(args.model, num_classes=args.num_classes, img_size=args.img_size)
    except TypeError:
        model = timm.create_model(args.model, num_classes=args.num_classes)
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    fused = {"fused": True} if device.type == "cuda" else {}  # the recipe asks for fused AdamW on CUDA too
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, defaults.weight_decay), lr=defaults.lr,
                                  weight_decay=defaults.weight_decay, **fused)
    criterion = torch.nn.CrossEntropyLoss()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    scaler = torch.amp.GradScaler(device.type) if args.mixed_precision == "fp16" else None
    train_loader, sampler = make_loader()

    model.train()
    # Timed as Meters does in the recipe: intervals of log_every steps, each closed by a device
    # synchronisation (the recipe's summary reads its sums with one .tolist()); the first is warm-up.
    step, images, data_seconds = 0, 0, 0.0
    intervals: list[tuple[float, int, float]] = []  # (seconds, images, seconds waiting for data)
    start = time.perf_counter()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for x, y in train_loader:
            data_seconds += time.perf_counter() - tick
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = criterion(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            images += len(x)  # host int: a shape
            if step % args.log_every == 0:
                sync(device)
                now = time.perf_counter()
                intervals.append((now - start, images, data_seconds))
                start, images, data_seconds = now, 0, 0.0
            if step == args.steps:
                break
            tick = time.perf_counter()
        if step == args.steps:
            break
    final_loss = loss.item()
    del train_loader, sampler  # stops persistent workers before the other side runs
    return summarise(intervals[1:], final_loss)


def summarise(intervals: list[tuple[float, int, float]], final_loss: float) -> dict[str, Any]:
    """Images/s over the timed intervals (total images / total seconds) and the per-interval rates."""
    seconds = sum(t for t, _, _ in intervals)
    return {"images_per_s": sum(n for _, n, _ in intervals) / seconds,
            "data_wait": sum(w for _, _, w in intervals) / seconds, "seconds": seconds,
            "interval_rates": [n / t for t, n, _ in intervals], "final_loss": final_loss}


# --------------------------------------------------------------------------------------------
# The recipe's real main()
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def rebind(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """The recipe installs SIGTERM/SIGINT handlers for its run; give ours back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def timed_recipe_intervals(args: argparse.Namespace, recipe: ModuleType, argv: list[str], out_dir: Path,
                           batches: list | None) -> list[dict[str, Any]]:
    """Run ``recipe.main(argv)`` in this process and return its logged training intervals after
    the first (warm-up), as metrics.jsonl rows. With ``batches`` (``--synthetic``), the recipe's
    ``train_loader_for`` is swapped for a loader over those pre-made device batches; everything
    from ``accelerator.prepare`` on stays the recipe's own code. Shared by dino_throughput.py."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(kept_signal_handlers())
        used = []
        if batches is not None:
            def train_loader_for(dataset, batch_size, seed, num_workers, num_processes, collate_fn=None):
                if batch_size != args.batch_size or num_processes != 1:
                    raise RuntimeError(f"unexpected recipe loader call: batch {batch_size}, {num_processes} processes")
                used.append(True)
                return synthetic_loader(batches, args.synthetic_epoch, batch_size)

            stack.enter_context(rebind(recipe, "train_loader_for", train_loader_for))
        if not args.verbose:
            log = stack.enter_context(open(out_dir.with_suffix(".log"), "w"))
            stack.enter_context(contextlib.redirect_stdout(log))
            stack.enter_context(contextlib.redirect_stderr(log))
        recipe.main(argv)
        if batches is not None and not used:
            raise RuntimeError("--synthetic: the recipe no longer calls train_loader_for; the patch did not apply")
    from accelerate.state import PartialState

    if PartialState().device.type != args.device:
        raise RuntimeError(f"the recipe ran on {PartialState().device}, not {args.device}")

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "train/images_per_s" in r][1:]  # the first interval is warm-up
    if not timed:
        raise RuntimeError(f"no timed interval in {out_dir / 'metrics.jsonl'}: need --steps >= 2 x --log_every")
    return timed


def recipe_run(args: argparse.Namespace, recipe: ModuleType, out_dir: Path, batches: list | None) -> dict[str, Any]:
    argv = ["--report_to", "none", "--model", args.model, "--img_size", str(args.img_size),
            "--batch_size", str(args.batch_size), "--max_steps", str(args.steps), "--log_every", str(args.log_every),
            "--eval_every", "100000", "--epochs", "100000", "--checkpoint_every", "10000000",
            "--num_workers", str(args.num_workers), "--output_dir", str(out_dir), "--smoothing", "0",
            "--mixed_precision", args.mixed_precision, "--channels_last", str(args.channels_last).lower()]
    timed = timed_recipe_intervals(args, recipe, argv, out_dir, batches)
    intervals = []
    for r in timed:
        seconds = r["train/s_per_step"] * args.log_every  # every logged interval is log_every steps
        intervals.append((seconds, r["train/images_per_s"] * seconds, r["train/data_wait"] * seconds))
    return summarise(intervals, timed[-1]["train/loss"])


def alternate(args: argparse.Namespace, sides: tuple[str, str], run_side: Callable[[str, int], dict[str, Any]],
              abba: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Run ``run_side(side, repeat)`` for both sides, ``args.repeats`` times, and collect the results.

    With ``abba`` every other repeat swaps the order, so neither side always runs first. Each run
    prints one line; a run that changes torch's global settings is reported, since it would make
    the other side's next run differ in more than the loop. Shared by dino_throughput.py.
    """
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in sides if not (abba and r % 2) else sides[::-1]:
            torch.set_num_threads(args.threads)
            before = global_settings()
            wall = time.perf_counter()
            res = run_side(side, r)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            wall = time.perf_counter() - wall
            results[side].append(res)
            left = multiprocessing.active_children()
            print(f"repeat {r + 1}/{args.repeats}  {side:<9} {res['images_per_s']:9.1f} img/s  "
                  f"data wait {res['data_wait'] * 100:4.1f} %  timed {res['seconds']:5.1f} s of {wall:5.1f} s  "
                  f"last-interval loss {res['final_loss']:.4f}"
                  + (f"  ({len(left)} child processes still alive)" if left else ""), flush=True)
            changed = {k: v for k, v in global_settings().items() if v != before[k]}
            if changed:
                print(f"warning: the {side} run changed torch settings: {changed}", flush=True)
    return results


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", help="timm model name")
    p.add_argument("--img_size", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run, warm-up included (0: 30 on cpu, 200 on cuda)")
    p.add_argument("--log_every", type=int, default=0, help="steps per timed interval, the first is warm-up (0: 5 on cpu, 20 on cuda)")
    p.add_argument("--repeats", type=int, default=5, help="bare/recipe pairs, alternated")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader workers (both sides)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores minus workers, at least 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default="no")
    p.add_argument("--channels_last", action="store_true")
    p.add_argument("--synthetic", action=argparse.BooleanOptionalAction, default=None,
                   help="pre-generated random batches on the device for both sides (default: on for cuda)")
    p.add_argument("--synthetic_batches", type=int, default=4, help="distinct synthetic batches, cycled")
    p.add_argument("--workdir", default="", help="keep the recipe's run folders here (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="show the recipe's own output")
    args = p.parse_args(argv)
    args.steps = args.steps or (200 if args.device == "cuda" else 30)
    args.log_every = args.log_every or (20 if args.device == "cuda" else 5)
    if args.steps % args.log_every or args.steps < 2 * args.log_every:
        p.error("--steps must be a multiple of --log_every and at least 2 x --log_every")
    if args.synthetic is None:
        args.synthetic = args.device == "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.device == "cpu" and args.mixed_precision == "fp16":
        p.error("fp16 needs --device cuda (bf16 works on CPU)")
    if args.threads <= 0:
        args.threads = max(1, cores() - (0 if args.synthetic else args.num_workers))
    args.synthetic_epoch = args.steps + 1  # one "epoch" covers the run: no epoch boundary inside
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.device == "cpu":  # on a GPU machine the recipe's Accelerator would otherwise pick the GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA
        os.environ["ACCELERATE_USE_CPU"] = "1"
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    recipe = load_recipe()

    batches = synthetic_batches(args, device) if args.synthetic else None
    if batches is not None:
        args.num_classes = NUM_CLASSES_SYNTHETIC

        def make_loader():
            return synthetic_loader(batches, args.synthetic_epoch, args.batch_size)
    else:
        # The recipe's data section, verbatim in effect: digits, timm transforms from the recipe's
        # defaults, ClassificationDataset and train_loader_for from common/data.py.
        from timm.data import create_transform, resolve_data_config
        import timm

        cfg = recipe.Config()
        data = recipe.load_classification(cfg.data, seed=cfg.seed)
        args.num_classes = len(data.classes)
        probe = timm.create_model(args.model, num_classes=args.num_classes, pretrained=False)
        data_cfg = resolve_data_config({"input_size": (3, args.img_size, args.img_size), "crop_pct": cfg.crop_pct,
                                        "interpolation": cfg.interpolation}, model=probe)
        del probe
        train_tf = create_transform(**data_cfg, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                                    hflip=cfg.hflip, color_jitter=cfg.color_jitter or None,
                                    auto_augment=cfg.auto_augment or None, re_prob=cfg.reprob)
        train_set = recipe.ClassificationDataset(data.train, data.image_column, data.label_column, train_tf, cfg.seed)

        def make_loader():
            return recipe.train_loader_for(train_set, args.batch_size, cfg.seed, args.num_workers, 1)

    with contextlib.ExitStack() as stack:
        work = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overhead-")))
        work.mkdir(parents=True, exist_ok=True)

        def run_side(side: str, r: int) -> dict[str, Any]:
            if side == "bare":
                return bare_run(args, recipe, device, make_loader)
            out = work / f"recipe-{r}"
            if out.exists():
                raise SystemExit(f"{out} exists; choose another --workdir")
            return recipe_run(args, recipe, out, batches)

        results = alternate(args, ("bare", "recipe"), run_side)

    bare = statistics.median(x["images_per_s"] for x in results["bare"])
    rec = statistics.median(x["images_per_s"] for x in results["recipe"])
    ratio = rec / bare
    pooled = {side: statistics.median(v for x in xs for v in x["interval_rates"]) for side, xs in results.items()}
    n_intervals = len(results["bare"][0]["interval_rates"])
    print()
    print(f"model {args.model} @ {args.img_size} px, batch {args.batch_size}, {args.device}, "
          f"precision {args.mixed_precision}, channels_last {args.channels_last}, "
          f"data {'synthetic (on device)' if args.synthetic else f'digits, {args.num_workers} workers'}")
    print(f"{args.repeats} alternating repeats of {args.steps} steps: {args.log_every} warm-up, "
          f"then {n_intervals} timed intervals of {args.log_every}")
    print(f"machine: {machine(device, args.threads)}")
    runs = {side: ", ".join(f"{x['images_per_s']:.1f}" for x in xs) for side, xs in results.items()}
    print(f"bare    {bare:9.1f} img/s   median of runs: {runs['bare']}")
    print(f"recipe  {rec:9.1f} img/s   median of runs: {runs['recipe']}")
    print(f"ratio   {ratio:9.3f}         recipe / bare, target >= {TARGET}: {'ok' if ratio >= TARGET else 'BELOW TARGET'}")
    print(f"check: medians over all {n_intervals * args.repeats} timed intervals: bare {pooled['bare']:.1f}, "
          f"recipe {pooled['recipe']:.1f} img/s, ratio {pooled['recipe'] / pooled['bare']:.3f}")
    return {"bare": bare, "recipe": rec, "ratio": ratio, "ratio_intervals": pooled["recipe"] / pooled["bare"]}


if __name__ == "__main__":
    main()


# --------------------------------------------------------------------------------------------
# Shared by the detector benchmarks (faster_rcnn_throughput.py, yolo_throughput.py, ...):
# everything but each one's bare loop and its header line
# --------------------------------------------------------------------------------------------
def detector_args(doc: str, argv: list[str] | None, batch_size: int) -> argparse.Namespace:
    """The flags every detector benchmark takes; everything after ``--`` is the recipe's config
    (``args.recipe_args``) and so reaches both sides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, default=batch_size, help=f"per step (default: {batch_size}, the recipe's)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run, warm-up included (0: 60 on cpu, 120 on cuda)")
    p.add_argument("--log_every", type=int, default=0, help="steps per timed interval, the first is warm-up (0: 10 on cpu, 20 on cuda)")
    p.add_argument("--repeats", type=int, default=4, help="bare/recipe pairs, in ABBA order")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader workers (both sides)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: cores minus workers, at least 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no", help="the recipe's precision (bare: fp32)")
    p.add_argument("--verbose", action="store_true", help="show the recipe's own output")
    args = p.parse_args(argv)
    args.recipe_args = recipe_args
    cuda = args.device == "cuda"
    args.steps = args.steps or (120 if cuda else 60)
    args.log_every = args.log_every or (20 if cuda else 10)
    if args.steps % args.log_every or args.steps < 2 * args.log_every:
        p.error("--steps must be a multiple of --log_every and at least 2 x --log_every")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.threads <= 0:
        args.threads = max(1, cores() - args.num_workers)
    if not cuda:  # else the recipe's Accelerator picks a GPU; set before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["ACCELERATE_USE_CPU"] = "1"
    return args


def detector_recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line: no evaluation, checkpoint or plot inside the timed run. Also
    parsed into the Config that the bare side uses, so both sides run the very same settings."""
    return [*args.recipe_args, "--report_to", "none", "--batch_size", str(args.batch_size),
            "--max_steps", str(args.steps), "--log_every", str(args.log_every), "--epochs", "1000",
            "--eval_every", "100000", "--checkpoint_every", "10000000", "--plot_images", "0",
            "--num_workers", str(args.num_workers), "--mixed_precision", args.mixed_precision]


def interval_summary(intervals: list[tuple[float, int, float, float]]) -> dict[str, Any]:
    """(seconds, images, mean loss, seconds waiting for data) per timed interval -> images/s, the
    data-wait fraction, the per-interval rates and the last interval's loss."""
    seconds = sum(t for t, _, _, _ in intervals)
    return {"images_per_s": sum(n for _, n, _, _ in intervals) / seconds, "seconds": seconds,
            "data_wait": sum(w for _, _, _, w in intervals) / seconds,
            "interval_rates": [n / t for t, n, _, _ in intervals], "final_loss": intervals[-1][2]}


def detector_recipe_run(args: argparse.Namespace, recipe: ModuleType, out_dir: Path,
                        extra_argv: list[str] = ()) -> dict[str, Any]:
    """The recipe's real ``main()`` on ``detector_recipe_argv``; its intervals read back from metrics.jsonl."""
    argv = detector_recipe_argv(args) + list(extra_argv) + ["--output_dir", str(out_dir)]
    intervals = []
    for r in timed_recipe_intervals(args, recipe, argv, out_dir, None):
        seconds = r["train/s_per_step"] * args.log_every  # every logged interval is log_every steps
        intervals.append((seconds, r["train/images_per_s"] * seconds, r["train/loss"], r["train/data_wait"] * seconds))
    return interval_summary(intervals)


def report_ratio(results: dict[str, list[dict[str, Any]]], header: list[str], args: argparse.Namespace,
                 device: torch.device) -> dict[str, float]:
    """Print the header lines, the median images/s of each side and the ratio recipe / the other side."""
    other, _ = results  # ("bare" or "reference", "recipe")
    base = statistics.median(x["images_per_s"] for x in results[other])
    rec = statistics.median(x["images_per_s"] for x in results["recipe"])
    pooled = {side: statistics.median(v for x in xs for v in x["interval_rates"]) for side, xs in results.items()}
    n_intervals = len(results[other][0]["interval_rates"])
    print()
    for line in header:
        print(line)
    print(f"{args.repeats} repeats in ABBA order, each of {args.steps} steps: {args.log_every} warm-up, "
          f"then {n_intervals} timed intervals of {args.log_every}")
    print(f"machine: {machine(device, args.threads)}")
    runs = {side: ", ".join(f"{x['images_per_s']:.1f}" for x in xs) for side, xs in results.items()}
    print(f"{other:<9} {base:9.1f} img/s   runs: {runs[other]}")
    print(f"{'recipe':<9} {rec:9.1f} img/s   runs: {runs['recipe']}")
    print(f"{'ratio':<9} {rec / base:9.3f}         recipe / {other}")
    print(f"check: medians over all {n_intervals * args.repeats} timed intervals: {other} {pooled[other]:.1f}, "
          f"recipe {pooled['recipe']:.1f} img/s, ratio {pooled['recipe'] / pooled[other]:.3f}")
    return {other: base, "recipe": rec, "ratio": rec / base, "ratio_intervals": pooled["recipe"] / pooled[other]}


def timed_loop(args: argparse.Namespace, device: torch.device, loader: Any, sampler: Any,
               train_step: Callable[[int, Any], float]) -> dict[str, Any]:
    """The bare or reference side's loop: ``train_step(step, batch)`` (optimizer step ``step``, from 0,
    on a batch as the loader gives it, returning the loss as a host float, i.e. synchronising as such
    loops do) for
    ``args.steps`` steps across epochs (``sampler.set_epoch``), timed in intervals of
    ``args.log_every`` steps, each closed by a device synchronisation; the first is warm-up."""
    step, images, loss_sum, data_seconds = 0, 0, 0.0, 0.0
    intervals: list[tuple[float, int, float, float]] = []
    start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(step // max(len(loader), 1))
        tick = time.perf_counter()
        for batch in loader:
            data_seconds += time.perf_counter() - tick
            loss_sum += train_step(step, batch)
            step += 1
            images += len(batch[0])
            if step % args.log_every == 0:
                sync(device)
                now = time.perf_counter()
                intervals.append((now - start, images, loss_sum / args.log_every, data_seconds))
                start, images, loss_sum, data_seconds = now, 0, 0.0, 0.0
            if step == args.steps:
                break
            tick = time.perf_counter()
    return interval_summary(intervals[1:])
