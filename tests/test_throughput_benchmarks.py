"""benchmarks/*_throughput.py and overhead.py: each hand-written side trains on the recipe's own model, data,
loss and schedules (imported, not retyped), so after the same steps both sides report the same loss (where
the hand-written side's optimizer is the recipe's). Two steps each, one repeat, no loader worker, on the CPU;
a bare side that drifts from its recipe shows here."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from conftest import ROOT, recipe_env

# benchmark: relative tolerance of the two sides' last-interval losses (None: both finite). The classifier's
# bare side steps the peak lr from the first step with torch's AdamW (the recipe: its warmup, timm's optimizer);
# torchvision's samplers in Faster R-CNN draw from the global RNG, which the sides consume differently; the
# others match the recipe exactly.
BENCHMARKS = {
    "overhead": None,
    "dino_throughput": 1e-6,
    "yolo_throughput": 1e-6,
    "detr_throughput": 1e-6,
    "faster_rcnn_throughput": 5e-2,
}


@pytest.mark.configs  # the second tier, with the shipped configs (-m configs; CI runs it)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_hand_written_side_trains_what_the_recipe_trains(name):
    quick = ["--steps", "2", "--log_every", "1", "--repeats", "1", "--threads", "1", "--num_workers", "0"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *quick],
        capture_output=True,
        text=True,
        env=recipe_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"last-interval loss (\S+)", done.stdout)]
    assert len(losses) == 2, done.stdout
    assert all(math.isfinite(x) for x in losses), done.stdout
    if BENCHMARKS[name] is not None:
        assert losses[0] == pytest.approx(losses[1], rel=BENCHMARKS[name]), done.stdout
