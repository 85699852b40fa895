"""YOLO txt datasets (Ultralytics' own, and Roboflow's "YOLOv5/v8/v11" exports), read as Ultralytics reads them
(``ultralytics/data/utils.py``: ``check_det_dataset``, ``img2label_paths``, ``verify_image_label``;
``ultralytics/data/base.py``: ``get_img_files``), into the normalised schema of :mod:`common.detection.sources`.

- The dataset is a yaml file: ``--data`` names it, or a folder with it at its top (``data.yaml``, else the one
  ``*.yaml`` / ``*.yml`` there that has ``train`` and ``names`` or ``nc``).
- ``path``: the root, absolute or relative to the yaml's folder (else to the working directory, as Ultralytics
  reads it); without it, the yaml's folder. ``train`` / ``val`` (or ``validation``) / ``test``: a folder (its images,
  recursively), a txt file listing image paths (``./x`` relative to the txt file, other relative paths to the root),
  or a list of those; an entry ``../x`` that does not exist is read as ``x`` (Roboflow's ``../train/images``). A
  folder's images are listed by Ultralytics' glob: no dot-file or dot-folder (:func:`split_images`).
- ``names``: a list, or a mapping ``{id: name}`` with ids 0..n-1; ``nc`` alone names the classes ``class_<i>``.
  Class index i is category id i.
- The label file of an image: the last ``/images/`` of its path replaced by ``/labels/``, the suffix by ``.txt``.
  Rows ``class cx cy w h`` normalised 0..1; polygon rows ``class x1 y1 x2 y2 ...`` (more than 6 values,
  Ultralytics' segment labels) read as their bounding boxes, each keeping its polygon as the object's mask
  (:func:`polygon_json`). A missing or empty file, or one of blank lines: no objects. Ultralytics' checks
  (``verify_image_label`` of ultralytics 8.4.183 and later), with its tolerance: class an integer in 0..nc-1, every
  box value <= 1.01, the least value >= 0, or >= -0.01 with the sides >= 0 (a centre may lie 1 % outside, a side
  is never negative); a file that fails one (or mixes polygon and box rows, or holds a malformed line) leaves its
  image out, as Ultralytics does ("ignoring corrupt image/label"): the image and the reason are listed as an
  unreadable image is (``bad_images.txt``). Repeated rows count once (polygons: the same points). One rule is
  this project's: a sixth value on a box row, a confidence as ``--predict --predict_scores`` writes, is ignored
  where Ultralytics refuses the file, so that a model's label files read back as its detections.
- Boxes become COCO ``[x, y, w, h]`` in pixels of the image as displayed (EXIF orientation applied), clipped to it.
- Masks: a split with a usable file of segment rows has masks (``objects.segmentation``): each polygon in pixels,
  clipped as the boxes are, its area the polygon's; the objects of files of box rows have none (``""``). Decided
  per file, which is this project's rule: Ultralytics' detection training drops every polygon of a split that
  mixes such files (a warning), and its segmentation training refuses the split.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common import UserError

#: What Ultralytics counts as an image (``IMG_FORMATS``).
IMG_FORMATS = {"avif", "bmp", "dng", "heic", "heif", "jp2", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp"}
SPLIT_KEYS = ("train", "val", "test")
DOCS = "docs/data.md#yolo-txt"


def img2label_path(image: str | Path) -> str:
    """Ultralytics' rule: the last ``/images/`` of the path replaced by ``/labels/``, the suffix by ``.txt``."""
    a, b = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return b.join(os.fspath(image).rsplit(a, 1)).rsplit(".", 1)[0] + ".txt"


def _is_data_yaml(file: Path) -> bool:
    import yaml

    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and ("train" in loaded) and ("names" in loaded or "nc" in loaded)


def find_yaml(path: Path) -> Path | None:
    """The YOLO data yaml that ``path`` is (a ``.yaml`` / ``.yml`` file) or holds at its top (``data.yaml``, else
    the only one with ``train`` and ``names`` / ``nc``, else the one named as the folder); None when none."""
    if path.is_file():
        return path if path.suffix.lower() in (".yaml", ".yml") else None
    if not path.is_dir():
        return None
    found = [f for ext in ("*.yaml", "*.yml") for f in sorted(path.glob(ext)) if f.is_file() and _is_data_yaml(f)]
    if len(found) > 1:
        found = [f for f in found if f.name == "data.yaml"] or [f for f in found if f.stem == path.name] or found
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise UserError(f"'{path}' holds {len(found)} YOLO data yamls ({names}): name one with --data {found[0]}")
    return found[0] if found else None


