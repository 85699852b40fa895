"""Reproducible loading: per-sample seeds, the epoch batch sampler and the DataLoaders every recipe uses.

The training order is a function of ``(seed, epoch)`` only, and every sample's augmentation randomness
is seeded from ``(seed, epoch, index)`` (and the repeat, with repeated augmentation). A batch is
therefore the same whatever the number of workers or processes, and a run resumed mid-epoch sees
exactly the batches, crops and flips the uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from common import UserError


def sample_seed(seed: int, epoch: int, index: int, repeat: int = 0) -> int:
    """A 63-bit seed unique to (run seed, epoch, sample index, repeat); index -1 seeds the epoch's order.
    Repeat 0 (no repeated augmentation) gives the seed of (seed, epoch, index) alone."""
    high, low = np.random.SeedSequence([seed, epoch, index + 1] + ([repeat] if repeat else [])).generate_state(2)
    return (int(high) >> 1) << 32 | int(low)


#: How many replacements a sample whose image became unreadable tries before the run stops.
REPLACEMENT_TRIES = 10
_told: set[str] = set()  # the unreadable files this process has named


def shared_count() -> Any:
    """An integer that the DataLoader workers forked from this process add to and this process reads
    (``.value``); a dataset holding one drops it when pickled (:func:`replacement` then counts nothing)."""
    import multiprocessing

    return multiprocessing.Value("q", 0)


def replacement(seed: int, epoch: int, index: int, size: int, attempt: int, error: Exception, count: Any = None) -> int:
    """The index of the sample that stands in for ``index``, whose image became unreadable after the
    start's scan (deleted or rewritten during the run; ``error`` says so): drawn from (seed, epoch, index,
    attempt), so a resumed run draws the same. The file is named once per process on stderr and counted in
    ``count`` (:func:`shared_count`); after :data:`REPLACEMENT_TRIES` unreadable draws the error ends the run."""
    if attempt >= REPLACEMENT_TRIES:
        raise error
    if count is not None:
        with count.get_lock():
            count.value += 1
    if str(error) not in _told:
        _told.add(str(error))
        print(f"warning: {error}; another image, drawn from the seed, takes its place", file=sys.stderr, flush=True)
    return int(np.random.default_rng(sample_seed(seed, epoch, index, 1 + attempt)).integers(size))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch, numpy and random for one sample's augmentations.

    In a worker process the global generators belong to that sample alone. In the main process
    (``num_workers=0``) their state is restored afterwards so the training loop's own random
    stream (dropout, mixup) does not depend on how the data was loaded.
    """
    in_main = torch.utils.data.get_worker_info() is None
    saved = (random.getstate(), np.random.get_state()) if in_main else None
    with torch.random.fork_rng(devices=[], enabled=in_main):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        yield
    if saved is not None:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------
class KeyedDataset(torch.utils.data.Dataset):
    """The one contract a training dataset meets here: ``dataset[(epoch, index)]`` (or ``(epoch, index,
    repeat)``, with repeated augmentation) is sample ``index`` augmented from its own seed,
    :func:`sample_seed` of (run seed, epoch, index, repeat); ``dataset[index]`` is epoch 0 (evaluation).
    What :class:`EpochBatchSampler` yields. The image datasets of ``common/`` and the recipes derive from it;
    :func:`train_loader_for` wraps any other map-style dataset (a torchvision dataset) in :class:`PerSample`."""


