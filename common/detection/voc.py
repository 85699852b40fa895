"""Pascal VOC folders read as the VOC devkit reads them (``VOCdevkit/VOCcode/VOCreadxml.m``, ``VOCevaldet.m``, and
their Python port ``voc_eval.py``), into the normalised schema of :mod:`common.detection.sources`.

- A VOC root is a folder with ``Annotations/`` (one XML per image) and ``JPEGImages/``, or, as annotation tools and
  shared sets lay it out (the raccoon set, LabelImg's exports), ``annotations/`` beside ``images/``: the folder names
  in any case, the images folder ``JPEGImages`` where there are both; one XML in the annotations folder at least
  (COCO's ``annotations/`` holds json). ``--data`` names one (a ``VOC2007`` folder, or any folder so laid out), or a
  folder holding several (``VOCdevkit`` with ``VOC2007/`` and ``VOC2012/``, or the folder above it).
- Splits: the image lists ``ImageSets/Main/<split>.txt`` (``train``, ``val``, ``trainval``, ``test``; the first word
  of each line; a class's own lists, ``<class>_<split>.txt``, are not splits). Without such lists every XML is the
  ``train`` split, and with no evaluation split :func:`common.detection.data.load_detection` holds out its seeded
  10 %, as for every form without one. Over several roots a split is named ``<root>/<split>`` (``VOC2007/test``), and
  the plain name reads every root's list of that name; ``+`` joins splits (``VOC2007/trainval+VOC2012/trainval``,
  :func:`common.detection.data.load_detection`). The lists of ``ImageSets/Segmentation/`` (the images with object
  masks) are the splits ``Segmentation/<split>`` (``VOC2012/Segmentation/train`` over several roots).
- Masks: where every image of a split that has objects has its ``SegmentationObject/<id>.png`` (a palette PNG whose
  value i is the XML's i-th object, from 1; 0 background; 255 the void band along outlines, in no mask), each object
  keeps its pixels (``objects.segmentation``, COCO's compressed RLE; ``""`` for one without pixels) and its area is
  their count. Where only some have one (VOC2012's ``Main`` lists), the split is read as boxes and a line says so.
  ``SegmentationClass/`` is not read: each object's class is its XML's. A PNG that is not object numbers or does not
  fit its image leaves the image out, listed as a malformed XML does.
- Classes: the 20 VOC classes in the devkit's order (``VOCinit.m``, alphabetical: the order of Ultralytics'
  ``VOC.yaml``) when the folder is a VOC year (``VOC20xx``, or under ``VOCdevkit``) and every ``<name>`` is one of
  them; otherwise the distinct ``<name>`` values of the split lists' XMLs, sorted. Category id = class index.
- Boxes: the devkit's pixels are 1-based and its corners inclusive (a box ``xmin..xmax`` covers ``xmax - xmin + 1``
  pixels: ``VOCevaldet.m`` adds the 1), so in COCO's continuous pixels ``x = xmin - 1``, ``w = xmax - xmin + 1``;
  clipped to the image. IoU of such boxes equals the devkit's IoU of the original corners.
- ``<difficult>1</difficult>`` boxes are crowd-like regions (``iscrowd`` 1): never training targets, and ignored in
  evaluation as the devkit ignores them (neither true nor false positives:
  :func:`common.detection.voc07.voc07_ap50`).
  ``truncated`` / ``occluded`` boxes are ordinary boxes, as in the devkit.
- Evaluation: without a split named, the one that follows the training split's years (:meth:`VocSource.eval_split`).
- Image ids: the VOC ids as numbers where every id is digits with at most one ``_`` and no two ids give one number
  (``000005`` -> 5, ``2008_000123`` -> 2008000123: unique across the years), otherwise the position in the sorted
  list of every root's ids, so that every file has an id of its own.
- Sizes: the XML's ``<size>`` where it gives one, else the image's header (as displayed). An image whose XML is
  missing or malformed is left out, listed as an unreadable image is (``bad_images.txt``).
- Photos stored turned (an EXIF orientation tag) are read as displayed (:mod:`common.data.images`), so their boxes
  are taken to the displayed picture's frame: where ``<size>`` is the stored picture's and not the displayed one's
  (a tool that drew on the stored pixels, as LabelImg does), the boxes are turned with the picture; where it is the
  displayed one's, or fits both (a half turn, a mirror, a square photo), they are used as written. One line says
  which frame the turned images' boxes were read in (:attr:`VocSource.notes`).

The folder's files (its roots, split lists, annotation XMLs) are found and read in :mod:`common.detection.voc_files`.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.data.folders import EVAL_SPLITS, same_split
from common.detection.voc_files import ANNOTATIONS, IMAGES, SEGMENTATION, parse_xml, split_lists, sub_folder, voc_roots

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


class VocSource:
    """A VOC folder's splits (:attr:`lists`: name -> [(root name, image id)]) and :meth:`load`, which reads one. The
    annotations of every listed image are parsed once, when the classes are first needed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.roots = voc_roots(path)
        # each root's annotations and images folders, as spelled there (Annotations/ or annotations/, ...)
        self._folders = {
            name: (
                sub_folder(root, ANNOTATIONS) or root / "Annotations",
                sub_folder(root, IMAGES) or root / "JPEGImages",
            )
            for name, root in self.roots.items()
        }
        # each root's object masks (SegmentationObject/<id>.png), where it has them
        self._masks = {name: sub_folder(root, ("segmentationobject",)) for name, root in self.roots.items()}
        self.lists: dict[str, list[tuple[str, str]]] = {}
        self._list_of: dict[str, tuple[str, str]] = {}  # split name of one root's list -> (root, list name)
        for name, root in self.roots.items():
            for split, ids in split_lists(root).items():
                self.lists[self._key(name, split)] = [(name, i) for i in ids]
                self._list_of[self._key(name, split)] = (name, split)
        if len(self.roots) > 1:  # a plain name: that list of every root that has one
            for split in sorted({name for _, name in self._list_of.values()}):
                self.lists[split] = [
                    k for s in sorted(self._list_of) if self._list_of[s][1] == split for k in self.lists[s]
                ]
        self._parsed: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
        self._classes: list[str] | None = None
        #: one line per split loaded where some images are stored turned: the frame their boxes were read in
        self.notes: list[str] = []

    def _annotation(self, key: tuple[str, str]) -> tuple[dict[str, Any], str]:
        if key not in self._parsed:
            folder = self._folders[key[0]][0]
            xml = folder / f"{key[1]}.xml"
            if not xml.is_file():  # the suffix in another case (IMG_1.XML)
                xml = next((p for p in folder.glob(f"{glob.escape(key[1])}.*") if p.suffix.lower() == ".xml"), xml)
            self._parsed[key] = parse_xml(xml)
        return self._parsed[key]

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            keys = dict.fromkeys(k for ids in self.lists.values() for k in ids)
            names = {o[0] for k in keys for o in self._annotation(k)[0].get("objects", [])}
            voc = any(re.fullmatch(r"VOC\d{4}", p.name) or p.parent.name == "VOCdevkit" for p in self.roots.values())
            self._classes = list(VOC_CLASSES) if voc and names <= set(VOC_CLASSES) else sorted(names)
        return self._classes

    def _key(self, root: str, name: str) -> str:
        """The split name of list ``name`` of ``root`` (``VOC2007/val``; over one root, ``val``)."""
        return f"{root}/{name}" if root else name

    def _reads(self, split: str) -> list[tuple[str, str]]:
        """``(root, list name)`` of each list that the split name ``split`` reads: ``VOC2007/train`` that one, a
        plain ``train`` that list of every root that has one."""
        if split in self._list_of:
            return [self._list_of[split]]
        return [(r, split) for r in self.roots if self._key(r, split) in self.lists]

    def eval_split(self, train_split: str) -> str:
        """The evaluation split for ``train_split`` when none is named: in each root (year) that the training split
        reads, the first of validation / val / valid / test that it has and that is no part of the training split
        there (VOC's ``val`` is part of ``trainval``), joined with ``+``; '' where no year has one (then a seeded
        share of the training split is held out). ``VOC2007/train`` evaluates on ``VOC2007/val`` alone,
        ``VOC2007/trainval+VOC2012/trainval`` on ``VOC2007/test`` (VOC2012 has no test list), a plain ``train``
        over several years on each year's ``val``. A segmentation list is evaluated on a segmentation list
        (``Segmentation/train`` on ``Segmentation/val``), whose images have masks too."""
        read: dict[str, list[str]] = {}  # root -> the lists of it that the training split reads
        for part in train_split.split("+"):
            for root, name in self._reads(same_split(part, self.lists)):
                read.setdefault(root, []).append(name)
        chosen = []
        for root, names in read.items():
            folder = SEGMENTATION if names[0].startswith(SEGMENTATION) else ""
            bare = [name.removeprefix(folder) for name in names]
            listed = [s for s in EVAL_SPLITS if self._key(root, folder + s) in self.lists]
            split = next((s for s in listed if not any(s in name for name in bare)), "")
            chosen += [self._key(root, folder + split)] if split else []
        return "+".join(chosen)

    def _image_ids(self) -> Callable[[tuple[str, str]], int]:
        """Image ids: the VOC ids as numbers where every id is digits with at most one ``_`` and the numbers are
        unique over every root's ids (``11_0`` and ``1_10`` would both be 110), else positions in their sorted
        list."""
        keys = sorted({k for ids in self.lists.values() for k in ids})
        if all(re.fullmatch(r"\d+(_\d+)?", i) for _, i in keys):
            numbers = {k: int(k[1].replace("_", "")) for k in keys}
            if len(set(numbers.values())) == len(keys) and max(numbers.values(), default=0) < 2**63:
                return numbers.__getitem__
        position = {k: n for n, k in enumerate(keys)}
        return position.__getitem__

    def _image(self, key: tuple[str, str], filename: str) -> str:
        folder = self._folders[key[0]][1]
        for candidate in (folder / f"{key[1]}.jpg", folder / filename if filename else None):
            if candidate is not None and candidate.is_file():
                return str(candidate)
        found = [p for p in sorted(folder.glob(f"{glob.escape(key[1])}.*")) if p.suffix.lower() in _IMAGE_SUFFIXES]
        return str(found[0] if found else folder / f"{key[1]}.jpg")

    def _mask_file(self, key: tuple[str, str]) -> Path | None:
        """The image's ``SegmentationObject/<id>.png``, or None."""
        folder = self._masks[key[0]]
        path = folder / f"{key[1]}.png" if folder else None
        return path if path is not None and path.is_file() else None

    def _with_masks(self, split: str) -> bool:
        """Whether every image of ``split`` with objects has its object PNG (then the split has masks); where only
        some have, :attr:`notes` says so, and the split is read as boxes."""
        keys = [k for k in self.lists[split] if self._annotation(k)[0].get("objects")]
        found = sum(self._mask_file(k) is not None for k in keys)
        if 0 < found < len(keys):
            lists = sorted(s for s in self.lists if SEGMENTATION in s)
            self.notes.append(
                f"Pascal VOC '{split}': {found} of {len(keys)} images with objects have SegmentationObject PNGs: "
                "read as boxes only, as masks need one for every image"
                + (f" ({', '.join(lists)} list the images with masks)" if lists else "")
            )
        return bool(keys) and found == len(keys)

    def _object_masks(
        self, key: tuple[str, str], count: int, size: tuple[int, int], turn: tuple[int, tuple[int, int]] | None
    ) -> tuple[list[str], list[int], str]:
        """The masks of an image's ``count`` objects from its ``SegmentationObject`` PNG, whose pixel value i is the
        i-th object of the XML (from 1; 0 background, 255 the void band along the outlines, in no mask): each as
        COCO's compressed RLE in JSON and its pixel count, ``""`` and 0 for an object without pixels; or why the PNG
        cannot be read. ``size``: the image's (width, height) as displayed; a PNG of the stored picture's size is
        turned with it (``turn``, :func:`frame`)."""
        import json

        import numpy as np
        from PIL import Image

        from common.detection.masks import rle_of

        path = self._mask_file(key)
        name = f"{path.parent.name}/{path.name}" if path else f"SegmentationObject/{key[1]}.png"
        try:
            with Image.open(path) as png:
                if png.mode not in ("P", "L", "I", "I;16"):  # a palette's indices; colours say nothing of objects
                    return [], [], f"{name} is {png.mode}, not object numbers (a palette or grey PNG)"
                if png.size != size and turn and png.size == turn[1]:  # drawn on the stored picture: turned with it
                    png = png.transpose(Image.Transpose[_TRANSPOSE[turn[0]]])
                values = np.asarray(png)
        except Exception as e:
            return [], [], f"{name}: {type(e).__name__}: {e}"
        if values.shape[::-1] != size:
            return [], [], f"{name} is {values.shape[1]} x {values.shape[0]}, its image {size[0]} x {size[1]}"
        shapes, areas = [], []
        for i in range(1, count + 1):
            mask = values == i
            areas.append(int(mask.sum()))
            shapes.append(json.dumps(rle_of(mask)) if areas[-1] else "")
        return shapes, areas, ""

    def load(self, split: str, size_of: Callable[[str], tuple[int, int]]) -> tuple[Any, list[str], list[int], dict]:
        """One split as a normalised ``datasets.Dataset``, the class names, their ids (the class indices) and the
        images left out with why (image path -> reason; their rows stay, without objects, for
        :meth:`common.detection.data.DetectionData.with_unusable` to list and drop). ``size_of``: an image's
        ``(width, height)`` as displayed, raising :class:`UserError` when unreadable. Where some images are stored
        turned, :attr:`notes` gains the line naming the frame their boxes were read in (:func:`frame`)."""
        import datasets

        from common import UserError
        from common.detection.sources import features

        classes = self.classes
        index = {c: i for i, c in enumerate(classes)}
        image_id = self._image_ids()
        unusable: dict[str, str] = {}
        frames: dict[str, int] = {}
        masks = self._with_masks(split)
        table: dict[str, list] = {"image": [], "image_id": [], "width": [], "height": [], "objects": []}
        for key in self.lists[split]:
            record, why = self._annotation(key)
            path = self._image(key, record.get("filename", ""))
            width, height, turn = 0, 0, None
            if not why:
                try:
                    (width, height), turn, read_as = frame(path, record["size"], size_of)
                    frames[read_as] = frames.get(read_as, 0) + 1
                except UserError as e:
                    why = str(e)
            shapes, areas = [], []
            if masks and not why and record["objects"]:
                shapes, areas, why = self._object_masks(key, len(record["objects"]), (width, height), turn)
            objects: dict[str, list] = {"bbox": [], "category": [], "area": [], "iscrowd": []}
            if why:
                unusable[path] = why
            for name, difficult, xmin, ymin, xmax, ymax in [] if why else record["objects"]:
                corners = (xmin - 1, ymin - 1, xmax, ymax)  # 1-based inclusive corners in continuous pixels
                x0, y0, x1, y1 = turned(corners, *turn) if turn else corners
                x0, y0 = min(max(x0, 0), width), min(max(y0, 0), height)
                x1, y1 = min(max(x1, 0), width), min(max(y1, 0), height)
                objects["bbox"].append([x0, y0, x1 - x0, y1 - y0])
                objects["category"].append(index[name])
                objects["area"].append((x1 - x0) * (y1 - y0))
                objects["iscrowd"].append(int(difficult > 0))
            if masks:  # an object's area is its mask's pixels, as COCO's; its box's where it has none
                objects["segmentation"] = shapes
                objects["area"] = [a or box for a, box in zip(areas, objects["area"])]
            table["image"].append({"path": path, "bytes": None})
            table["image_id"].append(image_id(key))
            table["width"].append(width)
            table["height"].append(height)
            table["objects"].append(objects)
        if line := frames_line(split, frames, len(self.lists[split])):
            self.notes.append(line)
        ds = datasets.Dataset.from_dict(table, features=features(masks=masks))
        return ds, classes, list(range(len(classes))), unusable


