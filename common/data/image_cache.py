"""Decoded images kept for a whole run (``--cache_images ram|disk``), as Ultralytics' ``cache=ram|disk``:
for a small dataset trained for many epochs, each image is decoded once (reduced to the size its
transforms need, :func:`common.data.images.decode_sized`) instead of once per epoch.

- ``ram``: one ``uint8`` array per image, filled in the training process before its loader workers
  start; the workers inherit them (fork, copy-on-write), so they are held once per training process.
- ``disk``: one ``.npy`` per image under ``<cache root>/images/<version>-<dataset fingerprint>-<column>-<side>/``,
  written once and memory-mapped afterwards; a later run on the same dataset reuses them.

The memory (or disk space) it takes is estimated from the images' headers before anything is decoded, and
a cache that would not fit is refused in one line. The transforms see the same pictures as without the
cache: an image is stored at the size the reduced decoding gives, turned upright (EXIF orientation).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common import UserError
from common.data.images import decode_sized, open_reduced, upright_size

#: Part of every disk cache folder's name: a change to how images are decoded (reduction, EXIF
#: orientation) starts a new cache rather than reading pictures decoded another way.
VERSION = "v2"


def _stored_size(value: dict[str, Any], shorter: int) -> tuple[int, int]:
    """The (width, height) an image is kept at: what :func:`decode_sized` gives (reduced, turned upright),
    from its header alone; (0, 0) for a file that cannot be opened (a large split's unreadable images stay in
    it until its background check ends: :mod:`common.data.scan`)."""
    try:
        image, _ = open_reduced(value, shorter)
    except Exception:  # PIL raises many kinds for a broken file; get() raises the decoder's own error for it
        return 0, 0
    with image:
        return upright_size(image)


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``; elsewhere a large number)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


class ImageCache:
    """The decoded images of ``table``'s ``column`` at ``shorter`` (see the module docstring), in RAM, or as
    ``.npy`` files in ``folder`` where one is given; ``get(i)`` gives row ``i``'s RGB image and the file's
    own (width, height)."""

    def __init__(self, table: Any, column: str, shorter: int, folder: Path | None = None) -> None:
        self.table, self.column, self.shorter, self.folder = table, column, shorter, folder
        self.images: list[np.ndarray | None] = [None] * len(table)
        self.sizes: list[tuple[int, int]] = [(0, 0)] * len(table)
        self.errors: dict[int, UserError] = {}  # rows that cannot be decoded: get() raises, the dataset replaces

    def estimate(self) -> int:
        """Bytes the cache will hold, from the images' headers."""
        values = self.table.select_columns([self.column])
        return sum(3 * w * h for w, h in (_stored_size(row[self.column], self.shorter) for row in values))

    def _one(self, index: int) -> tuple[np.ndarray, tuple[int, int]]:
        value = self.table[index][self.column]
        file = self.folder / f"{index}.npy" if self.folder is not None else None
        if file is not None and file.is_file():
            array = np.load(file, mmap_mode="r")
            image, size = open_reduced(value)  # the header only: the file's own size, as displayed
            image.close()
            return array, size
        image, size = decode_sized(value, f"row {index}", self.shorter)
        array = np.asarray(image)
        if file is not None:
            tmp = file.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, array)
            tmp.replace(file)
            array = np.load(file, mmap_mode="r")
        return array, size

    def _kept(self, index: int) -> tuple[np.ndarray, tuple[int, int]] | UserError:
        try:
            return self._one(index)
        except UserError as e:
            return e

    def fill(self, workers: int = 1) -> None:
        """Decode every image (``workers`` threads: the decoders release the GIL); one that cannot be decoded is
        kept as its error."""
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for i, kept in enumerate(pool.map(self._kept, range(len(self.table)))):
                if isinstance(kept, UserError):
                    self.errors[i] = kept
                else:
                    self.images[i], self.sizes[i] = kept

    def get(self, index: int) -> tuple[Image.Image, tuple[int, int]]:
        """Row ``index``'s RGB image and the file's own (width, height); the decoder's :class:`UserError` for a
        row that could not be decoded (the dataset then draws its replacement, as without the cache)."""
        if index in self.errors:
            raise self.errors[index]
        return Image.fromarray(np.asarray(self.images[index])), self.sizes[index]


def image_caches(where: str, workers: int, *tables: tuple[Any, str, int]) -> tuple[list[ImageCache | None], str]:
    """With ``where`` (``--cache_images``: ``ram`` or ``disk``; '' none), an :class:`ImageCache` for each of
    ``tables``, filled now (``workers`` threads), and the line for under the start banner; without,
    ``None`` for each and ''. Each of ``tables`` is what a cache needs: ``(table, column, shorter)``, a
    ``datasets.Dataset``, its undecoded image column and the shorter side its images are decoded at (the
    ``ds``, ``image_column`` and ``shorter`` the dataset is then built with: ``cache=``, as
    :class:`common.data.classification.ImageRows` takes it). All are estimated first: more than 80 % of the
    available memory (``ram``, times the training processes on this machine) or of the cache folder's free
    disk (``disk``) is one :class:`UserError`, before any is filled."""
    if not where:
        return [None] * len(tables), ""
    from common.data.builtin.cache import cache_root

    caches = []
    for table, column, shorter in tables:
        folder = None
        if where == "disk":  # the table's fingerprint (datasets') names its rows: a later run finds them
            folder = cache_root() / "images" / f"{VERSION}-{table._fingerprint}-{column}-{shorter}"
        caches.append(ImageCache(table, column, shorter, folder))
    need = sum(c.estimate() for c in caches)
    if where == "ram":
        need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # every training process on this machine holds one
        have, of = available_memory(), "available memory"
    else:
        root = cache_root()
        root.mkdir(parents=True, exist_ok=True)
        have, of = shutil.disk_usage(root).free, f"free disk under {root}"
    if need > 0.8 * have:
        raise UserError(
            f"cache_images {where} needs {need / 2**30:.1f} GiB for {sum(len(c.table) for c in caches):,} images; "
            f"{have / 2**30:.1f} GiB of {of}: use {'disk' if where == 'ram' else 'ram'} or leave it off"
        )
    for cache in caches:
        cache.fill(workers)
    line = f"  cache     {sum(len(c.table) for c in caches):,} images decoded once, {need / 2**20:,.0f} MiB in {where}"
    return list(caches), line
