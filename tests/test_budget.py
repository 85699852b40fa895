"""common/budget.py and a budgeted loop: durations as users write them, a run's length and the epoch counts of its
config laid over it, the plan a budget holds, and a real recipe run with ``--max_time`` that ends within it with
its decay run to the end, continued exactly by a resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import common.budget
import common.budgeted
import common.loop
import common.run
from common import UserError
from common.budget import EVAL_SHARE, STEP_MARGIN, Length, epochs_for, plan_budget, seconds_of
from common.config import ConfigError, RunConfig, parse_config
from common.loaders import train_loader_for
from common.loop import Loop
from common.run import Run
from common.schedules import LaidOut, schedule, schedule_warnings
from conftest import ROOT, recipe_env, run_recipe
from test_classifier import TINY
from test_loop import BATCH, Indices

STEP_S, EVAL_S = 0.05, 0.2  # the harness's seconds per step and per evaluation


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("10m", 600), ("10min", 600), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400)]
)
def test_a_duration_is_read_with_its_unit(text, seconds):
    assert seconds_of(text) == seconds
    assert seconds_of("") == 0  # no budget


@pytest.mark.parametrize("text", ["10", "10 minutes", "5x", "m10", "1m1m", "0s", "-5m"])
def test_a_duration_without_a_unit_or_with_an_unknown_one_is_refused_naming_the_forms(text):
    with pytest.raises(UserError, match="90s, 10m|no time at all"):
        seconds_of(text)


def test_a_bad_max_time_is_a_config_error_before_anything_is_written():
    with pytest.raises(ConfigError, match="max_time '10' is not a duration"):
        parse_config(RunConfig, ["--max_time", "10"])
    assert parse_config(RunConfig, ["--max_time", "2h"]).max_time == "2h"


def test_a_budgeted_length_lays_the_configs_epoch_counts_out_as_shares_of_its_steps():
    # a config of 100 epochs; the budget holds 240 steps, 12 epochs of 20
    length = Length(240, 20, 12, 100, timing=6, budgeted=True)
    assert length.at(3) == round(0.03 * 240)  # warmup_epochs 3 of 100: the first 3 %
    assert length.at(100) == 240 and length.at(0) == 0
    assert length.in_epochs(10) == pytest.approx(1.2)  # no_aug_epochs 10 of 100: the last 1.2 of 12 epochs
    assert length.total == 246
    # without a budget an epoch count means what it says, a fraction of the epoch it falls in included
    plain = Length(400, lambda e: 10 if e < 2 else 5, 40, 40)
    assert plain.at(2) == 20 and plain.at(2.4) == 22 and plain.in_epochs(3) == 3


def test_epochs_for_counts_the_epochs_the_steps_start():
    assert epochs_for(50, 25) == 2 and epochs_for(51, 25) == 3 and epochs_for(1, 25) == 1
    assert epochs_for(25, lambda e: 10 if e == 0 else 5) == 4  # 10 + 5 + 5 + 5 (the last cut short)


def test_a_plan_fills_the_budget_with_steps_after_the_evaluations_and_the_end():
    plan = plan_budget(600, 40, 2.0, 12.0, 9.0, 8, 25, evaluations=20)
    evals = math.ceil(plan.epochs / plan.eval_every)
    assert evals * 12.0 <= EVAL_SHARE * 600 + 12.0  # at most 10 % of the budget (the final one may tip it)
    assert 1 <= evals <= math.floor(EVAL_SHARE * 600 / 12.0)
    used = 40 + (plan.steps - 8) * 2.0 + evals * 12.0 + 9.0
    assert used <= 600  # ends within the budget at the timed speed
    assert used >= 600 - (1 - STEP_MARGIN) * 600 - 2 * 12.0  # and leaves little of it unused
    assert plan.epochs == math.ceil(plan.steps / 25)
    # max_steps caps it; a budget already spent leaves the timing steps alone (and the final evaluation)
    assert plan_budget(600, 40, 2.0, 12.0, 9.0, 8, 25, 20, max_steps=50).steps == 50
    spent = plan_budget(60, 70, 2.0, 12.0, 9.0, 8, 25, 20)
    assert spent.steps == 8 and spent.eval_every == spent.epochs


def test_a_config_whose_epoch_counts_lie_past_the_end_of_the_run_is_warned_about():
    cfg = RunConfig(epochs=2, eval_every=1)
    cfg.decay_milestones, cfg.freeze_last_layer, cfg.no_aug_epochs, cfg.mosaic = [16, 22], 3, 10, 0.5
    lines = "\n".join(schedule_warnings(cfg, 20, 10))
    assert "decay_milestones 16, 22 lies at or past the end of the run (2 epochs)" in lines
    assert "freeze_last_layer 3 outlasts the run (2 epochs)" in lines
    assert "no_aug_epochs 10 >= epochs 2: mosaic and mixup never happen" in lines
    cfg.epochs, cfg.decay_milestones, cfg.freeze_last_layer = 30, [16], 1
    assert schedule_warnings(cfg, 300, 10) == []  # all within a 30-epoch run
    # cut by max_steps before the epochs without mosaic
    assert "ends (epoch 10) before its last 10 epochs" in "\n".join(schedule_warnings(cfg, 100, 10))


@pytest.mark.configs
@pytest.mark.parametrize(("recipe", "budget"), [("classifier", 45), ("yolo", 60), ("faster_rcnn", 60)])
def test_a_budgeted_recipe_run_ends_within_it_with_its_decay_run_to_the_end(tmp_path, recipe, budget):
    """A demo with --max_time: the process ends within the budget, after its planned last step (whose lr is the
    schedule's end: the decay ran its course), its final evaluation and its weights; the plan is in the last
    checkpoint, the steps after the timing ones laid out as one schedule."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / f"recipes/{recipe}.py"), "--output_dir", str(run), "--max_time", f"{budget}s",
           "--log_every", "1", "--report_to", "none"]  # fmt: skip
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=recipe_env(), timeout=300)
    wall = time.time() - started
    assert out.returncode == 0, out.stderr[-2000:]
    assert wall <= budget, out.stdout
    plan_line = next(line for line in out.stdout.splitlines() if line.startswith(f"max_time 0:{budget // 60:02d}:"))
    planned = int(plan_line.split(": ")[1].split(" optimizer steps")[0].replace(",", ""))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["train/lr"] for r in records if "train/lr" in r}
    last = max(lr)  # the planned step, or where a refit to the machine's speed moved it (said in a line)
    assert last == planned or "max_time: the steps run " in out.stdout
    peak = max(lr.values())
    assert lr[last] <= 0.015 * peak  # cosine to min_lr, poly to 0: the last step is the decay's end
    assert any(k.startswith("eval/") for r in records if r["step"] == last for k in r)  # the final evaluation
    assert (run / "final.safetensors").is_file()
    state = json.loads(sorted((run / "checkpoints").glob("*/train_state.json"))[-1].read_text())
    assert state["extra"]["plan"]["steps"] == planned and 3 <= state["extra"]["plan"]["timing"] < planned
    assert state["extra"].get("refit", [[0, planned]])[-1][1] == last


