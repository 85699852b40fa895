"""The run around any recipe (common/run.py, run_folder.py, console.py): the start banner and end
summary within 120 columns, mistakes refused before anything is written, a changed resume refused, a
saved config run again in a new folder, evaluation and prediction folders named for what they hold and
never written over, --resume auto alone taking the newest interrupted run, Ctrl-C acknowledged once
with the command that continues, and the CUDA speed flags."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
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
    assert lines[-1] == f"output: {folder}"
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


def test_eval_and_predict_folders_are_named_and_nothing_is_written_over(wandb_run, tmp_path, monkeypatch, capsys):
    """Two --predict runs, an --eval_only and a training run aimed at the same place: each gets its own
    folder, named for what it holds (predict-<weights run>, eval-<weights run>), and every earlier file
    stays byte for byte; an explicit --output_dir holding only --predict output is refused."""
    folder, _ = wandb_run
    monkeypatch.chdir(tmp_path)
    weights = tmp_path / "runs" / "classifier" / "exp" / "best.safetensors"
    weights.parent.mkdir(parents=True)
    shutil.copy(folder / "best.safetensors", weights)
    shutil.copy(folder / "config.yaml", weights.parent / "config.yaml")  # a run folder: its name names the outputs
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    Image.new("RGB", (32, 32), "white").save(images / "a.png")
    main = load_recipe("classifier").main
    runs = tmp_path / "runs" / "classifier"
    common = ["--weights", str(weights), "--report_to", "none", "--num_workers", "0"]
    snapshots = {}
    for args, expected in [
        (["--predict", str(images)], "predict-exp"),
        (["--predict", str(images)], "predict-exp-2"),
        (["--eval_only"], "eval-exp"),
    ]:
        main(common + args)
        assert (runs / expected / "config.yaml").is_file(), sorted(p.name for p in runs.iterdir())
        for name, snapshot in snapshots.items():
            assert files(runs / name) == snapshot, name
        snapshots[expected] = files(runs / expected)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].endswith(str(Path("runs/classifier/eval-exp")))
    loaded = len(safetensors.torch.load_file(str(weights)))  # every tensor of the file: --weights loads strictly
    assert f"weights '{weights}' (saved by classifier.py for model test_vit): {loaded} tensors loaded\n" in out
    # a training run given the predict folder's config (and so its folder) goes to a new sibling
    main(["--config", str(runs / "predict-exp" / "config.yaml"), "--predict", "", "--weights", ""] + TINY[-4:])
    assert (runs / "predict-exp-3" / "final.safetensors").is_file()
    err = error_line(capsys, main, common + ["--predict", str(images), "--output_dir", str(runs / "predict-exp")])
    assert "already holds a run" in err
    for name, snapshot in snapshots.items():
        assert files(runs / name) == snapshot, name


def test_resume_auto_alone_takes_the_newest_interrupted_run(tmp_path, monkeypatch, capsys):
    """default finished, default-2 stopped mid-way, default-3 finished: --resume auto without a folder
    continues default-2; with no interrupted run left it starts a new run and says so."""
    monkeypatch.chdir(tmp_path)
    main = load_recipe("classifier").main
    args = TINY + ["--batch_size", "16", "--checkpoint_every", "2", "--report_to", "none"]
    runs = tmp_path / "runs" / "classifier"
    main(args + ["--max_steps", "2"])  # default: finished
    main(args + ["--max_steps", "4"])  # default-2: finished, then its end marker removed below
    main(args + ["--max_steps", "2"])  # default-3: finished
    state = runs / "default-2" / "checkpoints" / "step_00000004" / "train_state.json"
    assert json.loads(state.read_text())["finished"] is True
    shutil.rmtree(state.parent)  # as if stopped after step 2: its newest checkpoint is mid-run
    assert not json.loads((runs / "default-2" / "checkpoints" / "step_00000002" / "train_state.json").read_text())[
        "finished"
    ]
    capsys.readouterr()
    main(args + ["--max_steps", "4", "--resume", "auto"])
    out = capsys.readouterr().out
    assert f"resume auto: continuing {Path('runs/classifier/default-2')}" in out
    assert "resumed from" in out and "at step 2" in out
    assert json.loads(state.read_text())["finished"] is True and not (runs / "default-4").exists()
    main(args + ["--max_steps", "2", "--resume", "auto"])
    out = capsys.readouterr().out
    assert (
        "resume auto: no interrupted run named default" in out and (runs / "default-4" / "final.safetensors").is_file()
    )


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
    assert f"--config {folder / 'config.yaml'} --resume auto" in out.splitlines()[-1]
    assert list((folder / "checkpoints").glob("step_*"))


@pytest.mark.parametrize(
    "recipe, args, message",
    [
        ("classifier", ["--pretrained"], "--pretrained: timm's weights for 'resnet18' (timm/resnet18.a1_in1k) are not"),
        ("yolo", ["--pretrained"], "timm has no pretrained weights for 'cs3darknet_s': leave out --pretrained"),
        (
            "faster_rcnn",
            ["--config", str(ROOT / "configs/faster_rcnn/coco_r50_fpn_26ep.yaml"), "--data", "digits_det"]
            + ["--mixed_precision", "no"],  # in-process: the Accelerator of earlier tests is fp32
            "--pretrained_backbone: torchvision's weights https://download.pytorch.org/models/resnet50-0676ba61.pth",
        ),
    ],
)
def test_pretrained_weights_offline_are_one_line(recipe, args, message, tmp_path, monkeypatch, capsys):
    """HF_HUB_OFFLINE (set for the tests) and weights not in the cache: one line naming the download and
    what to do instead, no retries, no traceback, no run folder."""
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # an empty torch hub cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # and an empty hub cache
    start = time.perf_counter()
    err = error_line(capsys, load_recipe(recipe).main, args + ["--report_to", "none", "--num_workers", "0"])
    assert message in err and "\n" not in err.strip(), err
    assert time.perf_counter() - start < 60 and list(tmp_path.iterdir()) in ([], [tmp_path / "hf_cache"])


def test_a_short_run_on_few_classes_logs_its_loss_and_no_trivial_top5(tmp_path):
    """3 steps with log_every 20: the last step logs the training meters; 3 classes: no top-5 (always
    100 %); one evaluation image is '1 evaluation image'."""
    import json

    from PIL import Image

    from common.console import banner

    for split, count in (("train", 8), ("validation", 2)):
        for c, colour in enumerate(("red", "green", "blue")):
            (tmp_path / "data" / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (16, 16), colour).save(tmp_path / "data" / split / f"c{c}" / f"{i}.png")
    run = tmp_path / "run"
    args = TINY[:-4] + ["--max_steps", "3", "--log_every", "20", "--batch_size", "4", "--report_to", "none"]
    load_recipe("classifier").main(args + ["--data", str(tmp_path / "data"), "--output_dir", str(run)])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [3]
    evaluations = [r for r in records if "eval/top1" in r]
    assert evaluations and not any("eval/top5" in r for r in evaluations)
    text = banner("x", "runs/x", "cpu", 1, "fp32", 1, 1, ["a"], 1, 1, 1, 1, "none")
    assert "1 training image, 1 evaluation image, 1 class" in text, text


def test_a_second_ctrl_c_is_one_line_and_exit_130(capsys):
    """The second Ctrl-C stops at once (KeyboardInterrupt from the signal handler): one line, no traceback."""
    from common.console import cli_main

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        cli_main(interrupted)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 130 and err.strip().splitlines() == [
        "error: interrupted by a second Ctrl-C; the run's checkpoints are kept (--resume auto continues)"
    ]


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


def test_the_continue_command_carries_what_a_resume_changed(tmp_path):
    """A resumed run keeps its original config.yaml; the command that continues it adds the flags the resume
    changed, written so that the recipe parses them back to the same values."""
    from types import SimpleNamespace

    from common.config import parse_config
    from common.run import Run

    classifier = load_recipe("classifier")
    changes = {"max_steps": (4, 6), "scale": ([0.6, 1.0], [0.5, 1.0]), "report_to": ("none", "tensorboard")}
    fake = SimpleNamespace(recipe="classifier", dir=tmp_path / "run", resume_changes=changes)
    command = Run.continue_command(fake)
    assert command.startswith(f"python recipes/classifier.py --config {tmp_path / 'run' / 'config.yaml'} ")
    assert command.endswith(" --resume auto")
    flags = shlex.split(command)[4:-2]
    assert flags == ["--max_steps", "6", "--scale", "[0.5, 1.0]", "--report_to", "tensorboard"]
    cfg = parse_config(classifier.Config, flags)
    assert (cfg.max_steps, cfg.scale, cfg.report_to) == (6, [0.5, 1.0], "tensorboard")


def test_help_into_a_closed_pipe_ends_quietly():
    """`recipes/x.py --help | head -3`: the reader closes the pipe after three lines; no traceback, exit 0."""
    with subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "yolo.py"), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        bufsize=0,
    ) as proc:
        proc.stdout.read(50)
        proc.stdout.close()  # what `head` does once it has its lines
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0 and err == "", err


def test_folders_made_from_weights_say_their_source(tmp_path):
    """A file in a run folder (or in its model/ or export/) is named by its run; a loose file by its own name;
    an ONNX file adds -onnx, so its predictions never look like a second run of the safetensors' ones."""
    from common.run_folder import weights_source

    run = tmp_path / "runs" / "yolo" / "default"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("lr: 1\n")
    loose_export = tmp_path / "runs" / "yolo" / "export-mine"
    loose_export.mkdir()
    (loose_export / "config.yaml").write_text("lr: 1\n")
    cases = {
        run / "best.safetensors": "default",
        run / "model": "default",
        run / "export" / "model.onnx": "default-onnx",
        tmp_path / "downloads" / "mine.safetensors": "mine",
        Path("mine.safetensors"): "mine",
        loose_export / "model.onnx": "mine-onnx",
    }
    assert {str(k): weights_source(str(k)) for k in cases} == {str(k): v for k, v in cases.items()}


