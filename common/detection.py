"""Object detection data: sources, box-aware transforms, collate, COCO evaluation, drawing.

Shared by the three detection recipes (YOLO-style, DETR-style, Faster R-CNN-style). Every source
becomes a ``datasets.Dataset`` with one normalised schema::

    image     datasets.Image(decode=False)   bytes or a path; decoded in DataLoader workers
    image_id  int64                          unique within a split (COCO evaluation keys on it)
    width     int32, height int32            of the original image, pixels
    objects   {bbox:     [[x, y, w, h], ...] COCO boxes in original pixels (float64)
               category: [c, ...]            class index 0..C-1 (int64)
               area:     [a, ...]            COCO area (the mask's area where the json has one), px^2
               iscrowd:  [0 or 1, ...]}      crowd regions: never a training target, ignored by COCO eval

Sources: the built-in ``digits_det``, a local COCO-json folder, or a dataset with an ``objects``
column (hub name, ``save_to_disk`` folder or local copy of a hub repository, as ``cppe-5``).

Inside a recipe, :class:`DetectionDataset` yields ``(image, target)`` with boxes as
``tv_tensors.BoundingBoxes`` (XYXY, pixels of the transformed image); :func:`collate` pads a batch;
:class:`CocoEvaluator` computes COCO mAP with pycocotools from predictions in original pixels
(:func:`rescale_boxes` maps them back), across processes.

Reproducibility is that of :mod:`common.data`: each sample's augmentation is seeded from
``(seed, epoch, index)``, so resumed runs and any number of workers or processes see the same crops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from common import UserError
from common.data import EVAL_SPLITS, decode_image, load_saved_or_hub, sample_seed, seeded
from common.synthetic import _blend, _coverage

if TYPE_CHECKING:
    import datasets

BUILTIN = ("digits_det",)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------------------------
# Built-in set: digits_det
# --------------------------------------------------------------------------------------------
DET_SIZE = 96  # canvas side, pixels
DET_SS = 2  # supersampling of the clutter strokes and blobs (drawn at 2x, box-filtered down)
DET_VERSION = "v1"  # part of the cache folder name: change it whenever the rendering changes
DET_COUNTS = {"train": 2000, "val": 400}  # scenes per split
DET_SOURCE = {"train": "train", "val": "test"}  # the split of common.data.digits_dataset drawn from
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601 luminance of an RGB colour
_DET_SPLIT_ID = {"train": 0, "val": 1}  # seeds the two splits' Generators apart
_DET_GRID = 6  # background colour noise: a 6x6 grid upsampled bilinearly (low frequency)
_GY, _GX = (np.mgrid[0:_DET_GRID, 0:_DET_GRID].astype(np.float32) - (_DET_GRID - 1) / 2) / _DET_GRID
INK = 0.25  # a glyph pixel belongs to the digit's box when its coverage is at least this
MIN_HEIGHT, CELL_HEIGHT = 10, (12.0, 44.0)  # box height floor; the 8x8 cell's height range, px
MAX_IOU, MAX_COVERED = 0.3, 0.4  # two digits' boxes: IoU, and intersection over the smaller box
MAX_STROKE_OVERLAP = 3  # pixels where two digits' strokes may touch


def _rgba(rgb: np.ndarray, alpha: float) -> tuple[int, int, int, int]:
    """A PIL fill from a colour (3,) in 0..255 and an opacity in [0, 1]."""
    return int(rgb[0]), int(rgb[1]), int(rgb[2]), round(255 * alpha)


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]]) -> bool:
    """Whether XYXY ``box`` overlaps any of ``boxes`` beyond MAX_IOU or MAX_COVERED (plain Python:
    at most 5 boxes of ints, where torchvision.ops.box_iou would cost more than the drawing)."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    for other in boxes:
        iw = min(box[2], other[2]) - max(box[0], other[0])
        ih = min(box[3], other[3]) - max(box[1], other[1])
        if iw <= 0 or ih <= 0:
            continue
        inter, other_area = iw * ih, (other[2] - other[0]) * (other[3] - other[1])
        if inter / (area + other_area - inter) > MAX_IOU or inter / min(area, other_area) > MAX_COVERED:
            return True
    return False


