"""common/loop.py: the optimizer-step count under gradient accumulation, ``max_steps``, a stop request
checkpointed where it came and continued with exactly the batches the uninterrupted run saw; each
process's random numbers after the shared initialisation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.config import RunConfig
from common.loaders import KeyedDataset, train_loader_for
from common.loop import Loop
from common.run import Run
from common.schedules import schedule, schedule_warnings, steps_total
from conftest import ROOT, free_port, recipe_env

ITEMS, BATCH = 12, 2  # a 12-item dataset of its own indices in batches of 2: 6 batches an epoch
WEIGHTS = {"loss_a": 1.0, "loss_b": 0.5}  # the total: loss_a + 0.5 loss_b; "error" is logged, not summed


class Indices(KeyedDataset):
    """Item i is the tensor [i]; keys are (epoch, index) pairs, as common.loaders' samplers give them."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([float(key[1])])


def train(folder: Path, stop_at: int = 0, **fields) -> tuple[list[int], Loop]:
    """A loop over the indices 0..11 with a do-nothing model and a cosine learning rate from 1 to 0 (warmup
    ``warmup_epochs``); returns the indices its batches held, in order, and the finished loop. ``stop_at``: a
    SIGTERM to this process after that optimizer step."""
    cfg = RunConfig(output_dir=str(folder), report_to="none", num_workers=0, batch_size=BATCH, **fields)
    run = Run(cfg, "loop")
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = train_loader_for(Indices(), cfg.batch_size, cfg.seed, 0, 1)
    model, optimizer, loader = run.accelerator.prepare(model, optimizer, loader)
    loop = Loop(run, loader, lambda n: {"lr": schedule("cosine", 1.0, 0.0, n.steps, n.at(cfg.warmup_epochs))})
    loop.resume()
    seen: list[int] = []
    for _ in loop.epochs():
        for x in loop.batches():
            with run.accelerator.accumulate(model):
                out = model(x)
                losses = {"loss_a": out.abs().mean(), "loss_b": out.pow(2).mean(), "error": out.max()}
                loss = sum(losses[k] * w for k, w in WEIGHTS.items())
                run.accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss, losses, len(x))
            seen += x[:, 0].int().tolist()
            if not run.accelerator.sync_gradients:
                continue
            loop.end_step()
            if loop.log_due():
                loop.log_train()
            if loop.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a cluster's preemption would
            if loop.stop_requested():
                loop.save_checkpoint()
                loop.stop({})
                return seen, loop
            if loop.checkpoint_due():
                loop.save_checkpoint()
        if loop.checkpoint_due():
            loop.save_checkpoint()
    run.finish()
    return seen, loop


def test_accumulated_batches_make_one_step_and_max_steps_ends_mid_epoch(tmp_path):
    seen, loop = train(tmp_path / "run", epochs=3, grad_accum_steps=2, max_steps=5)
    assert loop.total_steps == 5 and loop.step == 5
    assert len(seen) == 5 * 2 * BATCH  # 5 steps of 2 batches: the first epoch and 4 batches of the second
    assert sorted(seen[:ITEMS]) == list(range(ITEMS)) and seen[:ITEMS] != seen[ITEMS : 2 * ITEMS]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000005" / "train_state.json").read_text())
    assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (5, 1, 4)


def test_one_losses_dict_feeds_the_meters_the_guard_and_the_step_line(tmp_path, capsys):
    """A loss term is one entry of ``losses``: it is logged under train/, shown on the step line and watched by
    the non-finite guard; a key not named loss_* (a class error) is logged only."""
    _, loop = train(tmp_path / "run", epochs=1, log_every=3)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in logged] == [3, 6]
    for r in logged:
        assert r["train/loss"] == pytest.approx(r["train/loss_a"] + 0.5 * r["train/loss_b"], rel=1e-5)
        assert "train/error" in r
    assert loop.run.guard.names == ["loss", "loss_a", "loss_b"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " step 6/6  loss " in ln]
    a, b = logged[-1]["train/loss_a"], logged[-1]["train/loss_b"]
    assert len(lines) == 1 and f"loss {logged[-1]['train/loss']:.4g} (a {a:.3g} b {b:.3g})  " in lines[0], lines


