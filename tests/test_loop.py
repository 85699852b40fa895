"""common/loop.py: the optimizer-step count under gradient accumulation, ``max_steps``, a stop request
checkpointed where it came and continued with exactly the batches the uninterrupted run saw; each
process's random numbers after the shared initialisation."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from common.config import RunConfig
from common.loaders import train_loader_for
from common.loop import Loop, steps_total
from common.run import Run
from conftest import ROOT, free_port, recipe_env

ITEMS, BATCH = 12, 2  # a 12-item dataset of its own indices in batches of 2: 6 batches an epoch


class Indices(torch.utils.data.Dataset):
    """Item i is the tensor [i]; keys are (epoch, index) pairs, as common.loaders' samplers give them."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([float(key[1])])


def train(folder: Path, stop_at: int = 0, **fields) -> tuple[list[int], Loop]:
    """A loop over the indices 0..11 with a do-nothing model; returns the indices its batches held, in
    order, and the finished loop. ``stop_at``: a SIGTERM to this process after that optimizer step."""
    cfg = RunConfig(output_dir=str(folder), report_to="none", num_workers=0, batch_size=BATCH, **fields)
    run = Run(cfg, "loop")
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = train_loader_for(Indices(), cfg.batch_size, cfg.seed, 0, 1)
    model, optimizer, loader = run.accelerator.prepare(model, optimizer, loader)
    loop = Loop(run, loader, steps_total(cfg.epochs, math.ceil(len(loader) / cfg.grad_accum_steps), cfg.max_steps))
    seen: list[int] = []
    for _ in loop.epochs():
        for x in loop.batches():
            with run.accelerator.accumulate(model):
                run.accelerator.backward(model(x).sum())
                optimizer.step()
                optimizer.zero_grad()
            seen += x[:, 0].int().tolist()
            if loop.optimizer_stepped() and loop.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a cluster's preemption would
    if not loop.stopped:
        run.finish()
    return seen, loop


def test_accumulated_batches_make_one_step_and_max_steps_ends_mid_epoch(tmp_path):
    seen, loop = train(tmp_path / "run", epochs=3, grad_accum_steps=2, max_steps=5)
    assert loop.total_steps == 5 and loop.step == 5
    assert len(seen) == 5 * 2 * BATCH  # 5 steps of 2 batches: the first epoch and 4 batches of the second
    assert sorted(seen[:ITEMS]) == list(range(ITEMS)) and seen[:ITEMS] != seen[ITEMS : 2 * ITEMS]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000005" / "train_state.json").read_text())
    assert (state["step"], state["epoch"], state["batches_in_epoch"]) == (5, 1, 4)


def test_a_stopped_run_continues_with_the_batches_it_would_have_seen(tmp_path):
    whole, _ = train(tmp_path / "whole", epochs=3)
    first, stopped = train(tmp_path / "cut", stop_at=8, epochs=3)
    assert stopped.stopped and stopped.step == 8 and len(first) == 8 * BATCH  # in the second epoch, batch 2 of 6
    rest, resumed = train(tmp_path / "cut", resume="auto", epochs=3)
    assert resumed.start.step == 8 and (resumed.start.epoch, resumed.start.batches_in_epoch) == (1, 2)
    assert first + rest == whole and resumed.step == 3 * ITEMS // BATCH


def test_steps_total_sums_epochs_of_changing_length_and_caps_at_max_steps():
    assert steps_total(3, lambda epoch: 10 if epoch < 2 else 4) == 24
    assert steps_total(3, 10, max_steps=25) == 25 and steps_total(3, 10, max_steps=0) == 30


SEEDS = textwrap.dedent("""
    import json, sys, torch
    sys.path[:0] = [sys.argv[1], sys.argv[3]]
    from common.config import RunConfig
    from common.loaders import train_loader_for
    from common.loop import Loop
    from common.run import Run

    run = Run(RunConfig(report_to="none", output_dir=sys.argv[2], num_workers=0), "seeds")
    init = torch.randn(3).tolist()  # model initialisation: the shared seed
    loader = run.accelerator.prepare(train_loader_for(torch.utils.data.TensorDataset(torch.zeros(64, 1)), 4, 0, 0,
                                                      run.accelerator.num_processes))
    Loop(run, loader, 1)
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
