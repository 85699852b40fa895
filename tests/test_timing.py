"""Time outside the training steps: the logged rate counts steps alone, the rest has its own time/* seconds;
the num_workers default; epoch-end curves read only metrics.jsonl's new lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import load_recipe
from test_classifier import TINY


def image_folder(root: Path, per_class: int = 8) -> Path:
    """train/ and val/ of two classes, ``per_class`` 32x32 images each: 4 steps an epoch at batch 4."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for index, name in enumerate(("dark", "light")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class if split == "train" else 4):
                pixels = rng.integers(0, 100, (32, 32, 3)) + 150 * index
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_rate_counts_steps_only_and_time_keys_are_logged(tmp_path: Path, monkeypatch) -> None:
    classifier = load_recipe("classifier")
    evaluate = classifier.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(1.0)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(classifier, "evaluate", slow_evaluate)
    run = tmp_path / "run"
    args = ["--data", str(image_folder(tmp_path / "data")), "--batch_size", "4", "--epochs", "2"]
    classifier.main(TINY + args + ["--checkpoint_every", "2", "--output_dir", str(run)])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in records for k in r}
    for key in ("first_step", "eval", "plots", "checkpoint", "save", "epoch_boundary"):
        assert f"time/{key}_s" in keys, key
    evals = [r for r in records if "eval/top1" in r]
    assert len(evals) == 2 and all(r["time/eval_s"] >= 1.0 for r in evals)  # the sleep is in the evaluation
    first = next(r for r in records if "time/first_step_s" in r)
    assert first["step"] == 1 and first["time/first_step_s"] > 0
    # step 5, the second epoch's first step: its interval held an evaluation (>= 1 s), which the rate leaves out
    after_eval = next(r for r in records if r["step"] == 5 and "train/s_per_step" in r)
    assert after_eval["train/s_per_step"] < 0.5, after_eval
    boundary = next(r for r in records if "time/epoch_boundary_s" in r)
    assert boundary["step"] == 4 and boundary["time/epoch_boundary_s"] < 1.0  # no evaluation in it


def test_num_workers_default_is_the_cores_per_local_process(monkeypatch) -> None:
    from common.loaders import MAX_AUTO_WORKERS, auto_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)))
    assert auto_workers(3) == 3  # an explicit number stays
    assert auto_workers(-1, local_processes=1) == MAX_AUTO_WORKERS  # 12 cores, one process: the cap
    assert auto_workers(-1, local_processes=4) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert auto_workers(-1) == 6
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert auto_workers(-1) == 0  # one core shared by 2 processes: load in the main process


def test_metrics_reader_parses_only_new_lines(tmp_path: Path, monkeypatch) -> None:
    from common import curves as figures

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": 1.5}\n')
    reader = figures.MetricsReader(path)
    assert reader.read()["train/loss"][1].tolist() == [2.0, 1.5]
    parsed: list[bytes] = []
    parse = figures.MetricsReader._parse
    monkeypatch.setattr(figures.MetricsReader, "_parse", lambda self, line: parsed.append(line) or parse(self, line))
    with open(path, "a") as f:
        f.write('{"step": 3, "train/loss": 1.0}\n{"step": 4, "train/lo')  # the last line is still being written
    assert reader.read()["train/loss"][0].tolist() == [1.0, 2.0, 3.0]
    assert len(parsed) == 1  # the new complete line only
    with open(path, "a") as f:
        f.write('ss": 0.5}\n')
    assert reader.read()["train/loss"][1].tolist() == [2.0, 1.5, 1.0, 0.5]
    assert len(parsed) == 2
    # a resume rewrites the file without the lines past its checkpoint, then appends: read again from the start
    path.write_text(
        '{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": 1.25}\n{"step": 3, "train/loss": 0.75}\n'
    )
    assert reader.read()["train/loss"][1].tolist() == [2.0, 1.25, 0.75]
    curves = figures.plot_curves(reader, tmp_path / "curves.png")
    assert curves is not None and (tmp_path / "curves.png").is_file()


@pytest.mark.parametrize("recipe", ["classifier", "detr", "faster_rcnn", "yolo", "dino"])
def test_defaults_use_the_machine_and_evaluate_at_the_training_batch(recipe: str) -> None:
    module = load_recipe(recipe)
    assert module.Config().num_workers == -1
    if hasattr(module.Config(), "eval_batch_size"):
        assert module.Config().eval_batch_size == 0  # 0: the training batch_size
