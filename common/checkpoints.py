"""A run's checkpoints, its resume and its stop signals: one concern, mixed into :class:`common.run.Run`.

A checkpoint is Accelerate's state plus :class:`common.run_folder.TrainState` (where the loop is), written
whole or not at all; :meth:`Checkpoints.resume` loads the one ``cfg.resume`` names. SIGTERM, SIGINT and
SIGUSR1 (Slurm's pre-emption warning), to this process or its whole group, set a flag that is honoured within one
step wherever it lands: in the training steps the loop asks :meth:`Checkpoints.should_stop` once per optimizer
step (every process gets the same answer at the same step), saves a checkpoint and ends with
:meth:`Checkpoints.stopped`; outside them (an evaluation's batches, its pictures, the last saves, the export,
``--predict``) :meth:`Checkpoints.check_stop` raises :class:`common.RunStopped`, which the loop turns into a
checkpoint while it is training. Inside :meth:`Checkpoints.interruptible` a single process stops at once.

The mixin uses what :class:`common.run.Run` holds: ``cfg``, ``accelerator``, ``dir``, ``checkpoint_dir``,
``recipe``, ``guard``, ``weights_metadata``, ``resume_changes``, and its ``begin``, ``log``, ``print``, ``finish``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import RunStopped, UserError
from common.console import launch_command
from common.loaders import STOP_SIGNALS
from common.origin import common_origin
from common.run_folder import (
    TrainState,
    complete_checkpoints,
    flag_value,
    is_checkpoint,
    record_resume,
    write_checkpoint,
)

#: How a stop of ``--eval_only`` or ``--export --weights`` ends its line; ``--predict`` names its partial file instead.
NOTHING_AFTER = "; nothing after it was written"


def partial_stop(stop: BaseException, done: int, total: int, partial: Path, also: str = "") -> RunStopped:
    """A prediction pass that a stop signal ended (``stop``, from :meth:`Checkpoints.check_stop`) after ``done`` of
    ``total`` images, what it had written kept in ``partial`` (``also``: what else it wrote per image): the
    line that says so."""
    return RunStopped(
        f"{str(stop).removesuffix(NOTHING_AFTER)}; {done:,} of {total:,} images predicted: {partial} holds them "
        f"(named partial{also}); the rest were not predicted"
    )


class Checkpoints:
    """Checkpoints, resume and stop signals of a :class:`common.run.Run` (see the module docstring)."""

    def start_checkpoints(self: Any) -> None:
        """Install the stop-signal handlers; with several processes, the gloo group that agrees on a stop."""
        self.last_checkpoint = ""
        self._stop_signal: int | None = None
        self._loop_done = False  # after the training loop a stop ends the run at the next check (RunStopped)
        # what a stop signal does now (STOP_PLANS): the loop sets "training" and "evaluation", loop_done "after";
        # --predict, --eval_only and --export --weights are a "task" from the start
        self.stop_phase = "task" if self.cfg.weights and not self.cfg.resume else "training"
        self._interruptible: list[str] = []  # the interruptible() calls we are in, innermost last
        self._stop_group = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        if self.accelerator.num_processes > 1 and dist.is_initialized():
            # Stop requests are agreed on over gloo (CPU), so checking every step never waits on the GPU stream, in a
            # group of their own, so they never interleave with the training's collectives.
            self._stop_group = dist.new_group(backend="gloo")
        # SIGTERM, SIGINT and SIGUSR1 (Slurm's pre-emption warning), to this process or its whole group. Loader
        # workers ignore them (common.loaders.leave_stop_signals); until they have set that, forked ones inherit
        # this handler, and only the process that installed it acts on a signal.
        self._pid = os.getpid()
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self: Any, state: TrainState) -> None:
        """Write Accelerate state and ``state`` as the newest checkpoint, whole or not at all
        (:func:`common.run_folder.write_checkpoint`). Refuses to save (raising :class:`NonFiniteLoss`) once a
        loss went non-finite, so the last good one stays newest; logs ``time/checkpoint_s``."""
        self.begin()
        tick = time.perf_counter()
        self.guard.check(self.accelerator, self.last_checkpoint)
        final = write_checkpoint(
            self.accelerator, self.checkpoint_dir, state, self.cfg.keep_checkpoints, self.weights_metadata
        )
        self.last_checkpoint = str(final)
        self.log({"time/checkpoint_s": time.perf_counter() - tick}, state.step, echo=False)

    def checkpoints(self: Any) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def resume_checkpoint(self: Any) -> Path | None:
        """The checkpoint ``cfg.resume`` names (``auto``: the newest complete one), or None when the
        run starts afresh; lets a recipe skip work the checkpoint already holds before :meth:`resume`."""
        if not self.cfg.resume:
            return None
        if self.cfg.resume == "auto":
            found = self.checkpoints()
            return found[-1] if found else None
        path = Path(self.cfg.resume)
        if not is_checkpoint(path):
            raise UserError(f"--resume '{path}' is not a complete checkpoint folder (no train_state.json)")
        return path

    def resume(self: Any) -> TrainState:
        """Load the checkpoint :meth:`resume_checkpoint` names.

        Model, optimizer, scaler, RNG states and every object registered with
        ``accelerator.register_for_checkpointing`` come back; the returned state says where to
        continue. ``metrics.jsonl`` lines past the checkpoint are dropped, as they will be logged
        again. Returns a fresh state when there is nothing to resume.
        """
        path = self.resume_checkpoint()
        if path is None:
            if self.cfg.resume == "auto":
                self.print("resume auto: no checkpoint yet, starting from scratch")
            return TrainState()
        self.accelerator.load_state(str(path))
        state = TrainState(**json.loads((path / "train_state.json").read_text()))
        self.last_checkpoint = str(path)
        if self.accelerator.is_main_process:
            record_resume(self.dir, path, state.step, self.resume_changes, common_origin())
        self.accelerator.wait_for_everyone()
        self.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batches_in_epoch})")
        return state

    # -- signals -------------------------------------------------------------------------------
    #: What the acknowledgement of a stop signal says will happen, by :attr:`stop_phase`.
    STOP_PLANS = {
        "training": "finishing the step, saving a checkpoint, then exiting",
        "evaluation": "ending the evaluation at its next batch, saving a checkpoint, then exiting",
        "after": "ending the run now; the last checkpoint holds the training",
        "task": "stopping at the next image batch",
    }

    def _on_signal(self: Any, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a DataLoader worker: the training process stops it
            return
        if self._stop_signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            return  # already stopping (Slurm's SIGTERM at the time limit after its SIGUSR1 warning): said once
        self._stop_signal = signum
        self.print(f"{signal.Signals(signum).name} received: {self.STOP_PLANS[self.stop_phase]}")
        # inside interruptible(), or after the loop with one process (saves are atomic): now. With several, one
        # process may be inside a collective: the next shared check (check_stop) stops them all
        if self._interruptible or (self._loop_done and self.accelerator.num_processes == 1):
            raise RunStopped(self.stopped_text(self._interruptible[-1] if self._interruptible else ""))

    @contextlib.contextmanager
    def interruptible(self: Any, what: str) -> Iterator[None]:
        """Around a long call that writes nothing of the run's until it returns (the exporter and its checks, COCO's
        accumulation): with one process, a stop signal raises :class:`RunStopped` inside it at once, rather than at
        the next batch. With several, the processes must agree first, so it waits for the next check
        (:meth:`check_stop`). ``what`` names the call in the stop's message."""
        if self.accelerator.num_processes > 1:  # no process may leave a collective the others are in
            yield
            return
        if self._stop_signal is not None:
            raise RunStopped(self.stopped_text(what))
        self._interruptible.append(what)
        try:
            yield
        finally:
            self._interruptible.pop()

    def check_stop(self: Any, where: str, shared: bool = True) -> None:
        """A point where a stop can be honoured outside the training steps (each batch of an evaluation or
        prediction pass, between pictures, between the export's files): raise :class:`RunStopped` once a stop signal
        reached any process. ``shared`` False: only this process runs the code around it (the main process's
        prediction of a handful of files), so only its own signal counts and nothing is agreed on."""
        stop = self.should_stop() if shared else self._stop_signal is not None
        if stop:
            raise RunStopped(self.stopped_text(where))

    def stopped_text(self: Any, where: str) -> str:
        """The lines a stop outside the training steps ends with: after the training loop, how to finish the run's
        files; before it, what stopped where (:class:`common.loop.Loop` adds the checkpoint, prediction its file)."""
        name = signal.Signals(self._stop_signal).name if self._stop_signal is not None else "a stop request"
        if self.stop_phase == "task":  # --eval_only, --export --weights (--predict names its partial file)
            return f"stopped by {name} during {where}{NOTHING_AFTER}"
        if not self._loop_done:
            return f"stopped by {name} during {where}"
        during = f" during {where}" if where else ""
        return (
            f"stopped by {name}{during} after the training loop, before the run's last files were written; "
            f"everything written so far is kept (last checkpoint: {self.last_checkpoint or 'none'})\n"
            f"finish it with: {self.continue_command()}"
        )

    def loop_done(self: Any) -> None:
        """The training loop ended and its last checkpoint is written: from here on (the recipe's final weights, the
        model folder, the export; every file written under a temporary name and renamed) a stop signal ends the run
        with :class:`RunStopped`: at once with one process, at the next shared check with several; as does one that
        arrived since the last check (any process's, with several)."""
        self._loop_done = True
        self.stop_phase = "after"
        several = self.accelerator.num_processes > 1  # agreed, so that no process leaves the others' collectives
        if self.should_stop() if several else self._stop_signal is not None:
            self.hand_back_signals()
            raise RunStopped(self.stopped_text(""))

    def should_stop(self: Any) -> bool:
        """True on every process once any process got a stop signal (SIGTERM, SIGINT, SIGUSR1); call once per step.

        With several processes the flags are combined by an asynchronous all-reduce over gloo
        (CPU): each call collects the reduction started by the previous call and starts the next,
        so the loop never waits on it and every process sees the same answer at the same step
        (one step after the signal).
        """
        if self._stop_group is None:
            return self._stop_signal is not None
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = bool(flag.item())  # a CPU tensor: no device synchronisation
        flag = torch.tensor([0 if self._stop_signal is None else 1])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_group, async_op=True), flag)
        return stop

    def stopped(self: Any, step: int, evaluation: bool = False) -> None:
        """End a run stopped by a signal at ``step``: say how to continue, then :meth:`finish`. ``evaluation``: the
        stop cut an evaluation short, which a resume does again."""
        reason = signal.Signals(self._stop_signal).name if self._stop_signal is not None else "a stop request"
        again = " (before the evaluation, which runs again on resume)" if evaluation else ""
        self.print(f"stopped by {reason} at step {step}; checkpoint {self.last_checkpoint or 'none'}{again}")
        self.print(f"continue with: {self.continue_command()}")
        self.finish()

    def continue_command(self: Any) -> str:
        """The command that continues this run where its newest checkpoint left off: its own saved config
        (every flag it was started with), the flags a resume changed, and ``--resume auto``. After the end of
        training it redoes what follows the final checkpoint (final weights, model folder, export, hub push)."""
        changed = "".join(f" --{k} {flag_value(new)}" for k, (_, new) in self.resume_changes.items())
        return f"{launch_command(self.recipe)} --config {self.dir / 'config.yaml'}{changed} --resume auto"

    def collect_stop_flags(self: Any) -> None:
        """Collect the last stop-flag reduction (before the processes shut down)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def hand_back_signals(self: Any) -> None:
        """The handlers that were installed before the run: a run inside a longer program hands them back."""
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
