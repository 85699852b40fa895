"""YOLO txt data (Ultralytics' layout and Roboflow's exports) read as Ultralytics reads it, by every detector
(common/detection/yolo_txt.py through load_detection): the yaml's forms, its split entries, the folder listing
without dot-files, the image -> label path rule and the label checks with Ultralytics' tolerance, EXIF-turned
photos, label files that fail a check left out and listed in bad_images.txt, a folder in no known form named in
one line, DINO's images; end to end, Faster R-CNN trains and evaluates on a Roboflow export, and its
``--predict`` label files read back as its detections.

Ultralytics is not a dependency. What its code answers is hard-wired below as it was observed (ultralytics
8.4.190's ``verify_image_label`` and ``get_img_files`` run on these files; docs/notes/readers.md); where
ultralytics 8.4.183 or later is importable, the tests against it run too and check the table as well."""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common import UserError
from common.data.scan import without_unreadable
from common.detection.data import detection_images, load_detection
from common.detection.yolo_txt import img2label_path, read_labels, split_images
from conftest import check, load_recipe, run_recipe

NAMES = ["RBC", "WBC", "Platelets"]


def _ultralytics_label_path(image: str) -> str:
    """``img2label_paths`` of ultralytics/data/utils.py (8.4.190), as written there."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return sb.join(image.rsplit(sa, 1)).rsplit(".", 1)[0] + ".txt"


def _picture(path: Path, size: tuple[int, int], box: tuple[int, int, int, int] | None = None, turned: bool = False):
    """A dark image of ``size`` (width, height) with a bright rectangle at COCO ``box``; ``turned``: a JPEG stored
    turned, with EXIF orientation 6, that displays at ``size``."""
    width, height = size
    pixels = np.full((height, width, 3), 30, np.uint8)
    if box:
        x, y, w, h = box
        pixels[y : y + h, x : x + w] = 230
    image = Image.fromarray(pixels)
    path.parent.mkdir(parents=True, exist_ok=True)
    if turned:
        exif = Image.Exif()
        exif[0x0112] = 6  # the viewer turns it 90 degrees clockwise
        image.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif)
    else:
        image.save(path)


def _same_boxes(found: list, expected: list, tolerance: float = 1e-6) -> None:
    np.testing.assert_allclose(np.reshape(found, (-1, 4)), np.reshape(expected, (-1, 4)), atol=tolerance)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# one image per row: (file, label text, its boxes in pixels of an 80 x 40 image, categories)
ROWS = [
    ("a.jpg", "0 0.5 0.5 0.25 0.5\n1 0.25 0.25 0.1 0.1\n", [[30, 10, 20, 20], [16, 8, 8, 4]], [0, 1]),
    ("b.png", "2 0.125 0.75 0.25 0.5\n", [[0, 20, 20, 20]], [2]),
    ("c.jpg", "", [], []),  # an empty label file: no objects
    ("d.jpg", None, [], []),  # no label file: no objects
]


def _layout(root: Path, layout: str) -> Path:
    """The same two splits (ROWS as train, the first two as val) in one layout; returns what --data names."""
    for split in ("train", "val"):
        for name, text, _, _ in ROWS if split == "train" else ROWS[:2]:
            image = {
                "ultralytics": root / "images" / split / name,
                "roboflow": root / ("valid" if split == "val" else split) / "images" / name,
                "lists": root / "images" / split / name,
            }[layout]
            _picture(image, (80, 40))
            if text is not None:
                _write(Path(img2label_path(image)), text)
    if layout == "ultralytics":  # the yaml elsewhere, path relative to it, names as a mapping
        return _write(
            root.parent / "configs" / f"{root.name}.yaml",
            f"path: ../{root.name}\ntrain: images/train\nval: images/val\nnames:\n  0: RBC\n  1: WBC\n  2: Platelets\n",
        )
    if layout == "roboflow":  # Roboflow's data.yaml: ../ entries, a list of names and nc
        _write(root / "data.yaml", f"train: ../train/images\nval: ../valid/images\nnc: 3\nnames: {NAMES}\n")
        return root
    _write(root / "train.txt", "".join(f"./images/train/{r[0]}\n" for r in ROWS))  # ./: relative to the txt
    _write(root / "val.txt", "".join(f"images/val/{r[0]}\n" for r in ROWS[:2]))  # relative to path
    _write(root / "data.yaml", "path: .\ntrain: train.txt\nval: [val.txt]\nnames: [RBC, WBC, Platelets]\n")
    return root


def test_label_paths_are_ultralytics_rule():
    for image in ("/d/images/train/a.jpg", "/d/train/images/x.y.png", "/d/images/a/images/b.jpg", "/d/photos/c.JPG"):
        assert img2label_path(image) == _ultralytics_label_path(image)
    assert img2label_path("/d/images/a/images/b.jpg") == "/d/images/a/labels/b.txt"  # the last images/
    assert img2label_path("/d/photos/c.JPG") == "/d/photos/c.txt"  # in no images/ folder: beside it


@pytest.mark.parametrize("layout", ["ultralytics", "roboflow", "lists"])
def test_every_layout_reads_the_same_rows(tmp_path, layout):
    data = _layout(tmp_path / "bccd", layout)
    for given in (data, data / "data.yaml" if data.is_dir() else data):
        loaded = load_detection(str(given), eval_split="validation")  # 'validation' reads val / valid
        assert loaded.classes == NAMES and loaded.category_ids == [0, 1, 2] and not loaded.unusable
        assert [Path(v["path"]).name for v in loaded.train["image"]] == [r[0] for r in ROWS]
        assert loaded.train["image_id"][:] == [0, 1, 2, 3] and len(loaded.eval) == 2
        assert (loaded.train["width"][:], loaded.train["height"][:]) == ([80] * 4, [40] * 4)
        for objects, (_, _, boxes, categories) in zip(loaded.train["objects"], ROWS):
            _same_boxes(objects["bbox"], boxes)
            assert objects["category"] == categories
            assert objects["iscrowd"] == [0] * len(boxes)


# Files under one split folder, and whether Ultralytics' get_img_files lists them (8.4.190, observed): its glob
# passes over dot-files and dot-folders, so neither a notebook's checkpoint copies nor macOS's resource forks (whose
# label files never exist) train as images without objects.
LISTED = {
    "a.jpg": True,
    "sub/b.PNG": True,
    "deeper/still/c.jpeg": True,
    "._a.jpg": False,
    ".ipynb_checkpoints/a-checkpoint.jpg": False,
    "sub/.hidden.jpg": False,
    ".cache/sub/d.jpg": False,
    "notes.txt": False,
    "e.gif": False,
}


def _listing(root: Path) -> Path:
    for name in LISTED:
        path = root / "images" / "train" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")  # listing reads names only
    return root / "images" / "train"


def test_folders_are_listed_as_ultralytics_lists_them(tmp_path):
    folder = _listing(tmp_path / "[ds]")  # glob characters in the path are the folder's own
    found = split_images(tmp_path / "[ds]", "images/train", "train", tmp_path / "data.yaml")
    assert found == sorted(str(folder / name) for name, listed in LISTED.items() if listed)
    listed = _write(tmp_path / "[ds]" / "train.txt", "./images/train/._a.jpg\n./images/train/a.jpg\n")
    found = split_images(tmp_path / "[ds]", str(listed), "train", tmp_path / "data.yaml")  # a list: as written
    assert found == [str(folder / "._a.jpg"), str(folder / "a.jpg")]


def test_folders_are_listed_as_the_real_ultralytics_lists_them(tmp_path):
    """Where Ultralytics is installed: its own BaseDataset.get_img_files on the same folder."""
    _real_ultralytics()
    from ultralytics.data.base import BaseDataset

    folder = _listing(tmp_path / "[ds]")
    theirs = BaseDataset.get_img_files(types.SimpleNamespace(prefix="", fraction=1.0), str(folder))
    assert split_images(tmp_path / "[ds]", "images/train", "train", tmp_path / "data.yaml") == theirs


def test_a_hidden_copy_of_an_image_never_trains(tmp_path):
    """A Jupyter checkpoint copy and a macOS resource fork beside a Roboflow export's images: read as the export's
    images alone (before, each was an image without a label file, trained on as background)."""
    root = _layout(tmp_path / "bccd", "roboflow")
    _picture(root / "train" / "images" / ".ipynb_checkpoints" / "a-checkpoint.jpg", (80, 40))
    (root / "train" / "images" / "._a.jpg").write_bytes(b"\x00\x05\x16\x07")  # AppleDouble, not an image
    loaded = load_detection(str(root))
    assert [Path(v["path"]).name for v in loaded.train["image"]] == [r[0] for r in ROWS] and not loaded.unusable


def test_yaml_forms_and_their_errors(tmp_path):
    root = _layout(tmp_path / "ds", "roboflow")
    (root / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\nnc: 3\n")  # nc alone
    assert load_detection(str(root)).classes == ["class_0", "class_1", "class_2"]
    moved = tmp_path / "elsewhere.yaml"
    moved.write_text(f"path: {root}\ntrain: train/images\nvalidation: valid/images\nnames: {NAMES}\n")  # absolute
    assert len(load_detection(str(moved)).eval) == 2
    (root / "data.yaml").write_text(f"path: /content/datasets/ds\ntrain: train/images\nnames: {NAMES}\n")
    assert len(load_detection(str(root)).train) >= 3  # another machine's path: the yaml's folder, where it all is
    for text, message in [
        ("train: ../train/images\nnc: 2\nnames: [a, b, c]\n", "has 3 names but 'nc' is 2"),
        ("train: ../train/images\nnames: {0: a, 2: b}\n", "needs 0..1"),
        ("train: ../nowhere\nnames: [a]\n", "does not exist"),
        ("train: ../train/images\nval: ../valid/images\nnames: [a]\n", "class 1 is not in names"),
    ]:
        (root / "data.yaml").write_text(text)
        try:
            loaded = load_detection(str(root))
        except UserError as e:
            assert message in str(e), (text, e)
            continue
        assert any(message in why for why in loaded.unusable.values()), (text, loaded.unusable)
    (root / "data.yaml").write_text("path: .\nnames: [a]\n")
    with pytest.raises(UserError, match="no 'train' entry"):
        load_detection(str(root / "data.yaml"))


# What Ultralytics' verify_image_label (8.4.190) answered for each label file, with 3 classes: (what the case shows,
# the rows [class, cx, cy, w, h] it kept, or None where it ignored the image as corrupt). Releases before 8.4.182
# answer some of these otherwise (docs/notes/readers.md): they keep a class 1.5 and a side of -0.005, and ignore a
# file with a whitespace-only line between its rows.
BOX = [0, 0.5, 0.5, 0.2, 0.2]
POLYGON = [1, 0.3, 0.2, 0.4, 0.2]  # the box of "1 0.1 0.1 0.5 0.1 0.5 0.3"
ULTRALYTICS = {
    "0 0.5 0.5 0.2 0.2": ("a box", [BOX]),
    "1.0 0.5 0.5 0.2 0.2": ("an integer class written as a float", [[1, 0.5, 0.5, 0.2, 0.2]]),
    "0 1e-1 0.5 0.2 0.2": ("an exponent", [[0, 0.1, 0.5, 0.2, 0.2]]),
    "0 1.005 0.5 0.2 0.2": ("a centre 0.5 % past the edge: within the tolerance", [[0, 1.005, 0.5, 0.2, 0.2]]),
    "0 -0.008 0.5 0.2 0.2": ("a centre 0.8 % before the edge: within the tolerance", [[0, -0.008, 0.5, 0.2, 0.2]]),
    "0 0.5 0.5 1.01 0.2": ("a side of 1.01: within the tolerance", [[0, 0.5, 0.5, 1.01, 0.2]]),
    "0 0.5 0.5 0 0.2": ("a side of zero", [[0, 0.5, 0.5, 0, 0.2]]),
    "0 1.02 0.5 0.2 0.2": ("2 % past the edge", None),
    "0 -0.02 0.5 0.2 0.2": ("2 % before the edge", None),
    "0 0.5 0.5 -0.001 0.2": ("a negative side", None),
    "0 0.5 0.5 -0.005 0.2": ("a side of -0.005", None),
    "0 0.003 0.5 -0.005 0.2": ("a side of -0.005, the least value within the tolerance", None),
    "0 nan 0.5 0.2 0.2": ("a NaN", None),
    "3 0.5 0.5 0.2 0.2": ("a class past names", None),
    "-1 0.5 0.5 0.2 0.2": ("a negative class", None),
    "0.5 0.5 0.5 0.2 0.2": ("a class that is no integer", None),
    "1.5 0.5 0.5 0.2 0.2": ("class 1.5", None),
    "0 0.5 0.5 0.2": ("4 values", None),
    "1 0.1 0.1": ("3 values", None),
    "0 0.5 0.5 0.2 zero": ("not numbers", None),
    "0 0x1 0.5 0.2 0.2": ("a hexadecimal number", None),
    "\ufeff0 0.5 0.5 0.2 0.2": ("a byte-order mark", [BOX]),
    "0 0.5 0.5 0.2 0.2 \r\n1 0.1 0.1 0.1 0.1\r\n": ("CRLF line ends", [BOX, [1, 0.1, 0.1, 0.1, 0.1]]),
    "   ": ("only whitespace: no objects", []),
    "0 0.5 0.5 0.2 0.2\n\t\n": ("a whitespace-only last line", [BOX]),
    "0 0.5 0.5 0.2 0.2\n   \n1 0.1 0.1 0.1 0.1": (
        "a whitespace-only line between rows",
        [BOX, [1, 0.1, 0.1, 0.1, 0.1]],
    ),
    "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2": ("two equal boxes: one kept", [BOX]),
    "0 0.5 0.5 0.2 0.2\n\n0 0.5 0.5 0.2 0.2\n1 0.1 0.1 0.1 0.1": (
        "a repeated row, a blank line",
        [BOX, [1, 0.1, 0.1, 0.1, 0.1]],
    ),
    "1 0.1 0.1 0.5 0.1 0.5 0.3": ("a polygon: its box", [POLYGON]),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n2 0.2 0.2 0.4 0.2 0.4 0.6 0.2 0.6": (
        "two polygons",
        [POLYGON, [2, 0.3, 0.4, 0.2, 0.4]],
    ),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n1 0.1 0.1 0.5 0.1 0.5 0.3": ("two equal polygons: one kept", [POLYGON]),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n1 0.1 0.1 0.5 0.3 0.5 0.1": ("two polygons with one box: both kept", [POLYGON] * 2),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n1 0.1 0.1 0.5 0.1 0.5 0.3 0.3 0.2": ("one box, a point more: both", [POLYGON] * 2),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n1 0.1 0.1": ("a polygon and a one-point row", [POLYGON, [1, 0.1, 0.1, 0, 0]]),
    "1 -0.05 0.1 0.5 0.1 0.5 0.3": ("a polygon's point outside, its box's centre inside", [[1, 0.225, 0.2, 0.55, 0.2]]),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n0 0.5 0.5 0.2 0.2": ("a polygon and a box mixed", None),
    "1 0.1 0.1 0.5 0.1 0.5 0.3 0.4": ("a polygon of an odd count of coordinates", None),
    "1 0.1 0.1 0.5 0.1 0.5 0.3\n2 0.5 0.5 0.2 0.2 0.91": ("a polygon and a box with a score", None),
    "2 0.5 0.5 0.2 0.2 0.91": ("a box with a score", None),
}
# Where this project reads a file otherwise, by a rule of its own (docs/data.md#yolo-txt): text -> (the rule, rows).
PROJECT_RULES = {
    "2 0.5 0.5 0.2 0.2 0.91": ("a box row's sixth value, --predict's score, is ignored", [[2, 0.5, 0.5, 0.2, 0.2]]),
}


def _same_rows(found: np.ndarray, expected: list) -> None:
    """The same rows in any order (Ultralytics sorts them as it removes repeated ones), within float32's rounding."""
    assert len(found) == len(expected)
    if len(expected):
        order = lambda rows: np.array(sorted(np.asarray(rows, np.float64).round(5).tolist()))  # noqa: E731
        np.testing.assert_allclose(order(found), order(expected), atol=1e-5)


