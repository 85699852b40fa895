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
    so a folder whose name is a keyword, alone or beside words after a separator, names the split:
    ``training_set/``, ``val_images/``, ``seg_train/``, ``train2017/``. Each glob is read as fsspec reads it
    (``fsspec.utils.glob_translate``), in datasets' order of splits and patterns; one change: the keyword in any
    case (``Training/``, ``TEST/``), which datasets' globs miss. Whether a folder so named makes a split is
    :func:`_split_folders`' question. ``(split, its patterns)`` in order."""
    from datasets.data_files import DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME
    from fsspec.utils import glob_translate

    return tuple(
        (str(split), tuple(re.compile(glob_translate(p), re.IGNORECASE) for p in patterns))
        for split, patterns in DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME.items()
    )


@functools.lru_cache(maxsize=1 << 16)
def named_splits(folder: str) -> dict[str, int]:
    """The splits that the name ``folder`` names by :func:`split_rules`, each with the index of the first of its
    patterns that takes it (its rows come in that order; a posix path is matched at any of its folders, '' names
    none). The patterns end in ``/**``: a file's name never matters."""
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
    - Splits (``get_data_patterns``): where folders holding images make splits (:func:`_split_folders`: their
      names are split keywords, :func:`split_rules`, and so are their siblings'), the splits are the images
      under them, train, validation, test, each in the order of its patterns and sorted by path within one
      (``DataFilesList.from_patterns``); images under no such folder are left out (Intel's ``seg_pred/``).
      Otherwise the whole folder is the training split, sorted by path.
    - Class folders: every image of the splits at one depth, none directly in ``path`` or in the folder that
      makes its split (the folder an image sits in is its class where all sit at one depth: imagefolder's
      ``analyze``).

    Where imagefolder misreads, this does not (docs/data.md, "A folder of images"): file names never name a
    split (its ``DEFAULT_PATTERNS_SPLIT_IN_FILENAME``, used when no folder does, read ``beach-test-2.jpg``
    as the test split and drop ``IMG_0001.jpg``); images directly in the folder that makes their split have
    no class (imagefolder labels ``train/*.jpg`` and ``test/*.jpg`` as classes "train" and "test"); a keyword
    counts in any case; a keyword folder among class folders is a class (imagefolder reads ``bus/ car/ train/
    truck/`` as a ``train`` split of ``train/``'s images alone); a keyword inside a split folder never moves an
    image to another split (imagefolder also puts ``train/dev_board/`` in the validation split and
    ``train/test_tube/`` in the test split); an image is listed once in a split that several of its patterns
    take (imagefolder repeats it); a file is an image by its last extension (imagefolder also takes
    ``photo.jpg.json``).

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
    made = _split_folders(images)
    where = (lambda f: _split_of(f, made)) if made else (lambda f: {"train": 0})  # else all is train ("**")
    zips = [f for f in zips if where(f)]
    if zips:
        raise UserError(
            f"'{data}' holds zip archives ({_shown(zips)}), which datasets' imagefolder would extract and read: "
            "extract each where it lies (unzip <zip> -d <its folder>) and move the .zip files out of the folder"
        )
    files: dict[str, list[Path]] = {}
    chosen = []
    for split in [s for s, _ in split_rules()] if made else ["train"]:
        ranked = sorted((where(f)[split], f) for f in images if split in where(f))
        if ranked:
            tables = sorted(f for f in metadata if split in where(f))
            files[split] = [base / f for _, f in ranked] + [base / f for f in tables]
            chosen += [f for _, f in ranked]
    depths = {f.count("/") for f in chosen}
    return files, len(depths) == 1 and depths != {0} and not any(f.rpartition("/")[0] in made for f in chosen)


def _split_folders(images: list[str]) -> dict[str, dict[str, int]]:
    """The folders that make a split (posix paths relative to the data folder), each with the splits its name
    names and the rank of the first pattern that takes it (:func:`named_splits`). Folders are looked at from the
    top down, the sub-folders of one folder together (only those holding images count). Where some of them
    name a split, they are split folders when every one of them does (``train/``, ``val/``; ``training_set/``,
    ``test_set/``), or when they name two splits or more and each holds its images in folders of its own
    (Intel's ``seg_train/``, ``seg_test/`` beside ``seg_pred/``: the others are then left out, as imagefolder
    leaves them); otherwise a keyword folder is a class like its siblings (``Bus/``, ``Car/``, ``Train/``,
    ``Truck/``) and the search goes on inside each of them. Nothing inside a split folder is looked at: a
    keyword in a class name (``train/test_tube/``, ``train/dev_board/``) never moves images between splits."""
    children: dict[str, set[str]] = {}
    for f in images:
        parts = f.split("/")[:-1]
        for depth in range(len(parts)):
            children.setdefault("/".join(parts[:depth]), set()).add(parts[depth])
    made: dict[str, dict[str, int]] = {}
    pending = [""]
    while pending:
        folder = pending.pop()
        paths = {name: f"{folder}/{name}" if folder else name for name in sorted(children.get(folder, ()))}
        named = {name: found for name in paths if (found := named_splits(name))}
        splits = {split for found in named.values() for split in found}
        if named and (len(named) == len(paths) or (len(splits) > 1 and all(paths[name] in children for name in named))):
            made.update({paths[name]: found for name, found in named.items()})
        else:
            pending += paths.values()
    return made


def _split_of(file: str, made: dict[str, dict[str, int]]) -> dict[str, int]:
    """The splits of ``file`` (a posix path relative to the data folder): those of the split folder it lies
    under (:func:`_split_folders`), each with its rank; empty when it lies under none."""
    parts = file.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        found = made.get("/".join(parts[:depth]))
        if found is not None:
            return found
    return {}


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
