"""The oldest version of each package a run uses, and the check a recipe makes before it writes anything.

A run is checked for what it uses, by the module it imports (:func:`needs`): every run the training core
(:data:`CORE`); a tracker only when ``report_to`` asks for it; matplotlib only when the run draws; ONNX only
with ``--export`` (and the torch that exports the recipe, :data:`EXPORT_TORCH`) or ONNX ``--weights``. A module
counts by the version of whatever distribution provides it, so ``onnxruntime-gpu`` or ``Pillow-SIMD`` pass as
``onnxruntime`` and ``pillow`` do, and the advice names the distribution that is installed, never a second wheel
beside it. Too old or missing is one ``error:`` line naming each package, the installed and the needed version,
and the pip command; :data:`SKIP_ENV` set to 1 skips the check (a cluster whose packages are pinned by its
stack, at the user's own risk).

``requirements.txt``'s runtime lines are :func:`declared` (``tests/test_requirements.py`` keeps them equal); the
floors tier (``tests/floors.sh``) installs what a resolver picks at those floors and runs every recipe there."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from common import UserError

#: Set to 1, the start-up check of :func:`check_requirements` is skipped (named in its error line).
SKIP_ENV = "CV_RECIPES_SKIP_REQUIREMENTS"


@dataclass(frozen=True)
class Floor:
    """``module`` (what the code imports, which is what counts) at ``version`` or newer; ``package`` is the
    distribution ``requirements.txt`` declares for it, which pip installs when the module is missing."""

    module: str
    package: str
    version: str


#: What every run imports: training, evaluation, prediction from safetensors weights.
CORE: tuple[Floor, ...] = (
    Floor("torch", "torch", "2.4"),
    Floor("torchvision", "torchvision", "0.19"),
    Floor("timm", "timm", "1.0.26"),
    Floor("accelerate", "accelerate", "1.0"),
    Floor("datasets", "datasets", "3.0"),
    Floor("huggingface_hub", "huggingface_hub", "0.25"),
    Floor("safetensors", "safetensors", "0.4.3"),
    Floor("numpy", "numpy", "2.0"),
    Floor("yaml", "pyyaml", "6.0"),
    Floor("sklearn", "scikit-learn", "1.4.2"),
    Floor("scipy", "scipy", "1.13"),
    Floor("pycocotools", "pycocotools", "2.0.8"),
    Floor("PIL", "pillow", "10.0"),
    Floor("tqdm", "tqdm", "4.66.3"),
)
#: ``report_to`` -> what that tracker imports.
TRACKERS: dict[str, tuple[Floor, ...]] = {
    "wandb": (Floor("wandb", "wandb", "0.18"),),
    "tensorboard": (Floor("tensorboard", "tensorboard", "2.16.2"),),
}
#: The PNGs under plots/ and the fonts of the detectors' pictures.
PLOTS: tuple[Floor, ...] = (Floor("matplotlib", "matplotlib", "3.8.4"),)
#: ``--export``: torch.onnx's exporter writes the file, ONNX Runtime checks it against eager.
ONNX_EXPORT: tuple[Floor, ...] = (
    Floor("onnx", "onnx", "1.18"),
    Floor("onnxscript", "onnxscript", "0.7"),
    Floor("onnxruntime", "onnxruntime", "1.24.1"),
)
#: ``--weights model.onnx``: ONNX Runtime runs the file, onnx reads its metadata.
ONNX_RUN: tuple[Floor, ...] = (ONNX_EXPORT[0], ONNX_EXPORT[2])
#: Recipe -> the oldest torch whose exporter writes its ONNX file; a renamed copy is held to the newest of them.
EXPORT_TORCH: dict[str, str] = {
    "classifier": "2.5",
    "dino": "2.5",
    "yolo": "2.7",
    "detr": "2.7",
    "faster_rcnn": "2.4",
}


def declared() -> dict[str, str]:
    """Distribution -> floor, for every runtime line ``requirements.txt`` must hold (torch: the training floor)."""
    floors = [*CORE, *(f for fs in TRACKERS.values() for f in fs), *PLOTS, *ONNX_EXPORT]
    return {f.package: f.version for f in floors}


def export_torch(recipe: str) -> str:
    """The oldest torch that exports ``recipe``; for a recipe copied under another name, the newest floor."""
    return EXPORT_TORCH.get(recipe) or max(EXPORT_TORCH.values(), key=release)


def exports(cfg: Any) -> bool:
    """Whether the run ``cfg`` writes an export: ``export`` at the end of training, or ``--export --weights W``;
    ``--predict`` and ``--eval_only`` never do, whatever ``export`` says (YOLO's default is true)."""
    return (
        bool(getattr(cfg, "export", False)) and not getattr(cfg, "predict", "") and not getattr(cfg, "eval_only", False)
    )


def needs(cfg: Any) -> list[Floor]:
    """What the run ``cfg`` imports (the module docstring; ``report_to``, ``export``, ``weights`` and ``eval_only``
    decide), each module once; the torch an export needs is :func:`export_torch`'s, checked by :func:`check_run`."""
    weights = str(getattr(cfg, "weights", "") or "")
    export_only = exports(cfg) and bool(weights)
    found = [*CORE, *TRACKERS.get(getattr(cfg, "report_to", "none"), ())]
    if not export_only:  # everything else draws: curves, confusion matrices, detections
        found += PLOTS
    if weights.lower().endswith(".onnx"):
        found += ONNX_RUN
    if exports(cfg):
        found += ONNX_EXPORT
    unique: dict[str, Floor] = {}
    for floor in found:  # ONNX_RUN's are ONNX_EXPORT's
        unique.setdefault(floor.module, floor)
    return list(unique.values())


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


def provider(floor: Floor) -> tuple[str, str] | None:
    """``(distribution, version)`` that provides ``floor.module``: the declared distribution when installed, else
    whichever distribution installs the module (``onnxruntime-gpu`` for ``onnxruntime``, ``Pillow-SIMD`` for
    ``PIL``); None when no installed distribution provides it. The second look reads every installed
    distribution's file list, so it is made only when the declared one is absent."""
    try:
        return floor.package, metadata.version(floor.package)
    except metadata.PackageNotFoundError:
        pass
    for name in metadata.packages_distributions().get(floor.module, []):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def problems(
    floors: Iterable[Floor], provided: Callable[[Floor], tuple[str, str] | None] | None = None
) -> list[tuple[Floor, tuple[str, str] | None]]:
    """``(floor, (distribution, version) or None when missing)`` for each of ``floors`` whose module is missing
    or older than its floor (``provided``: default :func:`provider`)."""
    provided = provided or provider
    found = [(floor, provided(floor)) for floor in floors]
    return [(floor, have) for floor, have in found if have is None or not at_least(have[1], floor.version)]


def advice(bad: Sequence[tuple[Floor, tuple[str, str] | None]], why: str = "this run") -> str:
    """One line for :func:`problems`' findings: what is installed, what ``why`` needs, the pip command (the
    installed distribution's name where one provides the module), and how to skip the check."""
    told, needed, command = [], [], []
    for floor, have in bad:
        name = have[0] if have else floor.package
        if have is None:
            told.append(f"{floor.package} is not installed")
        else:
            of = "" if have[0].lower() == floor.package.lower() else f" (module {floor.module})"
            told.append(f"{have[0]} {have[1]} is installed{of}")
        needed.append(f"{floor.package}>={floor.version}")
        command.append(f"'{name}>={floor.version}'")
    return (
        f"{'; '.join(told)}; {why} needs {', '.join(needed)}: pip install {' '.join(command)} "
        f"(or set {SKIP_ENV}=1 to skip this check)"
    )


def check_requirements(floors: Iterable[Floor] = CORE, why: str = "this run") -> None:
    """Raise :class:`UserError` (one line, exit status 2) when a module of ``floors`` is missing or older than its
    floor: ``timm 1.0.9 is installed; this run needs timm>=1.0.26: pip install 'timm>=1.0.26' (or set ...)``
    (every such package in the one line). Nothing is checked with :data:`SKIP_ENV` set to 1."""
    if os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    bad = problems(floors)
    if bad:
        raise UserError(advice(bad, why))


def check_run(cfg: Any, recipe: str) -> None:
    """:func:`check_requirements` for what the run ``cfg`` of ``recipe`` uses (:func:`needs`), then, with
    ``--export``, the torch that exports ``recipe``: a run that would fail after its training is refused before."""
    check_requirements(needs(cfg))
    if exports(cfg):
        floor = Floor("torch", "torch", export_torch(recipe))
        check_requirements([floor], f"--export of {recipe}.py (train without it: --export false)")