def budgeted(folder, monkeypatch, started: float, stop_at: int = 0, **fields) -> tuple[dict[int, float], Loop]:
    """A loop whose steps take STEP_S and evaluations EVAL_S, under ``max_time`` counted from ``started``; a
    cosine from 1 to 0 with 10 % warmup of its 10 epochs. Returns each step's lr and the finished loop."""
    for module in (common.loop, common.budget, common.run):  # the budget starts with the test
        monkeypatch.setattr(module, "process_start", lambda: started)
    monkeypatch.setattr(common.run, "_runs_made", 0)  # the run counts from that start, as a process's first does
    cfg = RunConfig(output_dir=str(folder), report_to="none", num_workers=0, batch_size=BATCH, epochs=10, **fields)
    run = Run(cfg, "budget")
    loader = run.accelerator.prepare(train_loader_for(Indices(), BATCH, 0, 0, 1))
    loop = Loop(run, loader, lambda n: {"lr": schedule("cosine", 1.0, 0.0, n.steps, n.at(1))}, eval_images=10)
    loop.resume()
    lrs: dict[int, float] = {}
    for _ in loop.epochs():
        for _x in loop.batches():
            lrs[loop.step + 1] = loop.value("lr")
            time.sleep(STEP_S)
            loop.end_step()
            if loop.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if loop.stop_requested():
                loop.save_checkpoint()
                loop.stop({})
                return lrs, loop
        if loop.eval_due():
            with loop.evaluation():
                time.sleep(EVAL_S)
        if loop.checkpoint_due():
            loop.save_checkpoint()
    return lrs, loop


