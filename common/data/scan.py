"""Unreadable images: one check of every image of a run's splits, before or while the run starts.

A photo collection or a scraped dataset always holds a few broken files (truncated JPEGs, empty files,
HTML saved as ``.jpg``). Found by the loader, one would end a run hours in; found here, it is named, listed
in ``bad_images.txt`` and never trained on.

- What is checked: :func:`common.data.images.unreadable` (the file opens, its header gives a size, its data
  is complete), for images stored as files and as bytes in a dataset alike.
- When: with ``--bad_images error`` every split, and otherwise the evaluation split and a training split of at
  most :data:`BACKGROUND_ROWS` images, is checked before the run starts: its unreadable images are left out (or
  the run is refused before anything is written); an evaluation never scores one image under another's id. A
  larger training split is checked in the background while the run starts, so that the first
  step does not wait for thousands of files: its rows all stay, so which samples a step sees never depends
  on when the check ended (a resumed run sees the very batches of the uninterrupted one), and an unreadable
  image is replaced, when a loader reaches it, by another drawn from the seed (:func:`common.loaders.replacement`,
  as for a file that breaks during the run); when the check ends, one warning line names them and
  ``bad_images.txt`` lists them.
- Where: in child Python processes (:mod:`common.data.check_processes`) that start in the time Python and
  PIL take; several share the files of a check that the start waits for, one at a lower priority runs a
  background check. Under several training processes each checks its own share of a split checked before
  the start and the lists are gathered; a background check runs on the main process alone (a collective in a
  thread beside the training's own would deadlock).
- Cached: the answer for each file is kept with its size and modification time in
  ``<cache root>/scans/`` (:func:`common.data.builtin.cache.cache_root`), one file per list of paths, so a
  second start re-reads only the files that changed. Images stored as bytes are cached by the dataset's
  fingerprint where its table is on disk, else read again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Only the package's UserError and PIL's checker at the top: the checking processes import this module
# without the rest of the package (see _CHILD).
from common import UserError
from common.data.check_processes import (
    BACKGROUND_NICE,
    check_files,
    check_in_parallel,
    child_answer,
    exiting,
    run_child,
)
from common.data.images import listing, unreadable

#: The checker's version, part of every cache file's name: a change to what is checked starts afresh.
VERSION = "v2"
#: Rows of a training split above which ``--bad_images skip`` checks it in the background (the module docstring).
#: A split this size is checked in a fraction of a second before the start.
BACKGROUND_ROWS = 2_000


def _cache_file(paths: Sequence[str]) -> Path:
    from common.data.builtin.cache import cache_root

    digest = hashlib.sha1("\n".join(paths).encode()).hexdigest()[:20]
    return cache_root() / "scans" / f"{VERSION}-{digest}.json"


def child_main(mode: str, nice: int, cache: str) -> None:
    """The checking process's work: on stdin a JSON list of paths; on stdout the JSON of :func:`check_files`
    of them (``mode`` ``check``) or of :func:`scan_files` of them (``scan``: with the cache file ``cache``).
    ``nice``: the niceness it adds to its own."""
    if nice:
        os.nice(nice)
    paths = json.load(sys.stdin)
    json.dump(check_files(paths) if mode == "check" else scan_files(paths, cache=Path(cache)), sys.stdout)


def _cached(paths: Sequence[str], cache: Path) -> tuple[dict[str, list], list[str]]:
    """The cache file's answers (``{path: [size, mtime_ns, ctime_ns, reason]}``) and the paths to check again:
    not in it, or changed since (a stat per file, no image read)."""
    known: dict[str, list] = {}
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    todo = []
    for path in paths:
        try:
            stat = os.stat(path)
            now = (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        except OSError:
            now = None
        if now is None or path not in known or tuple(known[path][:3]) != now:
            todo.append(path)
    return known, todo


def scan_files(paths: Sequence[str], workers: int = 0, cache: Path | None = None) -> tuple[dict[str, str], bool]:
    """Why each unreadable file of ``paths`` cannot be used (``{path: reason}``), and whether every answer
    came from the cache. ``workers`` > 1: files are checked by that many processes (:func:`run_child`).
    ``cache``: the cache file of ``paths`` (:func:`_cache_file`), where the caller knows it."""
    cache = cache or _cache_file(paths)
    known, todo = _cached(paths, cache)
    if todo:
        results = check_in_parallel(todo, workers)
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
    table: Any, column: str, workers: int = 0, share: tuple[int, int] = (0, 1), nice: int = 0
) -> tuple[list[tuple[int, str, str]], bool]:
    """The unreadable images of a ``datasets.Dataset`` whose ``column`` holds undecoded images, as
    ``(row, name, reason)``, and whether the files' answers all came from the cache. ``share``: (this
    process, processes): only the rows ``row % processes == this process`` are checked. ``nice`` > 0: the
    files are checked in one checking process of that added niceness (a background check), else as
    :func:`scan_files` checks them."""
    paths, has_bytes = _rows(table, column)
    mine = [i for i in range(len(paths)) if i % share[1] == share[0]]
    files = [i for i in mine if not has_bytes[i] and paths[i]]
    bad, cached = {}, True
    if files and nice > 0:
        some = [paths[i] for i in files]
        known, todo = _cached(some, cache_file := _cache_file(some))
        if todo:  # a checking process only where some image must be read
            bad, cached = child_answer(run_child("scan", some, nice, str(cache_file)))
        else:
            bad = {p: known[p][3] for p in some if known[p][3]}
    elif files:
        bad, cached = scan_files([paths[i] for i in files], workers)
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
    or when a split has none left, one :class:`UserError` naming them. ``replace``: the line a background
    check ends with (the loaders replace those images; a split with none readable is said, not raised)."""
    from common.console import counted

    parts = []
    for split, bad in found.items():
        if len(bad) == sizes[split] and policy != "replace":
            raise UserError(f"none of the {sizes[split]} {split} images can be read: {listing(bad)}")
        if bad:
            lost = f" (with {counted(boxes[split], 'box', 'boxes')})" if boxes.get(split) else ""
            done = {"skip": " and are skipped", "replace": " and are replaced by others drawn from the seed"}
            skipped = done.get(policy, "")
            parts.append(f"{len(bad)} of {sizes[split]} {split} images{lost} cannot be read{skipped}: {listing(bad)}")
    if parts and policy == "error":
        raise UserError("; ".join(parts) + " (--bad_images error; skip leaves them out)")
    return "; ".join(parts)


