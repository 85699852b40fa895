"""A local folder of images (common/data/folders.py) against datasets' own ``imagefolder`` given the same folder
(``load_dataset("imagefolder", data_dir=...)``, offline): the same splits, features (labels and their order)
and rows in the same order, on every layout of the table below; where imagefolder misreads a layout
(docs/data.md, "A folder of images") the test pins both what imagefolder gives and what is read instead.
Also: links and files gone during the walk, zip archives, the fingerprint, and what the classifier and DINO
take from the layouts users download."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from PIL import Image

from common import UserError
from common.data.classification import load_classification
from common.data.folders import folder_splits, read_image_folder

CHEMISTRY = ("beaker", "dev_board", "test_tube")  # "dev" names the validation split, "test" the test split
# Each layout: the image files under the data folder. The first seven are tests/test_data.py's parity layouts.
LAYOUTS = {
    "split folders with classes": [
        "train/cat/a.jpg",
        "train/dog/b.png",
        "train/dog/c.jpg",
        "val/cat/d.jpg",
        "val/dog/e.jpg",
    ],
    "class folders": ["cat/1.jpg", "dog/2.jpg", "zebra/3.JPG", "cat/0.jpg"],
    "one class folder: no labels": ["only/1.jpg", "only/2.jpg"],
    "flat": ["1.jpg", "b.png", "a.jpg"],
    "two depths: no labels": ["cat/1.jpg", "2.jpg"],
    "flat split folders": ["train/1.jpg", "train/2.jpg", "test/3.jpg"],  # imagefolder: split names as classes
    "glob characters": ["x [1]/a?.jpg", "y/b*.jpg"],
    # what users download
    "Kaggle cats and dogs": [
        "dataset/training_set/cats/cat.1.jpg",
        "dataset/training_set/cats/cat.10.jpg",
        "dataset/training_set/dogs/dog.2.jpg",
        "dataset/test_set/cats/cat.4001.jpg",
        "dataset/test_set/dogs/dog.4001.jpg",
    ],
    "Intel, split folders twice": [
        "seg_train/seg_train/buildings/0.jpg",
        "seg_train/seg_train/sea/10.jpg",
        "seg_train/seg_train/sea/9.jpg",
        "seg_test/seg_test/buildings/20.jpg",
        "seg_test/seg_test/sea/21.jpg",
        "seg_pred/seg_pred/5.jpg",  # in no split: left out
    ],
    "words beside the split": [
        "train_images/cat/a.jpg",
        "train_images/dog/b.jpg",
        "val_images/cat/c.jpg",
        "val_images/dog/d.jpg",
    ],
    "words beside, flat": ["train_images/a.jpg", "train_images/b.jpg", "val_images/c.jpg"],  # imagefolder: classes
    "class folders one level down": ["animals/cat/a.jpg", "animals/dog/b.jpg", "animals/dog/c.jpg"],
    "numbers, spaces, dots, words": [
        "train2017/cat/a.jpg",
        "training set/dog/b.jpg",
        "my-train/cat/c.jpg",
        "train.old/dog/d.jpg",
        "xtrain/cat/e.jpg",  # no separator: not a split
        "val-2/dog/f.jpg",
        "dev/cat/g.jpg",
        "the test 1/dog/h.jpg",
    ],
    "every validation keyword, merged in datasets' order": [
        "val/cat/a.jpg",
        "validation/dog/b.jpg",
        "valid/cat/c.jpg",
        "dev/dog/d.jpg",
        "train/cat/e.jpg",
        "train/dog/f.jpg",
    ],
    "images beside split folders: left out": [
        "train/cat/a.jpg",
        "train/dog/b.jpg",
        "test/cat/c.jpg",
        "test/dog/d.jpg",
        "extra.jpg",
        "misc/e.jpg",
    ],
    "a split folder inside a class folder": ["cat/test/a.jpg", "dog/b.jpg"],
    "hidden and special": [
        "cat/a.jpg",
        "dog/b.jpg",
        "cat/__x.jpg",
        "_u/c.jpg",
        "dog/.thumb.jpg",
        ".git/d.jpg",
        "__MACOSX/cat/._a.jpg",
    ],
    "sorted as datasets sorts": [
        "a/B.jpg",
        "a/a.jpg",
        "a/_c.jpg",
        "a/10.jpg",
        "a/9.jpg",
        "a-b/c.jpg",
        "a.b/d.jpg",
        "A/e.JPG",
    ],
    "matched by two patterns": ["train/train_cat/a.jpg", "train/train_dog/b.jpg", "val/x/c.jpg"],  # imagefolder: twice
    "capitalised split names": ["Training/cat/a.jpg", "Training/dog/b.jpg", "Test/cat/c.jpg", "Test/dog/d.jpg"],
    "split-like file names": ["IMG_val_3.jpg", "a.jpg", "beach-test-2.jpg"],
    # a keyword folder among class folders is a class; a keyword inside a split folder moves nothing
    "a class named like a split": [f"{c}/{n}.jpg" for c in ("Bus", "Car", "Train", "Truck") for n in "abc"],
    "a class named like a split, lower case": ["bus/a.jpg", "car/b.jpg", "train/c.jpg", "truck/d.jpg"],
    "keywords inside class names": [f"{s}/{c}/{s}_{c}.jpg" for s in ("train", "val") for c in CHEMISTRY],
    "keywords inside class names, one split": [f"train/{c}/{c}.jpg" for c in CHEMISTRY],
    "keywords inside class names, no split": [f"{c}/{c}.jpg" for c in CHEMISTRY],
}
# Where imagefolder misreads (and what it gives, pinned): how what is read here differs from it.
NO_LABELS = "images directly in the folder that makes their split have no class"
ONCE = "an image once per split"
INSIDE = "a keyword in a class name moves no image"
DEVIATIONS = {
    "flat split folders": NO_LABELS,
    "words beside, flat": NO_LABELS,
    "matched by two patterns": ONCE,
    "capitalised split names": "a keyword in any case",
    "split-like file names": "file names never name a split",
    "a class named like a split, lower case": "a keyword folder among class folders is a class",
    "keywords inside class names": INSIDE,
    "keywords inside class names, one split": INSIDE,
    "keywords inside class names, no split": INSIDE,
}


def _make(root: Path, names: list[str]) -> None:
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 3), (i, 7, 9)).save(root / name, format="PNG")  # tiny PNGs whatever the extension


def _view(dd, root: Path) -> dict[str, list[tuple[str, str | None]]]:
    """split -> [(file under root, its label name or None)], in row order; each path as the table holds it."""
    import datasets

    out = {}
    for split, ds in dd.items():
        ds = ds.cast_column("image", datasets.Image(decode=False))
        feature = ds.features.get("label")
        labels = [feature.int2str(v) if v is not None else None for v in ds["label"]] if feature else [None] * len(ds)
        paths = [v["path"] for v in ds["image"]]
        assert all(p.startswith(f"{root}/") for p in paths)  # the path as given, under the folder resolved
        out[split] = [(p.removeprefix(f"{root}/"), y) for p, y in zip(paths, labels)]
    return out


def _imagefolder(root: Path, cache: Path):
    import datasets

    datasets.utils.logging.disable_progress_bar()
    try:
        return datasets.load_dataset("imagefolder", data_dir=str(root), cache_dir=str(cache))
    finally:
        datasets.utils.logging.enable_progress_bar()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_reads_as_datasets_imagefolder_reads_it(tmp_path, layout):
    root = tmp_path / "data"
    _make(root, LAYOUTS[layout])
    ours = read_image_folder(*folder_splits(root, "data"))
    theirs = _imagefolder(root, tmp_path / "cache")
    mine, base = _view(ours, root.resolve()), _view(theirs, root.resolve())
    deviation = DEVIATIONS.get(layout)
    if deviation is None:
        assert list(ours) == list(theirs) and mine == base
        assert all(ours[s].features == theirs[s].features for s in ours)
    elif deviation == NO_LABELS:  # imagefolder: split folders as classes, in the later splits only
        assert "label" in theirs["train"].features and any(y is not None for rows in base.values() for _, y in rows)
        assert list(ours) == list(theirs) and "label" not in ours["train"].features
        assert mine == {s: [(f, None) for f, _ in rows] for s, rows in base.items()}
    elif deviation == ONCE:
        assert base["train"] == [("train/train_cat/a.jpg", "train_cat"), ("train/train_dog/b.jpg", "train_dog")] * 2
        assert mine == {s: list(dict.fromkeys(rows)) for s, rows in base.items()}
        assert all(ours[s].features == theirs[s].features for s in ours)
    elif layout == "capitalised split names":  # imagefolder: one train split, the test images in it
        assert list(theirs) == ["train"] and len(base["train"]) == 4
        assert mine == {
            "train": [("Training/cat/a.jpg", "cat"), ("Training/dog/b.jpg", "dog")],
            "test": [("Test/cat/c.jpg", "cat"), ("Test/dog/d.jpg", "dog")],
        }
    elif layout == "split-like file names":  # imagefolder: validation and test splits by file name, IMG's dropped
        assert base == {"validation": [("IMG_val_3.jpg", None)], "test": [("beach-test-2.jpg", None)]}
        assert mine == {"train": [("IMG_val_3.jpg", None), ("a.jpg", None), ("beach-test-2.jpg", None)]}
    elif layout == "a class named like a split, lower case":  # imagefolder: a train split of train/'s image alone
        assert base == {"train": [("train/c.jpg", None)]}
        assert mine == {"train": [(f, f.partition("/")[0]) for f in sorted(LAYOUTS[layout])]}
        assert ours["train"].features["label"].names == ["bus", "car", "train", "truck"]
    else:  # imagefolder: dev_board/ in the validation split and test_tube/ in the test split, wherever they lie
        splits = {name.partition("/")[0] for name in LAYOUTS[layout]} & {"train", "val"}
        expected = {
            ("validation" if s == "val" else s): [
                (f, f.split("/")[1]) for f in sorted(LAYOUTS[layout]) if f[:3] == s[:3]
            ]
            for s in sorted(splits)
        } or {"train": [(f, f.partition("/")[0]) for f in sorted(LAYOUTS[layout])]}
        assert mine == expected
        assert all(ours[s].features["label"].names == list(CHEMISTRY) for s in ours)
        moved = {f for s in ("validation", "test") for f, _ in base.get(s, []) if not f.startswith("val/")}
        assert moved == {f for f in LAYOUTS[layout] if not f.startswith("val/") and "beaker" not in f}
        if splits:  # where the images lie under train/ (and val/), imagefolder keeps them there too
            assert {f for f, _ in base["train"]} == {f for f, _ in mine["train"]}


def test_the_reported_layouts_give_their_splits_and_classes(tmp_path):
    """What the table's layouts give, spelled out for the ones users download (the table checks they are
    imagefolder's): Kaggle's training_set/test_set, Intel's seg_train/seg_train with seg_pred left out."""
    expected = {
        "Kaggle cats and dogs": ({"train": 3, "test": 2}, ["cats", "dogs"]),
        "Intel, split folders twice": ({"train": 3, "test": 2}, ["buildings", "sea"]),
        "words beside the split": ({"train": 2, "validation": 2}, ["cat", "dog"]),
        "class folders one level down": ({"train": 3}, ["cat", "dog"]),
        "numbers, spaces, dots, words": ({"train": 4, "validation": 2, "test": 1}, ["cat", "dog"]),
    }
    for layout, (sizes, classes) in expected.items():
        root = tmp_path / layout
        _make(root, LAYOUTS[layout])
        dd = read_image_folder(*folder_splits(root, "data"))
        assert {s: len(ds) for s, ds in dd.items()} == sizes, layout
        assert dd["train"].features["label"].names == classes, layout


