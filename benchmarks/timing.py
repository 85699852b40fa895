"""Side-by-side timing shared by the benchmarks (the scripts beside it); no script here.

A benchmark trains one recipe two ways in one process (:func:`compare`): the recipe's real ``main(argv)``
and a loop written by hand with the same model, data, loss and optimizer (:func:`timed_loop`). The sides
take turns in ABBA order (other, recipe, recipe, other, ...) and are timed alike: host wall clock over
intervals of ``--log_every`` steps, each closed by a device synchronisation, images counted on the host;
the first interval (loader start-up, compilation) is warm-up. The recipe's intervals come from its run
folder's ``metrics.jsonl``; its evaluation, checkpoint and saving at the end fall outside them. Printed:
each run's images/s, data wait and last-interval loss; each side's median images/s and the ratio recipe /
other side (above 1 = the recipe is faster); as checks against bursts of load, the ratio over all
intervals pooled and the median of the per-repeat ratios.

The benchmarks that time calls rather than training steps (inference.py, loader_throughput.py) share its
ABBA order and rate: :func:`alternate`, :func:`per_second`. Importing it puts the repository root and
recipes/ on ``sys.path`` (a bare loop imports the recipe's own pieces) and keeps the hubs offline.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# as pytest.ini's pythonpath: the repository root (common/), then recipes/, where a recipe is a script that
# imports the files beside it (``yolo_model``) plainly; a benchmark imports a recipe as ``import_module("yolo")``
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_MODE", "offline")):
    os.environ.setdefault(_key, _value)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
Intervals = list[tuple[float, float, float, float]]  # a run's timed intervals: seconds, images, mean loss, data wait


def total(run: Intervals, i: int) -> float:
    return sum(x[i] for x in run)


def rate(run: Intervals) -> float:
    return total(run, 1) / total(run, 0)


def abba(sides: list[str], r: int) -> list[str]:
    """The order of the sides in repeat ``r`` (from 0): as given, then reversed, and so on (A B, B A, A B, ...),
    so that a drift of the machine's speed over the run weighs on every side alike."""
    return sides if r % 2 == 0 else sides[::-1]


