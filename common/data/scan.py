"""Unreadable images found before the first step: one scan of every image of a run's splits.

A photo collection or a scraped dataset always holds a few broken files (truncated JPEGs, empty files,
HTML saved as ``.jpg``). Found by the loader, one ends a run hours in; found here, it is listed and
left out before anything is trained (or, with ``--bad_images error``, the run is refused before anything
is written).

- What is checked: :func:`common.data.images.unreadable` (the file opens, its header gives a size, its data
  is complete), for images stored as files and as bytes in a dataset alike.
- In parallel: files are checked by a pool of processes (``workers``); under several training
  processes each checks its own share and the lists are gathered, so no file is read twice.
- Cached: the answer for each file is kept with its size and modification time in
  ``<cache root>/scans/`` (:func:`common.data.builtin.cache.cache_root`), one file per list of paths, so a
  second start re-reads only the files that changed. Images stored as bytes are scanned every time
  (they come from datasets, hub or saved, whose files do not change under a run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import signal
import textwrap
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import UserError
from common.console import counted
from common.data.images import listing, unreadable
from common.loaders import STOP_SIGNALS, leave_stop_signals

#: The checker's version, part of every cache file's name: a change to what is checked starts afresh.
VERSION = "v2"
#: Files checked per task of the process pool.
CHUNK = 256


def _check_files(paths: Sequence[str]) -> list[tuple[int, int, int, str]]:
    """(size, modification and change times in ns, why unreadable or '') of each file: the change time moves
    when a file is replaced by one of the same size with its modification time kept (``cp -p``, ``rsync -a``)."""
    out = []
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError as e:
            out.append((-1, -1, -1, f"{type(e).__name__}: {e.strerror or e}"))
            continue
        out.append((stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, unreadable(path)))
    return out


def _cache_file(paths: Sequence[str]) -> Path:
    from common.data.builtin.cache import cache_root

    digest = hashlib.sha1("\n".join(paths).encode()).hexdigest()[:20]
    return cache_root() / "scans" / f"{VERSION}-{digest}.json"


def _pool_context() -> Any:
    """The checking pool's multiprocessing context: forkserver, as a fork of a process that already runs
    torch's thread pools can hang. The server, and the resource tracker it starts, outlive the pool (until
    the run ends) in the run's process group: started with the stop signals blocked, which they and the
    workers the server forks keep, they never act on one sent to the whole group (``scancel``, Ctrl-C); it is
    the training process's (:class:`common.run.Run`). The workers also ignore them (the pool's initializer),
    in case another part of the program started the server first."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # the server would start the tracker itself; started first, as starting it unblocks SIGINT and SIGTERM
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return multiprocessing.get_context("forkserver")


def scan_files(paths: Sequence[str], workers: int = 0) -> tuple[dict[str, str], bool]:
    """Why each unreadable file of ``paths`` cannot be used (``{path: reason}``), and whether every answer
    came from the cache. ``workers`` > 1: files are checked by that many processes."""
    cache = _cache_file(paths)
    known: dict[str, list] = {}
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    stats = []
    for path in paths:  # a stat per file: what changed since the cached answer is checked again
        try:
            stat = os.stat(path)
            stats.append((stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))
        except OSError:
            stats.append((-1, -1, -1))
    todo = [p for p, s in zip(paths, stats) if p not in known or tuple(known[p][:3]) != s or s[0] < 0]
    if todo:
        chunks = [todo[i : i + CHUNK] for i in range(0, len(todo), CHUNK)]
        if workers > 1 and len(chunks) > 1:
            with ProcessPoolExecutor(workers, mp_context=_pool_context(), initializer=leave_stop_signals) as pool:
                results = [r for chunk in pool.map(_check_files, chunks) for r in chunk]
        else:
            results = [r for chunk in chunks for r in _check_files(chunk)]
        known.update({p: list(r) for p, r in zip(todo, results)})
        try:  # written beside and renamed: a concurrent start reads the old cache or the new one
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({p: known[p] for p in paths}))
            tmp.replace(cache)
        except OSError:
            pass  # a read-only cache: scanned again next time
    return {p: known[p][3] for p in paths if known[p][3]}, not todo