def _scene(rng: np.random.Generator, glyphs: np.ndarray, labels: np.ndarray
           ) -> tuple[np.ndarray, list[tuple[int, int, int, int]], list[int], np.ndarray]:
    """One scene: image (S, S, 3) uint8, digit boxes (XYXY, integer pixel edges), their classes, and
    the background before the digits and the sensor noise ((S, S, 3) float32, for tests).

    ``glyphs`` (M, 10, 10) uint8 are zero-padded 8x8 digits with classes ``labels`` (M,); nothing
    else is drawn from. Colours are in 0..255, positions and lengths in canvas pixels.
    """
    S, SS = DET_SIZE, DET_SS
    # Background: a gradient between two dark colours at a random angle plus low-frequency colour
    # noise, then clutter that is fainter and thinner than any digit: 2-5 long strokes 0.5-1.5 px
    # wide at 25-55 % opacity, and 0-3 soft blobs (3 nested discs at 12 % opacity each).
    c0, c1 = rng.uniform(0, 110, 3).astype(np.float32), rng.uniform(0, 110, 3).astype(np.float32)
    theta, amplitude = rng.uniform(0, 2 * np.pi), rng.uniform(10, 35)
    ramp = _GX * np.float32(np.cos(theta)) + _GY * np.float32(np.sin(theta)) + 0.5  # (G, G), 0..1
    grid = c0 + ramp[..., None] * (c1 - c0) + rng.uniform(-amplitude, amplitude, (_DET_GRID, _DET_GRID, 3))
    # Upsampled bilinearly to the canvas, then to the supersampled canvas by pixel repetition, which
    # the final box filter undoes exactly (and costs a fraction of a bilinear resize to 2S).
    canvas = Image.fromarray(grid.clip(0, 255).astype(np.uint8)).resize((S, S), Image.BILINEAR)
    canvas = canvas.resize((SS * S,) * 2, Image.NEAREST)
    draw = ImageDraw.Draw(canvas, "RGBA")  # RGBA fills blend into the RGB canvas
    for _ in range(rng.integers(2, 6)):
        # A polyline of 1-2 segments, each 40-120 px long: long enough never to look like a '1'.
        points = rng.uniform(-8, S + 8, 2).tolist()  # x0, y0, x1, ...
        for _ in range(rng.integers(1, 3)):
            length, direction = rng.uniform(40, 120), rng.uniform(0, 2 * np.pi)
            points += [points[-2] + length * np.cos(direction), points[-1] + length * np.sin(direction)]
        points = [SS * p for p in points]
        fill = _rgba(rng.uniform(0, 255, 3), rng.uniform(0.25, 0.55))
        draw.line(points, fill, width=int(rng.integers(1, 4)), joint="curve")
    for _ in range(rng.integers(0, 4)):
        bx, by, radius = SS * rng.uniform(0, S), SS * rng.uniform(0, S), SS * rng.uniform(6, 20)
        fill = rng.uniform(0, 255, 3)
        for r in (radius, 0.7 * radius, 0.4 * radius):
            draw.ellipse((bx - r, by - r, bx + r, by + r), _rgba(fill, 0.12))
    image = np.asarray(canvas.reduce(SS), np.float32)  # (S, S, 3), a writable copy
    background = image.copy()

    # Digits: 1-6 wanted, each placed by rejection (8 tries per wanted digit): the 8x8 cell 12-44 px
    # tall (log-uniform: as many small as large), 0.75-1.1 as wide, tilted up to 0.15 rad, wholly
    # inside the canvas, box at least MIN_HEIGHT tall, overlapping earlier digits little.
    occupied = np.zeros((S, S), bool)  # pixels any digit's stroke touches
    boxes: list[tuple[int, int, int, int]] = []
    classes: list[int] = []
    wanted = int(rng.integers(1, 7))
    for _ in range(8 * wanted):
        if len(boxes) == wanted:
            break
        k = int(rng.integers(len(glyphs)))
        height = float(np.exp(rng.uniform(math.log(CELL_HEIGHT[0]), math.log(CELL_HEIGHT[1]))))
        aspect, angle = rng.uniform(0.75, 1.1), rng.uniform(-0.15, 0.15)
        cx = rng.uniform(0.5 * height * aspect, S - 0.5 * height * aspect)
        cy = rng.uniform(0.5 * height, S - 0.5 * height)
        # Coverage in a square patch around the digit (wide enough for the tilted cell), placed at
        # integer offset (x0, y0): drawing a patch costs a fraction of drawing the canvas.
        patch = int(1.6 * height) + 4
        x0, y0 = int(cx) - patch // 2, int(cy) - patch // 2
        cover = _coverage(glyphs[k], cx - x0, cy - y0, height, aspect, angle, size=patch)
        ax, ay, bx, by = max(x0, 0), max(y0, 0), min(x0 + patch, S), min(y0 + patch, S)  # on the canvas
        on_canvas = cover[ay - y0 : by - y0, ax - x0 : bx - x0]
        if on_canvas.sum() < cover.sum() - 1e-3:  # the canvas edge would cut the digit
            continue
        ink = on_canvas >= INK
        rows, cols = np.flatnonzero(ink.any(1)), np.flatnonzero(ink.any(0))
        if len(rows) == 0 or rows[-1] + 1 - rows[0] < MIN_HEIGHT:
            continue
        box = (ax + int(cols[0]), ay + int(rows[0]), ax + int(cols[-1]) + 1, ay + int(rows[-1]) + 1)
        touched = on_canvas > 0
        if (occupied[ay:by, ax:bx] & touched).sum() > MAX_STROKE_OVERLAP or _overlaps(box, boxes):
            continue
        # Colour: the first of 16 light candidates whose luminance differs from that of the canvas
        # under the digit by at least 80 (of 255): always readable.
        region = image[ay:by, ax:bx]  # a view: blending into it draws on the canvas
        under = float((region @ _LUMA * on_canvas).sum() / (on_canvas.sum() + 1e-6))
        candidates = rng.uniform(140, 255, (16, 3)).astype(np.float32)
        contrast = np.abs(candidates @ _LUMA - under)
        ok = np.flatnonzero(contrast >= 80)
        _blend(region, on_canvas, candidates[ok[0] if len(ok) else contrast.argmax()])
        occupied[ay:by, ax:bx] |= touched
        boxes.append(box)
        classes.append(int(labels[k]))
    # Sensor noise: uniform, zero-mean, standard deviation 0-4.
    image += (rng.random((S, S, 3), np.float32) - 0.5) * np.float32(rng.uniform(0, 4) * 12**0.5)
    return np.rint(image.clip(0, 255)).astype(np.uint8), boxes, classes, background


def render_scenes(glyphs: np.ndarray, labels: np.ndarray, count: int, seed: int, split: str
                  ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """``count`` scenes drawn from ``glyphs`` ((N, 8, 8) uint8, 0..255) with classes ``labels`` (N,):
    images (count, S, S, 3) uint8, and per image its boxes (n, 4) int64 as COCO ``[x, y, w, h]`` in
    pixels (tight around the glyph pixels with coverage >= INK) and classes (n,) int64, 1 <= n <= 6.

    Only ``glyphs`` are drawn: pass one split's digits and nothing of another split can appear.
    """
    padded = np.pad(glyphs, ((0, 0), (1, 1), (1, 1)))  # (N, 10, 10): samples off a glyph read 0
    images = np.empty((count, DET_SIZE, DET_SIZE, 3), np.uint8)
    boxes, classes = [], []
    for i in range(count):
        rng = np.random.default_rng([seed, _DET_SPLIT_ID[split], i])  # one stream per image: order-free
        images[i], xyxy, cls, _ = _scene(rng, padded, labels)
        xyxy = np.asarray(xyxy, np.int64).reshape(-1, 4)
        boxes.append(np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1))
        classes.append(np.asarray(cls, np.int64))
    return images, boxes, classes


def _write_coco_split(root: Path, split: str, images: np.ndarray, boxes: list[np.ndarray],
                      classes: list[np.ndarray]) -> None:
    """``root/<split>/<id>.png`` and ``root/annotations/instances_<split>.json`` (image ids from 1)."""
    (root / split).mkdir(parents=True)
    (root / "annotations").mkdir(exist_ok=True)
    entries, annotations = [], []
    for i, (image, xywh, cls) in enumerate(zip(images, boxes, classes), start=1):
        name = f"{i:06d}.png"
        # PNG (lossless), stored without compression: level 1 would save a third of the 67 MB but
        # add a quarter to the generation time; pixels are the same either way.
        Image.fromarray(image).save(root / split / name, format="PNG", compress_level=0)
        entries.append({"id": i, "file_name": name, "width": DET_SIZE, "height": DET_SIZE})
        for box, c in zip(xywh.tolist(), cls.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": c, "bbox": box,
                                "area": box[2] * box[3], "iscrowd": 0})
    categories = [{"id": d, "name": str(d), "supercategory": "digit"} for d in range(10)]
    with open(root / "annotations" / f"instances_{split}.json", "w") as f:
        json.dump({"images": entries, "annotations": annotations, "categories": categories}, f)


