"""The processes that check image files for :mod:`common.data.scan`: child Python processes that import PIL
and the checker only, not torch nor the recipe (as a multiprocessing pool's workers would), so that starting
one costs what Python and PIL take. Several share the files of a check the start waits for; one, at a lower
priority, runs a background check. They start with the stop signals blocked, and any still running when the
training process exits is killed then, silently.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Only PIL's checker at the top: the checking processes import this module without the rest of the package.
from common.data.images import unreadable

#: Files below which a check the start waits for stays in the training process (a child's start costs more).
CHUNK = 256
#: Niceness added to the background check's process: it yields the cores to the training and its loaders.
BACKGROUND_NICE = 10


def check_files(paths: Sequence[str]) -> list[tuple[int, int, int, str]]:
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


# The checking process: ``common`` stands in for the package (its __init__ imports timm and with it torch, which
# the checker never uses), so that the process starts in the time Python and PIL take.
_CHILD = """
import sys, types
package = types.ModuleType("common")
package.__path__ = [sys.argv[1]]
package.UserError = type("UserError", (Exception,), {})
sys.modules["common"] = package
from common.data.scan import child_main
child_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
"""
_children: set[subprocess.Popen] = set()  # the checking processes still running
exiting = threading.Event()  # set at exit: a background check cut short says nothing


def _kill_children() -> None:
    exiting.set()
    for child in list(_children):
        if child.poll() is None:
            child.kill()
            child.wait()


def run_child(mode: str, paths: Sequence[str], nice: int = 0, cache: str = "") -> subprocess.Popen:
    """Start a checking process on ``paths`` (:func:`common.data.scan.child_main`, ``mode`` ``check`` or
    ``scan``, then with its cache file ``cache``); its answer: :func:`child_answer`. It starts with the stop
    signals blocked and keeps them so: a signal sent to the whole process group (``scancel``, Ctrl-C) is the
    training process's alone (:class:`common.run.Run`). One still running when the training process exits is
    killed."""
    from common.loaders import STOP_SIGNALS

    if not _children and not exiting.is_set():
        atexit.register(_kill_children)
    package = str(Path(__file__).resolve().parents[1])
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        argv = [sys.executable, "-c", _CHILD, package, mode, str(nice), cache]
        # its errors to a file, not the terminal: one cut short at exit says nothing, and a failure is one line
        errors = tempfile.TemporaryFile()
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _children.add(child)
    child.errors = errors  # type: ignore[attr-defined]
    try:
        child.stdin.write(json.dumps(list(paths)).encode())
        child.stdin.close()
    except BrokenPipeError:  # it ended at once: child_answer says why
        pass
    return child


def child_answer(child: subprocess.Popen) -> Any:
    """What a checking process wrote, once it ends; RuntimeError when it failed (its error is on stderr)."""
    out = child.stdout.read()
    code = child.wait()
    _children.discard(child)
    child.errors.seek(0)
    last = (child.errors.read().decode(errors="replace").strip().splitlines() or [f"exit status {code}"])[-1]
    child.errors.close()
    if code != 0:
        raise RuntimeError(f"the image check's process failed: {last}")
    return json.loads(out)


def check_in_parallel(paths: Sequence[str], workers: int) -> list[tuple[int, int, int, str]]:
    """:func:`check_files` of ``paths``, shared by ``workers`` checking processes when there are enough files;
    where a process fails, its files are checked here."""
    if workers <= 1 or len(paths) <= CHUNK:
        return check_files(paths)
    share = -(-len(paths) // workers)
    parts = [paths[i : i + share] for i in range(0, len(paths), share)]
    children = [run_child("check", part) for part in parts]
    results = []
    for part, child in zip(parts, children):
        try:
            results += [tuple(r) for r in child_answer(child)]
        except (RuntimeError, ValueError):
            results += check_files(part)
    return results
