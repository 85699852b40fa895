"""Where a dataset's tables come from: a ``save_to_disk`` folder, a local folder of images (its splits decided by
its layout alone), or a hub name, each read into ``datasets`` tables; and the split names they share.

The classification and self-supervised sources (:mod:`common.data.classification`) and the detection tables with
an ``objects`` column (:mod:`common.detection.data`) are read here."""

from __future__ import annotations

import functools
import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from common import UserError

EVAL_SPLITS = ("validation", "val", "valid", "test")


@functools.cache
def split_rules() -> tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]:
    """The folder names that make a split, as the installed datasets defines them for ``load_dataset`` given a
    folder: ``datasets.data_files.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME``, its ``SPLIT_KEYWORDS`` (train: train,
    training; validation: validation, valid, dev, val; test: test, testing, eval, evaluation) in its
    ``KEYWORDS_IN_DIR_NAME_BASE_PATTERNS`` (``**/{keyword}/**``, ``**/{keyword}[{sep}]*/**``,
    ``**/*[{sep}]{keyword}/**``, ``**/*[{sep}]{keyword}[{sep}]*/**``, ``sep`` its ``NON_WORDS_CHARS`` "-._ 0-9"),
    so a folder at any depth whose name is a keyword, alone or beside words after a separator, names the
    split: ``training_set/``, ``val_images/``, ``seg_train/``, ``train2017/``. Each glob is read as fsspec reads
    it (``fsspec.utils.glob_translate``), in datasets' order of splits and patterns; one change: the keyword
    in any case (``Training/``, ``TEST/``), which datasets' globs miss. ``(split, its patterns)`` in order."""
    from datasets.data_files import DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME
    from fsspec.utils import glob_translate

    return tuple(
        (str(split), tuple(re.compile(glob_translate(p), re.IGNORECASE) for p in patterns))
        for split, patterns in DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME.items()
    )


