"""GPU check: what one GPU gives a user, end to end, and the time spent outside the training steps.

Seven runs, each started as a user starts it, in its own process: ``accelerate launch --config_file
configs/accelerate/single_gpu.yaml recipes/<recipe>.py`` (one GPU, bf16 autocast), run folder under ``--out``:

classifier, dino, yolo, detr, faster_rcnn
              each recipe's built-in demo with its defaults (training, evaluations, plots, saving, YOLO's export)
resnet50_224  configs/classifier/imagenet_resnet50.yaml (batch 128, channels_last, EMA): 3 epochs of 30 steps
dino_vits16   configs/dino/imagenet_vit_small.yaml (ViT-S/16, 2 x 224 + 8 x 96 px crops, batch 64, K 65536):
              2 epochs of 60 steps, then the kNN evaluation of its teacher
              both on one generated image folder (imagefolder layout, written once into the cache: 10 classes
              of oriented stripes in 256 px JPEGs, so that top-1 and kNN show whether training works)

From each run's metrics.jsonl: time to the first step (``time/first_step_s``), steady images/s (median of the
logged intervals after the first; training steps only), the epoch boundary (median of ``time/epoch_boundary_s``
over the epochs), evaluation, plots and saving seconds (``time/eval_s``, ``time/plots_s``, ``time/save_s``), peak
GPU memory (``train/max_memory_gib``) and the final metric; beside them the run's wall time and the peak resident
memory of its largest process. Printed as a table and written to
``<out>/gpu_check.md`` and ``gpu_check.json`` with the machine and the commit, to paste into
benchmarks/RESULTS.md. A failed run is named with the last lines of its stderr (logs in ``<out>/logs/``), the
other runs still run, and the check exits 1.

Expected wall time on one H100-class GPU with 16 cores: about 7 minutes, most of it the five demos' fixed
lengths (estimated from the recipes' step counts; not measured on a GPU yet: benchmarks/RESULTS.md).
``--steps`` scales the two fixed-length runs (not the demos). ``--tiny`` runs all seven on the CPU under bf16
autocast, as tests/test_gpu_check.py does: the demos' own small models, resnet18 and a 2-block ViT in place of
the large two, 2 epochs of 2 steps on generated data (40 px images, 16 + 8 of the demo's detection scenes), no
loader workers, through the environment ``accelerate launch --cpu`` sets rather than the launcher itself.

    python benchmarks/gpu_check.py                                    # all seven runs
    python benchmarks/gpu_check.py --runs resnet50_224 dino_vits16 --steps 2
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check        # the CPU check, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/, for the built-in sets and their cache
CLASSES = 10  # of the generated image folder


@dataclasses.dataclass(frozen=True)
class Check:
    """One run: ``recipes/<recipe>.py`` with ``args`` (``{folder}`` and ``{coco}``: the generated data), and in
    ``--tiny`` mode also ``tiny`` (its models and data made small); ``metric``: the metrics.jsonl key reported."""

    name: str
    recipe: str
    metric: str
    args: tuple[str, ...] = ()
    tiny: tuple[str, ...] = ()


# ViT-S/16's and DINO's head shapes kept, sizes cut: a ViT of 2 blocks of width 48 on 4-px patches
TINY_VIT = ("--model_kwargs", "{patch_size: 4, embed_dim: 48, depth: 2, num_heads: 2}")
TINY_DINO_HEAD = ("--out_dim", "256", "--head_hidden_dim", "64", "--head_bottleneck_dim", "32")
CHECKS = (
    Check("classifier", "classifier", "eval/top1", tiny=("--data", "{folder}")),
    Check("dino", "dino", "knn/teacher_top1", tiny=("--data", "{folder}")),
    Check("yolo", "yolo", "eval/map_50", tiny=("--data", "{coco}", "--export", "false")),
    Check(
        "detr",
        "detr",
        "eval/map_50",
        tiny=("--data", "{coco}", *"--pretrain_crops_epochs 1 --pretrain_crops_batch_size 16".split()),
    ),
    Check("faster_rcnn", "faster_rcnn", "eval/map_50", tiny=("--data", "{coco}")),
    Check(
        "resnet50_224",
        "classifier",
        "eval/top1",
        ("--config", "configs/classifier/imagenet_resnet50.yaml", "--data", "{folder}", "--epochs", "3"),
        ("--model", "resnet18", "--img_size", "32"),
    ),
    Check(
        "dino_vits16",
        "dino",
        "knn/teacher_top1",
        ("--config", "configs/dino/imagenet_vit_small.yaml", "--data", "{folder}", "--epochs", "2"),
        (*TINY_VIT, *TINY_DINO_HEAD, *"--global_size 32 --local_size 16 --local_crops 2 --knn_resize 0".split()),
    ),
)
# what every fixed-length run adds: 1 warmup epoch (the configs' 5 and 10 exceed the run), one evaluation at the
# end (epoch boundaries without evaluation), log intervals short enough for a median
FIXED = ("--warmup_epochs", "1", "--eval_every", "1000", "--log_every", "5")
# --tiny: 2 epochs of 2 steps of 8 images, logged every step, in the main process; metric from the last epoch
TINY = ("--epochs", "2", "--batch_size", "8", "--num_workers", "0", "--log_every", "1", "--eval_every", "1000")
TINY_DETECTION = {"train": 16, "val": 8}  # scenes of the built-in digits_det (96 px) in the --tiny COCO folder


# ---- the generated data --------------------------------------------------------------------------------------
def _write_class(job: tuple[Path, int, int, int, int]) -> None:
    """``count`` JPEGs of class ``label`` into ``folder``: stripes at one of 5 orientations and 2 frequencies
    (the class), random phase, on a smooth random colour background that compresses like a photo."""
    import numpy as np
    from PIL import Image

    folder, label, count, size, seed = job
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size  # (size, size), 0..1
    angle, cycles = math.radians(22.5 * (label % 5)), (4, 10)[label // 5 % 2]  # |angle - 90| differs under a flip
    along = x * math.cos(angle) + y * math.sin(angle)
    for i in range(count):
        stripes = 60 * np.sin(2 * math.pi * cycles * along + rng.uniform(0, 2 * math.pi))  # (size, size)
        grid = Image.fromarray(rng.integers(60, 196, (3, 3, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
        pixels = np.clip(np.asarray(grid, np.float32) + stripes[..., None], 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.jpg", quality=90)


def image_folder(train: int, val: int, size: int) -> Path:
    """The imagefolder ``train/<class>/*.jpg`` + ``validation/<class>/*.jpg`` (``train`` and ``val`` images in
    all, ``size`` px squares), written once into the built-in sets' cache and reused."""
    from common.data.builtin.cache import cached_folder

    def write(folder: Path) -> None:
        jobs = [
            (folder / split / str(c), c, n // CLASSES + (c < n % CLASSES), size, 1000 * s + c)
            for s, (split, n) in enumerate((("train", train), ("validation", val)))
            for c in range(CLASSES)
        ]
        with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            list(pool.map(_write_class, jobs))

    return cached_folder(f"gpu_check-v1-{train}+{val}x{size}px", "train/0/00000.jpg", write)


def tiny_coco(folder: Path) -> Path:
    """A COCO-json folder of the first scenes of the built-in digits_det (TINY_DETECTION of each split)."""
    from common.data.builtin import DETECTION

    source = DETECTION["digits_det"]()
    for split, count in TINY_DETECTION.items():
        coco = json.loads((source / "annotations" / f"instances_{split}.json").read_text())
        images = coco["images"][:count]
        ids = {image["id"] for image in images}
        coco.update(images=images, annotations=[a for a in coco["annotations"] if a["image_id"] in ids])
        (folder / split).mkdir(parents=True)
        for image in images:
            shutil.copy(source / split / image["file_name"], folder / split / image["file_name"])
        (folder / "annotations").mkdir(exist_ok=True)
        (folder / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return folder


# ---- running and reading one run ---------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One run's figures (None: not logged); seconds unless named otherwise."""

    name: str
    status: str  # ok, exit <code>, timed out
    wall_s: float
    steps: int | None = None
    first_step_s: float | None = None
    images_per_s: float | None = None  # median of the logged intervals after the first
    s_per_step: float | None = None  # the same intervals' median
    epoch_boundary_s: float | None = None  # median over the epochs
    epoch_boundaries_s: list[float] = dataclasses.field(default_factory=list)
    eval_s: float | None = None  # every evaluation, summed (the step-0 one included)
    plots_s: float | None = None
    checkpoint_s: float | None = None
    save_s: float | None = None
    gpu_memory_gib: float | None = None  # the largest train/max_memory_gib
    host_memory_gib: float | None = None  # peak resident memory of the run's largest process
    metric: str = ""
    value: float | None = None  # the metric's last logged value


def read_metrics(path: Path, row: Row) -> Row:
    """Fill ``row`` from a run's metrics.jsonl (missing file or keys: those figures stay None)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]

    def total(key: str) -> float | None:
        return sum(values(key)) if values(key) else None

    train = [r for r in records if "train/images_per_s" in r]
    steady = train[1:] or train  # the first interval holds the warm-up (cudnn autotuning, allocator, compile)
    row.steps = max((int(r["step"]) for r in records if "step" in r), default=None)
    row.first_step_s = next(iter(values("time/first_step_s")), None)
    if steady:
        row.images_per_s = statistics.median(r["train/images_per_s"] for r in steady)
        if all("train/s_per_step" in r for r in steady):
            row.s_per_step = statistics.median(r["train/s_per_step"] for r in steady)
    row.epoch_boundaries_s = values("time/epoch_boundary_s")
    row.epoch_boundary_s = statistics.median(row.epoch_boundaries_s) if row.epoch_boundaries_s else None
    row.eval_s, row.plots_s = total("time/eval_s"), total("time/plots_s")
    row.checkpoint_s, row.save_s = total("time/checkpoint_s"), total("time/save_s")
    row.gpu_memory_gib = max(values("train/max_memory_gib"), default=None)
    row.value = next(reversed(values(row.metric)), None)
    return row


def stderr_tail(text: str, lines: int = 12) -> list[str]:
    """The last ``lines`` a failed run wrote to stderr, less the launcher's own traceback at the end (which says
    only that the recipe exited non-zero: the recipe's error line or traceback stands above it)."""
    out = text.rstrip().splitlines()
    if out and out[-1].startswith("subprocess.CalledProcessError"):
        start = max(
            (i for i, line in enumerate(out) if line.startswith("Traceback (most recent call last)")), default=0
        )
        out = out[:start] or out
    return out[-lines:]


def run_one(check: Check, command: list[str], env: dict[str, str], out: Path, timeout: float) -> Row:
    """Run ``command`` (the recipe's launch) with ``env`` added to this process's environment and its output in
    ``out/logs/``; its figures, or its failure named on stderr with the last lines the run wrote there."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **env,
    )
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("WANDB_MODE", "offline")):
        env.setdefault(key, value)
    shown = [f"{k}={v}" for k, v in env.items() if k.startswith("ACCELERATE_") or k == "CUDA_VISIBLE_DEVICES"]
    (logs / f"{check.name}.command.txt").write_text(" ".join(shown + command) + "\n")
    start = time.perf_counter()
    with open(logs / f"{check.name}.stdout.log", "w") as stdout, open(logs / f"{check.name}.stderr.log", "w") as stderr:
        # a session of its own: a timeout or Ctrl-C ends the launcher, the recipe and its loader workers together
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this launch, its descendants included
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    state = "ok" if code == 0 else ("timed out" if code == -signal.SIGKILL and wall >= timeout else f"exit {code}")
    row = Row(check.name, state, wall, metric=check.metric, host_memory_gib=usage.ru_maxrss / 2**20)  # KiB -> GiB
    if code != 0:
        tail = stderr_tail((logs / f"{check.name}.stderr.log").read_text(errors="replace"))
        print(
            f"error: run {check.name} failed ({state}, after {wall:.0f} s); the last lines of its stderr "
            f"({logs / check.name}.stderr.log):",
            *(f"    {line}" for line in tail),
            sep="\n",
            file=sys.stderr,
            flush=True,
        )
    return read_metrics(out / "runs" / check.name / "metrics.jsonl", row)


# ---- the report --------------------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    """The GPU (nvidia-smi), CPU, versions and commit this check ran on."""
    info: dict[str, str] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        gpus = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
        info["gpu"] = f"{len(gpus)} x {gpus[0]}" if gpus else "none"
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = "none (no nvidia-smi)"
    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), cpu)
    except OSError:
        pass
    info["cpu"] = f"{cpu}, {os.cpu_count()} cores"
    info["python"] = platform.python_version()
    for package in ("torch", "torchvision", "timm", "accelerate"):
        info[package] = metadata.version(package)
    git = ["git", "-C", str(ROOT)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout
        info["commit"] = (commit or "unknown") + (" plus uncommitted changes" if dirty.strip() else "")
    except OSError:
        info["commit"] = "unknown"
    return info


COLUMNS = (  # (header, Row field, format)
    ("run", "name", "{}"),
    ("status", "status", "{}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("steps", "steps", "{}"),
    ("first step s", "first_step_s", "{:.2f}"),
    ("img/s", "images_per_s", "{:.0f}"),
    ("s/step", "s_per_step", "{:.4f}"),
    ("epoch boundary s", "epoch_boundary_s", "{:.2f}"),
    ("eval s", "eval_s", "{:.1f}"),
    ("plots s", "plots_s", "{:.1f}"),
    ("save s", "save_s", "{:.1f}"),
    ("GPU GiB", "gpu_memory_gib", "{:.2f}"),
    ("host GiB", "host_memory_gib", "{:.2f}"),
    ("metric", "metric", "{}"),
    ("value", "value", "{:.4g}"),
)


def table(rows: list[Row]) -> list[list[str]]:
    """Header and one line of cells per run ("-": not logged)."""
    cells = [[h for h, _, _ in COLUMNS]]
    for row in rows:
        cells.append([("-" if getattr(row, k) is None else f.format(getattr(row, k))) for _, k, f in COLUMNS])
    return cells


def report(rows: list[Row], info: dict[str, str], command: str, out: Path) -> None:
    """Print the table and write it with the machine to ``out/gpu_check.md`` and ``out/gpu_check.json``."""
    cells = table(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    print("\n" + "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells))
    described = "; ".join(f"{k} {v}" for k, v in info.items())
    print(f"\nmachine: {described}\nall runs: {sum(r.wall_s for r in rows):.0f} s")
    print(f"written: {out / 'gpu_check.md'} (rows for benchmarks/RESULTS.md), {out / 'gpu_check.json'}")
    # the rows of benchmarks/RESULTS.md's GPU-check table: the first names the date, machine and command
    first = [info["date"][:10], f"{info['gpu']}; {info['cpu']}", f"`{command}` at commit `{info['commit']}`"]
    lines = [["date", "machine", "command", *cells[0], "note"]]
    lines += [[*(first if i == 0 else [first[0], "same run", "same"]), *line, ""] for i, line in enumerate(cells[1:])]
    markdown = [f"machine: {described}", "", "| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
    (out / "gpu_check.md").write_text(
        "\n".join(markdown + ["| " + " | ".join(line) + " |" for line in lines[1:]]) + "\n"
    )

    def rounded(v: Any) -> Any:
        return round(v, 4) if isinstance(v, float) else [rounded(x) for x in v] if isinstance(v, list) else v

    runs = [{k: rounded(v) for k, v in dataclasses.asdict(r).items()} for r in rows]
    (out / "gpu_check.json").write_text(json.dumps({"command": command, "machine": info, "runs": runs}, indent=1))


# ---- main ----------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [c.name for c in CHECKS]
    p.add_argument("--runs", nargs="+", default=names, metavar="RUN", help=f"a subset of: {' '.join(names)}")
    p.add_argument(
        "--out", default="", help="a new folder for the runs, logs and table (default: runs/gpu_check/<time>)"
    )
    p.add_argument(
        "--steps", type=float, default=1.0, help="scales the fixed-length runs' steps per epoch (not the demos)"
    )
    p.add_argument(
        "--precision", choices=("bf16", "fp16", "no"), default="bf16", help="autocast (fp16: GPUs without bf16)"
    )
    p.add_argument(
        "--timeout", type=float, default=0, help="seconds per run before it is killed (0: 600; 300 with --tiny)"
    )
    p.add_argument("--tiny", action="store_true", help="on the CPU at tiny sizes: the check of the check (tests)")
    args = p.parse_args(argv)
    unknown = [r for r in args.runs if r not in names]
    if unknown:
        p.error(f"unknown run {unknown[0]!r}; the runs are: {', '.join(names)}")
    if not args.steps > 0:
        p.error(f"--steps must be above 0; got {args.steps}")
    args.out = Path(args.out or ROOT / "runs" / "gpu_check" / time.strftime("%Y%m%d-%H%M%S"))
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty (a check's runs must start afresh); name a new folder")
    if not args.tiny:
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True, text=True
        )
        if probe.stdout.strip() in ("", "0"):
            p.error("no CUDA GPU visible to torch: run it on a GPU machine, or --tiny for the CPU check")
    args.timeout = args.timeout or (300 if args.tiny else 600)
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse(argv)
    checks = [c for c in CHECKS if c.name in args.runs]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:  # what `accelerate launch --cpu` sets for one process, without its seconds of start-up
        launch, env = [sys.executable], {"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": args.precision}
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        single_gpu = ROOT / "configs" / "accelerate" / "single_gpu.yaml"
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(single_gpu)]
        launch, env = [*launch, "--mixed_precision", args.precision], {}
    # the fixed-length runs' folder: an epoch is 30 steps of the resnet50 config's batch of 128 (DINO's batch of 64:
    # 60 steps), --tiny's 2 steps of 8; evaluation: 50 images per class (--tiny: 1)
    train, val, size = (2 * 8, CLASSES, 40) if args.tiny else (max(1, round(30 * args.steps)) * 128, 50 * CLASSES, 256)
    data = {}
    if any("{folder}" in (c.args + c.tiny if args.tiny else c.args) for c in checks):
        print(f"image folder: {train} + {val} images of {size} px ...", flush=True)
        data["{folder}"] = str(image_folder(train, val, size))
    if args.tiny and any("{coco}" in c.tiny for c in checks):
        data["{coco}"] = str(tiny_coco(out / "data" / "digits_det_tiny"))
    rows = []
    for i, check in enumerate(checks):
        extra = [*check.args, *(FIXED if check.args else ()), *(TINY + check.tiny if args.tiny else ())]
        extra = [data.get(a, a) for a in extra]
        command = [*launch, str(ROOT / "recipes" / f"{check.recipe}.py"), *extra]
        command += ["--report_to", "none", "--output_dir", str(out / "runs" / check.name)]
        print(f"[{i + 1}/{len(checks)}] {check.name} ... (output: {out / 'logs' / check.name}.stdout.log)", flush=True)
        rows.append(run_one(check, command, env, out, args.timeout))
        print(f"[{i + 1}/{len(checks)}] {check.name}: {rows[-1].status} in {rows[-1].wall_s:.1f} s", flush=True)
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report(rows, machine(), command.strip(), out)
    failed = [r.name for r in rows if r.status != "ok"]
    if failed:
        print(
            f"error: {len(failed)} of {len(rows)} runs failed: {', '.join(failed)} (logs in {out / 'logs'})",
            file=sys.stderr,
        )
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
