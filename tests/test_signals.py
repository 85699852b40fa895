"""Stop signals as clusters and terminals send them (docs/reliability.md "Stop signals"): SIGTERM, SIGINT or
SIGUSR1 to the training process or to its whole process group (``scancel``, ``timeout``, Ctrl-C, Slurm's
pre-emption warning) finish the step, save a checkpoint and exit 0 with the command that continues the run;
DataLoader workers and the start-up scan's pool leave the signals to the training process.

The runs start in a session of their own (``start_new_session``: a process group, as a batch job's or a
terminal's) with two loader workers, and are signalled once their first step is printed. The stop under each
launcher (python, ``accelerate launch``) and the stop as an evaluation starts are in the default suite; the resumes
to the end, torchrun with two processes, the stops of ``--predict`` and ``--export --weights`` and each recipe's
clean end are in the second tier (``-m configs``), each a minute or more on 2 cores."""

from __future__ import annotations

import json
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

from conftest import ROOT, TINY_CLASSIFIER, free_port, recipe_cmd, recipe_env

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


def stopped_cleanly(
    out: str, folder: Path, name: str = "SIGTERM", last: bool = True, launcher: tuple[str, ...] = ("python",)
) -> tuple[int, list[str]]:
    """The stop contract on the training process's output: the signal acknowledged once, the checkpoint of the
    step it stopped at, and the command that continues it (``last``: on the last line), in the ``launcher`` that
    started the run. Returns that step and the command's arguments after the script."""
    assert out.count(f"{name} received: finishing the step, saving a checkpoint, then exiting") == 1, out[-4000:]
    found = re.search(rf"stopped by {name} at step (\d+); checkpoint (\S+)", out)
    assert found, out[-4000:]
    step, checkpoint = int(found.group(1)), Path(found.group(2))
    assert checkpoint == folder / "checkpoints" / f"step_{step:08d}" and (checkpoint / "train_state.json").is_file()
    ours = [line for line in out.splitlines() if line.startswith("continue with: ")]
    assert ours and (not last or out.rstrip().splitlines()[-1] == ours[-1]), out[-4000:]
    command = shlex.split(ours[-1].removeprefix("continue with: "))
    script = len(launcher) + 1
    assert command[:script] == [*launcher, str(SCRIPT)], command
    assert command[script:] == ["--config", str(folder / "config.yaml"), "--resume", "auto"], command
    return step, command[script:]


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
from common.data.check_processes import child_answer, run_child

got = []
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: got.append(signum))
missing = [f"{sys.argv[1]}/{i}.png" for i in range(600)]
children = [run_child("check", missing[:300]), run_child("check", missing[300:], nice=5)]  # before and background
os.killpg(0, signal.SIGTERM); os.killpg(0, signal.SIGUSR1); os.killpg(0, signal.SIGINT)
time.sleep(0.5)
answers = [child_answer(child) for child in children]  # a child the signals ended would fail here
print(sum(len(a) for a in answers), *sorted(got))
"""


def test_the_image_checks_leave_group_signals_to_the_training_process(tmp_path):
    """The start-up image check's child processes (the ones the start waits for and a background one) run in the
    run's group: a signal to the whole group reaches the training process alone, and every check still answers."""
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
    assert proc.stdout.split() == ["600", "2", "10", "15"], proc.stdout


# -- the command that continues a run, in the launcher that started it -----------------------------------
LAUNCHED = "from common.console import launch_command\nprint(launch_command('classifier'))\n"