def test_a_keyword_in_a_class_name_never_makes_a_split(tmp_path):
    """Classes Bus/ Car/ Train/ Truck/: four classes and one split, the classifier holding out its evaluation images
    from all four, and DINO's images the same 12 (not a Train split of 3, with no labels). Classes beaker/
    dev_board/ test_tube/ under train/: three classes, every image in training (the evaluation held out of it),
    none moved to a validation or test split by "dev" or "test" in its class's name."""
    vehicles = tmp_path / "vehicles"
    _make(vehicles, [f"{c}/{n}.jpg" for c in ("Bus", "Car", "Train", "Truck") for n in range(3)])
    data = load_classification(str(vehicles))
    assert data.classes == ["Bus", "Car", "Train", "Truck"] and len(data.train) + len(data.eval) == 12
    data = load_classification(str(vehicles), labels=False)  # DINO: its kNN evaluation held out of the 12
    assert data.classes == ["Bus", "Car", "Train", "Truck"] and len(data.train) + len(data.eval) == 12
    lab = tmp_path / "lab"
    _make(lab, [f"train/{c}/{n}.jpg" for c in CHEMISTRY for n in range(4)])
    data = load_classification(str(lab))
    assert data.classes == list(CHEMISTRY) and len(data.train) + len(data.eval) == 12
    used = [Path(v["path"]).relative_to(lab.resolve()) for ds in (data.train, data.eval) for v in ds["image"]]
    assert len(set(used)) == 12 and all(p.parts[0] == "train" for p in used)
    assert list(read_image_folder(*folder_splits(lab, "lab"))) == ["train"]


