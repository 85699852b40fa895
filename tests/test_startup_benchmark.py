"""benchmarks/startup.py: its reading of step lines from a process timed from outside (the figures of its
docstring), on a stand-in process that prints step lines at known moments."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT


def load_startup():
    spec = importlib.util.spec_from_file_location("startup", ROOT / "benchmarks" / "startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_lines_of_each_side_are_read():
    startup = load_startup()
    assert startup.ours_step("epoch 1 step 12/20  loss 1.4  lr 0.001  22 img/s", 10) == (1, 1)
    assert startup.ours_step("epoch 0 step 1/20  first step 1.8 s after the start", 10) is None
    timm = "Train: 1 [   3/10 ( 40%)]  Loss: 1.47 (1.47)  Time: 1.496s,   10.69/s"
    assert startup.reference_step(startup.TIMM_STEP, timm) == (1, 3)
    dino = "Epoch: [0/2]  [ 9/10]  eta: 0:00:02  loss: 8.23 (8.23)"
    assert startup.reference_step(startup.DINO_STEP, dino) == (0, 9)


def test_first_step_steady_step_and_boundary_from_the_line_times(tmp_path):
    """3 steps an epoch: start-up 0.6 s, steps 0.2 s apart, 0.5 s more between the epochs; the process is
    killed after epoch 1's first step (it would sleep on)."""
    startup = load_startup()
    child = (
        "import time\n"
        "time.sleep(0.6); print('epoch 0 step 1/6  loss 1')\n"
        "time.sleep(0.2); print('epoch 0 step 2/6  loss 1')\n"
        "time.sleep(0.2); print('epoch 0 step 3/6  loss 1')\n"
        "time.sleep(0.7); print('epoch 1 step 4/6  loss 1')\n"
        "time.sleep(60)\n"
    )
    env = startup.env()
    figures = startup.timed_steps(
        [sys.executable, "-c", child], tmp_path, env, lambda line: startup.ours_step(line, 3), 3, tmp_path / "log"
    )
    assert figures["first_step"] == pytest.approx(0.6, abs=0.5)  # the interpreter's start included
    assert figures["s/step"] == pytest.approx(0.2, abs=0.05)
    assert figures["boundary"] == pytest.approx(0.5, abs=0.1)
    assert "epoch 1 step 4/6" in (tmp_path / "log").read_text()


def test_first_step_only_stops_at_the_first_step_line(tmp_path):
    """--first_step_only: the process is killed at its first step line (it would sleep on) and only first_step is
    figured."""
    startup = load_startup()
    child = "import time\ntime.sleep(0.4); print('epoch 0 step 1/6  loss 1')\ntime.sleep(60)\n"
    started = __import__("time").perf_counter()
    figures = startup.timed_steps(
        [sys.executable, "-c", child], tmp_path, startup.env(), lambda line: startup.ours_step(line, 3), 3,
        tmp_path / "log", first_only=True,
    )  # fmt: skip
    assert list(figures) == ["first_step"] and figures["first_step"] == pytest.approx(0.4, abs=0.5)
    assert __import__("time").perf_counter() - started < 30