def digits_det_folder(seed: int = 0) -> Path:
    """The ``digits_det`` set as a COCO-json folder, generated on first use (about 12 s) and cached.

    Scenes of 96x96 RGB with 1-6 digits each (``common.data.digits_dataset``: train scenes draw only
    its 1,437 train digits, val scenes only its 360 test digits), boxes 10-48 px tall, on gradient
    backgrounds with faint strokes and blobs; 2,000 ``train`` and 400 ``val`` images, categories
    '0'..'9' with ids 0..9. Layout: ``annotations/instances_{train,val}.json``, ``{train,val}/*.png``.

    Cached in ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``digits_det-v1-seed<seed>``,
    written to a temporary folder and renamed: a concurrent process sees no cache or a complete
    one, and of two racing processes the first rename wins. A read-only cache location gets the
    set generated into a temporary folder for this process.
    """
    from common.data import digits_dataset

    root = Path(os.environ.get("CV_RECIPES_CACHE") or Path.home() / ".cache" / "cv-recipes")
    cache = root / f"digits_det-{DET_VERSION}-seed{seed}"
    if (cache / "annotations" / "instances_val.json").exists():
        return cache
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=root))
    except OSError:
        root = Path(tempfile.mkdtemp(prefix="cv-recipes-"))
        cache = tmp = root / cache.name
    source = digits_dataset()
    try:
        for split, count in DET_COUNTS.items():
            ds = source[DET_SOURCE[split]]
            glyphs = np.stack([np.asarray(image, np.uint8) for image in ds["image"]])  # (N, 8, 8)
            images, boxes, classes = render_scenes(glyphs, np.asarray(ds["label"]), count, seed, split)
            _write_coco_split(tmp, split, images, boxes, classes)
        if tmp != cache:
            tmp.rename(cache)
    except OSError:
        if not (cache / "annotations" / "instances_val.json").exists():  # not another process's win
            raise
    finally:
        if tmp != cache:
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


def crop_box(image: Image.Image, xywh: Sequence[float], size: int, margin: float = 0.15,
             shift: tuple[float, float] = (0.0, 0.0)) -> Image.Image:
    """The COCO box ``xywh`` (pixels) of ``image`` grown by ``margin`` of its longer side on every
    side, moved by ``shift`` (fractions of the grown window's width and height), clipped to the
    image and resized to ``size`` x ``size`` (bicubic): a detection box as a classification sample."""
    x, y, w, h = xywh
    m = margin * max(w, h)
    x0, y0, x1, y1 = x - m, y - m, x + w + m, y + h + m
    dx, dy = shift[0] * (x1 - x0), shift[1] * (y1 - y0)
    box = (max(x0 + dx, 0), max(y0 + dy, 0), min(x1 + dx, image.width), min(y1 + dy, image.height))
    return image.resize((size, size), Image.BICUBIC, box=box)


def digits_det_crops_dataset(seed: int = 0, size: int = 32, margin: float = 0.15) -> Any:
    """``digits_det_crops``: every box of ``digits_det`` cut out of its scene as a classification set,
    so that ``recipes/classifier.py`` can pretrain a detector's backbone on the detection demo's own
    data (DETR's demo does; ImageNet weights play that part with network). Each crop is the box grown
    by ``margin`` of its longer side on every side (clipped to the scene), resized to ``size`` px
    square (bicubic): splits ``train`` (the train scenes' digits) and ``test`` (the val scenes'),
    columns ``image`` and ``label`` (``ClassLabel`` '0'..'9'), as ``common.data.digits_dataset``.
    Built from the cached scenes in seconds; not cached itself."""
    import datasets

    data = load_detection("digits_det", seed=seed)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=data.classes)})
    splits = {}
    for name, table in (("train", data.train), ("test", data.eval)):
        images, labels = [], []
        for row in table.cast_column("image", datasets.Image(decode=False)):
            scene = decode_image(row["image"], row.get("file_name", ""))
            for box, category in zip(row["objects"]["bbox"], row["objects"]["category"]):
                images.append(crop_box(scene, box, size, margin))
                labels.append(category)
        splits[name] = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    return datasets.DatasetDict(splits)


# --------------------------------------------------------------------------------------------
# Loading: COCO-json folders, datasets with an `objects` column
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DetectionData:
    train: Any  # datasets.Dataset in the normalised schema (module docstring), images undecoded
    eval: Any
    classes: list[str]


def features() -> datasets.Features:
    """The normalised schema of every detection split (see the module docstring)."""
    import datasets

    return datasets.Features({
        "image": datasets.Image(decode=False),
        "image_id": datasets.Value("int64"),
        "width": datasets.Value("int32"),
        "height": datasets.Value("int32"),
        "objects": {
            "bbox": datasets.Sequence(datasets.Sequence(datasets.Value("float64"), length=4)),
            "category": datasets.Sequence(datasets.Value("int64")),
            "area": datasets.Sequence(datasets.Value("float64")),
            "iscrowd": datasets.Sequence(datasets.Value("int8")),
        },
    })


def _image_size(value: dict[str, Any] | Image.Image, name: str) -> tuple[int, int]:
    """(width, height) from an image's header, without decoding its pixels."""
    if isinstance(value, Image.Image):
        return value.size
    try:
        with Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]) as image:
            return image.size
    except Exception as e:
        raise UserError(f"cannot read image '{value.get('path') or name}': {type(e).__name__}: {e}") from None


def _coco_splits(folder: Path) -> dict[str, tuple[Path, list[Path]]]:
    """Split name -> (annotation json, folders its images may be in) for both common layouts:
    ``annotations/instances_<split>.json`` (COCO; images in ``<split>/``, ``<split>2017/``,
    ``images/`` or relative to the folder) and ``<split>/_annotations.coco.json`` (Roboflow)."""
    splits: dict[str, tuple[Path, list[Path]]] = {}
    for path in sorted((folder / "annotations").glob("instances_*.json")):
        name = path.stem[len("instances_"):]
        base = re.sub(r"20\d\d$", "", name)  # instances_val2017.json also answers to 'val'
        dirs = [folder / name, folder / f"{base}2017", folder / "images" / name, folder / "images", folder]
        splits[name] = (path, list(dict.fromkeys(dirs)))
        if base and base != name:
            splits.setdefault(base, splits[name])
    for path in sorted(folder.glob("*/_annotations.coco.json")):
        splits.setdefault(path.parent.name, (path, [path.parent]))
    return splits


