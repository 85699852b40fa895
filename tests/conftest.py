"""Shared fixtures: offline environment, and helpers to run a recipe as users do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never touch the network: datasets and weights come from built-in data, trackers log offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def _share_the_cores() -> None:
    """Under pytest-xdist (``-n N``, pytest.ini) N workers run tests side by side: give each worker,
    and every recipe process it starts, its share of the cores instead of all of them, so that N
    workers on N cores do not oversubscribe them (torch's default is one thread per core)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


_share_the_cores()  # before any test module imports torch


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (importing a recipe has no side effects)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def detection_table(
    images: list, boxes: list[list], categories: list[list] | None = None, crowd: list[list] | None = None
):
    """A detection split in the normalised schema (common/detection/sources.py) from images (PIL or
    datasets.Image values) and per-image COCO boxes; image ids from 1, classes 0 unless given."""
    import io

    import datasets
    from PIL import Image

    from common.detection.sources import features

    def value(image):
        if isinstance(image, dict):
            return image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}

    sizes = [image.size if isinstance(image, Image.Image) else (8, 8) for image in images]
    return datasets.Dataset.from_dict(
        {
            "image": [value(image) for image in images],
            "image_id": list(range(1, len(images) + 1)),
            "width": [w for w, _ in sizes],
            "height": [h for _, h in sizes],
            "objects": [
                {
                    "bbox": b,
                    "category": (categories or [[0] * len(b) for b in boxes])[i],
                    "area": [x[2] * x[3] for x in b],
                    "iscrowd": (crowd or [[0] * len(b) for b in boxes])[i],
                }
                for i, b in enumerate(boxes)
            ],
        },
        features=features(),
    )


def bright_rectangle(width: int = 80, height: int = 60, box: tuple[int, int, int, int] = (20, 10, 25, 20)):
    """A dark RGB image (grey 30) with one bright rectangle (grey 230) at COCO ``box``."""
    import numpy as np
    from PIL import Image

    pixels = np.full((height, width, 3), 30, np.uint8)
    x, y, w, h = box
    pixels[y : y + h, x : x + w] = 230
    return Image.fromarray(pixels)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_cmd(recipe: str, args: list[str], nproc: int = 1) -> list[str]:
    """The command line users type: plain python for one process, torchrun (gloo) for several."""
    script = str(ROOT / "recipes" / f"{recipe}.py")
    if nproc == 1:
        return [sys.executable, script, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        script,
        *args,
    ]


def recipe_env(nproc: int = 1, **extra: str) -> dict[str, str]:
    # the repository root first: common/ as `pip install -e .` gives it, whether or not it was installed
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.update(extra)
    if nproc > 1:
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    return env


