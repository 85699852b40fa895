"""Instance masks as the detection data keeps them and as the detectors write them.

In the normalised schema (:mod:`common.detection.sources`) a split with masks has one more list in ``objects``:
``segmentation``, per object a JSON string of its COCO segmentation in the original image's pixels, either
polygons ``[[x1, y1, x2, y2, ...], ...]`` or a run-length encoding ``{"size": [h, w], "counts": ...}`` (counts
compressed, a string, or uncompressed, a list, as COCO's crowd regions), or ``""`` where the object has none. The
readers write them; :func:`mask_of` rasterises one with pycocotools, exactly as COCO's evaluation does, so a
training target, the evaluation's ground truth and pycocotools' ``COCOeval(iouType="segm")`` see one mask.

Predictions leave as COCO's compressed RLE (:func:`rle_of`: ``predictions.json``, ``detections.json``) and as
polygons for Ultralytics' segment labels (:func:`polygons_of`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np


def has_masks(ds: Any) -> bool:
    """Whether a normalised split (a ``datasets.Dataset``) carries ``objects.segmentation`` (some may be ``""``)."""
    objects = ds.features.get("objects")
    return isinstance(objects, dict) and "segmentation" in objects


def with_empty_masks(ds: Any) -> Any:
    """A box-only normalised split in the schema with masks, every object's segmentation ``""`` (to join it with
    a split that has masks)."""
    from common.detection.sources import features

    def add(row: dict[str, Any]) -> dict[str, Any]:
        return {"objects": {**row["objects"], "segmentation": [""] * len(row["objects"]["bbox"])}}

    return ds.map(add, features=features(masks=True))


def objects_with_masks(ds: Any) -> tuple[int, int]:
    """(objects with a segmentation, objects) of a normalised split, crowd regions included."""
    if not has_masks(ds):
        return 0, sum(len(o["bbox"]) for o in ds["objects"])
    column = ds.select_columns(["objects"])["objects"]
    return sum(sum(bool(s) for s in o["segmentation"]) for o in column), sum(len(o["bbox"]) for o in column)


def coco_segmentation(segmentation: str, height: int, width: int) -> Any:
    """The COCO annotation's ``segmentation`` value of a schema string (polygons as lists, RLE as a dict),
    for pycocotools' ground truth; None for ``""``."""
    if not segmentation:
        return None
    value = json.loads(segmentation)
    if isinstance(value, dict) and "size" not in value:
        value = {**value, "size": [height, width]}
    return value


def _rle(segmentation: Any, height: int, width: int) -> dict[str, Any]:
    """One compressed RLE of a COCO segmentation value (polygons merged, uncompressed counts compressed)."""
    from pycocotools import mask as coco_mask

    if isinstance(segmentation, list):  # polygons: one RLE each, merged (COCO's annToRLE)
        polygons = [p for p in segmentation if len(p) >= 6]
        if not polygons:
            return coco_mask.encode(np.zeros((height, width, 1), np.uint8, order="F"))[0]
        return coco_mask.merge(coco_mask.frPyObjects(polygons, height, width))
    if isinstance(segmentation["counts"], list):  # uncompressed (crowd regions)
        return coco_mask.frPyObjects(segmentation, *segmentation["size"])
    counts = segmentation["counts"]
    return {"size": list(segmentation["size"]), "counts": counts.encode() if isinstance(counts, str) else counts}


def mask_of(segmentation: str, height: int, width: int) -> np.ndarray:
    """The uint8 mask ``[height, width]`` (1 inside) of a schema string at the original image's size; zeros for
    ``""``. Polygons are rasterised as COCO rasterises them (pycocotools' ``frPyObjects``)."""
    value = coco_segmentation(segmentation, height, width)
    return np.zeros((height, width), np.uint8) if value is None else decoded(value, height, width)


def decoded(value: Any, height: int, width: int) -> np.ndarray:
    """The uint8 mask ``[height, width]`` of a COCO segmentation value (polygons, or an RLE dict such as
    :func:`rle_of` gives), as pycocotools decodes it."""
    from pycocotools import mask as coco_mask

    rle = _rle(value, height, width)
    if list(rle["size"]) != [height, width]:
        raise ValueError(f"a mask of size {rle['size']} on an image of {height} x {width}")
    return coco_mask.decode(rle)


def masks_of(segmentations: Sequence[str], height: int, width: int, out: tuple[int, int] | None = None) -> np.ndarray:
    """The uint8 masks ``[N, H, W]`` of an image's objects at its original size, or at ``out`` (h, w) when its
    pixels were decoded at another size: polygons rasterised there, run lengths resized by nearest neighbour."""
    h, w = out or (height, width)
    masks = np.zeros((len(segmentations), h, w), np.uint8)
    for i, segmentation in enumerate(segmentations):
        value = coco_segmentation(segmentation, height, width)
        if value is None:
            continue
        if isinstance(value, list) and (h, w) != (height, width):  # polygons: scaled, then rasterised at out
            sx, sy = w / width, h / height
            value = [[c * (sx if k % 2 == 0 else sy) for k, c in enumerate(p)] for p in value]
            masks[i] = decoded(value, h, w)
            continue
        full = decoded(value, height, width)
        if (h, w) != (height, width):
            rows = (np.arange(h) * height // h).clip(0, height - 1)
            cols = (np.arange(w) * width // w).clip(0, width - 1)
            full = full[rows][:, cols]
        masks[i] = full
    return masks


def rle_of(mask: np.ndarray) -> dict[str, Any]:
    """COCO's compressed RLE of a boolean or 0/1 mask ``[H, W]``: ``{"size": [H, W], "counts": str}`` (JSON-ready)."""
    return rles_of(mask[None])[0]


def rles_of(masks: np.ndarray) -> list[dict[str, Any]]:
    """:func:`rle_of` of each of ``masks`` ``[N, H, W]``, encoded by pycocotools in one call."""
    from pycocotools import mask as coco_mask

    stacked = np.asfortranarray(np.moveaxis(masks.astype(np.uint8), 0, -1))  # [H, W, N], as pycocotools reads them
    return [{"size": [int(v) for v in r["size"]], "counts": r["counts"].decode()} for r in coco_mask.encode(stacked)]


def polygons_of(mask: np.ndarray, min_points: int = 3) -> list[np.ndarray]:
    """The outlines of a mask ``[H, W]`` as polygons ``[P, 2]`` (x, y in pixels, on the pixel edges' midpoints
    between inside and outside: the 0.5 level of the mask's pixel centres), largest first; pieces of fewer than
    ``min_points`` points left out. For Ultralytics' segment labels, which hold one polygon per object: the first."""
    import contourpy

    if not mask.any():
        return []
    padded = np.pad(mask.astype(np.float64), 1)  # closed outlines where the mask touches the border
    lines = contourpy.contour_generator(z=padded, line_type=contourpy.LineType.Separate).lines(0.5)
    polygons = [np.asarray(line, np.float64)[:-1] - 1.0 + 0.5 for line in lines if len(line) > min_points]

    def area(p: np.ndarray) -> float:
        x, y = p[:, 0], p[:, 1]
        return abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))) / 2

    return sorted(polygons, key=area, reverse=True)


def joined(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """Outlines ``[P_i, 2]`` (a mask's pieces and holes, :func:`polygons_of`) as one polygon, for formats that hold one
    per object: each next outline is reached from the nearest point of those joined so far, walked round and left
    the same way, so that the bridges have no area and a rasteriser that fills by crossings (pycocotools')
    fills the pieces and leaves the holes out."""
    path = np.asarray(pieces[0], np.float64)
    for piece in pieces[1:]:
        piece = np.asarray(piece, np.float64)
        distance = ((path[:, None, :] - piece[None, :, :]) ** 2).sum(-1)  # [len(path), len(piece)]
        i, j = np.unravel_index(int(distance.argmin()), distance.shape)
        loop = np.concatenate([piece[j:], piece[: j + 1]])  # round the piece, back to where it was entered
        path = np.concatenate([path[: i + 1], loop, path[i:]])
    return path


def segment_lines(
    masks: Sequence[dict[str, Any]],
    boxes: Sequence[Sequence[float]],
    labels: Sequence[int],
    scores: Sequence[float] | None = None,
) -> str:
    """Detections with masks as an Ultralytics segment label file: per row ``class x1 y1 x2 y2 ...``, the class index
    and the outline of the mask, its pieces joined into one polygon (:func:`joined`), normalised by the image's
    size (the RLE's);
    a mask with no piece of three points gives its box's corners (XYXY ``boxes`` in pixels). With ``scores`` each
    row ends with its score (Ultralytics' ``save_conf`` form, for labelling tools; not a training label)."""
    out = []
    for n, (rle, box, c) in enumerate(zip(masks, boxes, labels)):
        height, width = rle["size"]
        pieces = polygons_of(decoded(rle, height, width))
        x0, y0, x1, y1 = box
        points = joined(pieces) if pieces else np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float64)
        values = (points / np.array([width, height], np.float64)).clip(0, 1).reshape(-1).tolist()
        values += [] if scores is None else [scores[n]]
        out.append(" ".join([str(int(c))] + [f"{float(v):.6g}" for v in values]) + "\n")
    return "".join(out)


def save_mask_png(masks: Sequence[dict[str, Any]], size: tuple[int, int], path: Any) -> None:
    """One image's masks (COCO RLEs) as one PNG of ``size`` (h, w) at ``path``: pixel value k = the k-th mask (from
    1, in the order given: detections.json's), 0 = none; where masks overlap, the earlier (more confident) wins.
    8-bit below 256 masks, else 16-bit."""
    from pathlib import Path

    from PIL import Image

    label = np.zeros(size, np.uint16)
    for k, rle in reversed(list(enumerate(masks, start=1))):
        label[decoded(rle, *size).astype(bool)] = k
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(label.astype(np.uint8) if len(masks) < 256 else label).save(path)