class PerSample(KeyedDataset):
    """A map-style dataset indexed by integers (``torchvision.datasets.ImageFolder``, ``CIFAR10`` with its
    ``transform``) as a :class:`KeyedDataset`: torch, numpy and ``random`` are seeded from the sample's key
    around ``dataset[index]``, so its transforms draw the same crops and flips whatever the workers,
    processes or resume."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, ...]) -> Any:
        epoch, index, repeat = (tuple(key) + (0,))[:3] if isinstance(key, tuple) else (0, key, 0)
        with seeded(sample_seed(self.seed, epoch, index, repeat)):
            return self.dataset[index]


class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of ``(epoch, index)`` pairs; the order depends only on ``(seed, epoch)``.

    ``batch_size`` is per process: Accelerate hands process ``r`` of ``W`` the batches
    ``r, r + W, ...``, so one optimizer step of W processes covers the same samples as one
    step of a single process with batch ``W * batch_size``. With ``drop_last`` the epoch ends
    at the last complete round of ``W`` batches, which is again what the single process does.

    ``repeats`` > 1 is repeated augmentation (DeiT's RASampler, timm's RepeatAugSampler): the shuffled
    order with every index ``repeats`` times in a row is dealt to the processes in turn, so the copies
    of an image go to different processes (all into one batch with one process); the epoch keeps its
    length, so it sees about ``size / repeats`` distinct images. Items are then ``(epoch, index,
    repeat)``, each repeat augmented with its own seed.
    """

    def __init__(
        self,
        size: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_processes: int = 1,
        repeats: int = 1,
    ) -> None:
        if repeats < 1:
            raise UserError(f"aug_repeats must be at least 1, got {repeats}")
        self.repeats = repeats
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.drop_last, self.num_processes = drop_last, num_processes
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _check(self) -> None:
        """Checked when the loader is first measured (a recipe counts its steps before it writes anything),
        not when it is made: ``--eval_only`` makes one and never trains."""
        if self.drop_last and self.size < self.batch_size * self.num_processes:
            raise UserError(
                f"the training split has {self.size} images, fewer than one global batch "
                f"({self.batch_size} x {self.num_processes} processes); lower --batch_size"
            )

    def __len__(self) -> int:
        self._check()
        if self.drop_last:
            return self.size // (self.batch_size * self.num_processes) * self.num_processes
        return -(-self.size // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        self._check()
        if self.shuffle:
            order = torch.randperm(
                self.size, generator=torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1))
            )
        else:
            order = torch.arange(self.size)
        order = order.tolist()
        if self.repeats == 1:
            for b in range(len(self)):
                yield [(self.epoch, i) for i in order[b * self.batch_size : (b + 1) * self.batch_size]]
            return
        copies = [(self.epoch, i, r) for i in order for r in range(self.repeats)]
        streams = [copies[p :: self.num_processes] for p in range(self.num_processes)]  # process p's items
        for b in range(len(self)):  # global batch b is process b % W's (b // W)-th batch
            stream, j = streams[b % self.num_processes], b // self.num_processes
            yield stream[j * self.batch_size : (j + 1) * self.batch_size]


#: The most loader workers ``num_workers -1`` gives a process: beyond it start-up grows and throughput does not.
MAX_AUTO_WORKERS = 8


