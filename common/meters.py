"""Training meters that never synchronise the host with the device between log intervals.

Loss terms, gradient norms and the like are added into running sums that stay on the device
(``update`` queues an add, nothing more). At a log interval ``summary`` stacks every sum and
count into one tensor, reduces it across processes with a single all-reduce and reads it with a
single ``.tolist()``: one host-device synchronisation per interval instead of one per step and
value. Throughput and the share of time spent waiting for data are measured on the host, over the
time the meters run: :meth:`Meters.pause` stops their clock for what is not a training step (an
evaluation, plots, a checkpoint, the loader's restart between epochs), so images/s and s/step count
the steps alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch


class Meters:
    """Running means of on-device scalars plus images/s, data-wait share and ETA.

    Usage in a loop::

        meters.data_time(seconds_waited)          # host float, per step
        meters.update(n=batch_size, loss=loss)    # device tensors, no sync
        if step % log_every == 0:
            values = meters.summary(accelerator, steps_done=1, steps_left=max_steps - step)
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, float] = {}
        self._images = 0
        self._counts_host: dict[str, float] = {}
        self._data_seconds = 0.0
        self._started = time.perf_counter()
        self._steps = 0
        self._paused_at: float | None = None  # perf_counter() when the clock stopped; None while it runs
        self._paused_s = 0.0  # seconds paused in this interval

    def pause(self) -> None:
        """Stop the clock of images/s and s/step (time outside the training steps); idempotent."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Restart the clock stopped by :meth:`pause`; idempotent."""
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def update(self, n: int = 1, **values: torch.Tensor | float) -> None:
        """Add ``value * n`` to each named sum and ``n`` to its count (``n`` = samples the value averages)."""
        for name, value in values.items():
            value = value.detach().float() if torch.is_tensor(value) else torch.tensor(float(value))
            if hasattr(value, "full_tensor"):  # a DTensor (FSDP2's clipped gradient norm): the whole value
                value = value.full_tensor()
            if name not in self._sums:
                self._sums[name] = torch.zeros((), device=self.device)
                self._counts[name] = 0.0
            self._sums[name].add_(value.to(self.device, non_blocking=True).reshape(()), alpha=n)
            self._counts[name] += n

    def data_time(self, seconds: float) -> None:
        """Seconds this step's loop waited for the next batch."""
        self._data_seconds += seconds

    def images(self, n: int, **counts: float) -> None:
        """Images this process consumed in the step (host int: a shape, not a tensor value), and host
        counts over those images (boxes read from shapes, say), reported per image as ``<name>_per_image``."""
        self._images += n
        for name, value in counts.items():
            self._counts_host[name] = self._counts_host.get(name, 0.0) + value

    def step(self) -> None:
        self._steps += 1

    @property
    def interval_steps(self) -> int:
        """Optimizer steps since the last summary."""
        return self._steps

    def summary(self, accelerator=None, steps_left: int = 0) -> dict[str, float]:
        """Means over all processes since the last summary, then reset. One all-reduce, one sync.

        Adds ``images_per_s`` (all processes together), ``data_wait`` (share of wall time this
        process spent waiting for batches, 0..1), ``s_per_step`` and ``eta_s`` (from the last
        interval's speed, for ``steps_left`` more steps).
        """
        distributed = accelerator is not None and accelerator.num_processes > 1
        names, hosts = sorted(self._sums), sorted(self._counts_host)
        if distributed:  # a value only some processes logged still needs one agreed layout
            from accelerate.utils import gather_object

            names = sorted(set(gather_object(names)))
            hosts = sorted(set(gather_object(hosts)))
        now = time.perf_counter()
        paused = self._paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)
        elapsed = max(now - self._started - paused, 1e-9)  # seconds the clock ran: the steps alone
        zero = torch.zeros((), device=self.device)
        packed = torch.stack(
            [self._sums.get(k, zero) for k in names]
            + [torch.tensor(self._counts.get(k, 0.0), device=self.device) for k in names]
            + [torch.tensor(float(self._images), device=self.device)]
            + [torch.tensor(self._counts_host.get(k, 0.0), device=self.device) for k in hosts]
        )
        if distributed:
            packed = accelerator.reduce(packed, reduction="sum")
        flat = packed.tolist()  # the one host-device synchronisation of the interval
        sums, counts = flat[: len(names)], flat[len(names) : 2 * len(names)]
        images, host = flat[2 * len(names)], flat[2 * len(names) + 1 :]
        out = {k: s / max(c, 1e-12) for k, s, c in zip(names, sums, counts)}
        out.update({f"{k}_per_image": v / max(images, 1.0) for k, v in zip(hosts, host)})
        out["images_per_s"] = images / elapsed
        out["data_wait"] = min(self._data_seconds / elapsed, 1.0)
        if self._steps:
            out["s_per_step"] = elapsed / self._steps
            out["eta_s"] = out["s_per_step"] * max(steps_left, 0)
        self.reset()
        return out

    def reset(self) -> None:
        for s in self._sums.values():
            s.zero_()
        self._counts = dict.fromkeys(self._counts, 0.0)
        self._images = 0
        self._counts_host = dict.fromkeys(self._counts_host, 0.0)
        self._data_seconds = 0.0
        self._steps = 0
        self._started = time.perf_counter()
        self._paused_s = 0.0
        if self._paused_at is not None:  # still paused: the pause goes on from here
            self._paused_at = self._started


def format_seconds(seconds: float) -> str:
    """``3725`` -> ``'1:02:05'``."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def prefixed(values: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Prefix every key (``{'loss': 1.0}`` -> ``{'train/loss': 1.0}``) for trackers."""
    return {f"{prefix}/{k}": v for k, v in values.items()}
