"""Detection sources read into one normalised schema: COCO-json folders (the COCO and the Roboflow
layout) and tables with an ``objects`` column (hub datasets such as cppe-5, ``save_to_disk`` folders,
local copies of hub repositories). :func:`common.detection.data.load_detection` picks the reader.

The normalised schema of every split, a ``datasets.Dataset``::

    image     datasets.Image(decode=False)   bytes or a path; decoded in DataLoader workers
    image_id  int64                          unique within a split (COCO evaluation keys on it)
    width     int32, height int32            of the original image, pixels
    objects   {bbox:     [[x, y, w, h], ...] COCO boxes in original pixels (float64)
               category: [c, ...]            class index 0..C-1 (int64)
               area:     [a, ...]            COCO area (the mask's area where the json has one), px^2
               iscrowd:  [0 or 1, ...]       crowd regions: never a training target, ignored by COCO eval
               segmentation: ["...", ...]}   only a split with masks: each object's COCO segmentation as
                                             JSON, "" for none (:mod:`common.detection.masks`)
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from common import UserError
from common.data.images import upright_size

if TYPE_CHECKING:
    import datasets


def features(masks: bool = False) -> datasets.Features:
    """The normalised schema of every detection split (the module docstring); ``masks``: with
    ``objects.segmentation``."""
    import datasets

    objects = {
        "bbox": datasets.Sequence(datasets.Sequence(datasets.Value("float64"), length=4)),
        "category": datasets.Sequence(datasets.Value("int64")),
        "area": datasets.Sequence(datasets.Value("float64")),
        "iscrowd": datasets.Sequence(datasets.Value("int8")),
    }
    if masks:
        objects["segmentation"] = datasets.Sequence(datasets.Value("string"))
    return datasets.Features(
        {
            "image": datasets.Image(decode=False),
            "image_id": datasets.Value("int64"),
            "width": datasets.Value("int32"),
            "height": datasets.Value("int32"),
            "objects": objects,
        }
    )


def _image_size(value: dict[str, Any] | Image.Image, name: str) -> tuple[int, int]:
    """(width, height) as displayed (EXIF orientation applied: :func:`common.data.images.upright_size`) from an
    image's header, without decoding its pixels."""
    if isinstance(value, Image.Image):
        return upright_size(value)
    try:
        with Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]) as image:
            return upright_size(image)
    except Exception as e:
        raise UserError(f"cannot read image '{value.get('path') or name}': {type(e).__name__}: {e}") from None


def coco_splits(folder: Path) -> dict[str, tuple[Path, list[Path]]]:
    """Split name -> (annotation json, folders its images may be in) for both common layouts:
    ``annotations/instances_<split>.json`` (COCO; images in ``<split>/``, ``<split>2017/``,
    ``images/`` or relative to the folder) and ``<split>/_annotations.coco.json`` (Roboflow)."""
    splits: dict[str, tuple[Path, list[Path]]] = {}
    for path in sorted((folder / "annotations").glob("instances_*.json")):
        name = path.stem[len("instances_") :]
        base = re.sub(r"20\d\d$", "", name)  # instances_val2017.json also answers to 'val'
        dirs = [folder / name, folder / f"{base}2017", folder / "images" / name, folder / "images", folder]
        splits[name] = (path, list(dict.fromkeys(dirs)))
        if base and base != name:
            splits.setdefault(base, splits[name])
    for path in sorted(folder.glob("*/_annotations.coco.json")):
        splits.setdefault(path.parent.name, (path, [path.parent]))
    return splits