def auto_workers(requested: int, local_processes: int | None = None) -> int:
    """``num_workers``: ``requested`` when >= 0; for -1, the cores this process may run on
    (``os.sched_getaffinity``) shared by the training processes on this machine (``LOCAL_WORLD_SIZE``, set
    by torchrun and accelerate launch), at most :data:`MAX_AUTO_WORKERS`, as timm and DINO size theirs."""
    if requested >= 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(min(cores // max(local, 1), MAX_AUTO_WORKERS), 0)


#: The signals that stop a run: :class:`common.run.Run` handles them in each training process (finish the
#: step, save a checkpoint, exit 0). Slurm sends SIGUSR1 as its pre-emption warning (``--signal=USR1@90``).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def leave_stop_signals() -> None:
    """Ignore :data:`STOP_SIGNALS` in this process: what a worker process of a training process (DataLoader
    workers, the start-up scan's pool) does first. A signal sent to the whole process group (``scancel``,
    ``timeout``, Ctrl-C, torchrun's forwarding) then reaches them harmlessly; the training process stops them
    once its checkpoint is saved. Without it torch's worker loop installs a C handler that ends a worker on
    SIGTERM (its parent then fails with "DataLoader worker is killed by signal: Terminated"), and SIGUSR1's
    default action ends it too."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class LeavingStopSignals:
    """A DataLoader ``worker_init_fn``: :func:`leave_stop_signals`, then ``then(worker_id)`` where given. It
    runs after torch's worker loop has set its own signal handlers, so it replaces its SIGTERM one; a class
    (not a closure) so that spawn and forkserver workers can unpickle it."""

    def __init__(self, then: Callable[[int], Any] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        leave_stop_signals()
        if self.then is not None:
            self.then(worker_id)


def shutdown_workers(loader: Any) -> None:
    """End the worker processes of ``loader``'s persistent iterator now (a no-op without one): what torch does
    when the iterator is garbage-collected, done where the run knows the loader is finished with. torch keeps
    the iterator in the loader's private ``_iterator`` and offers no public call; its ``_shutdown_workers``
    asks the workers to exit, joins them and takes their pids out of torch's SIGCHLD bookkeeping, so that
    their exit is never reported as a failed worker."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    if hasattr(iterator, "_shutdown_workers"):  # a single-process iterator has none
        iterator._shutdown_workers()
    loader._iterator = None


def _end_workers_at_exit() -> None:
    """At the exit of a process that made loaders with workers: every multi-process iterator still alive (a
    persistent loader no one shut down, an evaluation a stop cut short) is shut down the way torch does it, then
    any daemonic child still alive is killed. The order matters twice. torch's SIGCHLD handler raises
    ``DataLoader worker (pid N) is killed by signal`` in whatever runs next (a later exit function) for a
    worker whose pid it still holds; ``_shutdown_workers`` removes the pids first. And multiprocessing's own
    exit handler ends daemonic children with SIGTERM, which the workers ignore (:func:`leave_stop_signals`),
    and then waits for them forever; this handler is registered after it, so it runs before it."""
    import gc
    import multiprocessing

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    for obj in gc.get_objects():
        if type(obj) is _MultiProcessingDataLoaderIter:  # type(): isinstance would wake lazy module attributes
            with contextlib.suppress(Exception):  # a half-made iterator: its workers are killed below
                obj._shutdown_workers()
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=1)


_exit_registered = False


def loader_kwargs(
    num_workers: int, persistent: bool = True, worker_init_fn: Callable[[int], Any] | None = None
) -> dict[str, Any]:
    """DataLoader settings of the performance contract: workers, pinned memory, persistent workers
    (``persistent``: the training loader; an evaluation loader's workers end with each pass, so a
    loader not in use holds no processes or memory), and a private generator so creating an
    iterator never draws from the global torch RNG. The workers leave the stop signals to the training
    process (:class:`LeavingStopSignals`, which runs ``worker_init_fn`` after)."""
    kwargs: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available(),
        "generator": torch.Generator(),
        "worker_init_fn": LeavingStopSignals(worker_init_fn),
    }
    if num_workers > 0:
        kwargs.update(persistent_workers=persistent, prefetch_factor=4)
        global _exit_registered
        if not _exit_registered:
            import atexit
            import multiprocessing.util  # noqa: F401  # its exit handler registered first, so ours runs before it

            atexit.register(_end_workers_at_exit)
            _exit_registered = True
    return kwargs


def train_loader_for(
    dataset: torch.utils.data.Dataset,
    batch_size: int,
    seed: int,
    num_workers: int,
    num_processes: int,
    collate_fn: Callable | None = None,
    repeats: int = 1,
    worker_init_fn: Callable[[int], Any] | None = None,
):
    """A shuffling, drop-last training DataLoader over an :class:`EpochBatchSampler` (its
    ``batch_sampler``) of ``dataset``: a :class:`KeyedDataset`, or any map-style dataset (:class:`PerSample`).
    Once prepared by Accelerate, call the loader's ``set_epoch`` before each epoch (:class:`common.loop.Loop`
    does): Accelerate re-applies its own epoch counter when iteration starts. ``worker_init_fn`` runs in each
    worker after it has set the stop signals aside (:func:`loader_kwargs`)."""
    if not isinstance(dataset, KeyedDataset):  # a plain dataset: its transforms seeded per sample here
        dataset = PerSample(dataset, seed)
    sampler = EpochBatchSampler(len(dataset), batch_size, True, seed, True, num_processes, repeats)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate_fn, **loader_kwargs(num_workers, True, worker_init_fn)
    )


def eval_loader_for(
    dataset: torch.utils.data.Dataset,
    batch_size: int,
    num_workers: int,
    collate_fn: Callable | None = None,
    worker_init_fn: Callable[[int], Any] | None = None,
):
    """A sequential evaluation DataLoader, its workers started for each pass only; Accelerate pads the last
    round, ``gather_for_metrics`` un-pads. ``worker_init_fn`` as for :func:`train_loader_for`."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        collate_fn=collate_fn,
        **loader_kwargs(num_workers, persistent=False, worker_init_fn=worker_init_fn),
    )
