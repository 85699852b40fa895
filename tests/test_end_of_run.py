"""The end of a run never loses the run (DESIGN.md, "Reliability contract"): once the weights are saved, a
step after them that fails (model folder, export, W&B artifacts, hub push) is one ``error:`` line naming it,
its error and the command that redoes it; the steps after it still run, the summary is still printed, the
exit status is 1, and the command given does redo the step."""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from pathlib import Path

import pytest
import safetensors.torch

from common import RunStopped, UserError
from common.console import cli_main, recorded_failure
from conftest import TINY_CLASSIFIER, TINY_RUNS, load_recipe

# A 2-step run of each recipe on its built-in data, no tracker, exporting (the classifier's: TINY_CLASSIFIER).
SHORT = ["--report_to", "none", "--num_workers", "0", "--max_steps", "2", "--export", "true"]
TINY = {**TINY_RUNS, "dino": [*TINY_RUNS["dino"], "--warmup_epochs", "0"]}
KEPT = {"dino": "teacher_backbone", "yolo": "best", "detr": "best", "faster_rcnn": "best"}


def _fails(error: Exception):
    def raises(*args, **kwargs):
        raise error

    return raises


def _run(module, args: list[str]) -> tuple[int, list[str]]:
    """``module.main(args)`` as the entry point runs it (``cli_main``): its exit status and its lines, stdout
    and stderr in the order they were written."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit) as exit_info:
        cli_main(lambda: module.main(args))
    return exit_info.value.code, out.getvalue().splitlines()


def _after_summary(lines: list[str], run: Path) -> list[str]:
    """The ``error:`` lines, checked to come after the summary (its ``done in`` and ``weights`` lines) and
    before the run folder's line, the last one."""
    done = next(i for i, line in enumerate(lines) if line.startswith("done in "))
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert errors and all(i > done for i in errors), lines[done - 5 :]
    assert any(line.startswith("  weights   ") for line in lines[done : errors[0]])
    assert lines[-1] == f"output: {run}" and "Traceback" not in "\n".join(lines)
    return [lines[i] for i in errors]


def test_a_failed_step_is_recorded_in_one_line_and_a_stop_still_stops():
    failed: list[str] = []
    with recorded_failure(failed, "export", "redo-export"):
        raise RuntimeError("the exporter broke\n  a page of its internals")
    with recorded_failure(failed, "push_to_hub", "hf upload"):
        raise UserError("push_to_hub me/x: refused")
    with recorded_failure(failed, "model folder", "redo-folder"):
        pass  # a step that works adds nothing
    assert failed == [
        "export failed (RuntimeError: the exporter broke); redo it with: redo-export",
        "push_to_hub failed (push_to_hub me/x: refused); redo it with: hf upload",
    ]
    for stop in (RunStopped("stopped by SIGTERM"), KeyboardInterrupt()):
        with pytest.raises(type(stop)), recorded_failure(failed, "export", "redo"):
            raise stop
    assert len(failed) == 2


@pytest.mark.slow
def test_classifier_failed_end_steps_are_told_after_the_summary_and_their_commands_redo_them(tmp_path, monkeypatch):
    """The model folder (the timm call the issue saw fail), the export, the W&B artifacts and the hub push
    all fail in one run: four lines after the summary, exit 1, the weights kept; then the export's command
    and the model folder's command (which pushes again) write what was missing."""
    import common.run

    classifier = load_recipe("classifier")
    run = tmp_path / "run"
    args = TINY_CLASSIFIER + SHORT + ["--log_weights", "--push_to_hub", "me/digits", "--output_dir", str(run)]
    save_for_hf = TypeError("save_for_hf() got an unexpected keyword argument 'data_config'")
    monkeypatch.setattr(sys.modules["classifier_inference"], "write_timm_folder", _fails(save_for_hf))
    monkeypatch.setattr(classifier, "export_files", _fails(RuntimeError("aten.view: no Cast\nand a page more")))
    monkeypatch.setattr(common.run, "log_weights", _fails(OSError("No space left on device")))
    monkeypatch.setattr(common.run, "check_hub_push", lambda repo: None)  # a token and network, as a user has
    monkeypatch.setattr(common.run, "push_folder", _fails(ConnectionError("no route to host")))
    monkeypatch.setattr(sys, "argv", ["recipes/classifier.py"])

    code, lines = _run(classifier, args)
    assert code == 1
    finish = f"python recipes/classifier.py --config {run / 'config.yaml'} --resume auto"  # as this run started
    export = f"python recipes/classifier.py --export --weights {run / 'best.safetensors'}"
    upload = f"hf upload me/digits {run / 'model'} ."
    assert _after_summary(lines, run) == [
        f"error: model folder failed (TypeError: {save_for_hf}); redo it with: {finish}",
        f"error: export failed (RuntimeError: aten.view: no Cast); redo it with: {export}",
        f"error: W&B artifacts failed (OSError: No space left on device); redo it with: {finish}",
        f"error: push_to_hub failed (ConnectionError: no route to host); redo it with: {upload}",
    ]
    assert (run / "best.safetensors").is_file() and (run / "final.safetensors").is_file()
    assert not (run / "model").exists() and not (run / "export").exists()

    # the export's command, as printed (in a fresh working directory: its own run folder there)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["recipes/classifier.py"])
    classifier.main(shlex.split(export)[2:] + ["--report_to", "none"])
    onnx = tmp_path / "runs" / "classifier" / "export-run" / "model.onnx"
    assert onnx.is_file()

    # the model folder's command: the run resumed at its end writes the folder and pushes it
    pushed = []
    monkeypatch.setattr(common.run, "check_hub_push", lambda repo: None)
    monkeypatch.setattr(common.run, "push_folder", lambda folder, repo: pushed.append((folder, repo)) or "pushed")
    classifier.main(shlex.split(finish)[2:])
    assert pushed == [(run / "model", "me/digits")]
    best = safetensors.torch.load_file(str(run / "best.safetensors"))
    folder = safetensors.torch.load_file(str(run / "model" / "model.safetensors"))
    assert folder.keys() == best.keys() and all((folder[k] == best[k]).all() for k in best)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dino", "yolo", "detr", "faster_rcnn"])
def test_each_recipe_tells_a_failed_model_folder_and_export_after_the_summary(recipe, tmp_path, monkeypatch):
    module = load_recipe(recipe)
    run = tmp_path / "run"
    writer = "write_timm_folder" if recipe == "dino" else "write_detector_folder"
    shipping = sys.modules.get(f"{recipe}_inference", module)  # the file that writes the model folder
    monkeypatch.setattr(shipping, writer, _fails(OSError("Read-only file system")))
    monkeypatch.setattr(module, "export_files", _fails(RuntimeError("the exporter broke")))
    monkeypatch.setattr(sys, "argv", [f"recipes/{recipe}.py"])

    code, lines = _run(module, TINY[recipe] + SHORT + ["--output_dir", str(run)])
    assert code == 1
    launch = f"python recipes/{recipe}.py"
    kept = run / f"{KEPT[recipe]}.safetensors"
    assert _after_summary(lines, run) == [
        f"error: model folder failed (OSError: Read-only file system); redo it with: {launch} --config "
        f"{run / 'config.yaml'} --resume auto",
        f"error: export failed (RuntimeError: the exporter broke); redo it with: {launch} --export --weights {kept}",
    ]
    assert kept.is_file() and not (run / "model").exists() and not (run / "export").exists()