def test_a_stopped_run_continues_with_the_batches_it_would_have_seen(tmp_path):
    whole, _ = train(tmp_path / "whole", epochs=3)
    first, stopped = train(tmp_path / "cut", stop_at=8, epochs=3)
    assert stopped.step == 8 and len(first) == 8 * BATCH  # in the second epoch, batch 2 of 6
    rest, resumed = train(tmp_path / "cut", resume="auto", epochs=3)
    assert resumed.start.step == 8 and (resumed.start.epoch, resumed.start.batches_in_epoch) == (1, 2)
    assert first + rest == whole and resumed.step == 3 * ITEMS // BATCH


def test_a_resume_that_changes_the_schedule_says_so(tmp_path, capsys):
    """Stopped at step 8 of 18, resumed with max_steps 10: the cosine is squeezed into the 2 steps left, and one
    line gives both lengths and the learning rate step 9 jumps to."""
    train(tmp_path / "cut", stop_at=8, epochs=3)
    capsys.readouterr()
    train(tmp_path / "cut", resume="auto", epochs=3, max_steps=10)
    old, new = schedule("cosine", 1.0, 0.0, 18)[8], schedule("cosine", 1.0, 0.0, 10)[8]
    line = f"resume: the schedule is now 10 optimizer steps, was 18; the lr of step 9 goes from {old:.3g} to {new:.3g}"
    assert line in capsys.readouterr().out.splitlines()
    train(tmp_path / "cut", resume="auto", epochs=3, max_steps=10)  # the same length: nothing to say
    assert "resume: the schedule" not in capsys.readouterr().out


def test_a_schedule_longer_than_the_run_is_a_warning_under_the_banner(tmp_path, capsys):
    train(tmp_path / "run", epochs=2, warmup_epochs=10, eval_every=5)
    out = capsys.readouterr().out.splitlines()
    assert (
        "warning: warmup_epochs 10 (60 steps) outlasts the run (12 steps): the lr never reaches its peak; "
        "lower --warmup_epochs" in out
    )
    assert (
        "warning: eval_every 5 epochs is longer than the run's 2: it is evaluated at its end only; lower "
        "--eval_every" in out
    )


def test_schedule_warnings_count_the_epochs_max_steps_leaves():
    fields = {"epochs": 100, "warmup_epochs": 1.0, "eval_every": 10}
    assert schedule_warnings(RunConfig(**fields), 1000, 10) == []
    assert "eval_every 10 epochs is longer than the run's 3" in schedule_warnings(RunConfig(**fields), 25, 10)[0]
    assert schedule_warnings(RunConfig(**{**fields, "eval_every": 1, "warmup_epochs": 0.0}), 5, 10) == []


def test_steps_total_sums_epochs_of_changing_length_and_caps_at_max_steps():
    assert steps_total(3, lambda epoch: 10 if epoch < 2 else 4) == 24
    assert steps_total(3, 10, max_steps=25) == 25 and steps_total(3, 10, max_steps=0) == 30


SEEDS = textwrap.dedent("""
    import json, sys, torch
    sys.path[:0] = [sys.argv[1], sys.argv[3]]
    from common.config import RunConfig
    from accelerate.utils import set_seed
    from common.loaders import KeyedDataset, train_loader_for
    from common.loop import Loop
    from common.run import Run

    run = Run(RunConfig(report_to="none", output_dir=sys.argv[2], num_workers=0), "seeds")
    init = torch.randn(3).tolist()  # model initialisation: the shared seed
    loader = run.accelerator.prepare(train_loader_for(torch.utils.data.TensorDataset(torch.zeros(64, 1)), 4, 0, 0,
                                                      run.accelerator.num_processes))
    loop = Loop(run, loader, steps_per_epoch=1)
    set_seed(0, device_specific=True)  # as the recipes do after the banner
    loop.resume()
    step = torch.randn(3).tolist()  # dropout, drop path, Mixup inside the loop: per process
    with open(f"{sys.argv[2]}/draws_{run.accelerator.process_index}.json", "w") as f:
        json.dump({"init": init, "step": step}, f)
    run.finish()
""")


