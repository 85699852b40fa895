"""common/console.py: COCO's -1 ("no ground truth of this size in the split") shows as n/a on the console, in the
step lines and the summary, while metrics.jsonl keeps the -1."""

from __future__ import annotations

import json

from common.config import RunConfig
from common.console import summary
from common.run import Run


def test_coco_minus_one_is_n_a_on_the_console_and_minus_one_in_the_file(tmp_path, capsys):
    values = {"eval/map": 0.5, "eval/map_large": -1.0, "eval/mar_100": -1.0, "eval/loss": -1.0}
    text = summary(1.0, values, {"map_large": (-1.0, 3)}, [])
    assert "  eval/map_large  n/a" in text and "  eval/mar_100    n/a" in text
    assert "  eval/loss       -1" in text  # a -1 that is not COCO's stays a number
    assert "best map_large n/a at step 3" in text
    run = Run(RunConfig(output_dir=str(tmp_path / "run"), report_to="none", num_workers=0), "console")
    run.log(values, 3)
    run.finish()
    assert "step 3: eval/map 0.5  eval/map_large n/a  eval/mar_100 n/a  eval/loss -1" in capsys.readouterr().out
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["eval/map_large"] == -1.0
