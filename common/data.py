"""Image-classification datasets (hub name, local folder, built-in set) and reproducible data loaders.

Everything becomes a ``datasets.Dataset`` with an image column and a label column, whatever the
source, so one code path serves a hub dataset, an imagefolder on disk and the built-in sets
(:mod:`common.builtin`). The samplers and loaders below serve the detection recipes too.

Reproducibility: the training order is a function of ``(seed, epoch)`` only, and every sample's
augmentation randomness is seeded from ``(seed, epoch, index)``. A batch is therefore the same
whatever the number of workers or processes, and a run resumed mid-epoch sees exactly the
batches, crops and flips the uninterrupted run would have seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from common import UserError
from common.builtin import CLASSIFICATION
from common.images import decode_image

EVAL_SPLITS = ("validation", "val", "valid", "test")


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def _load_source(data: str):
    """A ``DatasetDict`` (or ``Dataset``) from a built-in name, a local folder or a hub name."""
    if data in CLASSIFICATION:
        return CLASSIFICATION[data]()
    if Path(data).is_file():
        raise UserError(f"data '{data}' is a file; expected a folder (imagefolder layout or a saved dataset)")
    return load_saved_or_hub(data, "dataset", f"one of {', '.join(CLASSIFICATION)}, an existing folder, or a "
                             "hub dataset name (with network, or already in the cache)")


def load_saved_or_hub(data: str, what: str, expected: str) -> Any:
    """A ``DatasetDict`` or ``Dataset`` from a ``save_to_disk`` folder, else through
    ``datasets.load_dataset``: a hub name (``org/name`` or ``org/name:config``), or a local folder it
    reads as the hub would (images in ``<split>/<class>/`` folders, or a downloaded dataset
    repository with ``data/*.parquet``). A failure is one :class:`UserError`:
    "<what> '<data>' could not be loaded (<first line of the cause>); expected <expected>"."""
    import datasets

    path = Path(data)
    if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        try:
            return datasets.load_from_disk(str(path))
        except Exception as e:
            raise UserError(f"saved dataset '{data}' could not be read: {type(e).__name__}: {e}") from None
    name, _, subset = (data, "", "") if path.exists() else data.partition(":")  # "frgfm/imagenette:320px"
    try:
        return datasets.load_dataset(name, subset or None)
    except Exception as e:  # hub errors come in many types; the first line says what happened
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{what} '{data}' could not be loaded ({first}); expected {expected}") from None


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
        raise UserError(f"'{data}' has no evaluation split and class {lonely[0]!r} has a single image, too few to "
                        "hold one out: add images (2 per class at least) or name a split with --eval_split")
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
    if train_split not in source:
        raise UserError(f"dataset '{data}' has no split '{train_split}'; it has {list(source)}")
    train = source[train_split]
    eval_split = eval_split or next((s for s in EVAL_SPLITS if s in source and s != train_split), "")
    if eval_split and eval_split not in source:
        raise UserError(f"dataset '{data}' has no split '{eval_split}'; it has {list(source)}")
    image_column, label_column = _detect_columns(train, image_column, label_column, labels)
    if not label_column:
        if len(train) == 0:
            raise UserError(f"the training split of '{data}' is empty")
        return ClassificationData(train.cast_column(image_column, datasets.Image(decode=False)), None,
                                  image_column, "", [])
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
            raise UserError(f"the evaluation split of '{data}' has classes {eval_feature.names[:5]}... "
                            f"but the training split has {classes[:5]}... ({len(eval_feature.names)} vs {len(classes)})")
    elif eval_feature is not None:
        top = int(max(evaluation[label_column]))
        if top >= len(classes):
            raise UserError(f"the evaluation split of '{data}' has label {top}, "
                            f"but the training split has only {len(classes)} classes")
    train = train.cast_column(image_column, datasets.Image(decode=False))
    evaluation = evaluation.cast_column(image_column, datasets.Image(decode=False))
    return ClassificationData(train, evaluation, image_column, label_column, classes)


# --------------------------------------------------------------------------------------------
# Per-sample seeding
# --------------------------------------------------------------------------------------------
def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed unique to (run seed, epoch, sample index); index -1 seeds the epoch's order."""
    high, low = np.random.SeedSequence([seed, epoch, index + 1]).generate_state(2)
    return (int(high) >> 1) << 32 | int(low)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch, numpy and random for one sample's augmentations.

    In a worker process the global generators belong to that sample alone. In the main process
    (``num_workers=0``) their state is restored afterwards so the training loop's own random
    stream (dropout, mixup) does not depend on how the data was loaded.
    """
    in_main = torch.utils.data.get_worker_info() is None
    saved = (random.getstate(), np.random.get_state()) if in_main else None
    with torch.random.fork_rng(devices=[], enabled=in_main):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        yield
    if saved is not None:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


class ClassificationDataset(torch.utils.data.Dataset):
    """``(image tensor, label)`` pairs from a hub-style dataset, transformed reproducibly.

    Indexed by ``(epoch, index)`` (what :class:`EpochBatchSampler` yields) or by a plain index
    (epoch 0, for evaluation).
    """

    def __init__(self, ds: Any, image_column: str, label_column: str, transform: Callable, seed: int = 0) -> None:
        self.ds, self.image_column, self.label_column = ds, image_column, label_column
        self.transform, self.seed = transform, seed

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row = self.ds[int(index)]
        image = decode_image(row[self.image_column], f"row {index} of column '{self.image_column}'")
        with seeded(sample_seed(self.seed, epoch, index)):  # label -1: a dataset without labels
            return self.transform(image), int(row[self.label_column]) if self.label_column else -1


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------
class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of ``(epoch, index)`` pairs; the order depends only on ``(seed, epoch)``.

    ``batch_size`` is per process: Accelerate hands process ``r`` of ``W`` the batches
    ``r, r + W, ...``, so one optimizer step of W processes covers the same samples as one
    step of a single process with batch ``W * batch_size``. With ``drop_last`` the epoch ends
    at the last complete round of ``W`` batches, which is again what the single process does.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, num_processes: int = 1) -> None:
        if drop_last and size < batch_size * num_processes:
            raise UserError(
                f"the training split has {size} images, fewer than one global batch "
                f"({batch_size} x {num_processes} processes); lower --batch_size"
            )
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.drop_last, self.num_processes = drop_last, num_processes
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.size // (self.batch_size * self.num_processes) * self.num_processes
        return -(-self.size // self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1)))
        else:
            order = torch.arange(self.size)
        order = order.tolist()
        for b in range(len(self)):
            yield [(self.epoch, i) for i in order[b * self.batch_size : (b + 1) * self.batch_size]]


def loader_kwargs(num_workers: int) -> dict[str, Any]:
    """DataLoader settings of the performance contract: workers, pinned memory, persistent workers,
    and a private generator so creating an iterator never draws from the global torch RNG."""
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": torch.cuda.is_available(),
                              "generator": torch.Generator()}
    if num_workers > 0:
        kwargs.update(persistent_workers=True, prefetch_factor=4)
    return kwargs


def train_loader_for(dataset: torch.utils.data.Dataset, batch_size: int, seed: int, num_workers: int,
                     num_processes: int, collate_fn: Callable | None = None):
    """A shuffling, drop-last training DataLoader over an :class:`EpochBatchSampler` (its
    ``batch_sampler``). Once prepared by Accelerate, call the loader's ``set_epoch`` before each epoch
    (:class:`common.loop.Loop` does): Accelerate re-applies its own epoch counter when iteration starts."""
    sampler = EpochBatchSampler(len(dataset), batch_size, True, seed, True, num_processes)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, **loader_kwargs(num_workers))


def eval_loader_for(dataset: torch.utils.data.Dataset, batch_size: int, num_workers: int,
                    collate_fn: Callable | None = None):
    """A sequential evaluation DataLoader; Accelerate pads the last round, ``gather_for_metrics`` un-pads."""
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False,
                                       collate_fn=collate_fn, **loader_kwargs(num_workers))