def run_recipe(
    recipe: str, args: list[str], nproc: int = 1, timeout: float = 600, cwd: Path | None = None, **extra_env: str
) -> subprocess.CompletedProcess:
    """Run a recipe to completion; returns the process with text stdout/stderr."""
    return subprocess.run(
        recipe_cmd(recipe, args, nproc),
        cwd=cwd or ROOT,
        env=recipe_env(nproc, **extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(capsys: pytest.CaptureFixture, main, args: list[str]) -> str:
    """Run a recipe's ``main(args)`` in-process as its entry point does (``cli_main``): it must exit
    with status 2 and print exactly one ``error:`` line; returns that line. In-process because a
    subprocess per bad-input case costs seconds of imports."""
    from common.console import cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(lambda: main(args))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.fixture
def tmp_run(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-xdist (``--dist loadgroup``, pytest.ini) hands tests to workers one by one. A
    module-scoped fixture (one shared training run) would then run once in every worker that gets
    one of its tests, so the tests of a module that use such fixtures form one group, run by one
    worker; the rest are balanced freely."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.scope == "module" for fixture_defs in defs.values() for d in fixture_defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def assert_pictures(folder: Path, names: list[str]) -> None:
    """Each ``folder/<name>.png`` exists, opens, is at least 200 px on each side and has content (not one
    flat colour)."""
    import numpy as np
    from PIL import Image

    for name in names:
        path = folder / f"{name}.png"
        assert path.is_file(), f"{path} missing; found {sorted(p.name for p in folder.iterdir())}"
        pixels = np.asarray(Image.open(path).convert("L"), np.float32)
        assert min(pixels.shape) >= 200 and pixels.std() > 10, (name, pixels.shape, pixels.std())


# Each recipe's tiny model and sizes for short runs on its built-in data (the classifier's: TINY_CLASSIFIER):
# DINO a 4-block ViT on 32 px digits with 2 local crops, the detectors their demo models on small batches.
TINY_RUNS = {
    "dino": [
        *("--data", "digits", "--batch_size", "16", "--local_crops", "2", "--knn_train_limit", "200"),
        *("--plot_images", "0", "--drop_path_rate", "0", "--model", "vit_tiny_patch16_224", "--head_use_bn", "false"),
        *("--model_kwargs", "{patch_size: 4, embed_dim: 96, depth: 4, num_heads: 3}"),
    ],
    "yolo": ["--batch_size", "4", "--plot_images", "0"],
    "detr": ["--batch_size", "2", "--plot_images", "0", "--pretrain_crops_epochs", "0"],
    "faster_rcnn": ["--batch_size", "1", "--plot_images", "0", "--min_size", "64", "--max_size", "64"],
}

# A 4-step classifier run on the built-in digits: what the run plumbing tests run.
TINY_CLASSIFIER = [
    "--model",
    "test_vit",
    "--img_size",
    "32",
    "--num_workers",
    "0",
    "--opt",
    "sgd",
    "--lr",
    "0.05",
    "--warmup_epochs",
    "0",
    "--smoothing",
    "0",
    "--log_every",
    "2",
    "--max_steps",
    "4",
]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> tuple[Path, str]:
    """A 4-step classifier run logging to W&B offline (WANDB_MODE=offline, set above) with its weights,
    model folder and ONNX export as artifacts, and what it printed."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("ux") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_recipe("classifier").main(
            TINY_CLASSIFIER + ["--report_to", "wandb", "--log_weights", "--export", "--output_dir", str(folder)]
        )
    return folder, out.getvalue()


def scene_files(folder: Path, count: int = 4) -> Path:
    """``count`` of the built-in digits_det evaluation scenes copied as image files into ``folder``."""
    import shutil

    from common.data.builtin import DETECTION

    folder.mkdir(parents=True, exist_ok=True)
    for source in sorted((DETECTION["digits_det"]() / "val").iterdir())[:count]:
        shutil.copy(source, folder / source.name)
    return folder


def export_and_predict(recipe: str, weights: Path, images: Path, out: Path, *args: str) -> tuple[Path, Path, Path]:
    """What a user does to check a shipped file (in-process): ``--export --weights W`` into ``out/export``,
    then ``--predict images`` from W and from the exported ``model.onnx``. Returns the export folder and the
    two prediction folders (safetensors, ONNX)."""
    module = load_recipe(recipe)
    common_args = ["--report_to", "none", *args]
    module.main(["--export", "--weights", str(weights), "--output_dir", str(out / "export"), *common_args])
    predicted = []
    for name, source in (("eager", weights), ("onnx", out / "export" / "model.onnx")):
        predicted.append(out / name)
        module.main(["--predict", str(images), "--weights", str(source), "--output_dir", str(out / name), *common_args])
    return out / "export", predicted[0], predicted[1]


def assert_same_detections(eager: Path, onnx: Path, px: float = 0.5, score: float = 1e-3) -> int:
    """The detections.json of two --predict runs agree: the same images, classes and order, boxes within
    ``px`` pixels and scores within ``score``. Returns how many detections were compared."""
    import json

    a, b = (json.loads((folder / "detections.json").read_text()) for folder in (eager, onnx))
    assert [e["file"] for e in a] == [e["file"] for e in b]
    compared = 0
    for x, y in zip(a, b):
        assert [d["class"] for d in x["detections"]] == [d["class"] for d in y["detections"]], x["file"]
        for p, q in zip(x["detections"], y["detections"]):
            assert abs(p["score"] - q["score"]) <= score and max(abs(u - v) for u, v in zip(p["box"], q["box"])) <= px
            compared += 1
    return compared
