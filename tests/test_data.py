"""common/data/classification.py: local folders, saved and hub-layout datasets, reproducible sampling, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common import UserError
from common.data.builtin import digits_dataset
from common.data.classification import ClassificationDataset, load_classification
from common.data.images import decode_image
from common.loaders import EpochBatchSampler


def _write_imagefolder(root, per_class=6, size=12):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def test_imagefolder_and_saved_dataset(tmp_path):
    data = load_classification(str(_write_imagefolder(tmp_path / "folder")))
    assert data.classes == ["cat", "dog"] and len(data.train) == 12 and len(data.eval) == 12
    saved = tmp_path / "saved"
    digits_dataset().save_to_disk(str(saved))
    data = load_classification(str(saved))
    assert len(data.train) == 1437 and data.image_column == "image" and data.label_column == "label"


def test_eval_split_carved_from_train_when_missing(tmp_path):
    import datasets

    ds = digits_dataset()["train"]
    ds.save_to_disk(str(tmp_path / "only_train"))
    data = load_classification(str(tmp_path / "only_train"), eval_fraction=0.1, seed=3)
    assert len(data.train) + len(data.eval) == 1437 and abs(len(data.eval) - 144) <= 1
    assert isinstance(data.train.features["label"], datasets.ClassLabel)


@pytest.mark.parametrize(
    "data, message",
    [
        ("no_such_dataset_anywhere", "dataset 'no_such_dataset_anywhere' could not be loaded"),
    ],
)
def test_missing_dataset_is_one_clear_error(data, message):
    with pytest.raises(UserError, match=message):
        load_classification(data)


def test_unreadable_image_names_the_file(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"definitely not a png")
    with pytest.raises(UserError, match=r"cannot read image '.*broken\.png'"):
        decode_image({"path": str(bad), "bytes": None}, "row 0")


def test_sampler_is_a_function_of_seed_and_epoch():
    s = EpochBatchSampler(100, 8, seed=1)
    s.set_epoch(0)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    s.set_epoch(0)
    assert list(s) == first and first != second
    flat = [i for batch in first for _, i in batch]
    assert len(flat) == len(set(flat)) == 96  # drop_last: 12 full batches, no repeats
    assert all(e == 0 for batch in first for e, _ in batch)


def test_sampler_rounds_match_single_process_global_batch():
    two = EpochBatchSampler(100, 8, seed=0, num_processes=2)
    one = EpochBatchSampler(100, 16, seed=0)
    assert len(two) == 2 * len(one) == 12
    pairs = list(two)
    merged = [pairs[k] + pairs[k + 1] for k in range(0, len(pairs), 2)]
    assert merged == list(one)  # process 0 + process 1 in a round == the single process's batch


def test_augmentations_are_reproducible_per_sample():
    ds = digits_dataset()["train"].cast_column("image", __import__("datasets").Image(decode=False))

    def noisy(image):  # an augmentation that draws from all three global generators
        import random

        return torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])

    a = ClassificationDataset(ds, "image", "label", noisy, seed=5)
    x1, _ = a[(3, 10)]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    x2, _ = a[(3, 10)]
    assert torch.equal(x1, x2)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG stream is left alone
    assert not torch.equal(a[(4, 10)][0], x1) and not torch.equal(a[(3, 11)][0], x1)


def test_hub_layout_loads_through_the_hub_code_path(tmp_path):
    """A dataset repository as the hub serves it (data/<split>-*.parquet, CIFAR-10's columns img/label)
    goes through the same load_dataset call as a hub name, with column detection."""
    import datasets

    d = digits_dataset().rename_column("image", "img")
    (tmp_path / "cifar_like" / "data").mkdir(parents=True)
    d["train"].select(range(50)).to_parquet(str(tmp_path / "cifar_like" / "data" / "train-00000-of-00001.parquet"))
    d["test"].select(range(20)).to_parquet(str(tmp_path / "cifar_like" / "data" / "test-00000-of-00001.parquet"))
    data = load_classification(str(tmp_path / "cifar_like"))
    assert (data.image_column, data.label_column) == ("img", "label")
    assert data.classes == [str(i) for i in range(10)] and (len(data.train), len(data.eval)) == (50, 20)
    assert decode_image(data.train[0]["img"], "row 0").size == (8, 8)
    assert isinstance(data.train.features["img"], datasets.Image)


def test_empty_split_and_class_mismatch_are_clear_errors(tmp_path):
    import datasets

    d = digits_dataset()
    datasets.DatasetDict({"train": d["train"], "test": d["test"].filter(lambda row: False)}).save_to_disk(
        str(tmp_path / "empty")
    )
    with pytest.raises(UserError, match="the evaluation split of .* is empty"):
        load_classification(str(tmp_path / "empty"))
    other = d["test"].cast_column("label", datasets.ClassLabel(names=[f"c{i}" for i in range(10)]))
    datasets.DatasetDict({"train": d["train"], "test": other}).save_to_disk(str(tmp_path / "mismatch"))
    with pytest.raises(UserError, match="has classes"):
        load_classification(str(tmp_path / "mismatch"))


def test_a_tiny_folder_without_evaluation_split_holds_out_one_image_per_class(tmp_path):
    """3 images per class and no validation split: 10 % would be one image for two classes, which
    scikit-learn's stratified split refuses; one per class is held out instead. A class of one image
    is one clear error."""
    import shutil

    root = _write_imagefolder(tmp_path / "tiny", per_class=3)
    shutil.rmtree(root / "test")
    data = load_classification(str(root))
    assert sorted(data.eval["label"]) == [0, 1] and sorted(data.train["label"]) == [0, 0, 1, 1]
    for extra in (root / "train" / "dog").glob("*.png"):
        if extra.name != "0.png":
            extra.unlink()
    with pytest.raises(UserError, match="class 'dog' has a single image.*--eval_split"):
        load_classification(str(root))


def test_repeated_augmentation_spreads_the_copies_over_processes():
    """aug_repeats 3 over 2 processes: the epoch keeps its length, every image in it comes 3 times (the last
    one's copies may be cut), the copies of an image go to both processes, each copy with its own seed;
    the same epoch gives the same batches, another epoch others."""
    from common.loaders import sample_seed

    sampler = EpochBatchSampler(60, 5, seed=0, num_processes=2, repeats=3)
    sampler.set_epoch(1)
    batches = list(sampler)
    assert len(batches) == len(EpochBatchSampler(60, 5, seed=0, num_processes=2)) == 12
    items = [item for batch in batches for item in batch]
    assert len(items) == 60 and all(epoch == 1 for epoch, _, _ in items)
    by_image: dict[int, list[tuple[int, int]]] = {}
    for b, batch in enumerate(batches):
        for _, index, repeat in batch:
            by_image.setdefault(index, []).append((b % 2, repeat))  # (process, repeat)
    full = [copies for copies in by_image.values() if len(copies) == 3]
    assert len(full) >= len(by_image) - 1 and all(len(c) <= 3 for c in by_image.values())
    assert all({p for p, _ in c} == {0, 1} and sorted(r for _, r in c) == [0, 1, 2] for c in full)
    assert list(sampler) == batches
    sampler.set_epoch(2)
    assert list(sampler) != batches
    assert len({sample_seed(0, 1, 7, r) for r in range(3)}) == 3 and sample_seed(0, 1, 7, 0) == sample_seed(0, 1, 7)


# Names that datasets' own file-name rules read as splits (train, val, valid, dev, test, eval, ... between
# separators or digits), and glob characters that a data_files pattern would read as a pattern.
SPLIT_LIKE_NAMES = ["IMG_0001.jpg", "beach-test-2.jpg", "val_2019.jpg", "IMG_val_3.jpg", "dev.png", "x.eval.1.jpg"]
SPLIT_LIKE_NAMES += ["training set.jpg", "a[1].jpg", "b*?.jpg"]


def _photos(folder, names, size=(20, 12)):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        Image.new("RGB", size, (10 * i, 20, 30)).save(folder / name)
    return [folder / name for name in names]


def _paths(table) -> set[Path]:
    return {Path(v["path"]).resolve() for v in table["image"]}


def test_a_flat_folder_loads_every_photo_whatever_its_name(tmp_path):
    """A flat folder of photos (DINO's unlabelled data, --predict's input): each file is one training image,
    none taken for a split by its name; a hidden file and a __MACOSX copy are not photos."""
    from common.data.images import image_files

    files = _photos(tmp_path / "flat", SPLIT_LIKE_NAMES)
    _photos(tmp_path / "flat" / "__MACOSX", ["._IMG_0001.jpg"])
    (tmp_path / "flat" / ".thumb.jpg").write_bytes(b"not a photo")
    data = load_classification(str(tmp_path / "flat"), labels=False)
    assert data.eval is None and len(data.train) == len(files) and _paths(data.train) == {f.resolve() for f in files}
    assert set(files) <= set(image_files(tmp_path / "flat"))


def test_class_folders_load_every_photo_with_its_class_whatever_its_name(tmp_path):
    files = _photos(tmp_path / "photos" / "cat", SPLIT_LIKE_NAMES)
    files += _photos(tmp_path / "photos" / "dog", ["test.jpg", "valid-2.jpg", "IMG_train_7.jpg"])
    data = load_classification(str(tmp_path / "photos"), seed=1)
    assert data.classes == ["cat", "dog"] and len(data.train) + len(data.eval) == len(files)
    both = [*data.train.select_columns(["image", "label"]), *data.eval.select_columns(["image", "label"])]
    assert {(Path(r["image"]["path"]).resolve(), r["label"]) for r in both} == {
        (f.resolve(), int(f.parent.name == "dog")) for f in files
    }


def test_split_folders_are_the_splits_and_file_names_are_not(tmp_path):
    """train/ and val/ with class folders (a year on the folder's name allowed): the splits are the folders,
    whatever the files are called; images in a split folder without class folders have no labels (DINO's
    data), never the split names as classes."""
    root = tmp_path / "layout"
    train = _photos(root / "train2019" / "cat", ["test_1.jpg", "val.jpg"])
    train += _photos(root / "train2019" / "dog", ["a.jpg"])
    val = _photos(root / "val" / "cat", ["IMG_train_2.jpg"]) + _photos(root / "val" / "dog", ["dev_3.jpg", "b.jpg"])
    data = load_classification(str(root))
    assert data.classes == ["cat", "dog"] and (_paths(data.train), _paths(data.eval)) == (
        {f.resolve() for f in train},
        {f.resolve() for f in val},
    )
    flat = tmp_path / "flat_splits"
    _photos(flat / "train", ["IMG_test_1.jpg", "2.jpg"])
    _photos(flat / "test", ["IMG_train_1.jpg"])
    data = load_classification(str(flat), labels=False)
    assert (data.label_column, len(data.train)) == ("", 2)


@pytest.mark.parametrize(
    "layout",
    [
        ["train/cat/a.jpg", "train/dog/b.png", "train/dog/c.jpg", "val/cat/d.jpg", "val/dog/e.jpg"],
        ["cat/1.jpg", "dog/2.jpg", "zebra/3.JPG", "cat/0.jpg"],
        ["only/1.jpg", "only/2.jpg"],  # one class folder: no labels
        ["1.jpg", "b.png", "a.jpg"],
        ["cat/1.jpg", "2.jpg"],  # not every image in a class folder: no labels
        ["train/1.jpg", "train/2.jpg", "test/3.jpg"],
        ["x [1]/a?.jpg", "y/b*.jpg"],  # glob characters in names
    ],
)
def test_an_image_folder_reads_as_datasets_imagefolder_builds_it(tmp_path, layout):
    """read_image_folder skips datasets' builder; what it returns is what the builder gives for the same files:
    splits, features (labels and their order), and every row in order."""
    import datasets

    from common.data.folders import build_image_folder, folder_splits, read_image_folder

    for name in layout:
        _photos(tmp_path / "photos" / Path(name).parent, [Path(name).name])
    files, in_class_folders = folder_splits(tmp_path / "photos", "photos")
    ours = read_image_folder(files, in_class_folders)
    built = build_image_folder(files, in_class_folders, cache_dir=str(tmp_path / "cache"))
    assert list(ours) == list(built)
    for split in ours:
        assert ours[split].features == built[split].features
        undecoded = datasets.Image(decode=False)
        assert (
            ours[split].cast_column("image", undecoded).to_dict()
            == built[split].cast_column("image", undecoded).to_dict()
        )


def test_a_folder_with_a_metadata_table_reads_its_columns(tmp_path):
    """metadata.csv beside the images goes through datasets' builder (build_image_folder): its columns reach the
    table, here an integer label per file."""
    _photos(tmp_path / "photos", ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    (tmp_path / "photos" / "metadata.csv").write_text("file_name,kind\na.jpg,0\nb.jpg,1\nc.jpg,1\nd.jpg,0\n")
    data = load_classification(str(tmp_path / "photos"), label_column="kind", eval_fraction=0.5)
    rows = [*data.train.select_columns(["image", "kind"]), *data.eval.select_columns(["image", "kind"])]
    assert {Path(r["image"]["path"]).name: r["kind"] for r in rows} == {"a.jpg": 0, "b.jpg": 1, "c.jpg": 1, "d.jpg": 0}


def test_an_image_folder_is_fingerprinted_by_its_files(tmp_path):
    """The fingerprint (the disk image cache's key) is the same for the same files in a later run, and new when
    a file is edited in place."""
    import os

    from common.data.folders import folder_splits, read_image_folder

    photos = _photos(tmp_path / "photos" / "cat", ["a.jpg", "b.jpg"]) + _photos(tmp_path / "photos" / "dog", ["c.jpg"])
    prints = lambda: read_image_folder(*folder_splits(tmp_path / "photos", "photos"))["train"]._fingerprint  # noqa: E731
    first = prints()
    assert prints() == first
    Image.new("RGB", (9, 9)).save(photos[0])
    os.utime(photos[0], ns=(1, 1))
    assert prints() != first


def test_a_plain_torchvision_dataset_trains_reproducibly():
    """A dataset that knows nothing of (epoch, index) keys (torchvision's FakeData with random crops and flips)
    goes through train_loader_for as it is: each sample's augmentation is seeded from its key, so the batches
    are the same with 0 or 2 workers, and another epoch draws other crops of the same images."""
    import torchvision
    from torchvision import transforms as T

    from common.loaders import PerSample, train_loader_for

    tf = T.Compose([T.RandomResizedCrop(16, scale=(0.2, 1.0)), T.RandomHorizontalFlip(), T.ToTensor()])
    fake = torchvision.datasets.FakeData(size=12, image_size=(3, 24, 24), num_classes=3, transform=tf)

    def epoch_batches(workers: int, epoch: int) -> list[torch.Tensor]:
        loader = train_loader_for(fake, 4, seed=7, num_workers=workers, num_processes=1)
        assert isinstance(loader.dataset, PerSample)
        loader.batch_sampler.set_epoch(epoch)
        return [images for images, _ in loader]

    main, workers = epoch_batches(0, 0), epoch_batches(2, 0)
    assert len(main) == 3 and all(torch.equal(a, b) for a, b in zip(main, workers))
    assert not any(torch.equal(a, b) for a, b in zip(main, epoch_batches(0, 1)))
