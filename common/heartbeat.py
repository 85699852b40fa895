"""Never silent where no progress bar shows (a log file, a cluster job's output): a pass over batches
(:func:`progress`: an evaluation, a kNN pass, a prediction) or one long call (:func:`heartbeat`: an export and
its checks) prints where it is every :data:`SILENCE_S` seconds, on the main process only. In a terminal the
progress bars show it instead. :class:`common.run.Run` hands out both with its own printing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from common.meters import format_seconds

#: The longest the main process goes without a line where no progress bar shows, in seconds.
SILENCE_S = 60.0


@contextlib.contextmanager
def heartbeat(
    what: str, main: bool, say: Callable[[str], None], where: Callable[[], str] = lambda: ""
) -> Iterator[None]:
    """Around work that can take minutes without a line: every :data:`SILENCE_S` seconds, on the main process
    (``main``) and where stderr is no terminal, ``say`` gets ``what``, ``where()`` (how far it is) and the time
    since it began; from a thread, so that one long call is covered too."""
    if not main or sys.stderr.isatty():
        yield
        return
    began, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(SILENCE_S):
            say(f"{what}{where()}, {format_seconds(time.monotonic() - began)}")

    thread = threading.Thread(target=beat, name=f"heartbeat {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def progress(
    iterable: Iterable[Any], desc: str, main: bool, say: Callable[[str], None], images: int | None = None
) -> Iterable[Any]:
    """``iterable`` (a pass's batches) with a transient progress bar on the main process; where no bar shows, a
    :func:`heartbeat` line instead (``eval 40/72 images, 0:01:10``). ``images``: how many the whole pass holds,
    default the loader's dataset's length (a process's share of the batches counts as its share of them)."""
    from tqdm.auto import tqdm

    bar = tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, disable=None if main else True)
    if not (main and bar.disable):
        return bar
    return _beating(iterable, desc, say, images)


def _beating(iterable: Iterable[Any], desc: str, say: Callable[[str], None], images: int | None) -> Iterator[Any]:
    total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    if images is None and hasattr(getattr(iterable, "dataset", None), "__len__"):
        images = len(iterable.dataset)  # type: ignore[attr-defined]
    done = 0

    def where() -> str:
        if total and images:
            return f" {round(images * done / total):,}/{images:,} images"
        return f" {done:,}/{total:,} batches" if total else f" {done:,} batches"

    with heartbeat(desc, True, say, where):
        for item in iterable:
            yield item
            done += 1
