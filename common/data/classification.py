"""Image-classification datasets (hub name, local folder, built-in set) and reproducible data loaders.

Everything becomes a ``datasets.Dataset`` with an image column and a label column, whatever the
source, so one code path serves a hub dataset, an imagefolder on disk and the built-in sets
(:mod:`common.data.builtin`). The samplers and loaders below serve the detection recipes too.

Reproducibility: the training order is a function of ``(seed, epoch)`` only, and every sample's
augmentation randomness is seeded from ``(seed, epoch, index)``. A batch is therefore the same
whatever the number of workers or processes, and a run resumed mid-epoch sees exactly the
batches, crops and flips the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from common import UserError
from common.data.builtin import CLASSIFICATION
from common.data.folders import EVAL_SPLITS, load_saved_or_hub, same_split
from common.data.images import decode_sized
from common.loaders import KeyedDataset, replacement, sample_seed, seeded, shared_count


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def _load_source(data: str):
    """A ``DatasetDict`` (or ``Dataset``) from a built-in name, a local folder or a hub name."""
    if data in CLASSIFICATION:
        return CLASSIFICATION[data]()
    if Path(data).is_file():
        raise UserError(f"data '{data}' is a file; expected a folder (imagefolder layout or a saved dataset)")
    return load_saved_or_hub(
        data,
        "dataset",
        f"one of {', '.join(CLASSIFICATION)}, an existing folder, or a "
        "hub dataset name (with network, or already in the cache)",
    )


def _detect_columns(ds, image_column: str, label_column: str, labels: bool = True) -> tuple[str, str]:
    """The image and label columns, given or detected; with ``labels=False`` a dataset without a label
    column gives an empty label column name instead of an error."""
    import datasets

    cols = ds.features
    if not image_column:
        image_column = next((k for k, f in cols.items() if isinstance(f, datasets.Image)), "")
        if not image_column:
            raise UserError(f"no image column found among {list(cols)}; set --image_column")
    if not label_column:
        label_column = next((k for k, f in cols.items() if isinstance(f, datasets.ClassLabel)), "")
        label_column = label_column or next((k for k in ("label", "labels", "fine_label") if k in cols), "")
        if not label_column and labels:
            raise UserError(f"no label column found among {list(cols)}; set --label_column")
    for name in (image_column, label_column) if label_column else (image_column,):
        if name not in cols:
            raise UserError(f"column '{name}' not in the dataset; it has {list(cols)}")
    return image_column, label_column


@dataclasses.dataclass
class ClassificationData:
    train: Any  # datasets.Dataset, images left undecoded
    eval: Any  # None for a dataset without labels (load_classification(labels=False))
    image_column: str
    label_column: str
    classes: list[str]


def _hold_out(train: Any, label_column: str, fraction: float, seed: int, data: str) -> tuple[Any, Any]:
    """A seeded evaluation split carved from ``train``: ``fraction`` of it, stratified by class (a
    ClassLabel column), and at least one image of every class, so that tiny folders (3 images per
    class) still get one. A class with a single image cannot be both trained on and evaluated: one
    clear error instead of scikit-learn's."""
    import datasets

    if not isinstance(train.features[label_column], datasets.ClassLabel):
        parts = train.train_test_split(test_size=fraction, seed=seed)
        return parts["train"], parts["test"]
    counts = np.bincount(np.asarray(train[label_column]), minlength=train.features[label_column].num_classes)
    names = train.features[label_column].names
    lonely = [names[i] for i, n in enumerate(counts) if n == 1]
    if lonely:
        raise UserError(
            f"'{data}' has no evaluation split and class {lonely[0]!r} has a single image, too few to "
            "hold one out: add images (2 per class at least) or name a split with --eval_split"
        )
    held_out = max(int(np.ceil(fraction * len(train))), int((counts > 0).sum()))
    parts = train.train_test_split(test_size=held_out, seed=seed, stratify_by_column=label_column)
    return parts["train"], parts["test"]


def load_classification(
    data: str,
    image_column: str = "",
    label_column: str = "",
    train_split: str = "train",
    eval_split: str = "",
    eval_fraction: float = 0.1,
    seed: int = 0,
    labels: bool = True,
) -> ClassificationData:
    """Load train and evaluation splits of an image-classification dataset.

    ``eval_split`` empty: the first of validation/val/valid/test that exists, else a seeded
    ``eval_fraction`` of the training split. Images stay undecoded (bytes or a path) until a
    DataLoader worker decodes them, so an unreadable file is reported by name.
    ``labels=False`` (self-supervised training) also accepts images without labels (a folder of plain
    image files, a dataset without a label column): then ``label_column`` is empty, ``classes`` is
    empty, ``eval`` is None and the whole training split is kept.
    """
    import datasets

    source = _load_source(data)
    if isinstance(source, datasets.Dataset):
        source = datasets.DatasetDict({train_split: source})
    train_split = same_split(train_split, source)
    if train_split not in source:
        raise UserError(f"dataset '{data}' has no split '{train_split}'; it has {list(source)}")
    train = source[train_split]
    eval_split = same_split(eval_split, source) if eval_split else ""
    eval_split = eval_split or next((s for s in EVAL_SPLITS if s in source and s != train_split), "")
    if eval_split and eval_split not in source:
        raise UserError(f"dataset '{data}' has no split '{eval_split}'; it has {list(source)}")
    image_column, label_column = _detect_columns(train, image_column, label_column, labels)
    if not label_column:
        if len(train) == 0:
            raise UserError(f"the training split of '{data}' is empty")
        return ClassificationData(
            train.cast_column(image_column, datasets.Image(decode=False)), None, image_column, "", []
        )
    if eval_split:
        evaluation = source[eval_split]
    else:
        train, evaluation = _hold_out(train, label_column, eval_fraction, seed, data)
    for name, ds in (("training", train), ("evaluation", evaluation)):
        if len(ds) == 0:
            raise UserError(f"the {name} split of '{data}' is empty")

    feature = train.features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        classes = list(feature.names)
    else:
        classes = [str(i) for i in range(int(max(train[label_column])) + 1)]
    eval_feature = evaluation.features.get(label_column)
    if isinstance(eval_feature, datasets.ClassLabel) and isinstance(feature, datasets.ClassLabel):
        if list(eval_feature.names) != classes:
            raise UserError(
                f"the evaluation split of '{data}' has classes {eval_feature.names[:5]}... "
                f"but the training split has {classes[:5]}... ({len(eval_feature.names)} vs {len(classes)})"
            )
    elif eval_feature is not None:
        top = int(max(evaluation[label_column]))
        if top >= len(classes):
            raise UserError(
                f"the evaluation split of '{data}' has label {top}, "
                f"but the training split has only {len(classes)} classes"
            )
    train = train.cast_column(image_column, datasets.Image(decode=False))
    evaluation = evaluation.cast_column(image_column, datasets.Image(decode=False))
    return ClassificationData(train, evaluation, image_column, label_column, classes)


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------
class ImageRows(KeyedDataset):
    """What the image datasets share: the rows of ``ds``, whose ``image_column`` holds undecoded images.

    :meth:`read` gives a row with its image decoded: reduced where ``shorter`` > 0 (large JPEGs, to that
    shorter side: :func:`common.data.images.decode_sized`), from ``cache`` where one is given (an
    :class:`common.data.image_cache.ImageCache` of ``ds``'s ``image_column`` at ``shorter``, ``--cache_images``:
    :func:`common.data.image_cache.image_caches`), and, for an image that became unreadable after the start's
    scan, another row drawn from the seed (:func:`common.loaders.replacement`), counted in ``replaced``
    (:func:`common.loaders.shared_count`, shared with the DataLoader workers forked from this process; a
    new one unless given: datasets over the same rows can share one count). A recipe hands ``replaced``
    to :class:`common.loop.Loop`, which logs it.
    """

    def __init__(
        self, ds: Any, image_column: str, seed: int = 0, shorter: int = 0, cache: Any = None, replaced: Any = None
    ) -> None:
        self.ds, self.image_column, self.seed, self.shorter = ds, image_column, seed, shorter
        self.cache = cache
        self.replaced = shared_count() if replaced is None else replaced

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "replaced": None}  # a shared counter only passes to forked workers

    def __len__(self) -> int:
        return len(self.ds)

    def row_name(self, row: dict[str, Any], index: int) -> str:
        """How an error names the row."""
        return f"row {index} of column '{self.image_column}'"

    def read(self, epoch: int, index: int) -> tuple[dict[str, Any], int, Image.Image, tuple[int, int]]:
        """Row ``index`` (or the row that replaces it: the index returned is the one read), its RGB image
        and the file's own ``(width, height)``."""
        for attempt in itertools.count():
            row = self.ds[int(index)]
            try:  # a cached row that could not be decoded raises its error here too
                if self.cache is not None:
                    return row, index, *self.cache.get(int(index))
                return row, index, *decode_sized(row[self.image_column], self.row_name(row, index), self.shorter)
            except UserError as e:  # after REPLACEMENT_TRIES draws, replacement raises the error
                index = replacement(self.seed, epoch, index, len(self), attempt, e, self.replaced)
        raise AssertionError("unreachable")