@pytest.mark.parametrize("text", list(ULTRALYTICS), ids=[what for what, _ in ULTRALYTICS.values()])
def test_label_checks_are_ultralytics_checks(tmp_path, text):
    """Each file is used or left out as Ultralytics' verify_image_label decided, with the same rows; the project's
    own rules (PROJECT_RULES) instead where it has one."""
    rows, why = read_labels(str(_write(tmp_path / "x.txt", text)), 3)
    _, expected = PROJECT_RULES.get(text, ULTRALYTICS[text])
    assert (expected is None) == bool(why), (text, why)
    if expected is not None:
        _same_rows(rows, expected)


def test_the_projects_own_label_rules(tmp_path):
    """Each project rule reads a file that Ultralytics ignores as corrupt: the rule is this project's, not theirs.
    A missing label file is no objects, as there."""
    for text, (rule, rows) in PROJECT_RULES.items():
        assert ULTRALYTICS[text][1] is None and rows, rule
    assert read_labels(str(tmp_path / "missing.txt"), 3)[1] == ""


def _real_ultralytics():
    """ultralytics.data.utils where ultralytics 8.4.183 or later is importable (the release whose label rules are
    read here; earlier ones differ), else the test is skipped."""
    ultralytics = pytest.importorskip("ultralytics")
    version = tuple(int(v) for v in ultralytics.__version__.split(".")[:3])
    if version < (8, 4, 183):
        pytest.skip(f"ultralytics {ultralytics.__version__}: its label rules predate 8.4.183")
    import ultralytics.data.utils as utils

    return utils


