"""The oldest version of each package a run needs (``requirements.txt``'s runtime lines, kept equal to
:data:`FLOORS` by ``tests/test_requirements.py``), and the check :func:`common.console.cli_main` makes before a
recipe writes anything: a package too old or missing is one ``error:`` line naming it, the installed and the
needed version, and the pip command, instead of a traceback at the end of a run. The floors are proven by
installing exactly them (``constraints/minimum.txt``) and running every recipe (``tests/floors.sh``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from importlib import metadata

from common import UserError

#: Distribution name -> the oldest version with which every recipe trains, evaluates, exports and predicts.
FLOORS: dict[str, str] = {
    "torch": "2.9.1",
    "torchvision": "0.24.1",
    "timm": "1.0.26",
    "accelerate": "1.0",
    "datasets": "3.0",
    "huggingface_hub": "0.25",
    "safetensors": "0.4.3",
    "pyyaml": "6.0",
    "scikit-learn": "1.3",
    "scipy": "1.10",
    "pycocotools": "2.0.7",
    "pillow": "10.0",
    "tqdm": "4.66.3",
    "wandb": "0.18",
    "tensorboard": "2.16.2",
    "matplotlib": "3.8",
    "onnx": "1.18",
    "onnxscript": "0.7",
    "onnxruntime": "1.24.1",
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``'2.6.0a0+git1234'`` -> ``(2, 6, 0)``, ``'1.0'`` ->
    ``(1, 0)``. Pre-release, dev and local parts are ignored, so that a source build of a release (as GPU
    images ship torch) counts as that release; ``()`` when the string starts with no number."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip().lstrip("vV"))
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def at_least(installed: str, floor: str) -> bool:
    """Whether ``installed`` is ``floor`` or newer, release numbers compared with missing parts as zeros."""
    have, need = release(installed), release(floor)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def problems(
    floors: Mapping[str, str] = FLOORS, version_of: Callable[[str], str | None] | None = None
) -> list[tuple[str, str | None, str]]:
    """``(package, installed version or None when missing, floor)`` for each package of ``floors`` that is
    missing or older than its floor (``version_of``: a distribution name -> its installed version or None;
    default the installed distributions' metadata)."""
    version_of = version_of or _installed
    found = [(name, version_of(name), floor) for name, floor in floors.items()]
    return [(name, have, floor) for name, have, floor in found if have is None or not at_least(have, floor)]


def check_requirements(floors: Mapping[str, str] = FLOORS) -> None:
    """Raise :class:`UserError` (one line, exit status 2) when a package a run needs is missing or older than
    its floor: ``timm 1.0.9 is installed; this recipe needs timm>=1.0.26: pip install 'timm>=1.0.26'``
    (every such package in the one line)."""
    bad = problems(floors)
    if not bad:
        return
    told = [f"{name} {have} is installed" if have else f"{name} is not installed" for name, have, _ in bad]
    needed = ", ".join(f"{name}>={floor}" for name, _, floor in bad)
    command = " ".join(f"'{name}>={floor}'" for name, _, floor in bad)
    raise UserError(f"{'; '.join(told)}; this recipe needs {needed}: pip install {command}")
