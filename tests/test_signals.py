"""Stop signals as clusters and terminals send them (docs/reliability.md "Stop signals"): SIGTERM, SIGINT or
SIGUSR1 to the training process or to its whole process group (``scancel``, ``timeout``, Ctrl-C, Slurm's
pre-emption warning) finish the step, save a checkpoint and exit 0 with the command that continues the run;
DataLoader workers and the start-up scan's pool leave the signals to the training process.

The runs start in a session of their own (``start_new_session``: a process group, as a batch job's or a
terminal's) with two loader workers, and are signalled once their first step is printed. The stop under each
launcher (python, ``accelerate launch``) is in the default suite; the resumes to the end, and torchrun with two
processes, are in the second tier (``-m configs``), each a minute or more on 2 cores."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_CLASSIFIER, recipe_cmd, recipe_env

SCRIPT = ROOT / "recipes" / "classifier.py"
# two epochs of the classifier's tiny run (22 steps each on one process): long enough to be signalled mid-run
ARGS = [*TINY_CLASSIFIER[:-2], "--max_steps", "30", "--num_workers", "2", "--report_to", "none"]
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
ACCELERATE_LAUNCH += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


class Started:
    """A command started in its own session, its stdout and stderr read together as they come."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        """Until a line holding ``needle`` is printed; fails with the output if the command ends first."""
        end = time.monotonic() + timeout
        while not any(needle in line for line in list(self.lines)):
            if self.proc.poll() is not None or time.monotonic() > end:
                self._reader.join(10)
                pytest.fail(f"no {needle!r} (exit {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 180) -> str:
        """Everything printed, once the top process has ended and every process holding its output too (a
        launcher that died leaves the training process to finish on its own)."""
        try:
            self.proc.wait(timeout)
            self._reader.join(timeout)
            assert not self._reader.is_alive(), f"still printing after {timeout} s:\n{self.text()[-4000:]}"
        finally:
            self.kill()
        return self.text()

    def kill(self) -> None:
        """What is left of the group: gone (a failed test leaves no run behind)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_once_stepped(cmd: list[str], cwd: Path, env: dict[str, str], to_group: bool = True, sig=signal.SIGTERM):
    """Start ``cmd``, and send ``sig`` to its process group (or its top process) once it printed its first
    step. Returns the process and all it printed."""
    run = Started(cmd, cwd, env)
    try:
        run.wait_for("first step")
        (os.killpg if to_group else os.kill)(run.proc.pid, sig)
        return run.proc, run.finish()
    finally:
        run.kill()


def stopped_cleanly(out: str, folder: Path, name: str = "SIGTERM", last: bool = True) -> tuple[int, list[str]]:
    """The stop contract on the training process's output: the signal acknowledged once, the checkpoint of the
    step it stopped at, and the command that continues it (``last``: on the last line). Returns that step and
    the command's arguments after the script."""
    assert out.count(f"{name} received: finishing the step, saving a checkpoint, then exiting") == 1, out[-4000:]
    found = re.search(rf"stopped by {name} at step (\d+); checkpoint (\S+)", out)
    assert found, out[-4000:]
    step, checkpoint = int(found.group(1)), Path(found.group(2))
    assert checkpoint == folder / "checkpoints" / f"step_{step:08d}" and (checkpoint / "train_state.json").is_file()
    ours = [line for line in out.splitlines() if line.startswith("continue with: ")]
    assert ours and (not last or out.rstrip().splitlines()[-1] == ours[-1]), out[-4000:]
    command = shlex.split(ours[-1].removeprefix("continue with: "))
    assert command[:3] == ["accelerate", "launch", str(SCRIPT)], command
    assert command[3:] == ["--config", str(folder / "config.yaml"), "--resume", "auto"], command
    return step, command[3:]


# -- the workers alone: fast ---------------------------------------------------------------------------
class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> tuple[int, int]:
        time.sleep(0.002)
        return index, _started


_started = 0


def _mark(worker_id: int) -> None:
    global _started
    _started = 100 + worker_id


def test_loader_workers_ignore_the_stop_signals_and_run_a_given_worker_init_fn():
    """torch's worker loop gives each DataLoader worker a C handler that ends it on SIGTERM (the training
    process then fails with "DataLoader worker ... is killed by signal: Terminated"); SIGUSR1 would end it
    too. Workers of loader_kwargs ignore all three, sent to them directly, and a worker_init_fn given still runs."""
    from common.loaders import loader_kwargs

    loader = torch.utils.data.DataLoader(_Ids(), batch_size=None, **loader_kwargs(2, worker_init_fn=_mark))
    batches = iter(loader)
    seen = [next(batches) for _ in range(4)]
    workers = [w.pid for w in batches._workers]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        for pid in workers:
            os.kill(pid, sig)
    seen += [next(batches) for _ in range(200)]  # a dead worker would raise here
    assert all(w.is_alive() for w in batches._workers) and {marked for _, marked in seen} == {100, 101}
    del batches


SCAN = """
import os, signal, sys, time
from multiprocessing import forkserver, resource_tracker
from common.data.scan import scan_files

got = []
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: got.append(signum))
missing = [f"{sys.argv[1]}/{i}.png" for i in range(600)]  # three chunks: the pool of 2 processes checks them
bad, _ = scan_files(missing, 2)
helpers = forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid
os.killpg(0, signal.SIGTERM); os.killpg(0, signal.SIGUSR1); os.killpg(0, signal.SIGINT)
time.sleep(0.5)
states = [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for pid in helpers]
print(len(bad), *sorted(got), *("alive" if state not in "ZX" else "dead" for state in states))
"""


def test_the_scan_pool_leaves_group_signals_to_the_training_process(tmp_path):
    """The start-up scan's forkserver and multiprocessing's resource tracker outlive its pool, in the run's
    group: a signal to the whole group reaches the training process alone (before, SIGTERM ended the
    forkserver and SIGUSR1 the tracker: 'resource_tracker: process died unexpectedly' on the next pool)."""
    proc = subprocess.run(
        [sys.executable, "-c", SCAN, str(tmp_path / "none")],
        cwd=tmp_path,
        env=recipe_env(CV_RECIPES_CACHE=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.split() == ["600", "2", "10", "15", "alive", "alive"], proc.stdout


# -- whole runs: the stop in the default suite, the resume to the end in the second tier ------------------
def python_run(folder: Path) -> list[str]:
    return recipe_cmd("classifier", [*ARGS, "--output_dir", str(folder)])


@pytest.mark.slow
def test_group_sigterm_stops_a_run_with_workers(tmp_path):
    """`setsid python recipes/classifier.py --num_workers 2`, then `kill -TERM -<pgid>` (scancel, timeout): the
    step finishes, one checkpoint, exit 0, no traceback, the command that continues it (the issue: the workers
    died first and the run ended in "DataLoader worker (pid ...) is killed by signal: Terminated", exit 1)."""
    proc, out = stop_once_stepped(python_run(tmp_path / "run"), tmp_path, recipe_env())
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    stopped_cleanly(out, tmp_path / "run")


@pytest.mark.slow
def test_sigusr1_to_the_training_process_is_a_stop(tmp_path):
    """Slurm's pre-emption warning (`--signal=USR1@90`) to the training process: as SIGTERM."""
    proc, out = stop_once_stepped(python_run(tmp_path / "run"), tmp_path, recipe_env(), False, signal.SIGUSR1)
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    stopped_cleanly(out, tmp_path / "run", "SIGUSR1")


@pytest.mark.slow
def test_group_sigterm_under_accelerate_launch(tmp_path):
    """`accelerate launch` (one process) in the signalled group: accelerate's launcher has no handler and dies of
    the SIGTERM itself (status -15, nothing printed); the training process, in the same group, still stops
    cleanly and its lines end the output."""
    folder = tmp_path / "run"
    proc, out = stop_once_stepped(
        [*ACCELERATE_LAUNCH, str(SCRIPT), *ARGS, "--output_dir", str(folder)], tmp_path, recipe_env()
    )
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out[-4000:]
    stopped_cleanly(out, folder)


@pytest.mark.configs
def test_a_run_stopped_by_group_sigterm_continues_to_the_end_with_the_printed_command(tmp_path):
    """The stop above, then the printed command (through `accelerate launch`, as printed): it resumes from the
    checkpoint the stop wrote and trains to the end."""
    folder = tmp_path / "run"
    proc, out = stop_once_stepped(python_run(folder), tmp_path, recipe_env())
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    step, rest = stopped_cleanly(out, folder)
    resumed = subprocess.run(
        [*ACCELERATE_LAUNCH, str(SCRIPT), *rest, "--max_steps", str(step + 2)],
        cwd=tmp_path,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {folder / 'checkpoints' / f'step_{step:08d}'} at step {step} " in resumed.stdout
    assert (folder / "final.safetensors").is_file() and (folder / "checkpoints" / f"step_{step + 2:08d}").is_dir()


@pytest.mark.configs
def test_group_sigterm_under_torchrun_with_two_processes(tmp_path):
    """`torchrun --nproc_per_node 2` (gloo) in the signalled group. torchrun starts each training process in a
    session of its own, so the group's SIGTERM reaches torchrun alone; it forwards it to each training
    process's group (the process and its loader workers), waits for them (30 s) and then raises its own
    SignalException: exit 1 and that one traceback. Both training processes stop at the same step with one
    checkpoint, and `--resume auto` under torchrun continues from it to the end."""
    folder = tmp_path / "run"
    env = recipe_env(2)
    proc, out = stop_once_stepped(recipe_cmd("classifier", [*ARGS, "--output_dir", str(folder)], 2), tmp_path, env)
    last = out.rstrip().splitlines()[-1]
    if proc.returncode != 0:  # torchrun's own end, as above; nothing from the training processes
        assert proc.returncode == 1 and out.count("Traceback") == 1, out[-4000:]
        assert re.fullmatch(r".*SignalException: Process \d+ got signal: 15", last), out[-4000:]
    else:
        assert "Traceback" not in out, out[-4000:]
    step, rest = stopped_cleanly(out, folder, last=proc.returncode == 0)
    resumed = subprocess.run(
        recipe_cmd("classifier", [*rest, "--max_steps", str(step + 2)], 2),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {folder / 'checkpoints' / f'step_{step:08d}'} at step {step} " in resumed.stdout
    assert (folder / "final.safetensors").is_file()


EXIT_WITH_A_LIVE_WORKER = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from common.loaders import eval_loader_for
loader = eval_loader_for(torch.utils.data.TensorDataset(torch.zeros(64, 1)), 4, 2)
batches = iter(loader)
next(batches)  # the workers run, and nothing shuts them down before the interpreter exits
globals()["kept"] = (loader, batches)
print("exiting", flush=True)
"""


def test_a_process_exits_although_its_workers_ignore_sigterm(tmp_path):
    """multiprocessing's exit handler ends live daemonic children with SIGTERM, which the workers ignore, then
    waits for them: the workers are killed first, so the process ends (it hung before)."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_WITH_A_LIVE_WORKER)
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-2000:]