def test_label_checks_against_the_real_ultralytics(tmp_path):
    """Where Ultralytics is installed: its own verify_image_label on every case, against the table and the reader."""
    utils = _real_ultralytics()
    image = tmp_path / "images" / "a.jpg"
    _picture(image, (64, 48))
    label = _write(Path(_ultralytics_label_path(str(image))), "")
    for text, (what, expected) in ULTRALYTICS.items():
        label.write_text(text, encoding="utf-8", newline="")
        answer = utils.verify_image_label((str(image), str(label), "", False, 3, 0, 0, False))
        theirs = None if answer[0] is None else answer[1]
        assert (theirs is None) == (expected is None), what
        if theirs is not None:
            _same_rows(theirs, expected)
        if text not in PROJECT_RULES:
            rows, why = read_labels(str(label), 3)
            assert bool(why) == (theirs is None), what
            if theirs is not None:
                _same_rows(rows, theirs.tolist())
        assert utils.img2label_paths([str(image)]) == [img2label_path(image)]


def test_boxes_are_pixels_of_the_displayed_photo_and_clipped(tmp_path):
    root = tmp_path / "ds"
    _picture(root / "images" / "train" / "phone.jpg", (80, 40), turned=True)  # stored 40 x 80, shown 80 x 40
    _write(root / "labels" / "train" / "phone.txt", "0 0.5 0.5 0.25 0.5\n0 1.005 0.5 0.2 0.2\n")
    _write(root / "data.yaml", "train: images/train\nnames: [a]\n")
    with Image.open(root / "images" / "train" / "phone.jpg") as stored:
        assert stored.size == (40, 80)
    row = load_detection(str(root), eval_split="train").train[0]
    assert (row["width"], row["height"]) == (80, 40)
    _same_boxes(row["objects"]["bbox"], [[30, 10, 20, 20], [72.4, 16, 7.6, 8]])  # the second clipped


def test_unusable_label_files_are_left_out_and_listed(tmp_path):
    root = _layout(tmp_path / "ds", "roboflow")
    _write(root / "train" / "labels" / "b.txt", "2 0.125 0.75 0.25 0.5\n7 0.5 0.5 0.1 0.1\n")  # class 7 of 3
    _write(root / "valid" / "labels" / "a.txt", "0 0.5 0.5 1.2 0.5\n")
    data = load_detection(str(root))
    assert data.train[1]["objects"]["bbox"] == []  # in the table, without objects, until the scan leaves it out
    accelerator = types.SimpleNamespace(process_index=0, num_processes=1)
    scanned = without_unreadable(data, "image", accelerator, "skip", 0, 1, tmp_path / "run")
    assert len(scanned.data.train) == 3 and len(scanned.data.eval) == 1
    assert [Path(v["path"]).name for v in scanned.data.train["image"]] == ["a.jpg", "c.jpg", "d.jpg"]
    listed = scanned.files["bad_images.txt"].splitlines()
    assert listed[1] == f"training\t{root / 'train' / 'images' / 'b.png'}\tb.txt line 2: class 7 is not in names (0..2)"
    assert listed[2].startswith("evaluation\t") and "a.txt line 1: coordinates past 1" in listed[2]
    warning = [" ".join(n.split()) for n in scanned.notes if n.startswith("warning:")]  # wrapped at 120 columns
    assert len(warning) == 1 and "b.png (b.txt line 2: class 7 is not in names (0..2))" in warning[0]
    with pytest.raises(UserError, match="--bad_images error"):
        without_unreadable(data, "image", accelerator, "error", 0, 1, tmp_path / "run")


def test_a_folder_in_no_known_form_is_one_line_naming_what_is_there(tmp_path):
    root = tmp_path / "noyaml"
    _layout(root, "ultralytics")  # its yaml is elsewhere
    with pytest.raises(UserError) as error:
        load_detection(str(root))
    message = str(error.value)
    assert "found 6 images (images/ (6)) and 5 YOLO label files (labels/ (5));" in message
    assert "YOLO txt needs a data.yaml naming the classes" in message
    assert "docs/data.md#yolo-txt" in message and "\n" not in message
    photos = tmp_path / "photos"
    for folder in ("cat", "dog"):
        _picture(photos / folder / "1.jpg", (8, 8))
    with pytest.raises(UserError) as error:
        load_detection(str(photos))
    message = str(error.value)
    assert "found 2 images (cat/ (1), dog/ (1)) and no annotations" in message
    assert all(form in message for form in ("COCO json", "YOLO txt", "Pascal VOC"))
    with pytest.raises(UserError, match="is a file; expected a YOLO data yaml or a folder"):
        load_detection(str(photos / "cat" / "1.jpg"))


def test_dino_reads_a_yolo_dataset_as_its_images(tmp_path):
    data = detection_images(str(_layout(tmp_path / "ds", "roboflow") / "data.yaml"))
    assert data is not None and data.classes == [] and data.image_column == "image"
    assert [Path(v["path"]).name for v in data.train["image"]] == [r[0] for r in ROWS]


FRCNN = ["--report_to", "none", "--num_workers", "0", "--batch_size", "2", "--plot_images", "0"]
FRCNN += ["--min_size", "64", "--max_size", "64"]


@pytest.mark.slow
def test_faster_rcnn_trains_on_a_roboflow_export_and_its_labels_read_back(tmp_path):
    """A Roboflow YOLO export as users have it (--data the data.yaml): 2 steps and an evaluation, the image
    with a bad label file listed; then --predict's label files, beside the images, read back as its detections."""
    root = tmp_path / "bccd"
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("valid", 3)):
        for i in range(count):
            x, y, w, h = (int(v) for v in rng.integers([4, 4, 16, 16], [32, 32, 28, 28]))
            image = root / split / "images" / f"cell_{i}.jpg"
            _picture(image, (64, 64), (x, y, w, h))
            _write(Path(img2label_path(image)), f"{i % 3} {(x + w / 2) / 64} {(y + h / 2) / 64} {w / 64} {h / 64}\n")
    _write(root / "train" / "labels" / "cell_5.txt", "9 0.5 0.5 0.2 0.2\n")
    _write(root / "data.yaml", f"train: ../train/images\nval: ../valid/images\nnc: 3\nnames: {NAMES}\n")
    run = tmp_path / "run"
    proc = check(
        run_recipe(
            "faster_rcnn", ["--data", str(root / "data.yaml"), "--output_dir", str(run), "--max_steps", "2", *FRCNN]
        )
    )
    said = " ".join(proc.stdout.split())  # the warning is wrapped at 120 columns
    assert "1 of 6 training images cannot be read and are skipped: cell_5.jpg (cell_5.txt line 1: class 9" in said
    assert "cell_5.jpg" in (run / "bad_images.txt").read_text()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/map_50" in m and "eval/map_50_11pt" in m for m in metrics)
    images = root / "valid" / "images"
    out = tmp_path / "predict"
    args = ["--predict", str(images), "--weights", str(run / "final.safetensors"), "--output_dir", str(out)]
    load_recipe("faster_rcnn").main([*args, "--predict_score", "0", "--box_score_thresh", "0", *FRCNN])
    entries = {Path(e["file"]).name: e for e in json.loads((out / "detections.json").read_text())}
    assert sorted(entries) == ["cell_0.jpg", "cell_1.jpg", "cell_2.jpg"]
    assert sum(len(e["detections"]) for e in entries.values()) > 0
    shutil.rmtree(root / "valid" / "labels")
    shutil.copytree(out / "labels", root / "valid" / "labels")  # the images/ -> labels/ rule finds them
    back = load_detection(str(root / "data.yaml"), eval_split="val").eval
    for row in back:
        detections = entries[Path(row["image"]["path"]).name]["detections"]
        expected = [[x0, y0, x1 - x0, y1 - y0] for x0, y0, x1, y1 in (d["box"] for d in detections)]
        _same_boxes(row["objects"]["bbox"], expected, 0.02)
        assert row["objects"]["category"] == [d["category_id"] for d in detections]
