"""Time to the first step and at the epoch boundary: recipes/classifier.py against timm's train.py, and
recipes/dino.py against the DINO reference's main_dino.py, side by side in one run on the CPU.

The reference scripts are not part of this repository; take them from their repositories' newest commits:

    git clone --depth 1 https://github.com/huggingface/pytorch-image-models   # train.py
    git clone --depth 1 https://github.com/facebookresearch/dino              # main_dino.py, utils.py, ...
    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/startup.py \\
        --timm_train pytorch-image-models/train.py --dino_main dino/main_dino.py

Both sides of a pair train on one generated image folder (``--images`` random smooth-noise JPEGs of
``--side`` px in ``labelled/train/<class>/``, ``labelled/validation/`` beside it) with the same model,
batch, loader workers and epochs (2), without evaluation between the epochs (ours: ``--eval_every`` past
the end; timm: ``--val-interval`` past the end; the DINO reference has none; our DINO reads the same files
through ``unlabelled/train/``, links without class folders, so no kNN runs at step 0). Classifier pair:
``--model`` at ``--img_size``, ``--batch_size``, AdamW on both sides, each side's own default augmentation.
DINO pair: ViT-Ti/16 (timm's ``vit_tiny_patch16_224``; the reference's ``vit_tiny``), 2 x 224 px and
``--local_crops`` x 96 px crops, ``--dino_batch``, head 2048 -> 256 -> ``--out_dim`` without batch norm,
fp32. The defaults take about 6 minutes on 2 CPU cores. Each run is a subprocess timed from
outside alike: this script stamps every line of its output as it arrives (``PYTHONUNBUFFERED``), from the
moment the process starts, and reads the step lines (ours: ``--log_every 1``; timm: ``--log-interval 1``;
DINO's reference prints steps 0, 10, 20, ... and the last of each epoch). The process is killed once the
second epoch's first step is logged. Figures per run (seconds):

first_step   process start to the line of the first training step (imports, data scan, model, loader
             start, the step itself): what a user waits for.
s/step       steady state: (last step of epoch 0 - first step) / (steps per epoch - 1).
boundary     the epoch boundary beyond one step: epoch 1's first step line - epoch 0's last step line -
             s/step (loader restart, and what each does at an epoch end: timm's and DINO's epoch logs,
             DINO's checkpoint.pth every epoch; ours checkpoints every ``checkpoint_every`` steps, not
             due here).

``--first_step_only``: each run is killed at its first step line and only first_step is figured (a large
folder's whole epoch is not needed for it); with ``--data`` an existing folder in the generated layout (the
issue-49 case: 22,000 files, ``--images 17600`` generates one). ``--fresh_cache``: each of our runs starts
with an empty ``CV_RECIPES_CACHE`` (no cached scan answers: a first start on the folder); without it our runs
share one, so all but the first are second starts.

Pairs run in ABBA order (reference, ours, ours, reference, ...); printed: each run, each side's medians
and the ratio ours / reference of each median (goal: first_step and boundary <= 1.2, s/step about 1).
The DINO reference runs on the CPU through a shim passed as ``python -c`` (a process group of one over
gloo from RANK / WORLD_SIZE; ``.cuda()``, ``set_device`` and ``synchronize`` no-ops; DDP without
``device_ids``; ``torch.hub.list`` empty, as its ``--arch`` choices would ask GitHub; its epoch-end meter
reduction, which allocates on CUDA, skipped: one process has nothing to reduce): its files are left as
they are.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (epoch, index of the step in its epoch from 0, steps per epoch) from a reference's step line
TIMM_STEP = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+)")
DINO_STEP = re.compile(r"Epoch: \[(\d+)/\d+\]\s+\[\s*(\d+)/(\d+)\]")
OUR_STEP = re.compile(r"^epoch (\d+) step (\d+)/\d+  loss")  # optimizer steps from 1; a line each (--log_every 1)

DINO_SHIM = """
import os, runpy, sys
import torch, torch.distributed as dist
from torch import nn
torch.hub.list = lambda *a, **k: []
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.synchronize = lambda *a, **k: None
nn.Module.cuda = lambda self, *a, **k: self
torch.Tensor.cuda = lambda self, *a, **k: self
_init = dist.init_process_group
dist.init_process_group = lambda *a, backend=None, **k: _init(*a, backend="gloo", **k)
class DDP(nn.parallel.DistributedDataParallel):
    def __init__(self, module, *a, device_ids=None, **k):
        super().__init__(module, *a, **k)