def test_processes_share_the_initialisation_seed_then_draw_their_own(tmp_path):
    script = tmp_path / "seeds.py"
    script.write_text(SEEDS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(script),
        str(ROOT / "tests"),
        str(tmp_path / "run"),
        str(ROOT),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=recipe_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    draws = [json.loads((tmp_path / "run" / f"draws_{rank}.json").read_text()) for rank in (0, 1)]
    assert draws[0]["init"] == draws[1]["init"]
    assert draws[0]["step"] != draws[1]["step"]


SILENT = textwrap.dedent("""
    import sys, time, torch
    sys.path[:0] = [sys.argv[1], sys.argv[3]]
    import common.loop
    from common.config import RunConfig
    from common.loaders import KeyedDataset, train_loader_for
    from common.loop import Loop
    from common.run import Run

    common.loop.SILENCE_S = float(sys.argv[4])  # every step counts as a silent minute
    cfg = RunConfig(report_to="none", output_dir=sys.argv[2], num_workers=0, batch_size=2, log_every=1000, epochs=2)
    run = Run(cfg, "silent")
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    class Zeros(torch.utils.data.Dataset):  # keyed by (epoch, index), as common.loaders' sampler gives them
        def __len__(self):
            return 24

        def __getitem__(self, key):
            return torch.zeros(1)

    loader = train_loader_for(Zeros(), 2, 0, 0, run.accelerator.num_processes)
    model, optimizer, loader = run.accelerator.prepare(model, optimizer, loader)
    loop = Loop(run, loader, steps_per_epoch=len(loader))
    loop.resume()
    for _ in loop.epochs():
        for x in loop.batches():
            if run.accelerator.process_index == 1:
                time.sleep(0.01)  # the processes' clocks drift apart: the agreed step must not
            loss = model(x).sum()
            run.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loop.record(loss, {}, len(x))
            if run.accelerator.sync_gradients:
                loop.end_step()
                if loop.log_due():
                    loop.log_train()
    run.finish()
""")


def _silent_run(tmp_path: Path, nproc: int, silence: float) -> tuple[str, list[int]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run"]
    launch += [f"--nproc_per_node={nproc}", f"--master_port={free_port()}"] if nproc > 1 else []
    args = [str(script), str(ROOT / "tests"), str(tmp_path / "run"), str(ROOT), str(silence)]
    proc = subprocess.run(launch + args, cwd=ROOT, env=recipe_env(nproc), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, [r["step"] for r in records if "train/loss" in r]


def test_a_run_in_a_log_file_is_never_silent(tmp_path):
    """No progress bar (output to a file): the first step is told at once, and a step line comes at least every
    SILENCE_S seconds even when log_every is far away; those lines read host clocks only, so metrics.jsonl holds
    the same records whatever the timing (only the last step here), and with the usual SILENCE_S they are absent."""
    out, logged = _silent_run(tmp_path / "slow", 1, 0.0)
    assert "epoch 0 step 1/24  first step " in out and " s after the start" in out, out
    between = [ln for ln in out.splitlines() if " s/step  eta " in ln and "loss" not in ln]
    assert len(between) >= 20 and "epoch 1 step 23/24  " in out, out  # a line every step instead of one at the end
    assert logged == [24]
    out, logged = _silent_run(tmp_path / "fast", 1, 60.0)
    assert logged == [24] and "first step" in out and " s/step  eta " not in out


def test_only_the_main_process_prints_the_lines_between_logs(tmp_path):
    """With 2 processes the lines between logs come from the main process alone and need no agreement: the run
    ends (a collective entered by one process alone would hang it), each step is told once, metrics as usual."""
    out, logged = _silent_run(tmp_path, 2, 0.0)
    between = [ln for ln in out.splitlines() if " s/step  eta " in ln and "loss" not in ln]
    steps = [int(ln.split()[3].split("/")[0]) for ln in between]
    assert len(steps) >= 8 and len(steps) == len(set(steps)), out  # 2 epochs of 24 items / (2 processes x 2)
    assert logged == [12]
