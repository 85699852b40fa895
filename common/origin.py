"""Where the ``common/`` a process runs with comes from: one line for the head of each run's ``config.yaml``.

Two runs whose ``common/`` code differs must be told apart from their run folders alone, whether that code is
a git checkout (possibly with local edits) or a copy written by ``python -m common.vendor`` (possibly edited
since). The line names the source and a short hash of the ``.py`` files themselves, which differs whenever the
code does, committed or not:

- a vendored copy: ``vendored from git <commit>[ + local changes] on <date>[, edited since] (sha256 <hash>)``,
  read from :data:`RECORD` beside the copied modules;
- a checkout: ``<folder> at git <commit>[ + local changes] (sha256 <hash>)``;
- anything else (no git, not a repository): ``<folder>, no git commit (sha256 <hash>)``.

A leaf: it imports nothing from ``common``, so that the run folder's writer and the vendor can both use it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path

#: The file a vendored copy keeps in its ``common/``: where it came from and the sha256 of every file written.
RECORD = "VENDORED.json"

#: The package this module belongs to: the ``common/`` the running process imported.
HERE = Path(__file__).resolve().parent

# A git call must never hold a run back: a hung credential helper or a huge working tree is given this long.
_GIT_TIMEOUT_S = 10


def content_hash(package: Path, length: int = 12) -> str:
    """The first ``length`` hex digits of a sha256 over every ``.py`` file under ``package`` (relative paths
    and bytes, in path order): equal for equal code wherever it lies, different after any edit."""
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:length]


def git(folder: Path, *args: str) -> str | None:
    """``git -C folder <args>``'s output, stripped; None where git is missing, fails or takes too long."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(folder: Path, paths: list[str] | None = None) -> tuple[str, bool | None]:
    """The commit checked out where ``folder`` lies (``"unknown"`` outside a git checkout) and whether any of
    ``paths`` (relative to ``folder``; all of it when None) differs from it, untracked files included (None
    where unknown)."""
    commit = git(folder, "rev-parse", "HEAD")
    if not commit:
        return "unknown", None
    status = git(folder, "status", "--porcelain", "--", *(paths or ["."]))
    return commit, None if status is None else bool(status)


@functools.cache
def common_origin(package: Path = HERE) -> str:
    """Where ``package`` (this process's ``common/`` by default) comes from, in one line without a newline.
    Computed once per process: a run asks at its start, never in its loop."""
    digest = content_hash(package)
    record_file = package / RECORD
    if record_file.is_file():
        try:
            record = json.loads(record_file.read_text())
        except (OSError, ValueError):
            record = {}
        short = record.get("short")
        commit = f"git {short}" if short and short != "unknown" else "an unknown commit"
        commit += " + local changes" if record.get("local_changes") is True else ""
        edited = ", edited since" if record.get("common_sha256") not in (None, digest) else ""
        return f"vendored from {commit} on {record.get('date', 'an unknown date')}{edited} (sha256 {digest})"
    commit, changed = git_state(package)
    if commit == "unknown":
        return f"{package}, no git commit (sha256 {digest})"
    return f"{package} at git {commit[:12]}{' + local changes' if changed else ''} (sha256 {digest})"


def origin_comment() -> str:
    """The YAML comment line that heads a run's ``config.yaml`` (a comment: loading the file is unaffected)."""
    return f"# common/: {common_origin()}\n"