def read_yaml(file: Path) -> dict[str, Any]:
    """The data yaml, checked as Ultralytics' ``check_det_dataset`` checks it: ``names`` as a list, ``nc`` the
    number of classes; one :class:`UserError` naming the file otherwise."""
    import yaml

    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"YOLO data yaml '{file}' could not be read: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"'{file}' is no YOLO data yaml (expected keys path, train, val, names; {DOCS})")
    if "val" not in data and "validation" in data:
        data["val"] = data.pop("validation")
    types = {"path": (str,), "train": (str, list), "val": (str, list), "test": (str, list), "names": (list, dict)}
    for key, allowed in types.items():
        if data.get(key) is not None and not isinstance(data[key], allowed):
            expected = " or ".join("a list" if t is list else "a mapping" if t is dict else "a path" for t in allowed)
            raise UserError(f"'{key}' in '{file}' must be {expected}, not {data[key]!r}")
    if not data.get("train"):
        raise UserError(f"'{file}' has no 'train' entry: a folder of images, a txt list of them, or a list ({DOCS})")
    names, nc = data.get("names"), data.get("nc")
    if names is None and nc is None:
        raise UserError(f"'{file}' has neither 'names' nor 'nc': name the classes, e.g. names: [cat, dog] ({DOCS})")
    if nc is not None:
        try:
            if float(nc) != int(float(nc)):
                raise ValueError
            nc = int(float(nc))
        except (TypeError, ValueError):
            raise UserError(f"'nc: {data['nc']}' in '{file}' must be an integer") from None
    if names is None:
        names = [f"class_{i}" for i in range(nc)]
    if isinstance(names, dict):
        try:
            mapping = {int(k): str(v) for k, v in names.items()}
        except (TypeError, ValueError):
            raise UserError(f"'names' in '{file}' must map class indices 0, 1, ... to names") from None
        if sorted(mapping) != list(range(len(mapping))):
            raise UserError(
                f"'names' in '{file}' has ids {sorted(mapping)}; a {len(mapping)}-class set needs 0..{len(mapping) - 1}"
            )
        names = [mapping[i] for i in range(len(mapping))]
    names = [str(n) for n in names]
    if nc is not None and len(names) != nc:
        raise UserError(f"'names' in '{file}' has {len(names)} names but 'nc' is {nc}")
    if not names:
        raise UserError(f"'{file}' names no class: at least one is needed")
    data["names"] = names
    return data


def _root(file: Path, data: dict[str, Any]) -> Path:
    """The dataset root: ``path`` (absolute, or relative to the yaml's folder, else to the working directory), or
    the yaml's folder; where ``path`` does not exist (a yaml written on another machine) the yaml's folder, when the
    training entries are found there."""
    here = file.parent.absolute()
    given = data.get("path")
    if not given:
        return here
    candidates = [Path(given)] if Path(given).is_absolute() else [here / given, Path.cwd() / given]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is not None:
        return found
    entries = data["train"] if isinstance(data["train"], list) else [data["train"]]
    if all(_entry(here, str(e)).exists() for e in entries):
        return here
    raise UserError(f"'path: {given}' in '{file}' does not exist (looked at {', '.join(map(str, candidates))})")


def _entry(root: Path, entry: str) -> Path:
    """A split entry under the root; ``../x`` read as ``x`` where only that exists (Ultralytics' rule)."""
    path = Path(os.path.normpath(root / entry))
    if not path.exists() and entry.startswith("../"):
        path = Path(os.path.normpath(root / entry[3:]))
    return path