def test_a_budgeted_loop_times_its_first_steps_then_lays_the_schedule_over_the_budget(tmp_path, monkeypatch, capsys):
    started = time.time()
    lrs, loop = budgeted(tmp_path / "run", monkeypatch, started, max_time="12s")
    took = time.time() - started
    plan = loop.plan
    assert plan is not None and loop.step == plan.steps == max(lrs) and 3 + 2 <= plan.timing <= 30 + 2
    end_s = common.budget.END_S + common.budget.END_SHARE * 12
    assert took <= 12 - end_s + 1.0  # the end's reserve is left for weights the harness does not write
    assert took >= 0.8 * (12 - end_s - 2.8)  # the steps used most of what the end and an evaluation's estimate leave
    # the timing steps at the schedule's first value (warmup from 0); then warmup and cosine over the plan's steps
    assert all(lrs[s] == 0.0 for s in range(1, plan.timing + 1))
    laid = schedule("cosine", 1.0, 0.0, plan.steps - plan.timing, round(0.1 * (plan.steps - plan.timing)))
    assert [lrs[s] for s in range(plan.timing + 1, plan.steps + 1)] == pytest.approx(list(laid))
    assert lrs[plan.steps] == pytest.approx(0.0)  # the decay ran to its end
    out = capsys.readouterr().out
    assert f"max_time 0:00:12: {plan.steps:,} optimizer steps ({plan.epochs} epochs of 6)" in out


def test_a_budgeted_run_stopped_after_its_plan_resumes_the_same_schedule(tmp_path, monkeypatch, capsys):
    started = time.time()
    first, stopped = budgeted(tmp_path / "run", monkeypatch, started, stop_at=40, max_time="12s")
    plan = stopped.plan
    assert plan is not None and stopped.step == 40 < plan.steps
    capsys.readouterr()
    rest, resumed = budgeted(tmp_path / "run", monkeypatch, time.time(), max_time="12s", resume="auto")
    assert resumed.plan == plan and resumed.step == plan.steps  # not timed again: the checkpoint's plan
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resume: "))
    fits = int(line.split("spent; ")[1].split(" steps fit")[0])  # the earlier session's time counts
    assert line.startswith("resume: 0:00:0") and fits >= plan.steps and line.endswith(f"the plan had {plan.steps}")
    laid = schedule("cosine", 1.0, 0.0, plan.steps - plan.timing, round(0.1 * (plan.steps - plan.timing)))
    assert [rest[s] for s in range(41, plan.steps + 1)] == pytest.approx(list(laid[40 - plan.timing :]))


def test_a_budgeted_run_whose_steps_slow_down_squeezes_the_rest_of_its_schedule_into_the_time_left(
    tmp_path, monkeypatch, capsys
):
    """Steps three times slower than timed after the plan: the rest of the schedule is squeezed into fewer steps
    (said in one line), the decay still runs to its end, and the final evaluation ends within the budget; a
    resume after it lays out the same squeezed schedule."""
    global STEP_S
    started = time.time()
    original = common.loop.Loop._apply

    def slow_down(self, plan):
        global STEP_S
        original(self, plan)
        STEP_S = 0.15

    monkeypatch.setattr(common.loop.Loop, "_apply", slow_down)
    try:
        lrs, loop = budgeted(tmp_path / "run", monkeypatch, started, max_time="12s")
    finally:
        STEP_S = 0.05
    assert time.time() - started <= 12
    plan = loop.plan
    assert plan is not None and plan.timing < loop.step < plan.steps and loop.step == max(lrs)
    assert "max_time: the steps run slower than timed" in capsys.readouterr().out  # said once
    assert lrs[loop.step] == pytest.approx(0.0, abs=1e-12)  # the cosine's end, reached at the squeezed last step
    steps = [lrs[s] for s in range(plan.timing + 1, loop.step + 1)]
    peak = steps.index(max(steps))
    assert steps[peak:] == sorted(steps[peak:], reverse=True)  # warmup, then a decay that never rises again
    refits = loop.extra["refit"]
    assert refits and refits[-1][1] == loop.step and all(total < plan.steps for _, total in refits)
    # a resume lays out the same values: the plan's schedules, then the refits, in order
    again = LaidOut(loop.schedules.lay_out, Length(plan.steps, 6, 10, 10, 0, True))
    again.relay(Length(plan.steps - plan.timing, 6, plan.epochs, 10, plan.timing, True))
    total = plan.steps
    for at, new in refits:
        again.refit(at, total, new)
        total = new
    assert list(again.values["lr"]) == pytest.approx(list(loop.schedules.values["lr"]))