def _rows(table: Any, column: str) -> tuple[list[str | None], list[bool]]:
    """Per row of ``table``'s undecoded image ``column``, as the dataset orders them (a split's index mapping
    included): its path, and whether it holds the image's bytes; read in batches, so that images stored
    inside the dataset are never all in memory."""
    import pyarrow.compute as pc

    paths, inside = [], []
    for batch in table.select_columns([column]).with_format("arrow").iter(batch_size=1000):
        values = batch.column(column)
        paths += pc.struct_field(values, "path").to_pylist()
        inside += pc.invert(pc.is_null(pc.struct_field(values, "bytes"))).to_pylist()
    return paths, inside


def scan_table(
    table: Any, column: str, workers: int = 0, share: tuple[int, int] = (0, 1)
) -> tuple[list[tuple[int, str, str]], bool]:
    """The unreadable images of a ``datasets.Dataset`` whose ``column`` holds undecoded images, as
    ``(row, name, reason)``, and whether the files' answers all came from the cache. ``share``: (this
    process, processes): only the rows ``row % processes == this process`` are checked."""
    paths, has_bytes = _rows(table, column)
    mine = [i for i in range(len(paths)) if i % share[1] == share[0]]
    files = [i for i in mine if not has_bytes[i] and paths[i]]
    bad, cached = scan_files([paths[i] for i in files], workers) if files else ({}, True)
    found = [(i, paths[i], bad[paths[i]]) for i in files if paths[i] in bad]
    found += [(i, f"row {i}", "no image") for i in mine if not has_bytes[i] and not paths[i]]
    inside = [i for i in mine if has_bytes[i]]
    # images inside the dataset: cached by the dataset's fingerprint where its table is on disk (a hub or
    # saved dataset, whose fingerprint names its files), else read again
    cache = None
    if inside and getattr(table, "cache_files", None):
        from common.data.builtin.cache import cache_root

        name = f"{VERSION}-table-{table._fingerprint}-{column}-{share[0]}of{share[1]}.json"
        cache = cache_root() / "scans" / name
    if cache is not None and cache.is_file():
        try:
            return sorted(found + [tuple(r) for r in json.loads(cache.read_text())]), cached
        except ValueError:
            pass
    inner = []
    for i in inside:  # read from the arrow table one at a time
        value = table[i][column]
        why = unreadable(io.BytesIO(value["bytes"]))
        if why:
            inner.append((i, value.get("path") or f"row {i}", why))
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(inner))
        except OSError:
            pass
    return sorted(found + inner), cached and not inside


def bad_images_policy(
    found: dict[str, list[tuple[int, str, str]]], sizes: dict[str, int], policy: str, boxes: dict[str, int]
) -> str:
    """What to do about the unreadable images ``found`` per split (of ``sizes`` images, ``boxes`` of them on
    the unreadable ones): '' when there are none; with ``policy`` ``skip`` the warning line; with ``error``,
    or when a split has none left, one :class:`UserError` naming them."""
    parts = []
    for split, bad in found.items():
        if len(bad) == sizes[split]:
            raise UserError(f"none of the {sizes[split]} {split} images can be read: {listing(bad)}")
        if bad:
            lost = f" (with {counted(boxes[split], 'box', 'boxes')})" if boxes.get(split) else ""
            skipped = " and are skipped" if policy == "skip" else ""
            parts.append(f"{len(bad)} of {sizes[split]} {split} images{lost} cannot be read{skipped}: {listing(bad)}")
    if parts and policy == "error":
        raise UserError("; ".join(parts) + " (--bad_images error; skip leaves them out)")
    return "; ".join(parts)