def _load_coco_split(json_path: Path, image_dirs: list[Path], data: str) -> tuple[Any, list[str]]:
    """One COCO-json split as a normalised ``datasets.Dataset`` and its class names (categories by id)."""
    import datasets

    try:
        with open(json_path) as f:
            coco = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"annotation file '{json_path}' could not be read: {type(e).__name__}: {e}") from None
    if not isinstance(coco, dict) or not isinstance(coco.get("images"), list):
        raise UserError(f"annotation file '{json_path}' has no 'images' list; is it a COCO detection file?")
    categories = sorted(coco.get("categories") or [], key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(categories)}  # COCO category id -> contiguous class index
    classes = [str(c.get("name", c["id"])) for c in categories]

    images = coco["images"]
    folder = next((d for d in image_dirs if images and (d / images[0]["file_name"]).exists()), None)
    if images and folder is None:
        where = ", ".join(f"'{d}'" for d in image_dirs)
        raise UserError(f"image '{images[0]['file_name']}' of '{json_path}' is in none of {where}")
    rows = {img["id"]: {"bbox": [], "category": [], "area": [], "iscrowd": []} for img in images}
    for ann in coco.get("annotations") or []:
        objects = rows.get(ann.get("image_id"))
        if objects is None:
            raise UserError(f"annotation {ann.get('id')} in '{json_path}' refers to image_id "
                            f"{ann.get('image_id')}, which is not in its 'images'")
        if ann.get("category_id") not in index:
            raise UserError(f"annotation {ann.get('id')} in '{json_path}' has category_id "
                            f"{ann.get('category_id')}, which is not in its 'categories'")
        bbox = ann.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4:
            raise UserError(f"annotation {ann.get('id')} in '{json_path}' has bbox {bbox!r}; expected [x, y, w, h]")
        objects["bbox"].append([float(v) for v in bbox])
        objects["category"].append(index[ann["category_id"]])
        objects["area"].append(float(ann.get("area", bbox[2] * bbox[3])))
        objects["iscrowd"].append(int(ann.get("iscrowd", 0)))

    paths = [str(folder / img["file_name"]) for img in images] if folder else []
    sizes = [(img["width"], img["height"]) if "width" in img and "height" in img
             else _image_size({"path": p}, p) for img, p in zip(images, paths)]
    table = {
        "image": [{"path": p, "bytes": None} for p in paths],
        "image_id": [img["id"] for img in images],
        "width": [w for w, _ in sizes],
        "height": [h for _, h in sizes],
        "objects": list(rows.values()),
    }
    return datasets.Dataset.from_dict(table, features=features()), classes


_BOX_KEYS = ("bbox", "bboxes", "boxes")
_CATEGORY_KEYS = ("category", "categories", "category_id", "label", "labels", "class", "class_id")


def _normalise(ds: Any, data: str, split: str) -> tuple[Any, list[str] | None]:
    """A dataset with an ``objects`` column (COCO xywh boxes in pixels, as cppe-5) in the normalised
    schema, and its class names (from a ClassLabel, else None)."""
    import datasets

    columns = ds.features
    objects_feature = columns.get("objects")
    inner = objects_feature if isinstance(objects_feature, dict) else getattr(objects_feature, "feature", None)
    if not isinstance(inner, dict):
        raise UserError(f"split '{split}' of '{data}' has no 'objects' column (it has {list(columns)}); expected a "
                        "COCO-json folder (annotations/instances_<split>.json or <split>/_annotations.coco.json) "
                        "or a dataset whose 'objects' hold COCO [x, y, w, h] boxes and categories")
    box_key = next((k for k in _BOX_KEYS if k in inner), None)
    category_key = next((k for k in _CATEGORY_KEYS if k in inner), None)
    if box_key is None or category_key is None:
        raise UserError(f"the 'objects' of '{data}' have keys {list(inner)}; expected a box key "
                        f"({'/'.join(_BOX_KEYS)}) and a category key ({'/'.join(_CATEGORY_KEYS)})")
    image_column = next((k for k, f in columns.items() if isinstance(f, datasets.Image)), None)
    if image_column is None:
        raise UserError(f"split '{split}' of '{data}' has no image column (it has {list(columns)})")
    category_feature = inner[category_key]
    category_feature = getattr(category_feature, "feature", category_feature)  # inside a list, or not
    names = list(category_feature.names) if isinstance(category_feature, datasets.ClassLabel) else None

    images = ds.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
    meta = ds.select_columns([c for c in ("image_id", "width", "height", "objects") if c in columns])[:]
    table: dict[str, list] = {"image_id": meta.get("image_id") or list(range(len(ds))), "width": [], "height": [],
                              "objects": []}
    for i, objects in enumerate(meta["objects"]):
        if isinstance(objects, list):  # a list of per-object dicts rather than a dict of lists
            objects = {k: [o[k] for o in objects] for k in inner}
        boxes = [[float(v) for v in box] for box in objects[box_key]]
        if any(len(box) != 4 for box in boxes):
            raise UserError(f"row {i} of split '{split}' of '{data}' has a box that is not [x, y, w, h]")
        table["objects"].append({
            "bbox": boxes,
            "category": [int(c) for c in objects[category_key]],
            "area": [float(a) for a in objects["area"]] if "area" in objects else [b[2] * b[3] for b in boxes],
            "iscrowd": [int(c) for c in objects["iscrowd"]] if "iscrowd" in objects else [0] * len(boxes),
        })
    if "width" in meta and "height" in meta:
        table["width"], table["height"] = meta["width"], meta["height"]
    else:  # read each image's header: slower, but needed only once per load
        for i, value in enumerate(images[image_column]):
            w, h = _image_size(value, f"row {i} of split '{split}' of '{data}'")
            table["width"].append(w)
            table["height"].append(h)
    schema = features()
    meta_features = datasets.Features({k: v for k, v in schema.items() if k != "image"})
    meta_ds = datasets.Dataset.from_dict(table, features=meta_features)
    if image_column != "image":
        images = images.rename_column(image_column, "image")
    return datasets.concatenate_datasets([images, meta_ds], axis=1), names


def _load_table(data: str) -> Any:
    """A ``DatasetDict`` or ``Dataset`` from a ``save_to_disk`` folder, a local repository copy or a hub name."""
    return load_saved_or_hub(data, "detection dataset", f"{', '.join(BUILTIN)}, a COCO-json folder, a saved dataset, "
                             "or a hub dataset name (with network, or already in the cache)")


