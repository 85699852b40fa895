"""common/trackers.py: W&B (offline) and TensorBoard as a run's trackers: the W&B run kept across
--resume, weights as artifacts, project and run names, credentials for any host, pictures as images."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, load_recipe
from conftest import TINY_CLASSIFIER as TINY


def test_a_run_logging_to_wandb_prints_only_its_own_lines(tmp_path):
    """W&B silent: no banner of its own, no run summary, no warnings; the local folder loads without
    datasets' bars; no progress bar in a log (stderr is not a terminal): stderr stays empty and every
    stdout line is the recipe's."""
    from PIL import Image

    for split in ("train", "validation"):
        for c, colour in enumerate(("red", "blue")):
            (tmp_path / "data" / split / f"c{c}").mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), colour).save(tmp_path / "data" / split / f"c{c}" / f"{i}.png")
    args = TINY[:-4] + [
        "--max_steps",
        "2",
        "--batch_size",
        "4",
        "--report_to",
        "wandb",
        "--data",
        str(tmp_path / "data"),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "classifier.py"), *args, "--output_dir", str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"classifier: {tmp_path / 'run'}" and lines[-1] == f"output: {tmp_path / 'run'}"
    assert not any(word in done.stdout for word in ("Run summary", "Run history", "View run", "Syncing run"))


def test_wandb_is_loaded_only_by_a_run_that_reports_to_it():
    """timm imports wandb for its own train.py's logging; importing the recipes' package keeps it out (start-up
    time), and W&B itself still imports and works afterwards for a run that asks for it."""
    code = (
        "import sys, common, timm.utils; assert 'timm' in sys.modules and 'wandb' not in sys.modules, 'wandb loaded'; "
        "import wandb; from accelerate.tracking import WandBTracker; print(wandb.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_wandb_run_id_is_kept_across_resume(wandb_run, capsys):
    """--resume auto continues the same W&B run: the id in the run folder is reused, and the offline
    run directories of both sessions carry it."""
    folder, _ = wandb_run
    copy = folder.parent / "resumed"
    shutil.copytree(folder, copy)
    run_id = (copy / "wandb_run_id.txt").read_text().strip()
    assert len(run_id) >= 8
    load_recipe("classifier").main(
        TINY[:-2] + ["--max_steps", "6", "--report_to", "wandb", "--output_dir", str(copy), "--resume", "auto"]
    )
    out = capsys.readouterr().out
    assert "resume with changed max_steps 4 -> 6" in out and "resumed from" in out
    # the run keeps the config it was started with; the resume's change is recorded beside it
    assert yaml.safe_load((copy / "config.yaml").read_text())["max_steps"] == 4
    (resumed,) = [json.loads(line) for line in (copy / "resumes.jsonl").read_text().splitlines()]
    assert resumed["changed"]["max_steps"] == [4, 6] and resumed["step"] == 4, resumed
    assert (copy / "config.yaml").read_text().startswith(f"# common/: {resumed['common']}\n")  # the code, unchanged
    assert (copy / "wandb_run_id.txt").read_text().strip() == run_id
    sessions = sorted(p.name for p in (copy / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and all(name.endswith(run_id) for name in sessions), sessions


def test_weights_are_logged_as_wandb_artifacts(wandb_run):
    folder, _ = wandb_run
    (record,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert b"classifier-run-best" in data and b"classifier-run-final" in data
    # the model folder (a directory artifact) and the ONNX export, what leaves the project
    assert b"classifier-run-model" in data and b"classifier-run-model_onnx" in data


def test_tracker_project_and_run_name_defaults(monkeypatch, tmp_path):
    """The config's fields, else W&B's own environment variables, else the recipe and run folder names."""
    from types import SimpleNamespace

    from common.trackers import project_name, run_name

    cfg = SimpleNamespace(project="", run_name="")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_NAME", raising=False)
    assert (project_name(cfg, "my_recipe"), run_name(cfg, tmp_path / "exp-2")) == ("my_recipe", "exp-2")
    monkeypatch.setenv("WANDB_PROJECT", "team-project")
    monkeypatch.setenv("WANDB_NAME", "lr-sweep-3")
    assert (project_name(cfg, "my_recipe"), run_name(cfg, tmp_path / "exp-2")) == ("team-project", "lr-sweep-3")
    cfg = SimpleNamespace(project="p", run_name="n")
    assert (project_name(cfg, "my_recipe"), run_name(cfg, tmp_path / "exp-2")) == ("p", "n")


@pytest.mark.parametrize(
    "netrc_host, base_url, expected",
    [
        ("api.wandb.ai", "", True),
        ("wandb.example.com", "https://wandb.example.com", True),  # a self-hosted server
        ("wandb.example.com", "", False),  # credentials for another host than the one wandb would use
        ("", "", False),
    ],
)
def test_wandb_credentials_are_found_for_any_host(netrc_host, base_url, expected, tmp_path):
    """Through wandb's own login lookup, without a prompt or a network call (a fresh process: wandb
    keeps its login in process-wide state)."""
    if netrc_host:
        (tmp_path / ".netrc").write_text(f"machine {netrc_host}\n  login user\n  password {'k' * 40}\n")
        (tmp_path / ".netrc").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / ".netrc"), PYTHONPATH=str(ROOT))
    if base_url:
        env["WANDB_BASE_URL"] = base_url
    code = "from common.trackers import wandb_has_credentials as f; print(f())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == str(expected), proc.stderr[-2000:]


def test_tensorboard_gets_the_pictures_as_images(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "run"
    load_recipe("classifier").main(TINY + ["--report_to", "tensorboard", "--output_dir", str(folder)])
    tags = set()
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
        accumulator.Reload()
        tags |= set(accumulator.Tags()["images"])
    assert {"plots/curves", "plots/confusion_matrix"} <= tags, tags
    assert "tracker   tensorboard (tensorboard --logdir <run folder>); metrics.jsonl" in capsys.readouterr().out


def test_eval_only_sends_the_per_class_table_to_tensorboard_and_prints_one_line(tmp_path, capsys):
    """Per-class values go to a file and a tracker table; the console gets one line naming the file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    classifier = load_recipe("classifier")
    classifier.main(TINY + ["--report_to", "none", "--output_dir", str(tmp_path / "run")])
    weights, folder = tmp_path / "run" / "final.safetensors", tmp_path / "eval"
    args = ["--eval_only", "--weights", str(weights), "--report_to", "tensorboard", "--output_dir", str(folder)]
    classifier.main(args + ["--num_workers", "0"])
    texts = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["tensors"]:
            texts[tag] = accumulator.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
    table = texts["eval/accuracy_per_class/text_summary"].splitlines()
    assert table[0] == "class | images | accuracy" and len(table) == 2 + 10, table  # a header, a rule, 10 classes
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("accuracy per class: ")]
    assert out == [out[0]] and f"{folder / 'per_class_accuracy.csv'} (10 classes; lowest accuracy: " in out[0], out