def split_images(root: Path, value: str | list, split: str, file: Path) -> list[str]:
    """The image paths of one split entry (a folder, a txt list, or a list of them), sorted as Ultralytics sorts
    them. A folder is listed as Ultralytics' ``get_img_files`` lists it (``glob.glob(<folder>/**/*.*,
    recursive=True)``): its files at any depth, linked folders entered, no file or folder whose name starts with
    ``.`` (Jupyter's ``.ipynb_checkpoints/`` copies, macOS's ``._IMG_0001.jpg`` resource forks); a txt list's
    paths are taken as written, whatever their names."""
    found: list[str] = []
    for entry in value if isinstance(value, list) else [value]:
        path = _entry(root, str(entry))
        if path.is_dir():  # Ultralytics' glob: no dot-file or dot-folder (._IMG.jpg, .ipynb_checkpoints/)
            pattern = os.path.join(glob.escape(str(path)), "**", "*.*")
            found += [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
        elif path.is_file():
            lines = path.read_text(encoding="utf-8-sig").strip().splitlines()
            for line in (x.strip() for x in lines):
                if line.startswith("./"):
                    found.append(os.path.normpath(path.parent / line[2:]))
                elif line:
                    found.append(line if os.path.isabs(line) else os.path.normpath(root / line))
        else:
            raise UserError(f"split '{split}' of '{file}': '{path}' does not exist ({DOCS})")
    images = sorted(f for f in found if f.rpartition(".")[-1].lower() in IMG_FORMATS)
    if not images:
        raise UserError(f"split '{split}' of '{file}' has no images in {value!r} (under '{root}'; {DOCS})")
    return images


def read_labels(label_file: str, num_classes: int) -> tuple[np.ndarray, str]:
    """The rows ``[class, cx, cy, w, h]`` (float64, normalised) of one label file, and '' or why the file cannot be
    used (:func:`_check`); a missing or empty file has no rows. Polygons: :func:`read_segments`."""
    rows, _, why = read_segments(label_file, num_classes)
    return rows, why


def read_segments(label_file: str, num_classes: int) -> tuple[np.ndarray, list[np.ndarray] | None, str]:
    """One label file as :func:`read_labels` reads it, with the polygons of a file of segment rows: per row its
    points ``[K, 2]`` (x, y normalised 0..1, as written; K >= 3), in the order of the rows; None for a file of box
    rows, an empty or a missing one, or one that cannot be used."""
    none = np.zeros((0, 5))
    try:
        text = Path(label_file).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        return none, None, ""
    except (OSError, ValueError) as e:
        return none, None, f"{type(e).__name__}: {e}"
    name = Path(label_file).name
    lines = [(n, line.split()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    segments = any(len(x) > 6 for _, x in lines)
    if segments and any(len(x) == 5 for _, x in lines):
        return none, None, f"{name} mixes polygon and box rows"
    rows, polygons, seen = [], [], set()
    for n, values in lines:
        try:
            numbers = np.array(values, np.float64)
        except ValueError:
            return none, None, f"{name} line {n}: not numbers: {' '.join(values)[:60]!r}"
        key = tuple(numbers[: len(numbers) if segments else 5].astype(np.float32).tolist())
        points = None
        if segments:
            if len(numbers) < 3 or len(numbers) % 2 == 0:
                return none, None, f"{name} line {n}: a polygon needs class and x y pairs, found {len(values)} values"
            points = numbers[1:].reshape(-1, 2)
            x, y = points[:, 0], points[:, 1]
            box = [(x.min() + x.max()) / 2, (y.min() + y.max()) / 2, x.max() - x.min(), y.max() - y.min()]
            numbers = np.array([numbers[0], *box])
        elif len(numbers) not in (5, 6):
            return none, None, f"{name} line {n}: {len(values)} values; expected class cx cy w h"
        why = _check(numbers[:5], num_classes)
        if why:
            return none, None, f"{name} line {n}: {why}"
        if key not in seen:  # repeated rows count once (Ultralytics removes duplicates)
            seen.add(key)
            rows.append(numbers[:5])
            polygons.append(points)
    return np.array(rows, np.float64).reshape(-1, 5), (polygons if segments else None), ""


def polygon_json(points: np.ndarray, size: tuple[int, int]) -> tuple[str, float]:
    """A segment row's polygon ``[K, 2]`` (normalised) as the schema's segmentation, one COCO polygon in pixels of
    the image of ``size`` (width, height), clipped to it as its box is, and its area in px^2 (the polygon's own, by
    the shoelace formula, as COCO's polygon areas; rasterising every polygon to count pixels would cost minutes on
    a COCO-sized set); ``("", 0.0)`` for a polygon of no area (its points on one line), which masks nothing."""
    import json

    width, height = size
    xy = (points * np.array([width, height], np.float64)).clip(0, [width, height])
    x, y = xy[:, 0], xy[:, 1]
    area = abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))) / 2
    if area == 0:
        return "", 0.0
    # 1e-4 px is far below a pixel and keeps the JSON short (float64 products print 17 digits)
    return json.dumps([[round(float(v), 4) for v in xy.reshape(-1)]]), area


def _check(row: np.ndarray, num_classes: int) -> str:
    """Ultralytics' checks of one row ``[class, cx, cy, w, h]`` (``verify_image_label``, values as float32): every
    box value <= 1.01, the row's least value >= 0 or (>= -0.01 with w, h >= 0), an integer class below ``nc``.
    Each is written as Ultralytics asserts it, so that a NaN, for which every comparison is false, fails it."""
    lb = row.astype(np.float32)
    if not (lb[1:].max() <= 1.01):
        return f"coordinates past 1 (normalised coordinates are 0..1, 1 % tolerance): {row[1:].tolist()}"
    if not (lb.min() >= 0 or (lb.min() >= -0.01 and lb[3:5].min() >= 0)):
        return f"negative values: {row.tolist()}"
    if not (lb[0] % 1 == 0):
        return f"class {row[0]:g} is not an integer"
    if not (lb[0] < num_classes):
        return f"class {int(lb[0])} is not in names (0..{num_classes - 1})"
    return ""