def _sources(data: str) -> tuple[dict[str, Callable[[], tuple[Any, list[str] | None]]], str]:
    """Split name -> a function loading it (normalised dataset, class names or None); and a
    description of where the splits were looked for, for error messages."""
    path = Path(data)
    if data == "digits_det":
        path = digits_det_folder()
    elif path.is_file():
        raise UserError(f"data '{data}' is a file; expected a folder (COCO-json layout or a saved dataset)")
    if path.is_dir() and ((path / "annotations").is_dir() or any(path.glob("*/_annotations.coco.json"))):
        where = f"COCO folder '{data}' (annotations/instances_<split>.json or <split>/_annotations.coco.json)"
        return {split: (lambda p=p, dirs=dirs: _load_coco_split(p, dirs, data))
                for split, (p, dirs) in _coco_splits(path).items()}, where
    table = _load_table(data)
    if not hasattr(table, "keys"):  # a single Dataset: the training split
        table = {"train": table}
    return {split: (lambda split=split: _normalise(table[split], data, split)) for split in table}, f"'{data}'"


def load_detection(data: str, train_split: str = "train", eval_split: str = "", seed: int = 0,
                   eval_fraction: float = 0.1) -> DetectionData:
    """Load train and evaluation splits of a detection dataset in the normalised schema.

    ``data``: ``digits_det``, a COCO-json folder, a ``save_to_disk`` folder, a local copy of a hub
    repository, or a hub name (``org/name`` or ``org/name:config``). ``eval_split`` empty: the first of
    validation/val/valid/test that exists, else a seeded ``eval_fraction`` of the training split.
    Classes: the COCO categories sorted by id, else the ClassLabel names, else '0'..'C-1'.
    Crowd annotations stay in the rows (``objects.iscrowd``) for the evaluator; :class:`DetectionDataset`
    never makes them training targets. Images without objects stay: they are negatives.
    """
    sources, where = _sources(data)
    if train_split not in sources:
        raise UserError(f"{where} has no split '{train_split}'; it has {sorted(sources) or 'none'}")
    eval_split = eval_split or next((s for s in EVAL_SPLITS if s in sources and s != train_split), "")
    if eval_split and eval_split not in sources:
        raise UserError(f"{where} has no split '{eval_split}'; it has {sorted(sources)}")
    train, names = sources[train_split]()
    if eval_split:
        evaluation, eval_names = sources[eval_split]()
        if names is not None and eval_names is not None and eval_names != names:
            raise UserError(f"the evaluation split of '{data}' has classes {eval_names[:5]}... but the training "
                            f"split has {names[:5]}... ({len(eval_names)} vs {len(names)})")
    else:
        if len(train) < 2:
            raise UserError(f"the training split of '{data}' has {len(train)} images: "
                            "too few to carve an evaluation split")
        parts = train.train_test_split(test_size=eval_fraction, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    for name, ds in (("training", train), ("evaluation", evaluation)):
        if len(ds) == 0:
            raise UserError(f"the {name} split of '{data}' is empty")
    top = max((max(o["category"], default=-1) for ds in (train, evaluation) for o in ds["objects"]), default=-1)
    if names is None:
        names = [str(i) for i in range(top + 1)]
    if top >= len(names):
        raise UserError(f"'{data}' has category {top}, but only {len(names)} classes")
    if not names:
        raise UserError(f"'{data}' has no categories and no objects")
    return DetectionData(train, evaluation, names)


# --------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------
class RandomCropAtMost:
    """Crop to at most ``size`` x ``size`` at a random position (a no-op on a smaller image).

    Written here because ``v2.RandomCrop(pad_if_needed=True)`` would also pad, on both sides, and
    neither it nor ``v2.RandomIoUCrop`` (which needs boxes in every image) has a visibility rule.

    A box of which less than ``min_visibility`` of the area stays in the crop is made empty, so
    SanitizeBoundingBoxes drops it: a digit cut in half may read as another class. Called by
    ``v2.Compose`` with ``(image, target)``; randomness from torch's global generator (seeded per sample).
    """

    def __init__(self, size: int, min_visibility: float = 0.5) -> None:
        self.size, self.min_visibility = size, min_visibility

    def __call__(self, image: tv_tensors.Image, target: dict[str, Any]) -> tuple[tv_tensors.Image, dict[str, Any]]:
        h, w = image.shape[-2:]
        ch, cw = min(h, self.size), min(w, self.size)
        if (ch, cw) == (h, w):
            return image, target
        top = int(torch.randint(h - ch + 1, ()))
        left = int(torch.randint(w - cw + 1, ()))
        boxes = target["boxes"]
        before = _areas(F.clamp_bounding_boxes(boxes))
        cropped = F.crop(boxes, top, left, ch, cw)  # shifts and clamps to the crop
        hidden = _areas(cropped) < self.min_visibility * before
        if hidden.any():
            corners = cropped.as_subclass(torch.Tensor).clone()
            corners[hidden, 2:] = corners[hidden, :2]  # empty: removed by SanitizeBoundingBoxes
            cropped = tv_tensors.wrap(corners, like=cropped)
        return F.crop(image, top, left, ch, cw), {**target, "boxes": cropped}


def _areas(boxes: torch.Tensor) -> torch.Tensor:
    """Areas (N,) of XYXY boxes (N, 4)."""
    return (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)


class PadTo:
    """Pad right and bottom to ``size`` x ``size`` with 0 (after Normalize: the mean colour), so box
    coordinates do not move; records the unpadded ``(h, w)`` as ``target["size"]``. (``v2.Pad`` takes
    fixed amounts; the amounts here depend on each image's size.)"""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: tv_tensors.Image, target: dict[str, Any]) -> tuple[tv_tensors.Image, dict[str, Any]]:
        h, w = image.shape[-2:]
        padding = [0, 0, max(self.size - w, 0), max(self.size - h, 0)]  # left, top, right, bottom
        target = {**target, "size": (int(h), int(w)), "boxes": F.pad(target["boxes"], padding)}
        return F.pad(image, padding, fill=0.0), target