def alternate(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of each side's measurement (a rate: higher is faster), the sides in ABBA order."""
    results: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(repeats):
        for side in abba(list(sides), r):
            results[side].append(sides[side]())
    return {side: statistics.median(values) for side, values in results.items()}


def per_second(call: Callable[[int], object], calls: int, items_per_call: int = 1) -> float:
    """Items per second of ``call(0)``, ``call(1)``, ... ``call(calls - 1)``, host wall clock (no device sync)."""
    start = time.perf_counter()
    for i in range(calls):
        call(i)
    return calls * items_per_call / (time.perf_counter() - start)


def timed_loop(args: argparse.Namespace, loader: Any, train_step: Callable[[int, Any], tuple[Any, int]]) -> Intervals:
    """The hand-written side: ``train_step(step, batch) -> (loss, images)`` for ``args.steps`` steps across
    epochs; a loss left on the device is summed there and read once per interval."""
    step, images, loss_sum, waited, intervals = 0, 0, 0.0, 0.0, []
    start = time.perf_counter()
    for epoch in itertools.count():
        if hasattr(loader.batch_sampler, "set_epoch"):
            loader.batch_sampler.set_epoch(epoch)
        tick = time.perf_counter()
        for batch in loader:
            waited += time.perf_counter() - tick
            loss, n = train_step(step, batch)
            step, images, loss_sum = step + 1, images + n, loss_sum + loss
            if step % args.log_every == 0:
                if args.device == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                intervals.append((now - start, images, float(loss_sum) / args.log_every, waited))
                start, images, loss_sum, waited = now, 0, 0.0, 0.0
            if step == args.steps:
                return intervals[1:]
            tick = time.perf_counter()


def compare(
    recipe_name: str,
    other: str,
    other_run: Callable[[argparse.Namespace, Any, Any], Intervals],
    doc: str,
    argv: list[str] | None,
    *,
    steps: tuple[int, int],
    log_every: tuple[int, int],
    repeats: int,
    show: tuple[str, ...],
    note: str = "",
    defaults: tuple[str, ...] = (),
    last: tuple[str, ...] = (),
    synthetic: str = "",
    target: tuple[float, float] | None = None,
) -> dict[str, float]:
    """Time ``recipes/<recipe_name>.py``'s ``main()`` against ``other_run(args, recipe, cfg)`` and print the
    comparison, with the config fields ``show`` and ``note``. ``steps``, ``log_every``, ``target``: (cpu,
    cuda). The recipe's command line, parsed into the ``cfg`` both sides use: fp32 and DataLoader workers
    (1 on CPU, all cores but 2 on CUDA) unless told, ``defaults``, the user's recipe flags, ``last``, then
    the timing (no tracker, evaluation or checkpoint before the end). ``synthetic``: the config field giving
    the image size of ``--synthetic`` data (empty: no such flag)."""
    args = parse(doc, argv, steps, log_every, repeats, synthetic)
    recipe = importlib.import_module(recipe_name)  # recipes/<recipe_name>.py, the script (no side effects)
    from common import UserError
    from common.config import parse_config

    def config(extra: list[str]) -> tuple[list[str], Any]:
        workers = "1" if args.device == "cpu" else str(max(1, CORES - 2))
        argv = [
            "--mixed_precision",
            "no",
            "--num_workers",
            workers,
            *defaults,
            *args.recipe_args,
            *last,
            *extra,
            "--report_to",
            "none",
            "--max_steps",
            str(args.steps),
            "--log_every",
            str(args.log_every),
            "--epochs",
            "1000",
            "--eval_every",
            "100000",
            "--checkpoint_every",
            "1000000000",
        ]
        try:
            return argv, parse_config(recipe.Config, argv)
        except UserError as e:  # a typo in a recipe flag: one line, as the recipe's own command line says it
            raise SystemExit(f"error: {e}") from None

    argv, cfg = config([])
    args.threads = args.threads or max(1, CORES - cfg.num_workers)
    results: dict[str, list[Intervals]] = {other: [], "recipe": []}
    with tempfile.TemporaryDirectory(prefix="bench-") as work:
        if args.synthetic:
            n, size = (args.synthetic_batches or args.steps + 1) * cfg.batch_size, getattr(cfg, synthetic)
            argv, cfg = config(["--data", synthetic_images(Path(work) / "data", n, size)])
        for r in range(args.repeats):
            for side in abba([other, "recipe"], r):
                torch.set_num_threads(args.threads)
                wall = time.perf_counter()
                run = other_run(args, recipe, cfg) if side == other else run_recipe(recipe, argv, work, r, args)
                gc.collect()  # the side's loader workers end before the other side starts
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                results[side].append(run)
                print(
                    f"repeat {r + 1}/{args.repeats}  {side:<9} {rate(run):9.1f} img/s  data wait "
                    f"{100 * total(run, 3) / total(run, 0):4.1f} %  timed {total(run, 0):5.1f} s of "
                    f"{time.perf_counter() - wall:5.1f} s  last-interval loss {run[-1][2]:.4f}",
                    flush=True,
                )
    data = f"synthetic {getattr(cfg, synthetic)} px" if args.synthetic else cfg.data
    print("\n" + ", ".join(f"{k} {getattr(cfg, k)}" for k in show) + (f"; {note}" if note else ""))
    print(
        f"batch {cfg.batch_size}, {args.device}, data {data}, {cfg.num_workers} workers, recipe precision "
        f"{cfg.mixed_precision}{' + compile' if cfg.compile else ''}"
    )
    return report(results, args, target and target[args.device == "cuda"])


def parse(
    doc: str, argv: list[str] | None, steps: tuple[int, int], log_every: tuple[int, int], repeats: int, synthetic: str
) -> argparse.Namespace:
    """The benchmark's flags; every other flag (also after ``--``) is the recipe's, ``args.recipe_args``.
    On CPU, hides any GPU from the recipe's Accelerator before anything initialises CUDA."""
    p = argparse.ArgumentParser(
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is the recipe's config, for both sides (the recipe's --help)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help=f"optimizer steps per run, warm-up included (0: {steps[0]} on cpu, {steps[1]} on cuda)",
    )
    p.add_argument(
        "--log_every",
        type=int,
        default=0,
        help=f"steps per timed interval, the first: warm-up (0: {log_every[0]} cpu, {log_every[1]} cuda)",
    )
    p.add_argument("--repeats", type=int, default=repeats, help="runs of each side, in ABBA order")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores the loader workers leave)")
    p.add_argument("--verbose", action="store_true", help="show the recipe's own output")
    if synthetic:
        p.add_argument(
            "--synthetic",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"random {synthetic}-px JPEGs as the data of both sides (default: on for cuda)",
        )
        p.add_argument(
            "--synthetic_batches",
            type=int,
            default=0,
            help="synthetic images = this x batch_size (0: steps + 1, one epoch covers the run)",
        )
    args, rest = p.parse_known_args(argv)
    args.recipe_args, cuda = [a for a in rest if a != "--"], args.device == "cuda"
    args.steps, args.log_every = args.steps or steps[cuda], args.log_every or log_every[cuda]
    args.synthetic = cuda if getattr(args, "synthetic", False) is None else getattr(args, "synthetic", False)
    if args.steps % args.log_every or args.steps < 2 * args.log_every:
        p.error("--steps must be a multiple of --log_every and at least 2 x --log_every")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if not cuda:
        os.environ.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1")
    return args