#: EXIF orientation -> the PIL transpose (``Image.Transpose``) that shows the stored picture upright, as
#: ``PIL.ImageOps.exif_transpose`` turns it.
_TRANSPOSE = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_270",
    7: "TRANSVERSE",
    8: "ROTATE_90",
}


# How the boxes of an image were read (:func:`frame`): as written, for an image stored upright; for one stored turned,
# in the frame its ``<size>`` names, or as displayed where it names none.
UPRIGHT, STORED, DISPLAYED, BOTH, UNTOLD = "upright", "stored", "displayed", "both", "untold"


def frame(
    path: str, size: tuple[int, int], size_of: Callable[[str], tuple[int, int]]
) -> tuple[tuple[int, int], tuple[int, tuple[int, int]] | None, str]:
    """The size of the image at ``path`` as displayed, how to take its boxes there, and which frame they were read in.

    ``size``: the XML's ``<size>`` ((0, 0) where it gives none). The image's header gives its stored size and EXIF
    orientation (:func:`common.data.images.orientation`). Stored upright: ``<size>`` where given (the devkit's), else
    the header's. Stored turned: where ``<size>`` is the stored picture's and not the displayed one's, the boxes were
    drawn on the stored pixels and are turned with them (``(orientation, stored size)`` for :func:`turned`);
    otherwise they are taken as drawn on the picture as displayed, as every viewer shows it: ``<size>`` is the
    displayed one's, or fits both (a half turn or a mirror keeps the sides; so does a square), or is absent or
    fits neither. A header that cannot be read keeps ``<size>`` (the scan before the first step lists the file);
    without one it is ``size_of``'s :class:`UserError`."""
    from PIL import Image

    from common.data.images import orientation

    try:
        with Image.open(path) as image:
            stored, turn = image.size, orientation(image)
    except Exception:  # unreadable: what it is, the scan says
        return (size if min(size) > 0 else size_of(path)), None, UPRIGHT
    shown = (stored[1], stored[0]) if turn >= 5 else stored
    if turn == 1:
        return (size if min(size) > 0 else shown), None, UPRIGHT
    if size == stored and size != shown:
        return shown, (turn, stored), STORED
    if size == shown:
        return shown, None, BOTH if size == stored else DISPLAYED
    return (size if min(size) > 0 else shown), None, UNTOLD


