"""What a user sees and touches around any recipe (common/run.py, run_folder.py, trackers.py,
console.py): the start banner and end summary, lines within 120 columns, the W&B run kept across
--resume, mistakes refused before anything is written, and a recipe copied under another name or
outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, error_line, load_recipe

TINY = ["--model", "test_vit", "--img_size", "32", "--num_workers", "0", "--opt", "sgd", "--lr", "0.05",
        "--warmup_epochs", "0", "--smoothing", "0", "--log_every", "2", "--max_steps", "4"]


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> tuple[Path, str]:
    """A 4-step classifier run logging to W&B offline (tests/conftest.py sets WANDB_MODE=offline), and
    what it printed."""
    import contextlib
    import io

    folder = tmp_path_factory.mktemp("ux") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_recipe("classifier").main(TINY + ["--report_to", "wandb", "--log_weights", "--output_dir", str(folder)])
    return folder, out.getvalue()


def test_banner_summary_and_every_line_within_120_columns(wandb_run):
    folder, out = wandb_run
    lines = out.splitlines()
    assert lines[0] == f"classifier: {folder}"
    assert "  devices   1 process on cpu, precision fp32" in lines
    assert "  data      1,437 training images, 360 evaluation images, 10 classes: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9" in lines
    assert any(ln.startswith("  steps     4 optimizer steps (max_steps; 12 epochs would be") for ln in lines)
    assert "  tracker   wandb project 'classifier', run 'run' (offline: wandb/ in the run folder); metrics.jsonl" in lines
    assert any(ln.startswith("epoch 0 step 2/4  loss ") and " img/s  eta " in ln for ln in lines)
    end = lines.index(next(ln for ln in lines if ln.startswith("done in ")))
    assert lines[end].endswith(f": {folder}")
    assert any(ln.split()[:1] == ["eval/top1"] for ln in lines[end:])
    assert any(ln.startswith("  best top1 ") and ln.endswith(" at step 4") for ln in lines[end:])
    assert "  weights   best.safetensors, final.safetensors" in lines[end:]
    assert all(len(ln) <= 120 for ln in lines if not ln.startswith("classifier: ")), max(lines, key=len)
    assert sum(ln.startswith("classifier: ") for ln in lines) == 1 and sum(ln.startswith("done in") for ln in lines) == 1


def test_wandb_run_id_is_kept_across_resume(wandb_run, capsys):
    """--resume auto continues the same W&B run: the id in the run folder is reused, and the offline
    run directories of both sessions carry it."""
    folder, _ = wandb_run
    copy = folder.parent / "resumed"
    shutil.copytree(folder, copy)
    run_id = (copy / "wandb_run_id.txt").read_text().strip()
    assert len(run_id) >= 8
    load_recipe("classifier").main(TINY[:-2] + ["--max_steps", "6", "--report_to", "wandb", "--output_dir", str(copy),
                                                "--resume", "auto"])
    out = capsys.readouterr().out
    assert "resume with changed max_steps 4 -> 6" in out and "resumed from" in out
    assert (copy / "wandb_run_id.txt").read_text().strip() == run_id
    sessions = sorted(p.name for p in (copy / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and all(name.endswith(run_id) for name in sessions), sessions


def test_weights_are_logged_as_wandb_artifacts(wandb_run):
    folder, _ = wandb_run
    (record,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert b"classifier-run-best" in data and b"classifier-run-final" in data


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


@pytest.mark.parametrize("netrc_host, base_url, expected", [
    ("api.wandb.ai", "", True),
    ("wandb.example.com", "https://wandb.example.com", True),  # a self-hosted server
    ("wandb.example.com", "", False),  # credentials for another host than the one wandb would use
    ("", "", False),
])
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


def test_resume_with_a_changed_model_is_refused_before_anything_changes(wandb_run, capsys):
    folder, _ = wandb_run
    copy = folder.parent / "changed"
    shutil.copytree(folder, copy)
    before = files(copy)
    err = error_line(capsys, load_recipe("classifier").main,
                     TINY + ["--model", "resnet10t", "--lr", "0.1", "--report_to", "wandb", "--output_dir", str(copy),
                             "--resume", "auto"])
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
    load_recipe("classifier").main(["--config", str(parent / "exp" / "config.yaml"), "--max_steps", "1",
                                    "--report_to", "none"])
    assert capsys.readouterr().out.splitlines()[0] == f"classifier: {parent / 'exp-2'}"
    assert (parent / "exp-2" / "final.safetensors").is_file()
    assert files(parent / "exp") == before


@pytest.mark.parametrize("args, message", [
    (["--sched", "cosin"], "(did you mean 'cosine'?)"),
    (["--opt", "adamww"], "(did you mean 'adamw'?)"),
    (["--data", "no/such/folder"], "no/such/folder"),
    (["--model", "resnet10tt"], "resnet10tt"),
])
def test_mistakes_leave_no_run_folder(args, message, tmp_path, monkeypatch, capsys):
    """Parse-time choices, and mistakes found while loading the data or building the model: one line,
    and no runs/ folder (nothing is written before the training loop starts)."""
    monkeypatch.chdir(tmp_path)
    err = error_line(capsys, load_recipe("classifier").main, TINY + ["--report_to", "tensorboard"] + args)
    assert message in err
    assert list(tmp_path.iterdir()) == []


def _copy_run(script: Path, cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath  # what `pip install -e <repository>` gives
    return subprocess.run([sys.executable, str(script), *TINY[:-2], "--max_steps", "1", "--report_to", "none"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_copied_recipe_is_its_own_recipe_inside_and_outside_the_repository(tmp_path):
    """A copy under another name writes to runs/<its name>/ and labels its output with its name.
    Outside the repository it needs common/ installed: without it, one line says how."""
    script = tmp_path / "my_classifier.py"
    shutil.copy(ROOT / "recipes" / "classifier.py", script)
    missing = _copy_run(script, tmp_path, None)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        "error: this recipe needs the cv-recipes package common/: run `pip install -e <cv-recipes folder>` once "
        "(README, \"Your own recipe\")"]
    assert not (tmp_path / "runs").exists()
    done = _copy_run(script, tmp_path, str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "my_classifier: runs/my_classifier/default"
    assert (tmp_path / "runs" / "my_classifier" / "default" / "final.safetensors").is_file()


@pytest.mark.slow
def test_ctrl_c_with_dataloader_workers_is_acknowledged_once(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, the DataLoader workers too: one
    acknowledgement, a checkpoint, exit 0."""
    import signal
    import time

    folder = tmp_path / "run"
    args = [*TINY[:-2], "--max_steps", "100000", "--num_workers", "2", "--report_to", "none", "--output_dir", str(folder)]
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "classifier.py"), *args], cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own process group, as a terminal's job
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