def test_bf16_on_a_cpu_without_native_bf16_is_one_warning_line(tmp_path, monkeypatch):
    """A GPU config (mixed_precision bf16) started on a CPU: one line under the banner when the CPU lacks
    native bf16 (read from cpuinfo's flags), none when it has them or when the run is fp32."""
    from accelerate.state import AcceleratorState

    import common.console
    from common.config import parse_config
    from common.console import native_bf16
    from common.run import Run

    x86 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
    for text, native in ((x86, False), (x86.replace("avx512bw", "avx512bw avx512_bf16"), True)):
        (tmp_path / "cpuinfo").write_text(text)
        assert native_bf16(tmp_path / "cpuinfo") is native
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")  # Arm
    assert native_bf16(tmp_path / "cpuinfo") is True and native_bf16(tmp_path / "none") is None

    classifier = load_recipe("classifier")
    lines = {}
    AcceleratorState._reset_state(reset_partial_state=True)  # the precision is fixed per process otherwise
    try:
        for precision, native in (("bf16", False), ("bf16", True), ("bf16", None), ("no", False)):
            if precision == "no":
                AcceleratorState._reset_state(reset_partial_state=True)
            monkeypatch.setattr(common.console, "native_bf16", lambda native=native: native)
            flags = ["--mixed_precision", precision, "--report_to", "none", "--output_dir", str(tmp_path / "run")]
            run = Run(parse_config(classifier.Config, flags), "bf16")
            lines[precision, native] = [n for n in run.notes if "bf16" in n]
            run.finish()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert lines.pop(("bf16", False)) == [
        "warning: bf16 on a CPU without native bf16 (avx512_bf16, amx_bf16) is emulated, many times slower: "
        "pass --mixed_precision no"
    ]
    assert lines == {("bf16", True): [], ("bf16", None): [], ("no", False): []}