def test_a_resumed_budgeted_run_counts_the_time_its_earlier_sessions_spent(tmp_path, monkeypatch, capsys):
    """A session resumed where the earlier ones spent most of the budget lays the schedule's rest over the steps
    the rest holds (one line), runs the decay to its end and ends within what was left."""
    started = time.time()
    first, stopped = budgeted(tmp_path / "run", monkeypatch, started, stop_at=40, max_time="12s")
    plan = stopped.plan
    assert plan is not None and stopped.step == 40 < plan.steps
    state_file = sorted((tmp_path / "run" / "checkpoints").glob("*/train_state.json"))[-1]
    state = json.loads(state_file.read_text())
    assert 0 < state["extra"]["spent_s"] < 12
    state["extra"]["spent_s"] = 6.0  # as if the first session had started slowly
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    again = time.time()
    rest, resumed = budgeted(tmp_path / "run", monkeypatch, again, max_time="12s", resume="auto")
    assert time.time() - again <= 6.0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resume: "))
    fits = int(line.split("spent; ")[1].split(" steps fit")[0])
    assert line.startswith("resume: 0:00:06 of max_time 0:00:12 spent;") and 40 < fits < plan.steps
    assert f"the plan had {plan.steps}: its rest laid over the steps to {fits}" in line
    assert resumed.step == max(rest) <= fits and rest[resumed.step] == pytest.approx(0.0, abs=1e-12)
    assert resumed.extra["refit"][0] == [40, fits]


def test_a_budget_with_few_max_steps_runs_its_whole_schedule(tmp_path, monkeypatch):
    """``--max_time 10m --max_steps 20``: the timing ends early enough for a warmup, the peak and a decay to
    the schedule's end at step 20."""
    lrs, loop = budgeted(tmp_path / "run", monkeypatch, time.time(), max_time="10m", max_steps=20)
    assert loop.step == max(lrs) == 20 and loop.plan is not None and loop.plan.timing <= 5
    assert max(lrs.values()) > 0.9 and lrs[20] == pytest.approx(0.0, abs=1e-12)
    after = [lrs[s] for s in range(loop.plan.timing + 1, 21)]
    peak = after.index(max(after))
    assert after[peak:] == sorted(after[peak:], reverse=True) and peak < len(after) - 1


def test_a_budget_spent_before_the_first_step_still_runs_a_whole_schedule(tmp_path, monkeypatch, capsys):
    """30 s of start-up against ``--max_time 10s``: one warning line naming the budget and the time spent, then
    a short run whose lr rises and decays to its end (never a run at the warmup's start value)."""
    lrs, loop = budgeted(tmp_path / "run", monkeypatch, time.time() - 30, max_time="10s")
    out = capsys.readouterr().out
    warning = next(x for x in out.splitlines() if x.startswith("warning: max_time"))
    assert "max_time 0:00:10 was spent before the first step (0:00:30 spent)" in warning
    assert f"the run trains {loop.step} steps" in warning
    assert loop.step == max(lrs) == common.budgeted.SHORT_RUN
    assert max(lrs.values()) > 0.5 and lrs[loop.step] == pytest.approx(0.0, abs=1e-12)
    # stopped at its third step and resumed (the budget still spent): the same short schedule to its end
    _, stopped = budgeted(tmp_path / "again", monkeypatch, time.time() - 30, stop_at=3, max_time="10s")
    rest, resumed = budgeted(tmp_path / "again", monkeypatch, time.time() - 30, max_time="10s", resume="auto")
    assert stopped.step == 3 and resumed.step == max(rest) == loop.step
    assert [rest[s] for s in range(4, loop.step + 1)] == pytest.approx([lrs[s] for s in range(4, loop.step + 1)])


@pytest.mark.slow
def test_two_processes_whose_clocks_disagree_take_every_budget_decision_together(tmp_path):
    """torchrun, 2 processes, the second's budget clock 12 s ahead of the first's (the fault-injection variable,
    not a sleep race): alone it would plan, refit and leave out evaluations otherwise; every decision is the
    main process's, so the run ends (no hang) within its budget, its decay run to its end, on both."""
    run = tmp_path / "run"
    args = TINY + ["--max_time", "60s", "--epochs", "40", "--eval_every", "1", "--log_every", "1"]
    started = time.time()
    out = run_recipe("classifier", args + ["--output_dir", str(run)], nproc=2, timeout=240,
                     **{common.budget.SKEW_VARIABLE: "12"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.time() - started <= 60 + 15  # the budget counts each process from its own start; torchrun's too
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["train/lr"] for r in records if "train/lr" in r}
    assert lr[max(lr)] <= 0.015 * max(lr.values())
    assert any("eval/top1" in r for r in records if r["step"] == max(lr))