class ClassificationDataset(ImageRows):
    """``(image tensor, label)`` pairs from a hub-style dataset, transformed reproducibly.

    ``shorter`` > 0: JPEGs larger than the transform needs are decoded reduced, ``cache``: the decoded images
    (:class:`ImageRows`). Indexed by ``(epoch, index)`` or ``(epoch, index, repeat)`` (what
    :class:`common.loaders.EpochBatchSampler` yields) or by a plain index (epoch 0, for evaluation).
    """

    def __init__(
        self,
        ds: Any,
        image_column: str,
        label_column: str,
        transform: Callable,
        seed: int = 0,
        shorter: int = 0,
        cache: Any = None,
    ) -> None:
        super().__init__(ds, image_column, seed, shorter, cache)
        self.label_column, self.transform = label_column, transform

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index, repeat = (tuple(key) + (0,))[:3] if isinstance(key, tuple) else (0, key, 0)
        row, index, image, _ = self.read(epoch, index)
        with seeded(sample_seed(self.seed, epoch, index, repeat)):  # label -1: a dataset without labels
            return self.transform(image), int(row[self.label_column]) if self.label_column else -1


def label_fraction(table: Any, fraction: float, seed: int, label_column: str = "") -> Any:
    """A seeded ``fraction`` of a training split, the rest unused (the semi-supervised protocol: 1 % or
    10 % of the labels): with ``label_column`` (a classification split) ``round(fraction x n_c)`` images of
    each class ``c``, at least one; without (a detection split) ``round(fraction x n)`` images, at least
    one. The same seed gives the same images, so a resumed run trains on the same ones."""
    if fraction >= 1.0:
        return table
    rng = np.random.default_rng([seed, 7411])  # its own stream: the subset does not move the run's other draws
    if not label_column:
        count = max(1, round(fraction * len(table)))
        return table.select(sorted(rng.permutation(len(table))[:count].tolist()))
    labels = np.asarray(table[label_column])
    keep = []
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        keep += rng.permutation(rows)[: max(1, round(fraction * len(rows)))].tolist()
    return table.select(sorted(keep))


def with_label_fraction(data: Any, fraction: float, seed: int, label_column: str = "") -> tuple[Any, str]:
    """``data`` (with a ``train`` split: :class:`ClassificationData`, a detection recipe's data) with its
    training split cut to ``fraction`` (:func:`label_fraction`: stratified by ``label_column`` where given),
    and the line for under the start banner saying how many images train ('' when nothing is cut)."""
    if fraction >= 1.0:
        return data, ""
    train = label_fraction(data.train, fraction, seed, label_column)
    how = "stratified by class" if label_column else "images drawn"
    line = (
        f"  labels    train_fraction {fraction:g}: {len(train):,} of {len(data.train):,} training images "
        f"({how} from seed {seed}; the rest unused)"
    )
    return dataclasses.replace(data, train=train), line