@dataclasses.dataclass
class Scanned:
    """What :func:`without_unreadable` gives back: ``data`` without its unreadable images, the ``notes`` for
    under the start banner (:meth:`common.run.Run.note`) and the ``files`` for the run folder (``{name:
    text}``, :attr:`common.run.Run.files`: ``bad_images.txt`` where some were left out)."""

    data: Any
    notes: list[str]
    files: dict[str, str]

    def into(self, run: Any) -> Any:
        """Hand the notes and files to ``run`` (:class:`common.run.Run`, not begun) and return the data."""
        run.note(*self.notes)
        run.files.update(self.files)
        return self.data


def without_unreadable(
    data: Any,
    column: str,
    accelerator: Any,
    policy: str,
    workers: int,
    batch: int,
    folder: Path,
    train: bool = True,
) -> Scanned:
    """``data`` (a :class:`common.data.classification.ClassificationData` or
    :class:`common.detection.data.DetectionData`) with its unreadable images left out of ``train`` (when
    ``train``) and ``eval``. ``policy``: ``--bad_images`` (``skip`` or ``error``, :func:`bad_images_policy`);
    ``workers``: the processes that check files; ``batch``: the per-process batch size; ``accelerator``:
    every process scans its share and all take the gathered list; ``folder``: the run folder that
    ``bad_images.txt`` is listed in (it is written when the folder is made). Fewer readable training images
    than one global batch is one :class:`UserError` naming the unreadable ones. Returns the data, a line
    saying what was checked (and a warning naming what was skipped: a detection image takes its boxes with
    it), and ``bad_images.txt`` when there is one."""
    from accelerate.utils import gather_object

    splits = {"training": data.train if train else None, "evaluation": data.eval}
    splits = {k: v for k, v in splits.items() if v is not None}
    found, cached, boxes = {}, True, {}
    for split, table in splits.items():
        mine, from_cache = scan_table(table, column, workers, (accelerator.process_index, accelerator.num_processes))
        cached &= from_cache
        found[split] = sorted(gather_object(mine)) if accelerator.num_processes > 1 else mine
        if hasattr(data, "with_unusable"):  # and images whose annotation cannot be used (common/detection/data.py)
            found[split] = data.with_unusable(table, found[split])
        if "objects" in table.column_names:
            boxes[split] = sum(len(table[i]["objects"]["bbox"]) for i, _, _ in found[split])
    sizes = {k: len(v) for k, v in splits.items()}
    line = bad_images_policy(found, sizes, policy, boxes)
    bad = sum(len(v) for v in found.values())
    state = f"{bad} unreadable, left out (below)" if bad and policy == "skip" else "all readable"
    notes = [f"  images    {sum(sizes.values()):,} checked{' (answers from the cache)' if cached else ''}, {state}"]
    if not line:
        return Scanned(data, notes, {})
    left = sizes.get("training", 0) - len(found.get("training", []))
    if train and left < batch * accelerator.num_processes:
        raise UserError(
            f"{left} training images are left once the unreadable ones are out ({listing(found['training'])}), "
            f"fewer than one global batch ({batch} x {accelerator.num_processes} processes)"
        )
    listed = "".join(f"{split}\t{name}\t{why}\n" for split, bad in found.items() for _, name, why in bad)
    files = {"bad_images.txt": "split\tfile\treason\n" + listed}
    warning = f"warning: {line}; all listed in {folder / 'bad_images.txt'}"
    notes.append(textwrap.fill(warning, 120, subsequent_indent="    ", break_long_words=False))
    kept = {}
    for split, table in splits.items():
        dropped = {i for i, _, _ in found[split]}
        kept[split] = table.select([i for i in range(len(table)) if i not in dropped]) if dropped else table
    data = dataclasses.replace(data, train=kept.get("training", data.train), eval=kept.get("evaluation", data.eval))
    return Scanned(data, notes, files)