def test_the_printed_command_starts_the_recipe_as_this_process_was_started(tmp_path):
    """A script named as the recipe, started by python, by `accelerate launch` and by torchrun with 2 processes,
    each with the environment the launcher really gives it: the command its run would print (``continue with:``,
    ``redo it with:``) names that launcher, torchrun with its process count (the issue: `accelerate launch` for a
    run started with python, and Accelerate's warnings about its missing config on the resume)."""
    (tmp_path / "classifier.py").write_text(LAUNCHED)
    env = recipe_env()
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # this test's own launcher, if any, is not the one under test

    def printed(cmd: list[str]) -> list[str]:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.splitlines()

    assert printed([sys.executable, "classifier.py"]) == ["python classifier.py"]
    assert printed([*ACCELERATE_LAUNCH, "classifier.py"]) == ["accelerate launch classifier.py"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    assert printed([*torchrun, "classifier.py"]) == ["torchrun --nproc_per_node 2 classifier.py"] * 2


def test_accelerate_launch_over_torchrun_and_torchrun_over_machines(monkeypatch):
    """`accelerate launch --multi_gpu` starts its processes through torchrun (both launchers' variables set): the
    command is accelerate's, which applies the user's launch config again. torchrun over 2 machines of 4 processes:
    --nnodes too. A command for a run another process started (an FSDP checkpoint's) names the launcher given."""
    from common.console import launch_command

    monkeypatch.setattr(sys, "argv", [str(Path.cwd() / "recipes" / "classifier.py")])
    for name in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launch_command("classifier") == "torchrun --nnodes 2 --nproc_per_node 4 recipes/classifier.py"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what prepare_multi_gpu_env exports
    assert launch_command("classifier") == "accelerate launch recipes/classifier.py"
    assert launch_command("yolo", "accelerate launch") == "accelerate launch recipes/yolo.py"


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
    """`accelerate launch` (one process) in the signalled group: accelerate's launcher dies of the SIGTERM itself
    (status -15, nothing printed; from accelerate 1.16 it exits 143, 128 + SIGTERM, as a shell reports that death);
    the training process, in the same group, still stops cleanly and its lines end the output."""
    folder = tmp_path / "run"
    proc, out = stop_once_stepped(
        [*ACCELERATE_LAUNCH, str(SCRIPT), *ARGS, "--output_dir", str(folder)], tmp_path, recipe_env()
    )
    assert proc.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM) and "Traceback" not in out, out[-4000:]
    stopped_cleanly(out, folder, launcher=("accelerate", "launch"))


@pytest.mark.configs
def test_a_run_stopped_by_group_sigterm_continues_to_the_end_with_the_printed_command(tmp_path):
    """The stop above, then the printed command (`python recipes/classifier.py ...`, as printed): it resumes from
    the checkpoint the stop wrote and trains to the end."""
    folder = tmp_path / "run"
    proc, out = stop_once_stepped(python_run(folder), tmp_path, recipe_env())
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    step, rest = stopped_cleanly(out, folder)
    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), *rest, "--max_steps", str(step + 2)],
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
    step, rest = stopped_cleanly(out, folder, last=proc.returncode == 0, launcher=("torchrun", "--nproc_per_node", "2"))
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
    assert proc.returncode == 0 and "exiting" in proc.stdout and proc.stderr == "", proc.stderr[-2000:]


def test_a_finished_process_exits_without_a_traceback_from_its_workers(tmp_path):
    """The way a finished run failed (issue 49): many short processes whose persistent loader's workers are still
    alive at exit, output to a file, the cores busy with another process. torch's SIGCHLD handler used to report
    the workers that the exit killed (`RuntimeError: DataLoader worker (pid N) is killed by signal: Killed.`) after
    the last line, exit status 0: every one of 12 such processes did before the fix."""
    script = tmp_path / "finished.py"
    script.write_text(FINISHED_WITH_LIVE_WORKERS)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(6):
            log = tmp_path / f"out_{i}.txt"
            with open(log, "w") as out:
                code = subprocess.run(
                    [sys.executable, str(script), str(ROOT)], stdout=out, stderr=subprocess.STDOUT, timeout=120
                ).returncode
            assert code == 0 and log.read_text() == "finished\n", log.read_text()[-3000:]
    finally:
        busy.kill()


FINISHED_WITH_LIVE_WORKERS = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from common.loaders import eval_loader_for, train_loader_for

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, key):
        time.sleep(0.002)
        return torch.zeros(3)

loader = train_loader_for(Slow(), 4, 0, 2, 1)  # persistent workers, alive until the interpreter exits
for epoch in range(2):
    loader.batch_sampler.set_epoch(epoch)
    for batch in loader:
        pass
for batch in eval_loader_for(Slow(), 4, 2):
    pass
print("finished", flush=True)
"""


# -- a stop outside the steps: an evaluation, --predict, --export --weights ----------------------------------
#: Runs a recipe with one of its calls marked on stdout when it is first made (``OBSERVE``: ``evaluation`` marks
#: Run.evaluation_started and then holds the evaluation 2 s, so the signal lands inside it; ``check``: the first
#: Run.check_stop, a pass's first batch; ``export``: torch.onnx.export). Nothing else of the recipe changes.
OBSERVED = """
import os, runpy, sys, time
import common.run, torch
watch = os.environ["OBSERVE"]

def marked(owner, name, hold=0.0):
    original, said = getattr(owner, name), []
    def call(*args, **kwargs):
        if not said:
            said.append(True)
            print(f"{watch} started", file=sys.stderr, flush=True)  # stderr: the exporter hides stdout
            time.sleep(hold)
        return original(*args, **kwargs)
    setattr(owner, name, call)

if watch == "evaluation":
    marked(common.run.Run, "evaluation_started", 2.0)
elif watch == "check":
    marked(common.run.Run, "check_stop")
else:
    marked(torch.onnx, "export")
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def stop_when(watch: str, args: list[str], tmp_path: Path, kill_after: float = 10.0) -> tuple[int, str, float]:
    """The classifier with ``args``, SIGTERM to its group when ``watch`` (:data:`OBSERVED`) starts, SIGKILL
    ``kill_after`` seconds later if it is still running (docker stop's grace). Returns its exit status (-9 when
    killed), its output and the seconds from the signal to its end."""
    observed = tmp_path / "observed.py"
    observed.write_text(OBSERVED)
    run = Started([sys.executable, str(observed), str(SCRIPT), *args], tmp_path, recipe_env(OBSERVE=watch))
    try:
        run.wait_for(f"{watch} started")
        os.killpg(run.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        try:
            run.proc.wait(kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait(30)
        took = time.monotonic() - sent
        return run.proc.returncode, run.finish(), took
    finally:
        run.kill()


@pytest.mark.slow
def test_group_sigterm_as_an_evaluation_starts_leaves_a_checkpoint_before_it_within_10_s(tmp_path):
    """docker stop, scancel, timeout: SIGTERM to the group as the first evaluation starts (step 22, the end of epoch
    0), SIGKILL 10 s later. The evaluation ends at its next batch and the run saves the checkpoint of step 22 at the
    end of the epoch's batches, not yet evaluated, and exits 0 on its own (before: the evaluation, its plots, the
    next epoch's start and one more step came first)."""
    folder = tmp_path / "run"
    code, out, took = stop_when("evaluation", [*ARGS, "--log_every", "1", "--output_dir", str(folder)], tmp_path)
    assert code == 0 and took < 10 and "Traceback" not in out, out[-4000:]
    assert "SIGTERM received: ending the evaluation at its next batch, saving a checkpoint, then exiting" in out
    line = (
        f"stopped by SIGTERM at step 22; checkpoint {folder / 'checkpoints' / 'step_00000022'} (before the evaluation"
    )
    assert line in out, out[-3000:]
    state = json.loads((folder / "checkpoints" / "step_00000022" / "train_state.json").read_text())
    assert (state["step"], state["epoch"], state["batches_in_epoch"], state["finished"]) == (22, 0, 22, False)
    assert not any("eval/" in line for line in (folder / "metrics.jsonl").read_text().splitlines())
    assert out.rstrip().splitlines()[-1].startswith("continue with: ")


@pytest.mark.configs
def test_a_run_stopped_in_its_evaluation_resumes_there_and_ends_as_the_uninterrupted_run(tmp_path):
    """The stop above, then `--resume auto`: the checkpoint's evaluation runs first (the same metrics as the
    uninterrupted run's at step 22), then training goes on; the final and best weights equal, bit for bit, those of
    the run that was never stopped."""
    args = [*ARGS, "--log_every", "1"]
    folder, whole = tmp_path / "run", tmp_path / "whole"
    code, out, _ = stop_when("evaluation", [*args, "--output_dir", str(folder)], tmp_path)
    assert code == 0, out[-3000:]
    env = recipe_env()
    for cmd in (
        [*recipe_cmd("classifier", ["--config", str(folder / "config.yaml"), "--resume", "auto"])],
        recipe_cmd("classifier", [*args, "--output_dir", str(whole)]),
    ):
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]

    def evaluations(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k.startswith(("step", "eval/"))} for r in rows if "eval/top1" in r]

    assert evaluations(folder) == evaluations(whole) and len(evaluations(whole)) == 2
    from safetensors.torch import load_file

    for name in ("final.safetensors", "best.safetensors"):
        a, b = load_file(folder / name), load_file(whole / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.fixture(scope="module")
def classifier_weights(tmp_path_factory) -> Path:
    """The 4-step tiny classifier's best weights."""
    folder = tmp_path_factory.mktemp("weights") / "run"
    done = subprocess.run(
        recipe_cmd("classifier", [*TINY_CLASSIFIER, "--report_to", "none", "--output_dir", str(folder)]),
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "best.safetensors"


@pytest.mark.configs
def test_predict_given_sigterm_ends_within_seconds_naming_its_partial_file(tmp_path, classifier_weights):
    """`--predict` on 3,000 images, SIGTERM to the group at its first batch: it ends within 10 s on its own (before:
    it predicted on every image), exit 0, saying how many images were predicted and where they are, in a file named
    as partial; no predictions.csv that would pass for the whole."""
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(3000):
        Image.new("L", (8, 8), i % 256).save(images / f"{i:04d}.png")
    folder = tmp_path / "predicted"
    args = ["--predict", str(images), "--weights", str(classifier_weights), "--output_dir", str(folder)]
    code, out, took = stop_when("check", [*args, "--report_to", "none"], tmp_path)
    assert code == 0 and took < 10 and "Traceback" not in out, out[-3000:]
    assert "SIGTERM received: stopping at the next image batch" in out, out[-3000:]
    partial = re.escape(str(folder / "predictions.partial.csv"))
    said = rf"stopped by SIGTERM during predict \(\d+ of 47 batches\); (\d+) of 3,000 images predicted: {partial} "
    found = re.search(said + r"holds them \(named partial\)", out)
    assert found, out[-3000:]
    rows = (folder / "predictions.partial.csv").read_text().splitlines()
    assert len(rows) == 1 + int(found.group(1)) < 3000 and not (folder / "predictions.csv").exists()


@pytest.mark.configs
def test_export_given_sigterm_inside_the_exporter_ends_at_once_and_leaves_no_file(tmp_path, classifier_weights):
    """`--export --weights W`, SIGTERM to the group while torch.onnx's exporter runs: the run ends within seconds,
    exit 0, with one line saying the export was stopped (before: `error: export failed (ConversionError ...)`, and
    export/model.tmp.pt2 left behind); no temporary file, no model.onnx."""
    folder = tmp_path / "exported"
    args = ["--export", "--weights", str(classifier_weights), "--output_dir", str(folder), "--report_to", "none"]
    code, out, took = stop_when("export", args, tmp_path)
    assert code == 0 and took < 10 and "Traceback" not in out and "error" not in out, out[-3000:]
    assert out.rstrip().splitlines()[-1] == "stopped by SIGTERM during the export; nothing after it was written", out
    assert not [p.name for p in folder.rglob("model*")], sorted(p.name for p in folder.rglob("*"))


@pytest.mark.configs
@pytest.mark.parametrize("recipe", ["classifier", "dino", "yolo", "detr", "faster_rcnn"])
def test_a_short_run_with_loader_workers_ends_on_its_last_line(recipe, tmp_path):
    """Every recipe's demo for 2 steps with two loader workers, its output to a file and another process busy on a
    core (how a finished run used to end in `RuntimeError: DataLoader worker (pid N) is killed by signal`, exit 0):
    exit 0, nothing after `output: <run>`, no traceback."""
    folder, log = tmp_path / "run", tmp_path / "log.txt"
    args = ["--max_steps", "2", "--num_workers", "2", "--report_to", "none", "--export", "false"]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with open(log, "w") as out:
            code = subprocess.run(
                recipe_cmd(recipe, [*args, "--output_dir", str(folder)]),
                env=recipe_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=900,
            ).returncode
    finally:
        busy.kill()
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text[-4000:]
    assert text.rstrip().splitlines()[-1] == f"output: {folder}", text[-2000:]