def load_coco_split(json_path: Path, image_dirs: list[Path], data: str) -> tuple[Any, list[str], list[int]]:
    """One COCO-json split as a normalised ``datasets.Dataset``, its class names and their COCO
    category ids (categories sorted by id: class index i is ``categories[i]``)."""
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
    if len(index) != len(categories):
        raise UserError(f"annotation file '{json_path}' repeats a category id in its 'categories'")

    images = coco["images"]
    folder = next((d for d in image_dirs if images and (d / images[0]["file_name"]).exists()), None)
    if images and folder is None:
        where = ", ".join(f"'{d}'" for d in image_dirs)
        raise UserError(f"image '{images[0]['file_name']}' of '{json_path}' is in none of {where}")
    rows = {img["id"]: {"bbox": [], "category": [], "area": [], "iscrowd": [], "segmentation": []} for img in images}
    for ann in coco.get("annotations") or []:
        objects = rows.get(ann.get("image_id"))
        if objects is None:
            raise UserError(
                f"annotation {ann.get('id')} in '{json_path}' refers to image_id "
                f"{ann.get('image_id')}, which is not in its 'images'"
            )
        if ann.get("category_id") not in index:
            raise UserError(
                f"annotation {ann.get('id')} in '{json_path}' has category_id "
                f"{ann.get('category_id')}, which is not in its 'categories'"
            )
        bbox = ann.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4:
            raise UserError(f"annotation {ann.get('id')} in '{json_path}' has bbox {bbox!r}; expected [x, y, w, h]")
        objects["bbox"].append([float(v) for v in bbox])
        objects["category"].append(index[ann["category_id"]])
        objects["area"].append(float(ann.get("area", bbox[2] * bbox[3])))
        objects["iscrowd"].append(int(ann.get("iscrowd", 0)))
        objects["segmentation"].append((ann.get("id"), ann.get("segmentation")))  # checked once sizes are known

    paths = [str(folder / img["file_name"]) for img in images] if folder else []
    sizes = [
        (img["width"], img["height"]) if "width" in img and "height" in img else _image_size({"path": p}, p)
        for img, p in zip(images, paths)
    ]
    for objects, (width, height) in zip(rows.values(), sizes):
        objects["segmentation"] = [
            segmentation_json(value, (int(height), int(width)), f"annotation {ann_id} in '{json_path}'")
            for ann_id, value in objects["segmentation"]
        ]
    masks = any(s for objects in rows.values() for s in objects["segmentation"])
    if not masks:  # box-only data (Roboflow's detection exports write segmentation: []): the schema without masks
        for objects in rows.values():
            del objects["segmentation"]
    table = {
        "image": [{"path": p, "bytes": None} for p in paths],
        "image_id": [img["id"] for img in images],
        "width": [w for w, _ in sizes],
        "height": [h for _, h in sizes],
        "objects": list(rows.values()),
    }
    check_box_format(table, f"'{json_path}'")
    ds = datasets.Dataset.from_dict(table, features=features(masks=masks))
    return ds, classes, [int(c["id"]) for c in categories]


def segmentation_json(value: Any, size: tuple[int, int], where: str) -> str:
    """A COCO ``segmentation`` value as the schema keeps it (module docstring): polygons and run-length encodings
    as JSON, exactly as given (an RLE without ``size`` keeps none: :func:`common.detection.masks.mask_of` takes the
    image's); ``""`` for none (absent, ``None``, ``[]`` or only empty polygons, as box-only annotations of
    Roboflow's exports are written, or an RLE without counts). A string is JSON text of one of these (the
    schema's own, as a saved normalised split holds it). ``size``: the image's (height, width), which an RLE's
    ``size`` must equal. Anything else is a :class:`UserError` naming ``where``."""
    empty_rle = isinstance(value, dict) and value.get("counts") in (None, "", [])  # an Arrow struct's missing value
    if value is None or value == "" or (isinstance(value, list) and not any(value)) or empty_rle:
        return ""
    if isinstance(value, str):  # already a schema string (a saved normalised split), or JSON text of a value
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"{where} has a segmentation string that is not JSON: {value[:60]!r}") from None
        return segmentation_json(value, size, where)
    if isinstance(value, list):
        numbers = (int, float)
        if not all(isinstance(p, list) and all(isinstance(v, numbers) for v in p) for p in value):
            raise UserError(f"{where} has a segmentation that is not polygons [[x1, y1, x2, y2, ...], ...]")
        if any(len(p) % 2 for p in value):
            raise UserError(f"{where} has a polygon of an odd number of coordinates (x, y pairs expected)")
        return json.dumps(value)
    if isinstance(value, dict) and isinstance(value.get("counts"), (str, bytes, list)):
        if "size" in value and [int(v) for v in value["size"]] != list(size):
            raise UserError(
                f"{where} has a run-length mask of size {value['size']} (height, width) on an image of "
                f"{size[0]} x {size[1]}"
            )
        if isinstance(value["counts"], bytes):  # pycocotools' own encodings, as a hub table may hold them
            value = {**value, "counts": value["counts"].decode()}
        return json.dumps(value)
    raise UserError(f"{where} has segmentation {str(value)[:60]!r}; expected polygons or a run-length encoding")


