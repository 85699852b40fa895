"""The on-disk cache of the generated built-in sets: ``$CV_RECIPES_CACHE``, default
``~/.cache/cv-recipes``, one folder per set, version and seed (``digits_det-v1-seed0``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CV_RECIPES_CACHE") or Path.home() / ".cache" / "cv-recipes")


def cached_folder(name: str, complete: str, write: Callable[[Path], None]) -> Path:
    """The folder ``<cache root>/<name>``, made by ``write(folder)`` unless ``<name>/<complete>`` (a file
    written last) already exists.

    Written to a temporary folder beside it and renamed: a concurrent process sees no cache or a
    complete one, and of two racing processes the first rename wins. A read-only cache location gets
    the set written into a temporary folder for this process.
    """
    root = cache_root()
    cache = root / name
    if (cache / complete).exists():
        return cache
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="cv-recipes-")) / name
        write(folder)
        return folder
    try:
        write(tmp)
        tmp.rename(cache)
    except OSError:
        if not (cache / complete).exists():  # not another process's win: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache
