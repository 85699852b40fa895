"""Object detection data for the three detection recipes: loading, the dataset, collate, and
``--predict``'s images.

Every source (the built-in ``digits_det``, a local COCO-json folder, a YOLO txt dataset
(:mod:`common.detection.yolo_txt`), a Pascal VOC folder (:mod:`common.detection.voc`), or a dataset with an
``objects`` column: hub name, ``save_to_disk`` folder or local copy of a hub repository, as ``cppe-5``) becomes a
``datasets.Dataset`` in one normalised schema (:mod:`common.detection.sources`): per image its id,
size, and COCO ``[x, y, w, h]`` boxes in original pixels with class indices, areas and crowd flags. A folder in
none of these forms is one line naming what was looked for and what was found (:mod:`common.detection.forms`).

Inside a recipe, :class:`DetectionDataset` yields ``(image, target)`` with boxes as
``tv_tensors.BoundingBoxes`` (XYXY, pixels of the transformed image) and :func:`collate` pads a
batch. Evaluation (:mod:`common.detection.coco_eval`) takes predictions back in original pixels
(:func:`common.detection.boxes.rescale_boxes`). :func:`prediction_batches` serves ``--predict`` the same way:
new images as a split without objects, through the recipe's evaluation transform and collate.

Reproducibility is that of :mod:`common.data.classification`: each sample's augmentation is seeded from
``(seed, epoch, index)``, so resumed runs and any number of workers or processes see the same crops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from common import UserError
from common.data.builtin import DETECTION
from common.data.classification import ClassificationData, ImageRows
from common.data.folders import EVAL_SPLITS, load_saved_or_hub, same_split
from common.data.images import image_files, readable_images
from common.detection import yolo_txt
from common.detection.forms import FORMS, detection_form, no_known_form
from common.detection.masks import has_masks, with_empty_masks
from common.detection.sources import _image_size, coco_splits, image_table, load_coco_split, normalise
from common.detection.voc import VocSource
from common.loaders import eval_loader_for, sample_seed, seeded

# Per-channel RGB mean and std (0..1) that ImageNet-pretrained backbones expect; the detection
# recipes normalise with them, and plots undo it.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass
class DetectionData:
    train: Any  # datasets.Dataset in the normalised schema, images undecoded
    eval: Any
    classes: list[str]
    # the dataset's own id of each class (index = class index): COCO category ids, a ClassLabel's
    # index, or the distinct raw category values; what predictions.json and the weights carry
    category_ids: list[int]
    # image path -> why its annotation cannot be used (a YOLO label file or a VOC XML that fails the tool's
    # checks); those rows are in the splits without objects until :meth:`with_unusable` has them left out
    unusable: dict[str, str] = dataclasses.field(default_factory=dict)
    # lines for under the start banner (:meth:`common.run.Run.note`): how a VOC folder's turned photos were read
    notes: list[str] = dataclasses.field(default_factory=list)

    def with_unusable(self, table: Any, found: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
        """``found``, the unreadable images of ``table`` (one of the splits) as ``(row, path, reason)``
        (:func:`common.data.scan.without_unreadable`), with the rows whose annotation cannot be used added, so
        that they are left out and listed (``bad_images.txt``) as unreadable images are."""
        if not self.unusable:
            return found
        known = {row for row, _, _ in found}
        import pyarrow.compute as pc

        paths = pc.struct_field(table.select_columns(["image"]).with_format("arrow")["image"], "path").to_pylist()
        extra = [(i, p, self.unusable[p]) for i, p in enumerate(paths) if p in self.unusable and i not in known]
        return sorted(found + extra)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
Loader = Callable[[], tuple[Any, "list[str] | None", "list[int] | None", dict[str, str]]]


def _size(path: str) -> tuple[int, int]:
    return _image_size({"path": path}, path)


def _sources(data: str) -> tuple[dict[str, Loader], str, Callable[[str], str], list[str]]:
    """Split name -> a function loading it (normalised dataset, class names or None, category ids or
    None, image path -> why its annotation cannot be used); a description of where the splits were looked
    for, for error messages; the evaluation split for a training split when none is named (the first of
    validation/val/valid/test there that is no part of the training split's name; for VOC, of its years:
    :meth:`VocSource.eval_split`); and the list the loaders add their banner lines to."""
    path = Path(DETECTION[data]()) if data in DETECTION else Path(data)
    form = detection_form(path)
    if form == "coco":
        where = f"COCO folder '{data}' (annotations/instances_<split>.json or <split>/_annotations.coco.json)"
        loaders = {
            split: (lambda p=p, dirs=dirs: (*load_coco_split(p, dirs, data), {}))
            for split, (p, dirs) in coco_splits(path).items()
        }
        return loaders, where, _named_eval(loaders), []
    if form == "yolo":
        file = yolo_txt.find_yaml(path)
        where = f"YOLO data yaml '{file}'"
        loaders = {split: (lambda s=split: yolo_txt.load_split(file, s, _size)) for split in yolo_txt.splits(file)}
        return loaders, where, _named_eval(loaders), []
    if form == "voc":
        source = VocSource(path)
        where = f"Pascal VOC folder '{data}' (ImageSets/Main/<split>.txt; '+' joins splits)"
        loaders = {split: (lambda s=split: source.load(s, _size)) for split in source.lists}
        return loaders, where, source.eval_split, source.notes
    if path.is_file():
        raise UserError(f"data '{data}' is a file; expected a YOLO data yaml or a folder: {FORMS} (docs/data.md)")
    if path.is_dir() and (line := no_known_form(path, data)):
        raise UserError(line)
    table = load_saved_or_hub(
        data,
        "detection dataset",
        f"{', '.join(DETECTION)}, {FORMS} (docs/data.md), or a hub dataset name (with network, or in the cache)",
    )
    if not hasattr(table, "keys"):  # a single Dataset: the training split
        table = {"train": table}
    # no ids: a ClassLabel's index is its id (load_detection's default)
    loaders = {split: (lambda split=split: (*normalise(table[split], data, split), None, {})) for split in table}
    return loaders, f"'{data}'", _named_eval(loaders), []


def _named_eval(sources: dict[str, Loader]) -> Callable[[str], str]:
    """The first of validation/val/valid/test in ``sources`` that is no part of the training split's name (VOC's
    ``val`` of ``trainval``), or ''."""
    return lambda train_split: next((s for s in EVAL_SPLITS if s in sources and s not in train_split), "")


def _pick(sources: dict[str, Loader], name: str, where: str) -> Loader:
    """The loader of split ``name``: a split of ``sources`` (:func:`common.data.folders.same_split` names), or
    several joined by ``+`` (``VOC2007/trainval+VOC2012/trainval``, ``train+val``)."""
    parts = [same_split(part, sources) for part in name.split("+")]
    missing = [part for part in parts if part not in sources]
    if missing:
        raise UserError(f"{where} has no split '{missing[0]}'; it has {sorted(sources) or 'none'}")
    if len(parts) == 1:
        return sources[parts[0]]
    return lambda: _joined([sources[part]() for part in parts], name)


def _joined(loaded: list[tuple[Any, Any, Any, dict[str, str]]], name: str) -> tuple[Any, Any, Any, dict[str, str]]:
    """Splits joined into one: the same classes required; image ids kept where they stay unique, else 0..N-1."""
    import datasets

    first = loaded[0]
    for _, names, ids, _ in loaded[1:]:
        if (names, ids) != first[1:3]:
            raise UserError(f"the splits joined in '{name}' have different classes ({first[1]} and {names})")
    tables = [ds for ds, *_ in loaded]
    if any(has_masks(ds) for ds in tables):  # a box-only split joined with one with masks: its objects get none
        tables = [ds if has_masks(ds) else with_empty_masks(ds) for ds in tables]
    table = datasets.concatenate_datasets(tables)
    if len(set(table["image_id"])) < len(table):
        table = table.map(lambda _, i: {"image_id": i}, with_indices=True, features=table.features)
    return table, first[1], first[2], {k: v for *_, unusable in loaded for k, v in unusable.items()}


def detection_images(data: str, train_split: str = "train", seed: int = 0) -> ClassificationData | None:
    """The training images of a built-in detection set, a COCO-json folder, a YOLO txt dataset or a Pascal VOC
    folder as unlabelled data (the boxes unused), for self-supervised training; None when ``data`` names none
    (a hub dataset with an ``objects`` column reads as unlabelled images through
    :func:`common.data.classification.load_classification`)."""
    path = Path(DETECTION[data]()) if data in DETECTION else Path(data)
    if not detection_form(path):
        return None
    train = load_detection(data, train_split, seed=seed).train
    return ClassificationData(train.select_columns(["image"]), None, "image", "", [])


def load_detection(
    data: str, train_split: str = "train", eval_split: str = "", seed: int = 0, eval_fraction: float = 0.1
) -> DetectionData:
    """Load train and evaluation splits of a detection dataset in the normalised schema.

    ``data``: ``digits_det``, a COCO-json folder, a YOLO data yaml (or a folder with one), a Pascal VOC folder,
    a ``save_to_disk`` folder, a local copy of a hub repository, or a hub name (``org/name`` or
    ``org/name:config``). A split name may join several with ``+`` (``VOC2007/trainval+VOC2012/trainval``).
    ``eval_split`` empty: the first of validation/val/valid/test that exists, else a seeded ``eval_fraction`` of
    the training split. Rows whose annotation cannot be used stay, without objects, listed in ``unusable``
    (:meth:`DetectionData.with_unusable`).
    Classes: the COCO categories sorted by id, else the ClassLabel names; else the distinct category
    values of both splits, sorted, each named by its value and renumbered 0..C-1. ``category_ids``
    keeps each class's own id, so predictions can be written in the dataset's ids.
    Crowd annotations stay in the rows (``objects.iscrowd``) for the evaluator; :class:`DetectionDataset`
    never makes them training targets. Images without objects stay: they are negatives.
    """
    sources, where, eval_for, notes = _sources(data)
    load_train = _pick(sources, train_split, where)
    train_split = same_split(train_split, sources)
    eval_split = eval_split or eval_for(train_split)
    load_eval = _pick(sources, eval_split, where) if eval_split else None
    train, names, ids, unusable = load_train()
    if load_eval is not None:
        evaluation, eval_names, eval_ids, more = load_eval()
        unusable = {**unusable, **more}
        if names is not None and eval_names is not None and (eval_names, eval_ids) != (names, ids):
            raise UserError(
                f"the evaluation split of '{data}' has classes {eval_names[:5]}... but the training "
                f"split has {names[:5]}... ({len(eval_names)} vs {len(names)})"
            )
    else:
        if len(train) < 2:
            raise UserError(
                f"the training split of '{data}' has {len(train)} images: too few to carve an evaluation split"
            )
        parts = train.train_test_split(test_size=eval_fraction, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    for name, ds in (("training", train), ("evaluation", evaluation)):
        if len(ds) == 0:
            raise UserError(f"the {name} split of '{data}' is empty")
    if names is None:  # plain integer categories: the distinct values are the classes
        ids = sorted({c for ds in (train, evaluation) for o in ds["objects"] for c in o["category"]})
        names = [str(i) for i in ids]
        if ids != list(range(len(ids))):
            index = {c: i for i, c in enumerate(ids)}

            def renumber(row: dict[str, Any]) -> dict[str, Any]:
                return {"objects": {**row["objects"], "category": [index[c] for c in row["objects"]["category"]]}}

            train, evaluation = (ds.map(renumber, features=ds.features) for ds in (train, evaluation))
    top = max((max(o["category"], default=-1) for ds in (train, evaluation) for o in ds["objects"]), default=-1)
    if top >= len(names):
        raise UserError(f"'{data}' has category {top}, but only {len(names)} classes")
    if not names:
        raise UserError(f"'{data}' has no categories and no objects")
    ids = list(ids if ids is not None else range(len(names)))
    return DetectionData(train, evaluation, names, ids, unusable, notes)


# --------------------------------------------------------------------------------------------
# Dataset and collate
# --------------------------------------------------------------------------------------------
class DetectionDataset(ImageRows):
    """``(image, target)`` pairs from a normalised detection dataset, transformed reproducibly.

    Indexed by ``(epoch, index)`` (what :class:`common.loaders.EpochBatchSampler` yields) or a plain
    index (epoch 0, for evaluation). ``target``: ``boxes`` (BoundingBoxes XYXY float32 [N, 4], pixels
    of the transformed image), ``labels`` (int64 [N]), ``image_id`` (int), ``orig_size`` (h, w of the
    original), ``size`` (h, w of the picture in the transformed image, padding excluded), and
    ``dropped`` (int): boxes of this sample that are not targets because they were degenerate, cut
    by the crop or out of the image (crowd regions are not counted). DataLoader workers cannot update
    an attribute the main process sees, so a recipe sums ``target["dropped"]`` over its batches to log it.
    """

    def __init__(
        self,
        ds: Any,
        transform: Callable,
        seed: int = 0,
        shorter: int = 0,
        cache: Any = None,
        replaced: Any = None,
        masks: bool = False,
    ) -> None:
        # shorter > 0: large JPEGs decoded reduced (common.data.classification.ImageRows), the boxes scaled with them;
        # ``orig_size`` stays the file's own. cache, replaced: the decoded images and the count of images
        # replaced during the run (ImageRows). masks: targets carry each object's mask (a split with masks)
        super().__init__(ds, "image", seed, shorter, cache, replaced)
        self.transform = transform
        self.masks = masks

    def row_name(self, row: dict[str, Any], index: int) -> str:
        return f"row {index} (image_id {row['image_id']})"

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row, index, image, (width, height) = self.read(epoch, index)
        objects = row["objects"]
        keep = [i for i, crowd in enumerate(objects["iscrowd"]) if not crowd]
        xywh = torch.tensor([objects["bbox"][i] for i in keep], dtype=torch.float32).reshape(-1, 4)
        xywh *= torch.tensor([image.width / width, image.height / height] * 2)  # 1 unless decoded reduced
        boxes = tv_tensors.BoundingBoxes(xywh, format="XYWH", canvas_size=(image.height, image.width))
        target = {
            "boxes": F.convert_bounding_box_format(boxes, new_format=tv_tensors.BoundingBoxFormat.XYXY),
            "labels": torch.tensor([objects["category"][i] for i in keep], dtype=torch.int64),
        }
        if self.masks:  # moved by every transform as the pixels and boxes are (a tv_tensors.Mask)
            target["masks"] = tv_tensors.Mask(_object_masks(objects, keep, (height, width), image, target["boxes"]))
        with seeded(sample_seed(self.seed, epoch, index)):
            out, target = self.transform(image, target)
        out = out.as_subclass(torch.Tensor)
        target.update(
            image_id=int(row["image_id"]),
            orig_size=(height, width),
            dropped=len(keep) - len(target["boxes"]),
        )
        target.setdefault("size", tuple(out.shape[-2:]))
        return out, target


def _object_masks(
    objects: dict[str, list], keep: list[int], size: tuple[int, int], image: Any, boxes: torch.Tensor
) -> torch.Tensor:
    """uint8 ``[N, h, w]`` masks of the objects ``keep`` at the decoded image's size (``size``: the original's h, w);
    an object without a segmentation (``""``) fills its box, so that every target has a mask to learn."""
    from common.detection.masks import masks_of

    segmentations = [objects["segmentation"][i] for i in keep]
    masks = torch.from_numpy(masks_of(segmentations, *size, out=(image.height, image.width)))
    for i, segmentation in enumerate(segmentations):
        if not segmentation:
            x0, y0, x1, y1 = boxes[i].floor().int().tolist()
            masks[i, max(y0, 0) : max(y1 + 1, 0), max(x0, 0) : max(x1 + 1, 0)] = 1
    return masks


def collate(
    batch: Sequence[tuple[torch.Tensor, dict[str, Any]]],
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


def prediction_batches(
    run: Any, path: str, transform: Callable, collate: Callable, batch_size: int, num_workers: int
) -> tuple[Any, Iterator[Any]]:
    """``--predict``'s input: the images ``path`` names (one file or a folder) as a split without objects
    (:func:`common.detection.sources.image_table`) and its batches through the recipe's evaluation
    ``transform`` and ``collate``, on the run's device (``run``: :class:`common.run.Run`), with a progress
    bar. Prepared by Accelerate: each process gets its share of the images (the last round padded with
    repeats), so every process must pass its batches to :func:`common.detection.outputs.save_predictions`."""
    files, skipped = readable_images(image_files(path))
    if skipped:
        run.print(skipped)
    table = image_table(files)
    loader = eval_loader_for(DetectionDataset(table, transform), batch_size, num_workers, collate_fn=collate)
    return table, run.progress(run.accelerator.prepare(loader), "predict")