_BOX_KEYS = ("bbox", "bboxes", "boxes")
_CATEGORY_KEYS = ("category", "categories", "category_id", "label", "labels", "class", "class_id")


def normalise(ds: Any, data: str, split: str) -> tuple[Any, list[str] | None]:
    """A dataset with an ``objects`` column (COCO xywh boxes in pixels, as cppe-5) in the normalised
    schema, and its class names (from a ClassLabel, else None). Objects with a ``segmentation`` (COCO polygons or
    run-length encodings, or the schema's JSON strings: a saved normalised split) keep it, as the COCO reader
    does (:func:`segmentation_json`): the split has masks where one object at least has one."""
    import datasets

    columns = ds.features
    objects_feature = columns.get("objects")
    inner = objects_feature if isinstance(objects_feature, dict) else getattr(objects_feature, "feature", None)
    if not isinstance(inner, dict):
        raise UserError(
            f"split '{split}' of '{data}' has no 'objects' column (it has {list(columns)}); expected a "
            "COCO-json folder (annotations/instances_<split>.json or <split>/_annotations.coco.json) "
            "or a dataset whose 'objects' hold COCO [x, y, w, h] boxes and categories"
        )
    box_key = next((k for k in _BOX_KEYS if k in inner), None)
    category_key = next((k for k in _CATEGORY_KEYS if k in inner), None)
    if box_key is None or category_key is None:
        raise UserError(
            f"the 'objects' of '{data}' have keys {list(inner)}; expected a box key "
            f"({'/'.join(_BOX_KEYS)}) and a category key ({'/'.join(_CATEGORY_KEYS)})"
        )
    image_column = next((k for k, f in columns.items() if isinstance(f, datasets.Image)), None)
    if image_column is None:
        raise UserError(f"split '{split}' of '{data}' has no image column (it has {list(columns)})")
    category_feature = inner[category_key]
    category_feature = getattr(category_feature, "feature", category_feature)  # inside a list, or not
    names = list(category_feature.names) if isinstance(category_feature, datasets.ClassLabel) else None

    images = ds.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
    meta = ds.select_columns([c for c in ("image_id", "width", "height", "objects") if c in columns])[:]
    masks = "segmentation" in inner  # COCO-style polygons / RLE per object (or schema strings), kept
    table: dict[str, list] = {
        "image_id": meta.get("image_id") or list(range(len(ds))),
        "width": [],
        "height": [],
        "objects": [],
    }
    for i, objects in enumerate(meta["objects"]):
        if isinstance(objects, list):  # a list of per-object dicts rather than a dict of lists
            objects = {k: [o[k] for o in objects] for k in inner}
        boxes = [[float(v) for v in box] for box in objects[box_key]]
        if any(len(box) != 4 for box in boxes):
            raise UserError(f"row {i} of split '{split}' of '{data}' has a box that is not [x, y, w, h]")
        table["objects"].append(
            {
                "bbox": boxes,
                "category": [int(c) for c in objects[category_key]],
                "area": [float(a) for a in objects["area"]] if "area" in objects else [b[2] * b[3] for b in boxes],
                "iscrowd": [int(c) for c in objects["iscrowd"]] if "iscrowd" in objects else [0] * len(boxes),
            }
            | ({"segmentation": list(objects["segmentation"])} if masks else {})  # made schema strings below
        )
    if "width" in meta and "height" in meta:
        table["width"], table["height"] = meta["width"], meta["height"]
    else:  # read each image's header: slower, but needed only once per load
        for i, value in enumerate(images[image_column]):
            w, h = _image_size(value, f"row {i} of split '{split}' of '{data}'")
            table["width"].append(w)
            table["height"].append(h)
    check_box_format(table, f"split '{split}' of '{data}'")
    for i, (objects, w, h) in enumerate(zip(table["objects"], table["width"], table["height"]) if masks else []):
        where = f"row {i} of split '{split}' of '{data}'"
        objects["segmentation"] = [segmentation_json(v, (int(h), int(w)), where) for v in objects["segmentation"]]
    if masks and not any(s for objects in table["objects"] for s in objects["segmentation"]):
        masks = False  # a segmentation column with nothing in it: box-only data, the schema without masks
        for objects in table["objects"]:
            del objects["segmentation"]
    schema = features(masks=masks)
    meta_features = datasets.Features({k: v for k, v in schema.items() if k != "image"})
    meta_ds = datasets.Dataset.from_dict(table, features=meta_features)
    if image_column != "image":
        images = images.rename_column(image_column, "image")
    return datasets.concatenate_datasets([images, meta_ds], axis=1), names