class _Background:
    """The check of the splits ``tables`` (``{split: table}``) running in a thread while the run starts (see
    the module docstring); what it finds is reported through ``report(found, boxes)`` once it ends."""

    def __init__(self, tables: dict[str, Any], column: str, report: Any) -> None:
        self.tables, self.column, self.report = tables, column, report
        self.found: dict[str, list[tuple[int, str, str]]] | None = None
        self.thread = threading.Thread(target=self._check, name="image check", daemon=True)
        self.thread.start()

    def _check(self) -> None:
        try:
            found, boxes = {}, {}
            for split, table in self.tables.items():
                found[split], _ = scan_table(table, self.column, nice=BACKGROUND_NICE)
                if "objects" in table.column_names:
                    boxes[split] = sum(len(table[i]["objects"]["bbox"]) for i, _, _ in found[split])
            self.found = found
            self.report(found, boxes)
        except Exception as e:  # the run goes on: the loaders replace what they cannot read
            if not exiting.is_set():
                print(f"warning: the background check of the images stopped ({type(e).__name__}: {e})", flush=True)


@dataclasses.dataclass
class Scanned:
    """What :func:`without_unreadable` gives back: ``data`` without its unreadable images, the ``notes`` for
    under the start banner (:meth:`common.run.Run.note`) and the ``files`` for the run folder (``{name:
    text}``, :attr:`common.run.Run.files`: ``bad_images.txt`` where some were left out). Where a split is
    checked in the background, what it finds is reported to the run :meth:`into` names: one warning line and
    ``bad_images.txt`` (rewritten with every unreadable image of the run), whenever the check ends."""

    data: Any
    notes: list[str]
    files: dict[str, str]
    folder: Path | None = None
    found: dict[str, list[tuple[int, str, str]]] = dataclasses.field(default_factory=dict)
    background: _Background | None = None
    _run: Any = None
    _pending: list[str] | None = None  # the background check's warning, when it ended before into()
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def into(self, run: Any) -> Any:
        """Hand the notes and files to ``run`` (:class:`common.run.Run`, not begun) and return the data."""
        run.note(*self.notes)
        with self._lock:
            run.files.update(self.files)
            self._run, pending, self._pending = run, self._pending, None
        if pending:
            self._deliver(pending)
        return self.data

    def wait(self, timeout: float | None = None) -> dict[str, list[tuple[int, str, str]]]:
        """Every unreadable image found, ``{split: [(row, name, reason), ...]}``, after the background check
        (if any) ended or ``timeout`` seconds passed."""
        if self.background is not None:
            self.background.thread.join(timeout)
            if self.background.found is not None:
                return {**self.found, **self.background.found}
        return dict(self.found)

    def _reported(self, found: dict[str, list[tuple[int, str, str]]], boxes: dict[str, int]) -> None:
        """The background check ended: the warning line and the whole ``bad_images.txt``."""
        sizes = {split: len(self.background.tables[split]) for split in found}
        line = bad_images_policy(found, sizes, "replace", boxes)
        if not line:
            return
        order = [split for split in ("training", "evaluation") if split in self.found or split in found]
        everything = {split: sorted(self.found.get(split, []) + found.get(split, [])) for split in order}
        text = _listing(everything)
        where = self.folder / "bad_images.txt" if self.folder is not None else "bad_images.txt"
        warning = textwrap.fill(f"warning: {line}; all listed in {where}", 120, subsequent_indent="    ")
        with self._lock:
            self.files["bad_images.txt"] = text
            if self._run is None:
                self._pending = [warning]
                return
        self._deliver([warning])

    def _deliver(self, lines: list[str]) -> None:
        run, text = self._run, self.files["bad_images.txt"]
        run.files["bad_images.txt"] = text
        if getattr(run, "begun", False):  # the run folder exists, or is being made (Run.begin)
            run.dir.mkdir(parents=True, exist_ok=True)
            (run.dir / "bad_images.txt").write_text(text)
        for line in lines:
            run.print(line)