def test_the_classifier_finds_the_labels_and_dino_trains_on_the_train_split_only(tmp_path):
    root = tmp_path / "dataset"
    _make(root, LAYOUTS["Kaggle cats and dogs"])
    data = load_classification(str(root))
    assert data.classes == ["cats", "dogs"] and (len(data.train), len(data.eval)) == (3, 2)
    unlabelled = tmp_path / "photos"
    _make(unlabelled, ["train_images/a.jpg", "train_images/b.jpg", "test_images/c.jpg"])
    for folder, size in ((root, 3), (unlabelled, 2)):  # DINO: labels=False
        data = load_classification(str(folder), labels=False)
        paths = [Path(v["path"]).relative_to(folder.resolve()) for v in data.train["image"]]
        assert len(paths) == size and not any("test" in p.parent.as_posix() for p in paths)


def test_links_and_files_gone_during_the_walk(tmp_path, monkeypatch):
    """As imagefolder: a linked file is read, a linked folder is not entered (its images never cost the set its
    labels). A dangling link, or a file gone since the listing, never stops the load: it is a row that the
    start's scan finds unreadable, leaves out and lists in bad_images.txt (imagefolder leaves it out unlisted)."""
    import datasets

    from common.data.scan import scan_table

    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cv-cache"))  # the scan's answers
    root = tmp_path / "data"
    _make(root, ["cat/a.jpg", "cat/b.jpg", "dog/c.jpg"])
    _make(tmp_path / "elsewhere", ["d.jpg", "deeper/e.jpg"])
    (root / "cat" / "link.jpg").symlink_to(root / "dog" / "c.jpg")
    (root / "cat" / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "dog" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    files, in_class_folders = folder_splits(root, "data")
    (root / "cat" / "b.jpg").unlink()  # gone before the rows are read
    ours = read_image_folder(files, in_class_folders)
    theirs = _imagefolder(root, tmp_path / "cache")
    rows = _view(ours, root.resolve())["train"]
    assert rows == [("cat/a.jpg", "cat"), ("cat/b.jpg", "cat"), ("cat/link.jpg", "cat"), ("dog/c.jpg", "dog")] + [
        ("dog/dangling.jpg", "dog")
    ]
    gone = {"cat/b.jpg", "dog/dangling.jpg"}
    assert [r for r in rows if r[0] not in gone] == _view(theirs, root.resolve())["train"]
    assert ours["train"].features == theirs["train"].features
    found, _ = scan_table(ours["train"].cast_column("image", datasets.Image(decode=False)), "image")
    assert {os.path.relpath(name, root.resolve()) for _, name, _ in found} == gone


def test_a_folder_whose_images_are_all_linked_folders_is_one_error(tmp_path):
    _make(tmp_path / "real", ["train/cat/a.jpg", "train/dog/b.jpg"])
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train").symlink_to(tmp_path / "real" / "train", target_is_directory=True)
    with pytest.raises(UserError, match=r"no images outside its linked folders \(train\).*cp -rL"):
        folder_splits(tmp_path / "data", "data")


def test_zip_archives_a_split_would_read_are_one_error(tmp_path):
    """imagefolder extracts them and reads their images; here they are refused in one line saying how to
    extract them. One in no split (beside split folders) is left alone, as imagefolder leaves it."""
    root = tmp_path / "data"
    _make(root, ["train/cat/a.jpg", "train/dog/b.jpg"])
    (root / "extras.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    assert folder_splits(root, "data") is not None
    (root / "train" / "more.ZIP").write_bytes(b"PK\x05\x06" + bytes(18))
    with pytest.raises(UserError, match=r"holds zip archives \(train/more.ZIP\).*unzip <zip> -d <its folder>"):
        folder_splits(root, "data")


def test_the_fingerprint_notices_a_same_size_replacement(tmp_path):
    """The fingerprint (the disk image cache's key) is the same for unchanged files, and another once a file's
    bytes are replaced by others of the same size with its modification time put back: in place (cp -p: the
    change time moves) or by a new file renamed over it (rsync -a: the inode changes too)."""
    root = tmp_path / "data"
    _make(root, ["cat/a.jpg", "dog/b.jpg"])

    def prints() -> str:
        return read_image_folder(*folder_splits(root, "data"))["train"]._fingerprint

    first = prints()
    assert prints() == first
    photo = root / "cat" / "a.jpg"
    seen = {first}
    for how in ("in place", "renamed over"):
        before = photo.stat()
        data = photo.read_bytes()
        time.sleep(0.05)  # past the coarse clock that stamps change times (a few ms)
        written = photo.with_name("new.tmp") if how == "renamed over" else photo
        written.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other bytes
        os.utime(written, ns=(before.st_atime_ns, before.st_mtime_ns))
        written.replace(photo)
        after = photo.stat()
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns), how
        assert prints() not in seen, how
        seen.add(prints())