@functools.lru_cache(maxsize=1 << 16)
def named_splits(folder: str) -> dict[str, int]:
    """The splits that a file in ``folder`` (a posix path relative to the data folder; '' for the folder
    itself) belongs to by :func:`split_rules`, each with the index of the first of its patterns that takes
    it (its rows come in that order). The patterns end in ``/**``: the file's name never matters."""
    if not folder:
        return {}
    probe = f"{folder}/x"
    found = {}
    for split, patterns in split_rules():
        index = next((i for i, p in enumerate(patterns) if p.match(probe)), None)
        if index is not None:
            found[split] = index
    return found


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
    decides). Each split's fingerprint names its files' paths, sizes, modification and change times and
    inodes, so what is keyed by it (the image cache on disk) finds the same rows in a later run and never an
    edited file's old pixels, even one replaced by a file of the same size with the old modification time
    kept (``cp -p``, ``rsync -a``: the change time moves). A file gone since the listing is a row all the
    same (the start's scan lists it in ``bad_images.txt``)."""
    import hashlib

    import datasets

    names = sorted({f.parent.name for fs in files.values() for f in fs})
    columns = {"image": datasets.Image()}
    if in_class_folders and len(names) > 1:
        columns["label"] = datasets.ClassLabel(names=names)
    features = datasets.Features(columns)
    splits = {}
    for split, paths in files.items():
        digest = hashlib.sha256(b"image-folder-2")
        for f in paths:
            try:
                s = os.stat(f)
                stat = f"{s.st_size}\0{s.st_mtime_ns}\0{s.st_ctime_ns}\0{s.st_ino}"
            except OSError as e:  # gone, or a dangling link
                stat = type(e).__name__
            digest.update(f"{f}\0{stat}\n".encode())
        rows = {"image": [str(f) for f in paths]}
        if "label" in columns:
            rows["label"] = [f.parent.name for f in paths]
        table = datasets.table.InMemoryTable.from_pydict(features.encode_batch(rows), schema=features.arrow_schema)
        info = datasets.DatasetInfo(features=features)
        splits[split] = datasets.Dataset(table, info=info, split=split, fingerprint=digest.hexdigest()[:16])
    return datasets.DatasetDict(splits)


def folder_splits(path: Path, data: str) -> tuple[dict[str, list[Path]], bool] | None:
    """The files of each split of the local image folder ``path`` (``data`` names it in errors) as datasets'
    ``imagefolder`` lists them for ``load_dataset("imagefolder", data_dir=path)``, and whether its images lie in
    class folders (then :func:`read_image_folder` labels them). Paths are absolute, under ``path`` resolved
    (load_dataset's ``base_path``).

    - Files: :func:`_listing` (no hidden files, nothing under ``__MACOSX/``, linked folders not entered);
      images are the files whose last extension is an image's (``ImageFolder.EXTENSIONS``), each split lists
      its ``metadata.csv`` / ``.jsonl`` / ``.parquet`` tables.
    - Splits (``get_data_patterns``): where a folder holding images names a split (:func:`split_rules`, at any
      depth), the splits are the images under such folders, train, validation, test, each in the order of its
      patterns and sorted by path within one (``DataFilesList.from_patterns``); images under no such folder
      are left out (Intel's ``seg_pred/``). Otherwise the whole folder is the training split, sorted by path.
    - Class folders: every image of the splits at one depth, none directly in ``path`` or in the folder that
      makes its split (the folder an image sits in is its class where all sit at one depth: imagefolder's
      ``analyze``).

    Where imagefolder misreads, this does not (docs/data.md, "A folder of images"): file names never name a
    split (its ``DEFAULT_PATTERNS_SPLIT_IN_FILENAME``, used when no folder does, read ``beach-test-2.jpg``
    as the test split and drop ``IMG_0001.jpg``); images directly in the folder that makes their split have
    no class (:func:`_in_split_folder`; imagefolder labels ``train/*.jpg`` and ``test/*.jpg`` as classes
    "train" and "test"); a keyword counts in any case; an image is listed once in a split that several of
    its patterns take (imagefolder repeats it); a file is an image by its last extension (imagefolder also
    takes ``photo.jpg.json``).

    None for a folder datasets reads otherwise: no images, or tables of rows (``data/*.parquet``, ``.arrow``).
    Zip archives that a split would read (imagefolder extracts them) are one :class:`UserError`, as is a
    folder whose images all lie in linked folders."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    base = path.expanduser().resolve()
    found, linked = _listing(base)
    images = [f for f in found if os.path.splitext(f)[1].lower() in ImageFolder.EXTENSIONS]
    metadata = [f for f in found if f.rpartition("/")[2] in ImageFolder.METADATA_FILENAMES]
    if any(f.endswith((".parquet", ".arrow")) and f not in metadata for f in found):
        return None
    zips = [f for f in found if f.lower().endswith(".zip")]
    if not images:
        if linked and not zips:
            raise UserError(
                f"'{data}' has no images outside its linked folders ({_shown(linked)}), which datasets' "
                "imagefolder does not enter: give the folder a link points to, or copy them in (cp -rL)"
            )
        return None
    keyed = any(named_splits(f.rpartition("/")[0]) for f in images)  # else all is train (datasets' "**")
    where = (lambda f: named_splits(f.rpartition("/")[0])) if keyed else (lambda f: {"train": 0})
    zips = [f for f in zips if where(f)]
    if zips:
        raise UserError(
            f"'{data}' holds zip archives ({_shown(zips)}), which datasets' imagefolder would extract and read: "
            "extract each where it lies (unzip <zip> -d <its folder>) and move the .zip files out of the folder"
        )
    files: dict[str, list[Path]] = {}
    chosen = []
    for split in [s for s, _ in split_rules()] if keyed else ["train"]:
        ranked = sorted((where(f)[split], f) for f in images if split in where(f))
        if ranked:
            tables = sorted(f for f in metadata if split in where(f))
            files[split] = [base / f for _, f in ranked] + [base / f for f in tables]
            chosen += [f for _, f in ranked]
    depths = {f.count("/") for f in chosen}
    return files, len(depths) == 1 and depths != {0} and not any(_in_split_folder(f) for f in chosen)


def _in_split_folder(file: str) -> bool:
    """Whether ``file`` lies directly in the folder that makes its split: one whose name
    :func:`split_rules` take, inside none that they take (``train_images/1.jpg``, not
    ``train/train_cat/1.jpg``)."""
    folder, _, _ = file.rpartition("/")
    above, _, name = folder.rpartition("/")
    return bool(named_splits(name)) and not named_splits(above)


def _listing(base: Path) -> tuple[list[str], list[str]]:
    """The files under ``base`` that datasets' resolver lists (``datasets.data_files.resolve_pattern`` over
    fsspec's local ``find``), as posix paths relative to it, and the linked folders left out. As there: no file
    or folder whose name starts with ``.`` (``_is_unrequested_hidden_file_or_is_inside_unrequested_hidden_dir``),
    nothing inside a folder whose name starts with ``__`` (``_is_inside_unrequested_special_dir``:
    ``__MACOSX/``), a linked file read as a file, a linked folder not entered (so its images never change
    the depth that decides the labels). Unlike there, a dangling link stays, as does a file deleted during
    the walk: a row that the start's scan finds unreadable, leaves out and lists in ``bad_images.txt``; a
    folder that cannot be read is skipped."""
    files, linked = [], []
    for root, folders, names in os.walk(base):  # links to folders are listed in folders, not entered
        inside = Path(root).relative_to(base).as_posix()
        prefix = "" if inside == "." else inside + "/"
        folders[:] = sorted(f for f in folders if not f.startswith((".", "__")))
        linked += [prefix + f for f in folders if os.path.islink(os.path.join(root, f))]
        files += [prefix + n for n in names if not n.startswith(".")]
    return files, linked


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
