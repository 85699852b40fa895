"""``digits_det``: a built-in detection set of 96x96 scenes with 1-6 digits each, as a COCO-json
folder, and ``digits_det_crops``: every box of it cut out as a classification set.

Digits come from :func:`.digits.digits_dataset` (train scenes draw only its train digits, val scenes
only its test digits), drawn with :func:`.digits.coverage`, on gradient backgrounds with faint
clutter. Generation is deterministic in ``seed`` (a numpy Generator per split and scene) and cached.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw

from common.data.builtin.cache import cached_folder
from common.data.builtin.digits import blend, coverage, digits_dataset

if TYPE_CHECKING:
    import datasets

DET_SIZE = 96  # canvas side, pixels
DET_SS = 2  # supersampling of the clutter strokes and blobs (drawn at 2x, box-filtered down)
DET_VERSION = "v1"  # part of the cache folder name: change it whenever the rendering changes
DET_COUNTS = {"train": 2000, "val": 400}  # scenes per split
DET_SOURCE = {"train": "train", "val": "test"}  # the split of digits_dataset drawn from
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


def _scene(
    rng: np.random.Generator, glyphs: np.ndarray, labels: np.ndarray
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
        cover = coverage(glyphs[k], cx - x0, cy - y0, height, aspect, angle, size=patch)
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
        blend(region, on_canvas, candidates[ok[0] if len(ok) else contrast.argmax()])
        occupied[ay:by, ax:bx] |= touched
        boxes.append(box)
        classes.append(int(labels[k]))
    # Sensor noise: uniform, zero-mean, standard deviation 0-4.
    image += (rng.random((S, S, 3), np.float32) - 0.5) * np.float32(rng.uniform(0, 4) * 12**0.5)
    return np.rint(image.clip(0, 255)).astype(np.uint8), boxes, classes, background


def render_scenes(
    glyphs: np.ndarray, labels: np.ndarray, count: int, seed: int, split: str
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


def _write_coco_split(
    root: Path, split: str, images: np.ndarray, boxes: list[np.ndarray], classes: list[np.ndarray]
) -> None:
    """``root/<split>/<id>.png`` and ``root/annotations/instances_<split>.json`` (image ids from 1)."""
    (root / split).mkdir(parents=True)
    (root / "annotations").mkdir(exist_ok=True)
    entries, annotations = [], []
    for i, (image, xywh, cls) in enumerate(zip(images, boxes, classes), start=1):
        name = f"{i:06d}.png"
        # PNG (lossless), stored without compression: compressing would make the files smaller and
        # the generation slower; pixels are the same either way.
        Image.fromarray(image).save(root / split / name, format="PNG", compress_level=0)
        entries.append({"id": i, "file_name": name, "width": DET_SIZE, "height": DET_SIZE})
        for box, c in zip(xywh.tolist(), cls.tolist()):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": c,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": d, "name": str(d), "supercategory": "digit"} for d in range(10)]
    with open(root / "annotations" / f"instances_{split}.json", "w") as f:
        json.dump({"images": entries, "annotations": annotations, "categories": categories}, f)


def digits_det_folder(seed: int = 0) -> Path:
    """The ``digits_det`` set as a COCO-json folder, generated on first use (seconds) and cached.

    Scenes of 96x96 RGB with 1-6 digits each (train scenes draw only the 1,437 train digits of
    ``digits``, val scenes only its 360 test digits), boxes 10-48 px tall, on gradient backgrounds
    with faint strokes and blobs; 2,000 ``train`` and 400 ``val`` images, categories '0'..'9' with
    ids 0..9. Layout: ``annotations/instances_{train,val}.json``, ``{train,val}/*.png``.

    Cached in ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``digits_det-v1-seed<seed>``
    (:func:`.cache.cached_folder`).
    """

    def write(folder: Path) -> None:
        source = digits_dataset()
        for split, count in DET_COUNTS.items():
            ds = source[DET_SOURCE[split]]
            glyphs = np.stack([np.asarray(image, np.uint8) for image in ds["image"]])  # (N, 8, 8)
            images, boxes, classes = render_scenes(glyphs, np.asarray(ds["label"]), count, seed, split)
            _write_coco_split(folder, split, images, boxes, classes)

    return cached_folder(f"digits_det-{DET_VERSION}-seed{seed}", "annotations/instances_val.json", write)


def digits_det_crops_dataset(seed: int = 0, size: int = 32, margin: float = 0.15) -> datasets.DatasetDict:
    """``digits_det_crops``: every box of ``digits_det`` cut out of its scene as a classification set,
    so that ``recipes/classifier.py`` can pretrain a detector's backbone on the detection demo's own
    data (DETR's demo does; ImageNet weights play that part with network). Each crop is the box grown
    by ``margin`` of its longer side on every side (clipped to the scene), resized to ``size`` px
    square (bicubic; the arithmetic of ``common.detection.boxes.crop_box``, which this leaf package cannot
    import): splits ``train`` (the train scenes' digits) and ``test`` (the val scenes'), columns
    ``image`` and ``label`` (``ClassLabel`` '0'..'9'), as :func:`.digits.digits_dataset`. Built from the
    cached scenes and their annotations in seconds; not cached itself."""
    import datasets

    folder = digits_det_folder(seed)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(d) for d in range(10)])}
    )
    splits = {}
    for name, split in (("train", "train"), ("test", "val")):
        coco = json.loads((folder / "annotations" / f"instances_{split}.json").read_text())
        boxes: dict[int, list[dict]] = {entry["id"]: [] for entry in coco["images"]}
        for annotation in coco["annotations"]:
            boxes[annotation["image_id"]].append(annotation)
        images, labels = [], []
        for entry in coco["images"]:
            with Image.open(folder / split / entry["file_name"]) as png:
                scene = png.convert("RGB")
            for annotation in boxes[entry["id"]]:
                x, y, w, h = annotation["bbox"]
                m = margin * max(w, h)
                window = (max(x - m, 0), max(y - m, 0), min(x + w + m, scene.width), min(y + h + m, scene.height))
                images.append(scene.resize((size, size), Image.BICUBIC, box=window))
                labels.append(annotation["category_id"])  # category ids 0..9 are the class indices
        splits[name] = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    return datasets.DatasetDict(splits)