def run_recipe(recipe: Any, argv: list[str], work: str, r: int, args: argparse.Namespace) -> Intervals:
    """``recipe.main(argv)`` in this process, run folder in ``work``; its timed intervals from metrics.jsonl."""
    out_dir = Path(work, f"run{r}")
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # the run installs its own
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [signal.signal(s, h) for s, h in saved.items()])
        if not args.verbose:
            log = stack.enter_context(open(out_dir.with_suffix(".log"), "w"))
            stack.enter_context(contextlib.redirect_stdout(log))
            stack.enter_context(contextlib.redirect_stderr(log))
        recipe.main([*argv, "--output_dir", str(out_dir)])
    from accelerate.state import PartialState

    if PartialState().device.type != args.device:
        raise RuntimeError(f"the recipe ran on {PartialState().device}, not {args.device}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/images_per_s" in r][1:]  # the first interval is warm-up
    seconds = [r["train/s_per_step"] * args.log_every for r in rows]  # every interval is log_every steps
    return [(t, r["train/images_per_s"] * t, r["train/loss"], r["train/data_wait"] * t) for t, r in zip(seconds, rows)]


def report(results: dict[str, list[Intervals]], args: argparse.Namespace, target: float | None) -> dict[str, float]:
    """Print the timing setup, the machine, each side's median images/s and the ratio recipe / other side."""
    import accelerate
    import timm
    import torchvision

    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), cpu)
    gpu = [torch.cuda.get_device_name()] if args.device == "cuda" else []
    other, n = next(iter(results)), len(results["recipe"][0])
    print(
        f"{args.repeats} repeats in ABBA order, each of {args.steps} steps: {args.log_every} warm-up, then {n} "
        f"timed intervals of {args.log_every}\nmachine: "
        + "; ".join(
            [
                f"{cpu}, {os.cpu_count()} cores",
                *gpu,
                f"python {platform.python_version()}",
                f"torch {torch.__version__}",
                f"torchvision {torchvision.__version__}",
                f"timm {timm.__version__}",
                f"accelerate {accelerate.__version__}",
                f"torch threads {args.threads}",
            ]
        )
    )
    med = {side: statistics.median(rate(run) for run in runs) for side, runs in results.items()}
    pooled = {side: statistics.median(x[1] / x[0] for run in runs for x in run) for side, runs in results.items()}
    pairs = statistics.median(rate(b) / rate(a) for a, b in zip(results[other], results["recipe"]))
    for side, runs in results.items():
        print(f"{side:<9} {med[side]:9.1f} img/s   runs: {', '.join(f'{rate(run):.1f}' for run in runs)}")
    ratio = med["recipe"] / med[other]
    verdict = "" if target is None else f", target >= {target}: {'ok' if ratio >= target else 'BELOW TARGET'}"
    print(f"{'ratio':<9} {ratio:9.3f}         recipe / {other}{verdict}")
    print(
        f"check: all {n * args.repeats} timed intervals pooled: {other} {pooled[other]:.1f}, recipe "
        f"{pooled['recipe']:.1f} img/s, ratio {pooled['recipe'] / pooled[other]:.3f}; median of the "
        f"{args.repeats} per-repeat ratios {pairs:.3f}"
    )
    return {
        other: med[other],
        "recipe": med["recipe"],
        "ratio": ratio,
        "ratio_intervals": pooled["recipe"] / pooled[other],
        "ratio_pairs": pairs,
    }


def synthetic_images(folder: Path, images: int, size: int, eval_images: int = 64, classes: int = 10) -> str:
    """Random ``size``-px JPEGs with random labels as a saved ``datasets`` folder (train and validation
    splits), which the classification recipes load as ``--data <folder>``; returns the folder."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def split(n: int) -> datasets.Dataset:
        jpegs = []
        for _ in range(n):  # smooth noise: small files that decode fast
            buffer = io.BytesIO()
            noise = Image.fromarray(rng.integers(0, 256, (size // 8 + 1, size // 8 + 1, 3), dtype=np.uint8))
            noise.resize((size, size), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
            jpegs.append({"bytes": buffer.getvalue(), "path": None})
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=classes)})
        return datasets.Dataset.from_dict(
            {"image": jpegs, "label": rng.integers(0, classes, n).tolist()}, features=features
        )

    datasets.DatasetDict({"train": split(images), "validation": split(eval_images)}).save_to_disk(str(folder))
    return str(folder)
