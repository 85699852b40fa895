"""Where a dataset's tables come from: a ``save_to_disk`` folder, a local folder of images (its splits decided by
its layout alone), or a hub name, each read into ``datasets`` tables; and the split names they share.

The classification and self-supervised sources (:mod:`common.data.classification`) and the detection tables with
an ``objects`` column (:mod:`common.detection.data`) are read here."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from common import UserError

EVAL_SPLITS = ("validation", "val", "valid", "test")
#: A top-level folder of a local image folder that is a split, with an optional number or year
#: (``train2017``, ``val-2``), and the split it names (datasets' names for its own keywords).
SPLIT_FOLDER = re.compile(
    r"(train|training|validation|valid|val|dev|test|testing|eval|evaluation)(?:[-_. ]?\d+)?", re.I
)
SPLIT_NAMES = {"train": "train", "training": "train", "test": "test", "testing": "test", "eval": "test"}
SPLIT_NAMES |= {"evaluation": "test", "validation": "validation", "valid": "validation", "val": "validation"}
SPLIT_NAMES |= {"dev": "validation"}


def same_split(name: str, splits: Iterable[str]) -> str:
    """``name``, or the one split of ``splits`` that names the same split with or without a year, so a
    config written for COCO's ``train2017`` / ``val2017`` reads a folder of ``train`` / ``val`` and the
    other way round (``val`` also matches ``validation`` / ``valid``); ``name`` itself when none or
    several do (the caller's error then lists the splits)."""
    splits = list(splits)
    if name in splits:
        return name
    base = re.sub(r"\d{4}$", "", name)
    family = set(EVAL_SPLITS[:3]) if base in EVAL_SPLITS[:3] else {base}  # validation, val, valid
    found = [s for s in splits if re.sub(r"\d{4}$", "", s) in family]
    return found[0] if len(found) == 1 else name


def load_saved_or_hub(data: str, what: str, expected: str) -> Any:
    """A ``DatasetDict`` or ``Dataset`` from a ``save_to_disk`` folder, else through
    ``datasets.load_dataset``: a hub name (``org/name`` or ``org/name:config``), a local folder of images
    (split by :func:`folder_splits`; read by :func:`read_image_folder`, or with its metadata tables by
    :func:`build_image_folder`), or a downloaded dataset repository (``data/*.parquet``) read as the hub
    would. A failure is one :class:`UserError`:
    "<what> '<data>' could not be loaded (<first line of the cause>); expected <expected>"."""
    import datasets
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    path = Path(data)
    if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:
            raise UserError(f"saved dataset '{data}' could not be read: {type(e).__name__}: {e}") from None
    name, _, subset = (data, "", "") if path.exists() else data.partition(":")  # "frgfm/imagenette:320px"
    layout = folder_splits(path, data) if path.is_dir() else None
    bars = datasets.utils.logging.is_progress_bar_enabled()
    if path.exists():  # a local folder: its "Downloading data" and "Generating split" bars only copy files
        datasets.utils.logging.disable_progress_bar()
    try:
        if layout is not None:
            files, in_class_folders = layout
            if not any(f.name in ImageFolder.METADATA_FILENAMES for fs in files.values() for f in fs):
                return read_image_folder(files, in_class_folders)  # images alone: no builder needed
            return build_image_folder(files, in_class_folders)  # with metadata tables: datasets' builder
        return datasets.load_dataset(name, subset or None)
    except Exception as e:  # hub errors come in many types; the first line says what happened
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{what} '{data}' could not be loaded ({first}); expected {expected}") from None
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()


def build_image_folder(files: dict[str, list[Path]], in_class_folders: bool, cache_dir: str | None = None) -> Any:
    """The ``DatasetDict`` of datasets' ``imagefolder`` builder over ``files`` (split -> image and metadata paths,
    as :func:`folder_splits` gives them): every file named, so that datasets never reads a file name as a split
    (``data_files`` are patterns, hence escaped); labels where every image is in a class folder (datasets adds
    them for 2 classes or more)."""
    import datasets

    patterns = {split: [glob.escape(str(f)) for f in fs] for split, fs in files.items()}
    drop_labels = None if in_class_folders else True
    return datasets.load_dataset("imagefolder", data_files=patterns, drop_labels=drop_labels, cache_dir=cache_dir)


def read_image_folder(files: dict[str, list[Path]], in_class_folders: bool) -> Any:
    """The ``DatasetDict`` that datasets' ``imagefolder`` builds from ``files`` (split -> image paths, as
    :func:`folder_splits` gives them), read directly: the same columns, features, labels and row order,
    without the builder's start-up and its copy of every row into the datasets cache, which the builder
    writes on its first run over a folder (:func:`build_image_folder`). Labels: the class folders' names,
    sorted, where every image is in a class folder and there are 2 classes or more (as ``imagefolder``
    decides). Each split's fingerprint names its files' paths, sizes and modification times, so what is keyed
    by it (the image cache on disk) finds the same rows in a later run and never an edited file's old pixels."""
    import hashlib

    import datasets

    names = sorted({f.parent.name for fs in files.values() for f in fs})
    columns = {"image": datasets.Image()}
    if in_class_folders and len(names) > 1:
        columns["label"] = datasets.ClassLabel(names=names)
    features = datasets.Features(columns)
    splits = {}
    for split, paths in files.items():
        digest = hashlib.sha256(b"image-folder-1")
        for f in paths:
            stat = f.stat()
            digest.update(f"{f}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        rows = {"image": [str(f) for f in paths]}
        if "label" in columns:
            rows["label"] = [f.parent.name for f in paths]
        table = datasets.table.InMemoryTable.from_pydict(features.encode_batch(rows), schema=features.arrow_schema)
        info = datasets.DatasetInfo(features=features)
        splits[split] = datasets.Dataset(table, info=info, split=split, fingerprint=digest.hexdigest()[:16])
    return datasets.DatasetDict(splits)


def folder_splits(path: Path, data: str) -> tuple[dict[str, list[Path]], bool] | None:
    """The files of each split of the local image folder ``path`` (``data`` names it in errors), decided
    by its layout alone, and whether its images lie in class folders.

    Top-level folders named as splits (:data:`SPLIT_FOLDER`: ``train/``, ``val/``, ``validation/``,
    ``test/``, ...) are the splits, else the whole folder is the training split; file names never name a
    split (``IMG_val_3.jpg`` is a training photo like any other). Each split lists its images and its
    ``metadata.csv`` / ``.jsonl`` / ``.parquet`` files (datasets' imagefolder columns) as absolute paths.
    Class folders: every image one folder inside its split's folder (or inside ``path``), which then names
    its class; an image directly in it has none. Hidden
    files and folders (``.*``, ``__MACOSX``) are left out. None for a folder datasets reads otherwise:
    no images, or tables of rows (``data/*.parquet``, ``.arrow``). Images beside split folders are one
    :class:`UserError` naming them (no split would read them)."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    found = []
    for root, folders, names in os.walk(path, followlinks=True):  # linked folders count as the user's own
        inside = Path(root).relative_to(path)
        if any(os.path.samefile(root, path / up) for up in inside.parents):  # a link back up: a loop
            folders[:] = []
            continue
        folders[:] = sorted(f for f in folders if not f.startswith((".", "__")))
        found += [Path(root, n).relative_to(path) for n in sorted(names) if not n.startswith((".", "__"))]
    images = [f for f in found if f.suffix.lower() in ImageFolder.EXTENSIONS]
    metadata = [f for f in found if f.name in ImageFolder.METADATA_FILENAMES]
    if not images or any(f.suffix.lower() in (".parquet", ".arrow") and f not in metadata for f in found):
        return None
    owner: dict[str, str] = {}  # top-level folder -> the split it holds
    for folder in sorted({f.parts[0] for f in found if len(f.parts) > 1}):
        match = SPLIT_FOLDER.fullmatch(folder)
        if match:
            split = SPLIT_NAMES[match.group(1).lower()]
            twin = next((k for k, v in owner.items() if v == split), None)
            if twin is not None:
                raise UserError(
                    f"'{data}' has two folders for its {split} split, '{twin}' and '{folder}': merge them or rename one"
                )
            owner[folder] = split
    depth = 3 if owner else 2  # the parts of the path to an image in a class folder: [split/]class/file
    if owner:
        loose = [f for f in images if len(f.parts) == 1 or f.parts[0] not in owner]
        if loose:
            shown = ", ".join(str(f) for f in loose[:3]) + (" ..." if len(loose) > 3 else "")
            raise UserError(
                f"'{data}' has split folders ({', '.join(owner)}) and {len(loose)} images outside them "
                f"({shown}), which no split would read: move them into a split folder"
            )
    files: dict[str, list[Path]] = {}
    for f in images + metadata:  # a metadata file outside the split folders belongs to none
        split = "train" if not owner else owner.get(f.parts[0], "") if len(f.parts) > 1 else ""
        if split:
            files.setdefault(split, []).append((path / f).absolute())
    return files, all(len(f.parts) == depth for f in images)