def detection_transforms(train: bool, size: int, scale_range: tuple[float, float] = (0.5, 1.5),
                         hflip: float = 0.5, color_jitter: bool = True, min_visibility: float = 0.5) -> v2.Compose:
    """Box-aware transforms ``(PIL image, {"boxes": BoundingBoxes, "labels": Tensor}) -> (image, target)``.

    Output: a float image [3, size, size] normalised with ImageNet mean/std, the picture in the top-left
    ``target["size"] = (h, w)`` and zeros (the mean colour) right and bottom; XYXY boxes in its pixels.

    train: large-scale jitter as in "Simple Copy-Paste" (resize so the image fits ``size`` x ``size``
    times a factor in ``scale_range``, then a random crop of at most ``size`` x ``size`` where it is
    larger; boxes less than ``min_visibility`` inside are dropped), horizontal flip with probability
    ``hflip`` (use 0 for digits: mirrored digits are not digits), photometric distortion (brightness,
    contrast, saturation, hue, channel order: torchvision's SSD recipe), pad.
    eval: resize so the longest side is ``size`` (aspect kept), pad.
    Both end with SanitizeBoundingBoxes: boxes under 1 px wide or tall go, with their labels.
    torchvision.transforms.v2 does all the box arithmetic; only the crop and the pad are written here.
    """
    if not 0 < scale_range[0] <= scale_range[1]:
        raise UserError(f"scale_range must be 0 < low <= high, got {scale_range}")
    steps: list[Callable] = [v2.ToImage()]
    if train:
        steps += [v2.ScaleJitter((size, size), scale_range=tuple(scale_range), antialias=True),
                  RandomCropAtMost(size, min_visibility)]
        if hflip > 0:
            steps.append(v2.RandomHorizontalFlip(hflip))
        if color_jitter:
            steps.append(v2.RandomPhotometricDistort(p=0.5))
    else:
        steps.append(v2.Resize(None, max_size=size, antialias=True))
    steps += [v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes(min_size=1.0),
              v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD), PadTo(size)]
    return v2.Compose(steps)


def rescale_boxes(boxes_xyxy: torch.Tensor, size: tuple[int, int], orig_size: tuple[int, int]) -> torch.Tensor:
    """Map XYXY boxes (N, 4) from the transformed image (``target["size"]``: the unpadded (h, w)) to the
    original image (``target["orig_size"]``), per axis: what :class:`CocoEvaluator` expects. Not clipped."""
    (h, w), (oh, ow) = size, orig_size
    scale = torch.tensor([ow / w, oh / h, ow / w, oh / h], dtype=torch.float32, device=boxes_xyxy.device)
    return boxes_xyxy.float() * scale


# --------------------------------------------------------------------------------------------
# Dataset and collate
# --------------------------------------------------------------------------------------------
class DetectionDataset(torch.utils.data.Dataset):
    """``(image, target)`` pairs from a normalised detection dataset, transformed reproducibly.

    Indexed by ``(epoch, index)`` (what :class:`common.data.EpochBatchSampler` yields) or a plain
    index (epoch 0, for evaluation). ``target``: ``boxes`` (BoundingBoxes XYXY float32 [N, 4], pixels
    of the transformed image), ``labels`` (int64 [N]), ``image_id`` (int), ``orig_size`` (h, w of the
    original), ``size`` (h, w of the picture in the transformed image, padding excluded), and
    ``dropped`` (int): boxes of this sample that are not targets because they were degenerate, cut
    by the crop or out of the image (crowd regions are not counted). DataLoader workers cannot update
    an attribute the main process sees, so a recipe sums ``target["dropped"]`` over its batches to log it.
    """

    def __init__(self, ds: Any, transform: Callable, seed: int = 0) -> None:
        self.ds, self.transform, self.seed = ds, transform, seed

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row = self.ds[int(index)]
        image = decode_image(row["image"], f"row {index} (image_id {row['image_id']})")
        objects = row["objects"]
        keep = [i for i, crowd in enumerate(objects["iscrowd"]) if not crowd]
        xywh = torch.tensor([objects["bbox"][i] for i in keep], dtype=torch.float32).reshape(-1, 4)
        boxes = tv_tensors.BoundingBoxes(xywh, format="XYWH", canvas_size=(image.height, image.width))
        target = {"boxes": F.convert_bounding_box_format(boxes, new_format=tv_tensors.BoundingBoxFormat.XYXY),
                  "labels": torch.tensor([objects["category"][i] for i in keep], dtype=torch.int64)}
        with seeded(sample_seed(self.seed, epoch, index)):
            out, target = self.transform(image, target)
        out = out.as_subclass(torch.Tensor)
        target.update(image_id=int(row["image_id"]), orig_size=(image.height, image.width),
                      dropped=len(keep) - len(target["boxes"]))
        target.setdefault("size", tuple(out.shape[-2:]))
        return out, target


class BoxCropDataset(torch.utils.data.Dataset):
    """Every box of a normalised detection dataset as a classification sample ``(image [3, size, size]
    float normalised with the ImageNet mean and std as the detection transforms do, class index)``,
    cut by :func:`crop_box` (crowd regions and boxes under 1 px left out). What a detector's backbone
    can be pre-trained on when no pretrained weights are at hand (recipes/detr.py does).

    ``shift`` > 0 (training): the window moves by up to that fraction of its side on each axis, drawn
    per ``(epoch, index)`` (keys as :class:`DetectionDataset`'s), so that the classifier does not learn
    that a digit always sits in the middle. Scenes are decoded per crop, nothing is cached: any size of
    dataset stays on disk, and DataLoader workers do the decoding.
    """

    def __init__(self, ds: Any, size: int = 32, margin: float = 0.15, shift: float = 0.0, seed: int = 0) -> None:
        self.ds, self.size, self.margin, self.shift, self.seed = ds, size, margin, shift, seed
        objects = ds.select_columns(["objects"])[:]["objects"]
        self.items = [(row, box, category) for row, o in enumerate(objects)
                      for box, category, crowd in zip(o["bbox"], o["category"], o["iscrowd"])
                      if not crowd and box[2] >= 1 and box[3] >= 1]  # (row, COCO box, class)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row, box, category = self.items[int(index)]
        image = decode_image(self.ds[row]["image"], f"row {row} of the detection dataset")
        shift = (0.0, 0.0)
        if self.shift > 0:
            shift = tuple(np.random.default_rng(sample_seed(self.seed, epoch, index)).uniform(-self.shift, self.shift, 2))
        crop = F.to_dtype(F.pil_to_tensor(crop_box(image, box, self.size, self.margin, shift)), torch.float32, scale=True)
        return F.normalize(crop, IMAGENET_MEAN, IMAGENET_STD), int(category)