def check_box_format(table: dict[str, list], where: str) -> None:
    """Refuse boxes that are plainly not COCO ``[x, y, w, h]`` in pixels, as one :class:`UserError`
    naming ``where``: every coordinate within 0..1.5 on images larger than 4 px (normalised boxes),
    or more than a tenth of the boxes reaching past their image when read as x, y, w, h while as
    x0, y0, x1, y1 every one is a well-formed box inside it (corner boxes). Such data loads without a
    complaint otherwise and scores a meaningless mAP. ``table``: ``width``, ``height`` and ``objects``
    columns of the normalised schema (module docstring)."""
    import numpy as np

    boxes = [
        (b, w, h) for objects, w, h in zip(table["objects"], table["width"], table["height"]) for b in objects["bbox"]
    ]
    if not boxes:
        return
    xywh = np.array([b for b, _, _ in boxes], np.float64)  # [N, 4]
    size = np.array([[w, h] for _, w, h in boxes], np.float64)  # [N, 2] image width, height
    if np.abs(xywh).max() <= 1.5 and np.median(size) > 4:
        raise UserError(
            f"the boxes of {where} are all within 0..1 ({len(xywh)} boxes): they look normalised; "
            "detection data needs COCO [x, y, w, h] boxes in pixels of the original image"
        )
    slack = 0.02 * size + 1.0  # annotation tools round and overshoot edges by a pixel or so
    past = ((xywh[:, :2] + xywh[:, 2:]) > size + slack).any(1)
    corners = (xywh[:, 2:] > xywh[:, :2]).all(1) & (xywh[:, 2:] <= size + slack).all(1) & (xywh[:, :2] >= -slack).all(1)
    if past.mean() > 0.1 and corners.all():
        raise UserError(
            f"{past.sum()} of the {len(xywh)} boxes of {where} reach past their image when read as "
            "[x, y, w, h], and every one is a box inside it as [x0, y0, x1, y1]: they look like corner "
            "boxes; detection data needs COCO [x, y, w, h] boxes in pixels (w = x1 - x0, h = y1 - y0)"
        )


def image_table(files: Sequence[Path]) -> Any:
    """Image files (``common.data.images.image_files``) as a normalised split without objects, for a
    detector's ``--predict``: ``image_id`` is the file's position; sizes come from the headers."""
    import datasets

    sizes = [_image_size({"path": str(f)}, str(f)) for f in files]
    table = {
        "image": [{"path": str(f), "bytes": None} for f in files],
        "image_id": list(range(len(files))),
        "width": [w for w, _ in sizes],
        "height": [h for _, h in sizes],
        "objects": [{"bbox": [], "category": [], "area": [], "iscrowd": []} for _ in files],
    }
    return datasets.Dataset.from_dict(table, features=features())