def turned(box: tuple[float, float, float, float], turn: int, stored: tuple[int, int]) -> list[float]:
    """``box`` (``[x0, y0, x1, y1]`` in continuous pixels of the picture as stored, of size ``stored``) in the
    picture as displayed, which EXIF orientation ``turn`` (2-8) makes of it as ``PIL.ImageOps.exif_transpose``
    does: 2 a mirror, 3 a half turn, 4 a flip, 5 a transpose, 6 a quarter turn clockwise, 7 a transverse, 8 a
    quarter turn anticlockwise."""
    width, height = stored
    move = {
        2: lambda x, y: (width - x, y),
        3: lambda x, y: (width - x, height - y),
        4: lambda x, y: (x, height - y),
        5: lambda x, y: (y, x),
        6: lambda x, y: (height - y, x),
        7: lambda x, y: (height - y, width - x),
        8: lambda x, y: (y, width - x),
    }[turn]
    (ax, ay), (bx, by) = move(box[0], box[1]), move(box[2], box[3])
    return [min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)]


def frames_line(split: str, frames: dict[str, int], total: int) -> str:
    """One line saying in which frame the boxes of a split's turned photos were read (:func:`frame`); '' where every
    image is stored upright."""
    read = {
        STORED: "turned with the picture (their <size> is the stored picture's)",
        DISPLAYED: "as drawn on the picture as displayed (their <size> is its)",
        BOTH: "as drawn on the picture as displayed (their <size> fits it and the stored one alike)",
        UNTOLD: "as drawn on the picture as displayed (no <size> tells otherwise)",
    }
    parts = [f"{frames[k]} {how}" for k, how in read.items() if frames.get(k)]
    if not parts:
        return ""
    count = sum(frames.get(k, 0) for k in read)
    return f"Pascal VOC '{split}': {count} of {total} images are stored turned (EXIF orientation); boxes read: " + (
        "; ".join(parts)
    )