nn.parallel.DistributedDataParallel = DDP
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
import utils
utils.SmoothedValue.synchronize_between_processes = lambda self: None
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def image_folder(root: Path, images: int, side: int, classes: int = 4) -> Path:
    """``images`` training JPEGs in ``root/labelled/train/c<k>/`` (and a quarter as many in
    ``labelled/validation/``), smooth random noise (small files, fast to decode), and ``root/unlabelled/train/``
    linking the training files without class folders. Returns ``root``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", images), ("validation", max(images // 4, classes))):
        for i in range(n):
            folder = root / "labelled" / split / f"c{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            noise = Image.fromarray(rng.integers(0, 256, (side // 8 + 1, side // 8 + 1, 3), dtype=np.uint8))
            buffer = io.BytesIO()
            noise.resize((side, side), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
            (folder / f"{i:05d}.jpg").write_bytes(buffer.getvalue())
    flat = root / "unlabelled" / "train"
    flat.mkdir(parents=True, exist_ok=True)
    for path in sorted((root / "labelled" / "train").glob("*/*.jpg")):
        (flat / f"{path.parent.name}_{path.name}").symlink_to(path)
    return root


def ours_step(line: str, steps_per_epoch: int) -> tuple[int, int] | None:
    """(epoch, index in the epoch from 0) of one of our step lines, else None."""
    m = OUR_STEP.match(line)
    return (int(m.group(1)), int(m.group(2)) - 1 - int(m.group(1)) * steps_per_epoch) if m else None


def reference_step(pattern: re.Pattern, line: str) -> tuple[int, int] | None:
    """(epoch, index in the epoch from 0) of a reference's step line (``pattern``), else None."""
    m = pattern.search(line)
    return (int(m.group(1)), int(m.group(2))) if m else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(
    cmd: list[str], cwd: Path, env: dict[str, str], parse, steps_per_epoch: int, log: Path, first_only: bool = False
) -> dict:
    """Run ``cmd``; ``parse(line) -> (epoch, index) | None`` reads a step line. Returns the figures of the
    module docstring; the process group is killed once epoch 1's first step is seen (or at its end), or with
    ``first_only`` once the first step is seen (then only ``first_step`` is figured)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen: dict[tuple[int, int], float] = {}
    with open(log, "w") as out:
        for line in proc.stdout:
            now = time.perf_counter() - start
            out.write(f"{now:9.3f} {line}")
            at = parse(line)
            if at is not None:
                seen.setdefault(at, now)
                if at == (1, 0) or (first_only and at == (0, 0)):
                    break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if first_only:
        if (0, 0) not in seen:
            raise SystemExit(f"{cmd[:3]}: no first step line; see {log}")
        return {"first_step": seen[0, 0]}
    last = steps_per_epoch - 1
    if (0, 0) not in seen or (0, last) not in seen or (1, 0) not in seen:
        raise SystemExit(f"{cmd[:3]}: step lines missing (have {sorted(seen)}); see {log}")
    per_step = (seen[0, last] - seen[0, 0]) / last
    return {
        "first_step": seen[0, 0],
        "s/step": per_step,
        "boundary": seen[1, 0] - seen[0, last] - per_step,
    }


def classifier_pair(args: argparse.Namespace, data: Path, work: Path, steps: int) -> dict:
    common = dict(model=args.model, size=args.img_size, batch=args.batch_size, workers=args.workers)

    def ours(log: Path) -> dict:
        cmd = [sys.executable, str(ROOT / "recipes" / "classifier.py"), "--data", str(data / "labelled")]
        cmd += ["--model", common["model"], "--img_size", str(common["size"]), "--batch_size", str(common["batch"])]
        cmd += ["--num_workers", str(common["workers"]), "--epochs", "2", "--log_every", "1", "--eval_every", "100"]
        cmd += ["--report_to", "none", "--output_dir", str(work / f"ours-{time.time_ns()}")]
        parse = lambda line: ours_step(line, steps)  # noqa: E731
        return timed_steps(cmd, ROOT, env(our_cache(args, work)), parse, steps, log, args.first_step_only)

    def timm(log: Path) -> dict:
        script = Path(args.timm_train).resolve()
        cmd = [sys.executable, str(script), "--data-dir", str(data / "labelled"), "--train-split", "train"]
        cmd += ["--val-split", "validation", "--val-interval", "100", "--model", common["model"]]
        cmd += ["--img-size", str(common["size"]), "--batch-size", str(common["batch"])]
        cmd += ["--workers", str(common["workers"]), "--epochs", "2", "--log-interval", "1", "--device", "cpu"]
        cmd += ["--no-prefetcher", "--opt", "adamw", "--num-classes", "4"]  # AdamW as ours
        cmd += ["--output", str(work / f"timm-{time.time_ns()}")]
        parse = lambda line: reference_step(TIMM_STEP, line)  # noqa: E731
        return timed_steps(cmd, script.parent, env(), parse, steps, log, args.first_step_only)

    return {"reference": timm, "ours": ours}


def dino_pair(args: argparse.Namespace, data: Path, work: Path, steps: int) -> dict:
    def ours(log: Path) -> dict:
        cmd = [sys.executable, str(ROOT / "recipes" / "dino.py"), "--data", str(data / "unlabelled")]
        cmd += ["--model", "vit_tiny_patch16_224", "--model_kwargs", "{}", "--global_size", "224"]
        cmd += ["--local_size", "96", "--local_crops", str(args.local_crops), "--batch_size", str(args.dino_batch)]
        cmd += ["--out_dim", str(args.out_dim), "--head_hidden_dim", "2048", "--head_use_bn", "false"]
        cmd += ["--num_workers", str(args.workers), "--epochs", "2", "--log_every", "1", "--eval_every", "100"]
        cmd += ["--report_to", "none", "--output_dir", str(work / f"ours-{time.time_ns()}")]
        parse = lambda line: ours_step(line, steps)  # noqa: E731
        return timed_steps(cmd, ROOT, env(our_cache(args, work)), parse, steps, log, args.first_step_only)

    def reference(log: Path) -> dict:
        script = Path(args.dino_main).resolve()
        cmd = [sys.executable, "-c", DINO_SHIM, str(script), "--arch", "vit_tiny", "--patch_size", "16"]
        cmd += ["--data_path", str(data / "labelled" / "train"), "--local_crops_number", str(args.local_crops)]
        cmd += ["--batch_size_per_gpu", str(args.dino_batch), "--out_dim", str(args.out_dim), "--use_fp16", "false"]
        cmd += ["--num_workers", str(args.workers), "--epochs", "2", "--warmup_epochs", "1"]
        cmd += ["--output_dir", str(work / f"dino-{time.time_ns()}")]
        extra = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        extra["MASTER_PORT"] = str(free_port())
        parse = lambda line: reference_step(DINO_STEP, line)  # noqa: E731
        return timed_steps(cmd, script.parent, env(extra), parse, steps, log, args.first_step_only)

    return {"reference": reference, "ours": ours}


def our_cache(args: argparse.Namespace, work: Path) -> dict[str, str]:
    """Our runs' cache root (scan answers, built-in data): a new empty one per run with ``--fresh_cache``."""
    if not args.fresh_cache:
        return {}
    return {"CV_RECIPES_CACHE": tempfile.mkdtemp(prefix="cache-", dir=work)}


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every run: offline, unbuffered output, ``OMP_NUM_THREADS`` as given."""
    out = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    out.update({"HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", **(extra or {})})
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timm_train", default="", help="timm's train.py (empty: no classifier pair)")
    p.add_argument("--dino_main", default="", help="the DINO reference's main_dino.py (empty: no DINO pair)")
    p.add_argument("--repeats", type=int, default=2, help="ABBA pairs: each side runs 2 x this")
    p.add_argument("--images", type=int, default=80, help="training images (steps per epoch = images // batch)")
    p.add_argument("--side", type=int, default=256, help="the JPEGs' side, px")
    p.add_argument("--model", default="resnet18", help="the classifier pair's timm model")
    p.add_argument("--img_size", type=int, default=128, help="the classifier pair's resolution, px")
    p.add_argument("--batch_size", type=int, default=16, help="the classifier pair's batch")
    p.add_argument("--dino_batch", type=int, default=8, help="the DINO pair's batch (ViT-Ti/16, 224 and 96 px crops)")
    p.add_argument("--local_crops", type=int, default=2, help="the DINO pair's local crops per image")
    p.add_argument("--out_dim", type=int, default=4096, help="the DINO pair's prototypes")
    p.add_argument("--workers", type=int, default=2, help="loader workers per process, both sides")
    p.add_argument("--work", default="", help="folder for the data, run folders and logs (empty: a temporary one)")
    p.add_argument("--data", default="", help="an image folder of image_folder()'s layout (empty: generated in --work)")
    p.add_argument("--first_step_only", action="store_true", help="time to the first step only (see the docstring)")
    p.add_argument("--fresh_cache", action="store_true", help="each of our runs without cached scan answers")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="startup-"))
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else work / "data"
    if not (data / "unlabelled").is_dir():
        image_folder(data, args.images, args.side)
    pairs = {}
    if args.timm_train:
        pairs["classifier"] = classifier_pair(args, data, work, args.images // args.batch_size)
    if args.dino_main:
        pairs["dino"] = dino_pair(args, data, work, args.images // args.dino_batch)
    if not pairs:
        raise SystemExit("name --timm_train and/or --dino_main (see the docstring for where to get them)")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, sides in pairs.items():
        runs: dict[str, list[dict[str, float]]] = {"reference": [], "ours": []}
        for r in range(args.repeats):
            for side in ("reference", "ours", "ours", "reference"):
                log = work / f"{name}-{side}-{r}-{len(runs[side])}.log"
                runs[side].append(sides[side](log))
                figures = "  ".join(f"{k} {v:7.2f}" for k, v in runs[side][-1].items())
                print(f"{name:10s} {side:9s} {figures}  ({log})", flush=True)
        medians = {side: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for side, rs in runs.items()}
        ratio = {k: medians["ours"][k] / medians["reference"][k] for k in medians["ours"]}
        results[name] = {**{f"{s}/{k}": v for s, m in medians.items() for k, v in m.items()}}
        results[name].update({f"ratio/{k}": v for k, v in ratio.items()})
        print(f"{name}: median of {2 * args.repeats} runs per side, seconds (ratio ours / reference)")
        for k in ratio:
            ref, us = medians["reference"][k], medians["ours"][k]
            print(f"  {k:11s} reference {ref:7.2f}  ours {us:7.2f}  ratio {ratio[k]:.2f}")
    return results


if __name__ == "__main__":
    main()
