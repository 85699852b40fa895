"""``shapes_seg``: a built-in instance-segmentation set of 96x96 scenes with 1-5 flat shapes each, as a COCO-json
folder whose annotations carry each shape's polygon.

Every shape is drawn from its own polygon (filled at 4x and box-filtered down), so the polygon is its exact mask,
and shapes never share a pixel, so no mask is cut by another. The classes are chosen so that a box is a poor mask:
thin rotated ``bar``\\ s, ``ell``\\ s (an L, any rotation), ``triangle``\\ s and five-pointed ``star``\\ s; their
boxes overlap where their pixels do not. Backgrounds are colour gradients with sensor noise. Generation is
deterministic in ``seed`` (a numpy Generator per split and scene) and cached (:mod:`.cache`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from common.data.builtin.cache import cached_folder

SEG_SIZE = 96  # canvas side, pixels
SEG_SS = 4  # supersampling of the shapes' edges
SEG_VERSION = "v1"  # part of the cache folder name: change it whenever the rendering changes
SEG_COUNTS = {"train": 1200, "val": 300}  # scenes per split
SEG_CLASSES = ("bar", "ell", "triangle", "star")
_SPLIT_ID = {"train": 0, "val": 1}
SIDE = (18.0, 46.0)  # a shape's size (its longer extent before rotation), px


def _outline(kind: str, rng: np.random.Generator, size: float) -> np.ndarray:
    """A shape's polygon [P, 2] (x, y) around the origin, unrotated, of extent about ``size`` px."""
    if kind == "bar":
        w = size * rng.uniform(0.14, 0.24)
        return np.array([[-size / 2, -w / 2], [size / 2, -w / 2], [size / 2, w / 2], [-size / 2, w / 2]])
    if kind == "ell":
        t = size * rng.uniform(0.2, 0.3)  # arm thickness
        s = size / 2
        return np.array([[-s, -s], [-s + t, -s], [-s + t, s - t], [s, s - t], [s, s], [-s, s]])
    if kind == "triangle":
        angles = np.array([90.0, 210.0, 330.0]) + rng.uniform(-15, 15, 3)
        r = size / 2 * np.array([1.0, rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)])
        return np.stack([r * np.cos(np.radians(angles)), r * np.sin(np.radians(angles))], 1)
    outer, inner = size / 2, size / 2 * rng.uniform(0.38, 0.5)  # star: 5 points, 10 corners
    angles = np.radians(np.arange(10) * 36.0 - 90.0)
    r = np.where(np.arange(10) % 2 == 0, outer, inner)
    return np.stack([r * np.cos(angles), r * np.sin(angles)], 1)


def _scene(rng: np.random.Generator) -> tuple[np.ndarray, list[list[float]], list[int]]:
    """One scene: the image [S, S, 3] uint8 and each shape's polygon (flat x, y list, pixels) and class index."""
    s = SEG_SIZE
    corners = rng.uniform(40, 215, (2, 2, 3)).astype(np.float32)  # a bilinear colour gradient
    u = np.linspace(0, 1, s, dtype=np.float32)[:, None, None]
    v = np.linspace(0, 1, s, dtype=np.float32)[None, :, None]
    image = (corners[0, 0] * (1 - u) * (1 - v) + corners[0, 1] * (1 - u) * v + corners[1, 0] * u * (1 - v)
             + corners[1, 1] * u * v)  # fmt: skip
    taken = np.zeros((s, s), bool)
    polygons: list[list[float]] = []
    classes: list[int] = []
    for _ in range(int(rng.integers(1, 6))):
        for _attempt in range(20):
            c = int(rng.integers(len(SEG_CLASSES)))
            size = rng.uniform(*SIDE)
            angle = rng.uniform(0, 2 * math.pi)
            rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            points = _outline(SEG_CLASSES[c], rng, size) @ rotation.T
            lo, hi = points.min(0), points.max(0)
            if (hi - lo).max() >= s - 4:
                continue
            centre = rng.uniform(-lo + 1, s - 1 - hi)
            points = points + centre
            coverage = _coverage(points)
            inside = coverage > 0
            if (inside & taken).any() or (coverage >= 0.5).sum() < 12:  # no shared pixel; big enough to see
                continue
            taken |= inside
            colour = rng.uniform(0, 255, 3).astype(np.float32)
            while np.abs(colour - image[inside].mean(0)).sum() < 120:  # stands out from the background there
                colour = rng.uniform(0, 255, 3).astype(np.float32)
            image = image * (1 - coverage[..., None]) + colour * coverage[..., None]
            polygons.append([round(float(v), 2) for v in points.reshape(-1)])
            classes.append(c)
            break
    image += (rng.random((s, s, 3), np.float32) - 0.5) * np.float32(rng.uniform(0, 4) * 12**0.5)
    return np.rint(image.clip(0, 255)).astype(np.uint8), polygons, classes


def _coverage(points: np.ndarray) -> np.ndarray:
    """The fraction [S, S] of each pixel inside the polygon ``points`` [P, 2] (pixel (i, j) spans x in [j, j + 1]),
    from a SEG_SS-times finer rasterisation."""
    big = Image.new("L", (SEG_SIZE * SEG_SS, SEG_SIZE * SEG_SS))
    ImageDraw.Draw(big).polygon([tuple(p) for p in points * SEG_SS], fill=255)
    fine = np.asarray(big, np.float32) / 255.0
    return fine.reshape(SEG_SIZE, SEG_SS, SEG_SIZE, SEG_SS).mean((1, 3))


def _write_split(root: Path, split: str, count: int, seed: int) -> None:
    """``root/<split>/<id>.png`` and ``root/annotations/instances_<split>.json`` (image ids from 1, category ids
    1..4 as COCO numbers from 1), each annotation with its polygon, box and area as pycocotools computes them."""
    from pycocotools import mask as coco_mask

    (root / split).mkdir(parents=True)
    (root / "annotations").mkdir(exist_ok=True)
    entries, annotations = [], []
    for i in range(1, count + 1):
        image, polygons, classes = _scene(np.random.default_rng([seed, _SPLIT_ID[split], i]))
        name = f"{i:06d}.png"
        Image.fromarray(image).save(root / split / name, format="PNG", compress_level=0)
        entries.append({"id": i, "file_name": name, "width": SEG_SIZE, "height": SEG_SIZE})
        for polygon, c in zip(polygons, classes):
            rle = coco_mask.frPyObjects([polygon], SEG_SIZE, SEG_SIZE)[0]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": c + 1,
                    "segmentation": [polygon],
                    "bbox": [float(v) for v in coco_mask.toBbox(rle)],
                    "area": float(coco_mask.area(rle)),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": c + 1, "name": name, "supercategory": "shape"} for c, name in enumerate(SEG_CLASSES)]
    with open(root / "annotations" / f"instances_{split}.json", "w") as f:
        json.dump({"images": entries, "annotations": annotations, "categories": categories}, f)


def shapes_seg_folder(seed: int = 0) -> Path:
    """The ``shapes_seg`` set as a COCO-json folder with polygon masks, generated on first use (seconds) and
    cached: 1,200 ``train`` and 300 ``val`` scenes of 96x96 px with 1-5 shapes (bar, ell, triangle, star; category
    ids 1..4). Layout: ``annotations/instances_{train,val}.json``, ``{train,val}/*.png``. Cached in
    ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``shapes_seg-v1-seed<seed>``."""

    def write(folder: Path) -> None:
        for split, count in SEG_COUNTS.items():
            _write_split(folder, split, count, seed)

    return cached_folder(f"shapes_seg-{SEG_VERSION}-seed{seed}", "annotations/instances_val.json", write)
