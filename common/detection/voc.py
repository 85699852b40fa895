"""Pascal VOC folders read as the VOC devkit reads them (``VOCdevkit/VOCcode/VOCreadxml.m``, ``VOCevaldet.m``, and
their Python port ``voc_eval.py``), into the normalised schema of :mod:`common.detection.sources`.

- A VOC root is a folder with ``Annotations/`` (one XML per image) and ``JPEGImages/``. ``--data`` names one (a
  ``VOC2007`` folder, or any folder so laid out), or a folder holding several (``VOCdevkit`` with ``VOC2007/`` and
  ``VOC2012/``, or the folder above it).
- Splits: the image lists ``ImageSets/Main/<split>.txt`` (``train``, ``val``, ``trainval``, ``test``; the first word
  of each line; a class's own lists, ``<class>_<split>.txt``, are not splits). Without such lists every XML is the
  ``train`` split. Over several roots a split is named ``<root>/<split>`` (``VOC2007/test``), and the plain name reads
  every root's list of that name; ``+`` joins splits (``VOC2007/trainval+VOC2012/trainval``,
  :func:`common.detection.data.load_detection`).
- Classes: the 20 VOC classes in the devkit's order (``VOCinit.m``, alphabetical: the order of Ultralytics'
  ``VOC.yaml``) when the folder is a VOC year (``VOC20xx``, or under ``VOCdevkit``) and every ``<name>`` is one of
  them; otherwise the distinct ``<name>`` values of the split lists' XMLs, sorted. Category id = class index.
- Boxes: the devkit's pixels are 1-based and its corners inclusive (a box ``xmin..xmax`` covers ``xmax - xmin + 1``
  pixels: ``VOCevaldet.m`` adds the 1), so in COCO's continuous pixels ``x = xmin - 1``, ``w = xmax - xmin + 1``;
  clipped to the image. IoU of such boxes equals the devkit's IoU of the original corners.
- ``<difficult>1</difficult>`` boxes are crowd-like regions (``iscrowd`` 1): never training targets, and ignored in
  evaluation as the devkit ignores them (neither true nor false positives:
  :func:`common.detection.coco_eval.voc07_ap50`).
  ``truncated`` / ``occluded`` boxes are ordinary boxes, as in the devkit.
- Image ids: the VOC ids as numbers where every id is digits with at most one ``_`` (``000005`` -> 5, ``2008_000123``
  -> 2008000123: unique across the years), otherwise the position in the sorted list of every root's ids.
- Sizes: the XML's ``<size>`` where it gives one, else the image's header (as displayed). An image whose XML is
  missing or malformed is left out, listed as an unreadable image is (``bad_images.txt``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOC_CLASSES = (
    "aeroplane",
    "bicycle",
    "bird",
    "boat",
    "bottle",
    "bus",
    "car",
    "cat",
    "chair",
    "cow",
    "diningtable",
    "dog",
    "horse",
    "motorbike",
    "person",
    "pottedplant",
    "sheep",
    "sofa",
    "train",
    "tvmonitor",
)
DOCS = "docs/data.md#pascal-voc"
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def is_root(path: Path) -> bool:
    return (path / "Annotations").is_dir() and (path / "JPEGImages").is_dir()


def voc_roots(path: Path) -> dict[str, Path]:
    """The VOC roots ``path`` is or holds (itself; else its sub-folders, or theirs), by name ('' for ``path`` itself,
    else the folder's name); empty when none."""
    if is_root(path):
        return {"": path}
    for pattern in ("*", "*/*"):
        found = sorted(p for p in path.glob(pattern) if p.is_dir() and is_root(p))
        if found:
            names = [p.name for p in found]
            if len(set(names)) < len(names):
                return {str(p.relative_to(path)): p for p in found}
            return dict(zip(names, found))
    return {}


def split_lists(root: Path) -> dict[str, list[str]]:
    """Split name -> image ids, from ``ImageSets/Main/<split>.txt`` (a class's ``<class>_<split>.txt`` left out);
    without them every annotation is the ``train`` split."""
    main = root / "ImageSets" / "Main"
    files = sorted(main.glob("*.txt")) if main.is_dir() else []
    stems = {f.stem for f in files}
    lists = {}
    for f in files:
        head, _, tail = f.stem.rpartition("_")
        if head and tail in stems:
            continue
        lists[f.stem] = [line.split()[0] for line in f.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return lists or {"train": sorted(p.stem for p in (root / "Annotations").glob("*.xml"))}


def parse_xml(xml: Path) -> tuple[dict[str, Any], str]:
    """One annotation: ``filename``, ``size`` (width, height; 0 where not given) and ``objects`` (name, difficult,
    xmin, ymin, xmax, ymax as written); or why it cannot be used."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except FileNotFoundError:
        return {}, f"no annotation {xml.parent.name}/{xml.name}"
    except (OSError, ET.ParseError) as e:
        return {}, f"{xml.name}: {type(e).__name__}: {e}"
    objects = []
    for n, obj in enumerate(root.findall("object"), 1):
        name, box = (obj.findtext("name") or "").strip(), obj.find("bndbox")
        if not name or box is None:
            return {}, f"{xml.name}: object {n} has no <name> or no <bndbox>"
        try:
            xmin, ymin, xmax, ymax = (float(box.findtext(k) or "") for k in ("xmin", "ymin", "xmax", "ymax"))
            difficult = int(float(obj.findtext("difficult") or 0))
        except ValueError:
            return {}, f"{xml.name}: object {n} ({name}) has a <bndbox> or <difficult> that is not numbers"
        if xmax < xmin or ymax < ymin:
            return {}, f"{xml.name}: object {n} ({name}) has xmax < xmin or ymax < ymin"
        objects.append((name, difficult, xmin, ymin, xmax, ymax))
    try:
        size = (int(float(root.findtext("size/width") or 0)), int(float(root.findtext("size/height") or 0)))
    except ValueError:
        size = (0, 0)
    return {"filename": (root.findtext("filename") or "").strip(), "size": size, "objects": objects}, ""


class VocSource:
    """A VOC folder's splits (:attr:`lists`: name -> [(root name, image id)]) and :meth:`load`, which reads one. The
    annotations of every listed image are parsed once, when the classes are first needed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.roots = voc_roots(path)
        self.lists: dict[str, list[tuple[str, str]]] = {}
        for name, root in self.roots.items():
            for split, ids in split_lists(root).items():
                self.lists[f"{name}/{split}" if name else split] = [(name, i) for i in ids]
        if len(self.roots) > 1:  # a plain name: that list of every root that has one
            for split in sorted({s.rpartition("/")[2] for s in self.lists}):
                self.lists[split] = [
                    k for s in sorted(self.lists) if s.rpartition("/")[2] == split for k in self.lists[s]
                ]
        self._parsed: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
        self._classes: list[str] | None = None

    def _annotation(self, key: tuple[str, str]) -> tuple[dict[str, Any], str]:
        if key not in self._parsed:
            self._parsed[key] = parse_xml(self.roots[key[0]] / "Annotations" / f"{key[1]}.xml")
        return self._parsed[key]

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            keys = dict.fromkeys(k for ids in self.lists.values() for k in ids)
            names = {o[0] for k in keys for o in self._annotation(k)[0].get("objects", [])}
            voc = any(re.fullmatch(r"VOC\d{4}", p.name) or p.parent.name == "VOCdevkit" for p in self.roots.values())
            self._classes = list(VOC_CLASSES) if voc and names <= set(VOC_CLASSES) else sorted(names)
        return self._classes

    def _image_ids(self) -> Callable[[tuple[str, str]], int]:
        keys = sorted({k for ids in self.lists.values() for k in ids})
        if all(re.fullmatch(r"\d+(_\d+)?", i) for _, i in keys):
            return lambda key: int(key[1].replace("_", ""))
        position = {k: n for n, k in enumerate(keys)}
        return position.__getitem__

    def _image(self, key: tuple[str, str], filename: str) -> str:
        folder = self.roots[key[0]] / "JPEGImages"
        for candidate in (folder / f"{key[1]}.jpg", folder / filename if filename else None):
            if candidate is not None and candidate.is_file():
                return str(candidate)
        found = [p for p in sorted(folder.glob(f"{key[1]}.*")) if p.suffix.lower() in _IMAGE_SUFFIXES]
        return str(found[0] if found else folder / f"{key[1]}.jpg")

    def load(self, split: str, size_of: Callable[[str], tuple[int, int]]) -> tuple[Any, list[str], list[int], dict]:
        """One split as a normalised ``datasets.Dataset``, the class names, their ids (the class indices) and the
        images left out with why (image path -> reason; their rows stay, without objects, for
        :meth:`common.detection.data.DetectionData.with_unusable` to list and drop). ``size_of``: an image's
        ``(width, height)`` as displayed, raising :class:`UserError` when unreadable."""
        import datasets

        from common import UserError
        from common.detection.sources import features

        classes = self.classes
        index = {c: i for i, c in enumerate(classes)}
        image_id = self._image_ids()
        unusable: dict[str, str] = {}
        table: dict[str, list] = {"image": [], "image_id": [], "width": [], "height": [], "objects": []}
        for key in self.lists[split]:
            record, why = self._annotation(key)
            path = self._image(key, record.get("filename", ""))
            width, height = record.get("size", (0, 0))
            if not why and (width <= 0 or height <= 0):
                try:
                    width, height = size_of(path)
                except UserError as e:
                    width, height, why = 0, 0, str(e)
            objects: dict[str, list] = {"bbox": [], "category": [], "area": [], "iscrowd": []}
            if why:
                unusable[path] = why
            for name, difficult, xmin, ymin, xmax, ymax in [] if why else record["objects"]:
                x0, y0 = min(max(xmin - 1, 0), width), min(max(ymin - 1, 0), height)
                x1, y1 = min(max(xmax, 0), width), min(max(ymax, 0), height)
                objects["bbox"].append([x0, y0, x1 - x0, y1 - y0])
                objects["category"].append(index[name])
                objects["area"].append((x1 - x0) * (y1 - y0))
                objects["iscrowd"].append(int(difficult > 0))
            table["image"].append({"path": path, "bytes": None})
            table["image_id"].append(image_id(key))
            table["width"].append(width)
            table["height"].append(height)
            table["objects"].append(objects)
        return datasets.Dataset.from_dict(table, features=features()), classes, list(range(len(classes))), unusable
