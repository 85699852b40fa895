"""Never silent outside the steps either (issue 43, item 7): where no progress bar shows (output to a file, as a
cluster job writes it), an evaluation, a kNN pass or a prediction prints where it is every SILENCE_S seconds
(``eval 40/72 images, 0:01:10``), and one long call (an export and its checks) prints its time; with the usual
SILENCE_S a short pass prints nothing."""

from __future__ import annotations

import re
import time

import pytest
import torch

import common.heartbeat
from common.config import RunConfig
from common.run import Run


class Slow(torch.utils.data.DataLoader):
    """A loader of 72 images in 6 batches of 12, each taking ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(torch.utils.data.TensorDataset(torch.zeros(72, 1)), batch_size=12)
        self.delay = delay

    def __iter__(self):
        for batch in super().__iter__():
            time.sleep(self.delay)
            yield batch


@pytest.fixture
def run(tmp_path):
    made = Run(RunConfig(output_dir=str(tmp_path / "run"), report_to="none", num_workers=0), "heartbeat")
    yield made
    made.finish()


def test_an_evaluation_without_a_progress_bar_says_where_it_is(run, monkeypatch, capsys):
    monkeypatch.setattr(common.heartbeat, "SILENCE_S", 0.25)
    assert sum(len(batch[0]) for batch in run.progress(Slow(0.2), "eval")) == 72
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval")]
    assert len(lines) >= 3, lines
    done = [int(re.fullmatch(r"eval (\d+)/72 images, 0:00:0\d", line).group(1)) for line in lines]
    assert done == sorted(done) and 0 < done[-1] <= 72 and all(n % 12 == 0 for n in done)


def test_a_prediction_over_files_counts_its_images(run, monkeypatch, capsys):
    monkeypatch.setattr(common.heartbeat, "SILENCE_S", 0.1)
    for _ in run.progress(range(0, 200, 64), "predict", 200):
        time.sleep(0.15)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("predict")]
    assert lines and all(re.fullmatch(r"predict \d+/200 images, 0:00:0\d", line) for line in lines), lines


def test_one_long_call_prints_its_time(run, monkeypatch, capsys):
    monkeypatch.setattr(common.heartbeat, "SILENCE_S", 0.2)
    with run.heartbeat("export"):
        time.sleep(0.7)
    time.sleep(0.3)  # nothing after the work ended
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("export")]
    assert len(lines) == 3 and all(line == "export, 0:00:00" for line in lines), lines


def test_a_short_pass_says_nothing(run, capsys):
    assert len(list(run.progress(Slow(0.0), "eval"))) == 6
    assert "eval" not in capsys.readouterr().out