def collate(batch: Sequence[tuple[torch.Tensor, dict[str, Any]]]
            ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """Images [B, 3, Hmax, Wmax] zero-padded right and bottom, mask [B, Hmax, Wmax] (True = padding:
    outside each image's ``target["size"]``, so the transforms' padding counts too), targets list."""
    images, targets = zip(*batch)
    height, width = max(x.shape[-2] for x in images), max(x.shape[-1] for x in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    mask = torch.ones((len(images), height, width), dtype=torch.bool)
    for i, (image, target) in enumerate(zip(images, targets)):
        h, w = image.shape[-2:]
        out[i, :, :h, :w] = image
        vh, vw = target.get("size", (h, w))
        mask[i, : min(vh, h), : min(vw, w)] = False
    return out, mask, list(targets)


# --------------------------------------------------------------------------------------------
# COCO evaluation
# --------------------------------------------------------------------------------------------
METRICS = ("map", "map_50", "map_75", "map_small", "map_medium", "map_large")  # COCOeval.stats[:6]


class CocoEvaluator:
    """COCO box mAP with pycocotools, from predictions in original image pixels, across processes.

    Ground truth comes from the evaluation ``datasets.Dataset`` (normalised schema): boxes in original
    pixels, category id = class index, COCO areas and crowd flags as loaded, so the numbers are those
    of pycocotools on the original json. ``update`` keeps the first predictions seen per image_id:
    the repeated samples with which Accelerate pads the last evaluation batch count once, so results
    do not depend on batch size or process count. ``compute`` gathers from every process (all get the
    same numbers) and returns fractions 0..1 as pycocotools gives them, -1 where the split has no
    ground truth of that size (``map_large`` on digits_det). Call ``reset`` before each evaluation:
    predictions left from the previous one would win over the new ones.
    """

    def __init__(self, ds: Any, classes: Sequence[str] | None = None) -> None:
        from pycocotools.coco import COCO

        meta = ds.select_columns(["image_id", "width", "height", "objects"])[:]
        ids = [int(i) for i in meta["image_id"]]
        if len(set(ids)) != len(ids):
            raise UserError("the evaluation split has repeated image_id values; COCO evaluation needs them unique")
        images, annotations = [], []
        for image_id, w, h, objects in zip(ids, meta["width"], meta["height"], meta["objects"]):
            images.append({"id": image_id, "width": int(w), "height": int(h)})
            for box, category, area, crowd in zip(objects["bbox"], objects["category"], objects["area"],
                                                  objects["iscrowd"]):
                # ids from 1: COCOeval takes a matched id of 0 for "unmatched"
                annotations.append({"id": len(annotations) + 1, "image_id": image_id, "bbox": list(box),
                                    "category_id": int(category), "area": float(area), "iscrowd": int(crowd)})
        count = len(classes) if classes is not None else 1 + max((a["category_id"] for a in annotations), default=0)
        names = list(classes) if classes is not None else [str(i) for i in range(count)]
        self.gt = COCO()
        self.gt.dataset = {"images": images, "annotations": annotations,
                           "categories": [{"id": i, "name": n} for i, n in enumerate(names)]}
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            self.gt.createIndex()
        self.image_ids = set(ids)
        self.predictions: dict[int, np.ndarray] = {}

    def reset(self) -> None:
        self.predictions = {}

    def update(self, predictions: Sequence[dict[str, Any]]) -> None:
        """Per image: ``image_id`` (int), ``boxes`` [N, 4] XYXY in original pixels, ``scores`` [N],
        ``labels`` [N] (class indices); tensors on any device, copied to the CPU here."""
        for p in predictions:
            image_id = int(p["image_id"])
            if image_id not in self.image_ids:
                raise ValueError(f"prediction for image_id {image_id}, which is not in the evaluation split")
            if image_id in self.predictions:
                continue
            boxes = torch.as_tensor(p["boxes"]).as_subclass(torch.Tensor).detach()
            boxes = boxes.to("cpu", torch.float64).reshape(-1, 4)
            scores = torch.as_tensor(p["scores"]).detach().to("cpu", torch.float64).reshape(-1, 1)
            labels = torch.as_tensor(p["labels"]).detach().to("cpu", torch.float64).reshape(-1, 1)
            xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1)
            self.predictions[image_id] = torch.cat([xywh, scores, labels], 1).numpy()  # (N, 6)

    def compute(self, accelerator: Any = None) -> dict[str, float]:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        local = list(self.predictions.items())
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            local = gather_object(local)  # every process's list, in rank order
        merged: dict[int, np.ndarray] = {}
        for image_id, rows in local:
            merged.setdefault(image_id, rows)
        # A fixed order (images by id, each image's detections as the model gave them): COCOeval breaks
        # score ties by input order, so the order of arrival must not matter.
        results = [{"image_id": image_id, "bbox": row[:4].tolist(), "score": float(row[4]), "category_id": int(row[5])}
                   for image_id in sorted(merged) for row in merged[image_id]]
        with contextlib.redirect_stdout(io.StringIO()):
            if results:
                dt = self.gt.loadRes(results)
            else:  # loadRes rejects an empty list; no detections scores 0 wherever there is ground truth
                dt = COCO()
                dt.dataset = {"images": list(self.gt.dataset["images"]), "annotations": [],
                              "categories": list(self.gt.dataset["categories"])}
                dt.createIndex()
            evaluation = COCOeval(self.gt, dt, iouType="bbox")
            evaluation.evaluate()
            evaluation.accumulate()
            evaluation.summarize()
        return {name: float(value) for name, value in zip(METRICS, evaluation.stats[:6])}


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------
def _boxes(x: Any) -> torch.Tensor:
    return torch.as_tensor(x if x is not None else []).detach().cpu().float().reshape(-1, 4).as_subclass(torch.Tensor)


def _values(x: Any) -> list:
    return torch.as_tensor(x if x is not None else []).detach().cpu().reshape(-1).tolist()


def draw_detections(image: Image.Image | torch.Tensor, target_boxes: Any, target_labels: Any, pred_boxes: Any,
                    pred_labels: Any, pred_scores: Any, classes: Sequence[str], score_threshold: float = 0.3,
                    min_size: int = 256) -> Image.Image:
    """The image with ground truth in green and predictions (score >= ``score_threshold``) in red,
    labelled "class score". Boxes XYXY in the image's pixels. ``image``: PIL, uint8 [3, H, W], or a
    float [3, H, W] normalised with the ImageNet mean and std (what :func:`detection_transforms`
    gives). An image whose shorter side is under ``min_size`` is first enlarged by an integer factor
    (nearest), so that labels stay legible on 96-px scenes."""
    from torchvision.utils import draw_bounding_boxes

    pixels = F.pil_to_tensor(image.convert("RGB")) if isinstance(image, Image.Image) else image.detach().cpu()
    if pixels.is_floating_point():  # undo the normalisation; out-of-range values would wrap around in uint8
        mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
        pixels = (pixels.float() * std + mean).clamp(0, 1).mul(255).round().to(torch.uint8)
    factor = max(1, -(-min_size // min(pixels.shape[-2:])))
    if factor > 1:
        pixels = pixels.repeat_interleave(factor, -2).repeat_interleave(factor, -1)
    gt = _boxes(target_boxes) * factor
    names = [classes[int(c)] if 0 <= int(c) < len(classes) else str(int(c)) for c in _values(target_labels)]
    if len(gt):
        pixels = draw_bounding_boxes(pixels, gt, labels=names, colors="lime", width=max(1, factor // 2))
    scores = _values(pred_scores)
    keep = [i for i, s in enumerate(scores) if s >= score_threshold]
    pred, labels = _boxes(pred_boxes)[keep] * factor, [_values(pred_labels)[i] for i in keep]
    captions = [f"{classes[int(c)] if 0 <= int(c) < len(classes) else int(c)} {scores[i]:.2f}"
                for i, c in zip(keep, labels)]
    if len(pred):
        pixels = draw_bounding_boxes(pixels, pred, labels=captions, colors="red", width=max(1, factor // 2))
    return F.to_pil_image(pixels)


def wandb_boxes(target_boxes: Any, target_labels: Any, pred_boxes: Any, pred_labels: Any, pred_scores: Any,
                classes: Sequence[str], score_threshold: float = 0.3) -> dict[str, Any]:
    """``boxes=`` for ``wandb.Image(image, boxes=...)``: ground truth and predictions (score >=
    ``score_threshold``), XYXY in the image's pixels, with the class-id -> name mapping."""
    class_labels = {i: name for i, name in enumerate(classes)}

    def box_data(boxes: Any, labels: Any, scores: list[float] | None) -> list[dict[str, Any]]:
        out = []
        for i, (box, c) in enumerate(zip(_boxes(boxes).tolist(), _values(labels))):
            if scores is not None and scores[i] < score_threshold:
                continue
            entry = {"position": {"minX": box[0], "minY": box[1], "maxX": box[2], "maxY": box[3]},
                     "domain": "pixel", "class_id": int(c), "box_caption": class_labels.get(int(c), str(int(c)))}
            if scores is not None:
                entry["scores"] = {"score": scores[i]}
                entry["box_caption"] += f" {scores[i]:.2f}"
            out.append(entry)
        return out

    return {"ground_truth": {"box_data": box_data(target_boxes, target_labels, None), "class_labels": class_labels},
            "predictions": {"box_data": box_data(pred_boxes, pred_labels, _values(pred_scores)),
                            "class_labels": class_labels}}


def save_detections(images: Sequence[torch.Tensor], targets: Sequence[dict[str, Any]],
                    predictions: Sequence[dict[str, Any]], classes: Sequence[str], path: Path,
                    wandb_run: Any = None, step: int = 0, score_threshold: float = 0.3) -> None:
    """Ground truth (green) and predictions (red) of a few images side by side in one PNG at ``path``;
    with ``wandb_run`` (a ``wandb`` run), also each plain image at its own size with its boxes as
    W&B box overlays under the key ``detections``. ``images``: what :func:`draw_detections` takes;
    ``targets``: ``boxes`` and ``labels``; ``predictions``: ``boxes``, ``labels`` (0-based, as
    ``classes``) and ``scores``; boxes XYXY in each image's pixels. Every recipe's "plots" step."""
    pictures = [draw_detections(image, t["boxes"], t["labels"], p["boxes"], p["labels"], p["scores"], classes,
                                score_threshold) for image, t, p in zip(images, targets, predictions)]
    height = max(p.height for p in pictures)
    canvas = np.concatenate([np.pad(np.asarray(p), ((0, height - p.height), (0, 0), (0, 0))) for p in pictures], axis=1)
    Image.fromarray(canvas).save(path)
    if wandb_run is not None:
        import wandb

        none = torch.zeros(0, 4)  # the plain image, at its own size: W&B draws the boxes, in its pixels
        logged = [wandb.Image(draw_detections(image, none, [], none, [], [], classes, min_size=1),
                              boxes=wandb_boxes(t["boxes"], t["labels"], p["boxes"], p["labels"], p["scores"], classes,
                                                score_threshold))
                  for image, t, p in zip(images, targets, predictions)]
        wandb_run.log({"detections": logged}, step=step)


# --------------------------------------------------------------------------------------------
# Anchors
# --------------------------------------------------------------------------------------------
def kmeans_anchors(boxes_wh: np.ndarray, k: int, seed: int = 0, iterations: int = 300) -> np.ndarray:
    """``k`` anchor (w, h) pairs (k, 2), sorted by area, by k-means on box widths and heights
    (``boxes_wh`` (N, 2), pixels) with distance 1 - IoU of boxes sharing a corner (YOLOv2): large
    boxes do not dominate as with Euclidean distance. Centres start at k-means++ picks and move to
    the median of their members."""
    wh = np.asarray(boxes_wh, np.float64).reshape(-1, 2)
    wh = wh[(wh > 0).all(1)]
    if len(np.unique(wh, axis=0)) < k:
        raise UserError(f"{len(wh)} boxes ({len(np.unique(wh, axis=0))} distinct sizes) are too few for {k} anchors")

    def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # (N, 2), (K, 2) -> (N, K)
        inter = np.minimum(a[:, None, 0], b[None, :, 0]) * np.minimum(a[:, None, 1], b[None, :, 1])
        return inter / (a[:, None].prod(-1) + b[None].prod(-1) - inter)

    rng = np.random.default_rng(seed)
    centres = wh[[rng.integers(len(wh))]]
    while len(centres) < k:  # k-means++: the next centre far (in 1 - IoU) from the chosen ones
        distance = (1 - iou(wh, centres).max(1)) ** 2
        centres = np.concatenate([centres, wh[[rng.choice(len(wh), p=distance / distance.sum())]]])
    assignment = None
    for _ in range(iterations):
        new = iou(wh, centres).argmax(1)
        if assignment is not None and np.array_equal(new, assignment):
            break
        assignment = new
        centres = np.stack([np.median(wh[assignment == j], 0) if (assignment == j).any() else centres[j]
                            for j in range(k)])
    return centres[np.argsort(centres.prod(1))]