def _listing(found: dict[str, list[tuple[int, str, str]]]) -> str:
    """``bad_images.txt``: a header and one ``split, file, reason`` line per unreadable image."""
    listed = "".join(f"{split}\t{name}\t{why}\n" for split, bad in found.items() for _, name, why in bad)
    return "split\tfile\treason\n" + listed


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
    :class:`common.detection.data.DetectionData`) with the unreadable images of ``train`` (when ``train``) and
    ``eval`` dealt with as the module docstring says: a split checked before the start without them, a larger
    one checked in the background with all its rows. ``policy``: ``--bad_images`` (``skip`` or ``error``,
    :func:`bad_images_policy`; ``error`` checks every split before the start); ``workers``: the processes that
    check files; ``batch``: the per-process batch size; ``accelerator``: every process checks its share of a
    split checked before the start and all take the gathered list; ``folder``: the run folder that
    ``bad_images.txt`` is listed in (it is written when the folder is made, or when a background check ends).
    Fewer readable training images than one global batch is one :class:`UserError` naming the unreadable
    ones. Rows whose annotation cannot be used (a detection set's) are left out before the start in every
    case: no file is read to know them. Returns the data, the lines for under the banner (what was checked,
    what is being checked, a warning naming what was skipped: a detection image takes its boxes with it),
    and ``bad_images.txt`` when there is one."""
    from accelerate.utils import gather_object

    splits = {"training": data.train if train else None, "evaluation": data.eval}
    splits = {k: v for k, v in splits.items() if v is not None}
    # only the training split in the background: an evaluation image replaced by another would be scored as it
    later = {k: v for k, v in splits.items() if policy == "skip" and k == "training" and len(v) > BACKGROUND_ROWS}
    found, cached, boxes = {}, True, {}
    for split, table in splits.items():
        if split in later:  # only the annotations now; the files in the background
            found[split] = data.with_unusable(table, []) if hasattr(data, "with_unusable") else []
        else:
            share = (accelerator.process_index, accelerator.num_processes)
            mine, from_cache = scan_table(table, column, workers, share)
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
    now = sum(n for k, n in sizes.items() if k not in later)
    notes = [f"  images    {now:,} checked{' (answers from the cache)' if cached else ''}, {state}"] if now else []
    if later:
        checking = sum(sizes[k] for k in later)
        notes.append(
            f"  images    {checking:,} {' and '.join(later)} images being checked while the run starts: an unreadable "
            "one is replaced by another drawn from the seed, and named when the check ends"
        )
    files = {"bad_images.txt": _listing(found)} if line else {}
    left = sizes.get("training", 0) - len(found.get("training", []))
    if line and train and left < batch * accelerator.num_processes:
        raise UserError(
            f"{left} training images are left once the unreadable ones are out ({listing(found['training'])}), "
            f"fewer than one global batch ({batch} x {accelerator.num_processes} processes)"
        )
    if line:
        warning = f"warning: {line}; all listed in {folder / 'bad_images.txt'}"
        notes.append(textwrap.fill(warning, 120, subsequent_indent="    ", break_long_words=False))
    kept = {}
    for split, table in splits.items():
        dropped = {i for i, _, _ in found[split]}
        kept[split] = table.select([i for i in range(len(table)) if i not in dropped]) if dropped else table
    if line:
        data = dataclasses.replace(data, train=kept.get("training", data.train), eval=kept.get("evaluation", data.eval))
    scanned = Scanned(data, notes, files, folder, {k: v for k, v in found.items() if v})
    if later and accelerator.process_index == 0:  # the main process
        scanned.background = _Background({k: kept[k] for k in later}, column, scanned._reported)
    return scanned
