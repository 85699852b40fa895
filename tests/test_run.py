"""The run around any recipe (common/run.py, run_folder.py, console.py): the start banner and end
summary within 120 columns, mistakes refused before anything is written, a changed resume refused, a
saved config run again in a new folder, Ctrl-C acknowledged once, and the CUDA speed flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, error_line, load_recipe
from conftest import TINY_CLASSIFIER as TINY


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_banner_summary_and_every_line_within_120_columns(wandb_run):
    folder, out = wandb_run
    lines = out.splitlines()
    assert lines[0] == f"classifier: {folder}"
    assert "  devices   1 process on cpu, precision fp32" in lines
    assert "  data      1,437 training images, 360 evaluation images, 10 classes: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9" in lines
    assert any(ln.startswith("  steps     4 optimizer steps (max_steps; 12 epochs would be") for ln in lines)
    assert (
        "  tracker   wandb project 'classifier', run 'run' (offline: wandb/ in the run folder); metrics.jsonl" in lines
    )
    assert any(ln.startswith("epoch 0 step 2/4  loss ") and " img/s  eta " in ln for ln in lines)
    end = lines.index(next(ln for ln in lines if ln.startswith("done in ")))
    assert lines[end].endswith(f": {folder}")
    assert any(ln.split()[:1] == ["eval/top1"] for ln in lines[end:])
    assert any(ln.startswith("  best top1 ") and ln.endswith(" at step 4") for ln in lines[end:])
    assert "  weights   best.safetensors, final.safetensors" in lines[end:]
    assert all(len(ln) <= 120 for ln in lines if not ln.startswith("classifier: ")), max(lines, key=len)
    assert (
        sum(ln.startswith("classifier: ") for ln in lines) == 1 and sum(ln.startswith("done in") for ln in lines) == 1
    )


def test_resume_with_a_changed_model_is_refused_before_anything_changes(wandb_run, capsys):
    folder, _ = wandb_run
    copy = folder.parent / "changed"
    shutil.copytree(folder, copy)
    before = files(copy)
    err = error_line(
        capsys,
        load_recipe("classifier").main,
        TINY
        + [
            "--model",
            "resnet10t",
            "--lr",
            "0.1",
            "--report_to",
            "wandb",
            "--output_dir",
            str(copy),
            "--resume",
            "auto",
        ],
    )
    assert "other values of model 'test_vit' -> 'resnet10t', lr 0.05 -> 0.1" in err, err
    assert f"--config {copy / 'config.yaml'} --resume auto" in err
    assert files(copy) == before  # config.yaml, metrics, checkpoints: all as they were


def test_a_saved_config_runs_again_in_a_new_folder(wandb_run, tmp_path, capsys):
    """README: re-run a run with --config <run>/config.yaml. The saved output_dir is that run's folder:
    the new run goes to the next free sibling, and the old one is untouched."""
    folder, _ = wandb_run
    parent = tmp_path / "runs"
    shutil.copytree(folder, parent / "exp")
    before = files(parent / "exp")
    load_recipe("classifier").main(
        ["--config", str(parent / "exp" / "config.yaml"), "--max_steps", "1", "--report_to", "none"]
    )
    assert capsys.readouterr().out.splitlines()[0] == f"classifier: {parent / 'exp-2'}"
    assert (parent / "exp-2" / "final.safetensors").is_file()
    assert files(parent / "exp") == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sched", "cosin"], "(did you mean 'cosine'?)"),
        (["--opt", "adamww"], "(did you mean 'adamw'?)"),
        (["--data", "no/such/folder"], "no/such/folder"),
        (["--model", "resnet10tt"], "resnet10tt"),
    ],
)
def test_mistakes_leave_no_run_folder(args, message, tmp_path, monkeypatch, capsys):
    """Parse-time choices, and mistakes found while loading the data or building the model: one line,
    and no runs/ folder (nothing is written before the training loop starts)."""
    monkeypatch.chdir(tmp_path)
    err = error_line(capsys, load_recipe("classifier").main, TINY + ["--report_to", "tensorboard"] + args)
    assert message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_with_dataloader_workers_is_acknowledged_once(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, the DataLoader workers too: one
    acknowledgement, a checkpoint, exit 0."""
    import signal
    import time

    folder = tmp_path / "run"
    args = [
        *TINY[:-2],
        "--max_steps",
        "100000",
        "--num_workers",
        "2",
        "--report_to",
        "none",
        "--output_dir",
        str(folder),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "classifier.py"), *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its own process group, as a terminal's job
    metrics = folder / "metrics.jsonl"
    end = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < end, proc.stderr.read()[-3000:] if proc.poll() is not None else ""
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("SIGINT received") == 1, out[-3000:]
    assert "continue with --resume auto" in out and list((folder / "checkpoints").glob("step_*"))


def test_tf32_and_cudnn_benchmark_follow_the_field(tmp_path):
    """Run turns on TF32 matmuls/convolutions and cudnn.benchmark (CUDA's; no effect on a CPU); --tf32 false
    turns them off."""
    from common.config import parse_config
    from common.run import Run
    from conftest import load_recipe

    classifier = load_recipe("classifier")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        for value in (True, False):
            cfg = parse_config(
                classifier.Config,
                ["--tf32", str(value).lower(), "--report_to", "none", "--output_dir", str(tmp_path / str(value))],
            )
            run = Run(cfg, "tf32")
            assert (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark,
            ) == (value, value, value)
            run.finish()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved
