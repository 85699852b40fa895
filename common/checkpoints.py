"""A run's checkpoints, its resume and its stop signals: one concern, mixed into :class:`common.run.Run`.

A checkpoint is Accelerate's state plus :class:`common.run_folder.TrainState` (where the loop is), written
whole or not at all; :meth:`Checkpoints.resume` loads the one ``cfg.resume`` names. SIGTERM, SIGINT and
SIGUSR1 (Slurm's pre-emption warning), to this process or its whole group, only set a flag: the loop asks
:meth:`Checkpoints.should_stop` once per optimizer step (every process gets the same answer at the same step),
saves a checkpoint and ends with :meth:`Checkpoints.stopped`; after the training loop (:meth:`loop_done`) a
signal ends the run at once with :class:`common.RunStopped`.

The mixin uses what :class:`common.run.Run` holds: ``cfg``, ``accelerator``, ``dir``, ``checkpoint_dir``,
``recipe``, ``guard``, ``weights_metadata``, ``resume_changes``, and its ``begin``, ``log``, ``print``, ``finish``.
"""

from __future__ import annotations

import json
import os
import signal
import time
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


class Checkpoints:
    """Checkpoints, resume and stop signals of a :class:`common.run.Run` (see the module docstring)."""

    def start_checkpoints(self: Any) -> None:
        """Install the stop-signal handlers; with several processes, the gloo group that agrees on a stop."""
        self.last_checkpoint = ""
        self._stop_signal: int | None = None
        self._loop_done = False  # after the training loop a stop signal ends the run at once (RunStopped)
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
    def _on_signal(self: Any, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a DataLoader worker: the training process stops it
            return
        if self._stop_signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            return  # already stopping (Slurm's SIGTERM at the time limit after its SIGUSR1 warning): said once
        self._stop_signal = signum
        if self._loop_done:
            self._raise_stopped()
        self.print(f"{signal.Signals(signum).name} received: finishing the step, saving a checkpoint, then exiting")

    def loop_done(self: Any) -> None:
        """The training loop ended and its last checkpoint is written: from here on (the recipe's final
        weights, the export) a stop signal ends the run at once with :class:`RunStopped`, as does one
        that arrived during the last epoch's evaluation."""
        self._loop_done = True
        if self._stop_signal is not None:
            self._raise_stopped()

    def _raise_stopped(self: Any) -> None:
        for sig, handler in self._handlers.items():  # the run ends here: the signals go back
            signal.signal(sig, handler)
        name = signal.Signals(self._stop_signal).name
        raise RunStopped(
            f"stopped by {name} after the training loop, before the run's last files were written; everything "
            f"written so far is kept (last checkpoint: {self.last_checkpoint or 'none'})\n"
            f"finish it with: {self.continue_command()}"
        )

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

    def stopped(self: Any, step: int) -> None:
        """End a run stopped by a signal at ``step``: say how to continue, then :meth:`finish`."""
        reason = signal.Signals(self._stop_signal).name if self._stop_signal is not None else "a stop request"
        self.print(f"stopped by {reason} at step {step}; checkpoint {self.last_checkpoint}")
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
