"""benchmarks/gpu_check.py, the GPU check a user runs: all seven runs at tiny sizes on the CPU (so that the command
keeps working where CI has no GPU), its reading of metrics.jsonl, and how it reports a run that fails."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT, recipe_env


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.configs  # the second tier, with the shipped configs (-m configs; CI runs it)
@pytest.mark.slow
def test_tiny_check_runs_every_run_and_tables_its_numbers(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--out", str(out)],
        cwd=tmp_path,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    names = [row["name"] for row in report["runs"]]
    assert names == ["classifier", "dino", "yolo", "detr", "faster_rcnn", "resnet50_224", "dino_vits16"]
    for row in report["runs"]:
        assert row["status"] == "ok" and row["steps"] == 4, row  # 2 epochs of 2 steps
        for key in ("wall_s", "first_step_s", "images_per_s", "s_per_step", "eval_s", "plots_s", "save_s"):
            assert row[key] is not None and row[key] > 0, (row["name"], key, row)
        assert len(row["epoch_boundaries_s"]) >= 1 and row["epoch_boundary_s"] >= 0, row
        assert row["first_step_s"] < row["wall_s"] and row["eval_s"] < row["wall_s"], row
        assert row["value"] is not None and 0 <= row["value"] <= 100, row  # top-1 %, kNN %, mAP 0..1
        assert row["gpu_memory_gib"] is None and row["host_memory_gib"] > 0.1, row  # GPU memory: logged on CUDA only
    assert report["machine"]["torch"] and report["command"].endswith(f"--tiny --out {out}")
    lines = [line[2:-2].split(" | ") for line in (out / "gpu_check.md").read_text().splitlines() if line[:2] == "| "]
    header = next(cells for cells in lines if cells[0] == "date")  # RESULTS.md's columns: date, machine, command
    rows = [cells for cells in lines if len(cells) == len(header) and cells[3] in names]
    assert [cells[3] for cells in rows] == names and rows[0][2].startswith("`python benchmarks/gpu_check.py --tiny")
    for cells in rows:  # every figure filled but the GPU memory
        assert [h for h, c in zip(header, cells) if c == "-"] == ["GPU GiB"], cells
    for name in names:  # each run's own folder and logs
        assert (out / "runs" / name / "metrics.jsonl").is_file() and (out / "logs" / f"{name}.stdout.log").is_file()


def test_figures_come_from_metrics_jsonl(tmp_path):
    gpu_check = load_check()
    records = [
        {"step": 0, "knn/teacher_top1": 10.0, "time/eval_s": 2.0},
        {"step": 5, "time/first_step_s": 7.5, "train/images_per_s": 50.0, "train/s_per_step": 0.9},
        {"step": 10, "train/images_per_s": 200.0, "train/s_per_step": 0.3, "train/max_memory_gib": 3.0},
        {"step": 10, "time/epoch_boundary_s": 1.0},
        {"step": 15, "train/images_per_s": 100.0, "train/s_per_step": 0.5, "train/max_memory_gib": 4.0},
        {"step": 15, "time/epoch_boundary_s": 3.0},
        {"step": 20, "train/images_per_s": 300.0, "train/s_per_step": 0.2, "train/max_memory_gib": 3.5},
        {"step": 20, "time/epoch_boundary_s": 8.0, "time/save_s": 4.0},
        {"step": 20, "knn/teacher_top1": 42.0, "time/eval_s": 5.0, "epoch": 3},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    row = gpu_check.read_metrics(path, gpu_check.Row("dino_vits16", "ok", 60.0, metric="knn/teacher_top1"))
    assert row.steps == 20 and row.first_step_s == 7.5
    assert row.images_per_s == 200.0 and row.s_per_step == 0.3  # medians without the first (warm-up) interval
    assert row.epoch_boundaries_s == [1.0, 3.0, 8.0] and row.epoch_boundary_s == 3.0
    assert row.eval_s == 7.0 and row.save_s == 4.0 and row.plots_s is None  # summed; absent: None
    assert row.gpu_memory_gib == 4.0 and row.value == 42.0  # the peak; the last evaluation
    empty = gpu_check.read_metrics(tmp_path / "missing.jsonl", gpu_check.Row("yolo", "exit 1", 3.0))
    assert empty.images_per_s is None and empty.value is None and empty.epoch_boundaries_s == []


def test_a_failing_run_is_named_with_its_stderr_and_the_next_still_runs(tmp_path, capsys):
    gpu_check = load_check()
    fails = (
        "import sys; print('loading', file=sys.stderr); print('error: no such dataset', file=sys.stderr); sys.exit(3)"
    )
    row = gpu_check.run_one(gpu_check.CHECKS[2], [sys.executable, "-c", fails], {}, tmp_path, timeout=120)
    err = capsys.readouterr().err
    assert row.status == "exit 3" and row.images_per_s is None and row.host_memory_gib > 0
    assert err.startswith("error: run yolo failed (exit 3") and "    error: no such dataset" in err, err
    hangs = [sys.executable, "-c", "import time; time.sleep(60)"]
    row = gpu_check.run_one(gpu_check.CHECKS[3], hangs, {}, tmp_path, timeout=1)
    assert row.status == "timed out" and row.wall_s < 30
    assert "error: run detr failed (timed out" in capsys.readouterr().err
    # accelerate launch's own traceback after the recipe's error says nothing more: the recipe's lines are shown
    launcher = ["error: the training split has 3 boxes", "Traceback (most recent call last):", '  File "x"']
    launcher += ["subprocess.CalledProcessError: Command '[...]' returned non-zero exit status 2."]
    assert gpu_check.stderr_tail("\n".join(launcher)) == ["error: the training split has 3 boxes"]


def test_bad_options_are_refused_before_anything_is_written(tmp_path, capsys):
    gpu_check = load_check()
    for argv, cause in (
        (["--tiny", "--runs", "yolo", "resnet_50"], "unknown run 'resnet_50'"),
        (["--tiny", "--steps", "0"], "--steps must be above 0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.main([*argv, "--out", str(tmp_path / "new")])
        assert exit_info.value.code == 2 and cause in capsys.readouterr().err
        assert not (tmp_path / "new").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "gpu_check.json").write_text("{}")
    with pytest.raises(SystemExit):
        gpu_check.main(["--tiny", "--out", str(tmp_path / "used")])
    assert "is not empty" in capsys.readouterr().err