def load_split(
    file: Path, split: str, size_of: Callable[[str], tuple[int, int]]
) -> tuple[Any, list[str], list[int], dict[str, str]]:
    """One split of a YOLO data yaml as a normalised ``datasets.Dataset`` (image ids 0..N-1 in Ultralytics' order),
    its class names, their ids (the class indices) and the images left out with why (image path -> reason; their
    rows stay, without objects, for :meth:`common.detection.data.DetectionData.with_unusable` to list and drop).
    ``size_of``: an image's ``(width, height)`` as displayed, raising :class:`UserError` when unreadable."""
    import datasets

    from common.detection.sources import features

    data = read_yaml(file)
    root = _root(file, data)
    names = data["names"]
    images = split_images(root, data[split], split, file)
    unusable: dict[str, str] = {}
    table: dict[str, list] = {"image": [], "image_id": [], "width": [], "height": [], "objects": []}
    masks = False  # whether a usable label file holds segment rows: then the split has masks
    for i, image in enumerate(images):
        rows, polygons, why = read_segments(img2label_path(image), len(names))
        try:
            width, height = size_of(image)
        except UserError as e:
            width, height, why = 0, 0, why or str(e)
        if why:
            unusable[image] = why
            rows, polygons = np.zeros((0, 5)), None
        x0 = np.clip((rows[:, 1] - rows[:, 3] / 2) * width, 0, width)
        y0 = np.clip((rows[:, 2] - rows[:, 4] / 2) * height, 0, height)
        x1 = np.clip((rows[:, 1] + rows[:, 3] / 2) * width, 0, width)
        y1 = np.clip((rows[:, 2] + rows[:, 4] / 2) * height, 0, height)
        boxes = np.stack([x0, y0, x1 - x0, y1 - y0], 1).tolist()
        # a file of box rows in a split with segment files: its objects have no mask ("")
        shapes = [polygon_json(p, (width, height)) for p in polygons] if polygons else [("", 0.0)] * len(boxes)
        masks = masks or polygons is not None
        table["image"].append({"path": image, "bytes": None})
        table["image_id"].append(i)
        table["width"].append(width)
        table["height"].append(height)
        table["objects"].append(
            {
                "bbox": boxes,
                "category": rows[:, 0].astype(np.int64).tolist(),
                "area": [area if shape else b[2] * b[3] for b, (shape, area) in zip(boxes, shapes)],
                "iscrowd": [0] * len(boxes),
                "segmentation": [shape for shape, _ in shapes],
            }
        )
    if not masks:  # box rows only: the schema without masks
        for objects in table["objects"]:
            del objects["segmentation"]
    ds = datasets.Dataset.from_dict(table, features=features(masks=masks))
    return ds, names, list(range(len(names))), unusable


def splits(file: Path) -> list[str]:
    """The splits a data yaml names (``train``, ``val``, ``test``, those it has)."""
    data = read_yaml(file)
    return [k for k in SPLIT_KEYS if data.get(k)]


def label_lines(
    boxes: Sequence[Sequence[float]],
    labels: Sequence[int],
    size: tuple[int, int],
    scores: Sequence[float] | None = None,
) -> str:
    """Detections as an Ultralytics label file: per row ``class cx cy w h``, ``class`` the class index (``labels``,
    the position in the data yaml's ``names``), the box normalised by the image's ``size`` (width, height), from XYXY
    ``boxes`` in its pixels; with ``scores``, each row ends with its score (``--save_txt --save_conf``'s form, which
    labelling tools import, but which Ultralytics refuses as training labels: 5 columns only)."""
    width, height = size
    out = []
    for n, ((x0, y0, x1, y1), c) in enumerate(zip(boxes, labels)):
        values = [(x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height]
        values += [] if scores is None else [scores[n]]
        out.append(" ".join([str(int(c))] + [f"{float(v):.6g}" for v in values]) + "\n")
    return "".join(out)


def data_yaml(names: Sequence[str]) -> str:
    """A data yaml naming the classes ``names`` (index -> name) with ``train`` and ``val`` at ``images/`` beside it
    and no ``path`` (so the yaml's own folder, for Ultralytics and :func:`read_yaml` alike): what makes the label
    files under ``labels/`` a dataset once the images are put under ``images/`` at the same relative paths."""
    import yaml

    head = (
        "# Ultralytics' data yaml for the label files in labels/ (class indices of names below). To train on them\n"
        "# (yolo train data=<this file>), put the images at the same paths under images/ beside labels/.\n"
    )
    return head + yaml.safe_dump(
        {"train": "images", "val": "images", "nc": len(names), "names": dict(enumerate(map(str, names)))},
        sort_keys=False,
        allow_unicode=True,
    )
