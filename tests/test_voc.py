"""Pascal VOC folders read as the devkit reads them (common/detection/voc.py through load_detection): its layouts
(VOCdevkit of several years, one year, any Annotations/ + JPEGImages/ folder), split lists and joined years,
classes, 1-based inclusive corners, difficult boxes (never targets, ignored in evaluation); ``eval/map_50_11pt``
equal to the devkit's own computation, written here from its published algorithm (``voc_eval.py``: ``parse_rec``,
``voc_eval``, ``voc_ap`` with ``use_07_metric=True``), not from our code; end to end, Faster R-CNN on VOC07+12."""

from __future__ import annotations

import json
import math
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from common import UserError
from common.data.scan import without_unreadable
from common.detection.coco_eval import CocoEvaluator
from common.detection.data import DetectionDataset, detection_images, load_detection
from common.detection.forms import detection_form
from common.detection.voc import VOC_CLASSES, VocSource
from conftest import check, run_recipe

CLASSES = ["dog", "cat", "person", "car"]


def _xml(image_id: str, size: tuple[int, int], objects: list[tuple[str, int, int, tuple[int, int, int, int]]]) -> str:
    """A VOC annotation: objects (name, difficult, truncated, (xmin, ymin, xmax, ymax) 1-based inclusive)."""
    parts = [
        f"<annotation><folder>VOC</folder><filename>{image_id}.jpg</filename><source><database>test</database>"
        f"</source><size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size><segmented>0</segmented>"
    ]
    for name, difficult, truncated, (x0, y0, x1, y1) in objects:
        parts.append(
            f"<object><name>{name}</name><pose>Unspecified</pose><truncated>{truncated}</truncated>"
            f"<difficult>{difficult}</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax>"
            f"<ymax>{y1}</ymax></bndbox><part><name>head</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>2</xmax>"
            "<ymax>2</ymax></bndbox></part></object>"
        )
    return "".join(parts) + "</annotation>\n"


def _year(root: Path, ids: list[str], splits: dict[str, list[str]], seed: int) -> Path:
    """One VOC year: random objects of CLASSES (about one in five difficult), drawn on the images; the split lists
    and a class's own list (dog_<split>.txt), which is no split."""
    rng = np.random.default_rng(seed)
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for image_id in ids:
        width, height = int(rng.integers(72, 100)), int(rng.integers(64, 90))
        pixels = np.full((height, width, 3), 30, np.uint8)
        objects = []
        for _ in range(int(rng.integers(1, 5))):
            x0, y0 = int(rng.integers(1, width - 24)), int(rng.integers(1, height - 24))
            x1, y1 = (
                int(rng.integers(x0 + 8, min(width, x0 + 40) + 1)),
                int(rng.integers(y0 + 8, min(height, y0 + 40) + 1)),
            )
            name = CLASSES[int(rng.integers(len(CLASSES)))]
            objects.append((name, int(rng.random() < 0.2), int(rng.random() < 0.3), (x0, y0, x1, y1)))
            pixels[y0 - 1 : y1, x0 - 1 : x1] = 80 + 40 * CLASSES.index(name)
        Image.fromarray(pixels).save(root / "JPEGImages" / f"{image_id}.jpg", quality=100)
        (root / "Annotations" / f"{image_id}.xml").write_text(_xml(image_id, (width, height), objects))
    for split, listed in splits.items():
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in listed))
        (root / "ImageSets" / "Main" / f"dog_{split}.txt").write_text("".join(f"{i}  1\n" for i in listed))
    return root


def _devkit(root: Path) -> Path:
    """VOCdevkit/VOC2007 (train 3, val 3, test 4) and VOCdevkit/VOC2012 (train 2, val 2)."""
    ids07 = [f"{i:06d}" for i in (5, 7, 9, 12, 16, 17, 19, 20, 21, 23)]
    _year(root / "VOC2007", ids07, {"train": ids07[:3], "val": ids07[3:6], "trainval": ids07[:6], "test": ids07[6:]}, 7)
    ids12 = ["2008_000002", "2008_000003", "2008_000007", "2008_000008"]
    _year(root / "VOC2012", ids12, {"train": ids12[:2], "val": ids12[2:], "trainval": ids12}, 12)
    return root


# ---- the devkit's evaluation, from voc_eval.py (Girshick's port of VOCevaldet.m), as published ------------------
def _parse_rec(filename: Path) -> list[dict]:
    tree = ET.parse(filename)
    objects = []
    for obj in tree.findall("object"):
        bbox = obj.find("bndbox")
        objects.append(
            {
                "name": obj.find("name").text,
                "difficult": int(obj.find("difficult").text),
                "bbox": [int(bbox.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax")],
            }
        )
    return objects


def _voc_ap_07(rec: np.ndarray, prec: np.ndarray) -> float:
    ap = 0.0
    for t in np.arange(0.0, 1.1, 0.1):
        p = 0 if np.sum(rec >= t) == 0 else np.max(prec[rec >= t])
        ap = ap + p / 11.0
    return ap


def _voc_eval(detections: list[tuple], annotations: dict[str, Path], classname: str, ovthresh: float = 0.5):
    """AP of one class: ``detections`` (image name, confidence, xmin, ymin, xmax, ymax) in the devkit's 1-based
    inclusive pixels, as its results files hold them; None where the class has no box that is not difficult."""
    class_recs, npos = {}, 0
    for name, xml in annotations.items():
        R = [obj for obj in _parse_rec(xml) if obj["name"] == classname]
        bbox = np.array([x["bbox"] for x in R])
        difficult = np.array([x["difficult"] for x in R]).astype(bool)
        npos = npos + sum(~difficult)
        class_recs[name] = {"bbox": bbox, "difficult": difficult, "det": [False] * len(R)}
    if npos == 0:
        return None
    image_ids = [d[0] for d in detections if d[0] in class_recs]
    confidence = np.array([d[1] for d in detections if d[0] in class_recs])
    BB = np.array([d[2:] for d in detections if d[0] in class_recs]).reshape(-1, 4)
    sorted_ind = np.argsort(-confidence)
    BB = BB[sorted_ind, :]
    image_ids = [image_ids[x] for x in sorted_ind]
    nd = len(image_ids)
    tp, fp = np.zeros(nd), np.zeros(nd)
    for d in range(nd):
        R = class_recs[image_ids[d]]
        bb = BB[d, :].astype(float)
        ovmax = -np.inf
        BBGT = R["bbox"].astype(float)
        if BBGT.size > 0:
            ixmin = np.maximum(BBGT[:, 0], bb[0])
            iymin = np.maximum(BBGT[:, 1], bb[1])
            ixmax = np.minimum(BBGT[:, 2], bb[2])
            iymax = np.minimum(BBGT[:, 3], bb[3])
            iw = np.maximum(ixmax - ixmin + 1.0, 0.0)
            ih = np.maximum(iymax - iymin + 1.0, 0.0)
            inters = iw * ih
            uni = (
                (bb[2] - bb[0] + 1.0) * (bb[3] - bb[1] + 1.0)
                + (BBGT[:, 2] - BBGT[:, 0] + 1.0) * (BBGT[:, 3] - BBGT[:, 1] + 1.0)
                - inters
            )
            overlaps = inters / uni
            ovmax = np.max(overlaps)
            jmax = np.argmax(overlaps)
        if ovmax > ovthresh:
            if not R["difficult"][jmax]:
                if not R["det"][jmax]:
                    tp[d] = 1.0
                    R["det"][jmax] = 1
                else:
                    fp[d] = 1.0
        else:
            fp[d] = 1.0
    fp, tp = np.cumsum(fp), np.cumsum(tp)
    rec = tp / float(npos)
    prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    return _voc_ap_07(rec, prec)


def _devkit_map(detections: list[tuple], annotations: dict[str, Path]) -> float:
    aps = [_voc_eval([d[1:] for d in detections if d[0] == c], annotations, c) for c in VOC_CLASSES]
    return float(np.mean([ap for ap in aps if ap is not None]))


# ---- reading ---------------------------------------------------------------------------------------------------
def test_a_year_reads_as_the_devkit_reads_it(tmp_path):
    year = _devkit(tmp_path / "VOCdevkit") / "VOC2007"
    data = load_detection(str(year), "trainval")  # evaluated on test: val is part of trainval
    assert data.classes == list(VOC_CLASSES) and data.category_ids == list(range(20))
    assert data.train["image_id"][:] == [5, 7, 9, 12, 16, 17] and data.eval["image_id"][:] == [19, 20, 21, 23]
    for row in data.train:
        objects = _parse_rec(year / "Annotations" / f"{row['image_id']:06d}.xml")
        root = ET.parse(year / "Annotations" / f"{row['image_id']:06d}.xml").getroot()
        assert (row["width"], row["height"]) == (int(root.findtext("size/width")), int(root.findtext("size/height")))
        expected = [[x0 - 1, y0 - 1, x1 - x0 + 1, y1 - y0 + 1] for x0, y0, x1, y1 in (o["bbox"] for o in objects)]
        assert row["objects"]["bbox"] == expected  # 1-based inclusive corners: w = xmax - xmin + 1
        assert row["objects"]["iscrowd"] == [o["difficult"] for o in objects]
        assert row["objects"]["category"] == [VOC_CLASSES.index(o["name"]) for o in objects]
        # the box covers exactly the pixels the corners name (drawn there by _year)
        with Image.open(row["image"]["path"]) as image:
            x, y, w, h = (int(v) for v in row["objects"]["bbox"][-1])
            inside = np.asarray(image.convert("L"), np.int16)[y : y + h, x : x + w]
            assert inside.size and inside.min() > 55
    assert sorted(load_detection(str(year), "train", "val").eval["image_id"]) == [12, 16, 17]


def test_years_are_splits_of_their_own_and_join_with_plus(tmp_path):
    devkit = _devkit(tmp_path / "VOCdevkit")
    joined = load_detection(str(devkit), "VOC2007/trainval+VOC2012/trainval", "VOC2007/test")
    assert len(joined.train) == 10 and 2008000002 in joined.train["image_id"] and len(joined.eval) == 4
    plain = load_detection(str(tmp_path), "train")  # the folder above VOCdevkit; val: every year's val
    assert len(plain.train) == 5 and sorted(plain.eval["image_id"]) == [12, 16, 17, 2008000007, 2008000008]
    with pytest.raises(UserError, match=r"no split 'VOC2012/test'; it has \[.*'VOC2007/test'"):
        load_detection(str(devkit), "train", "VOC2012/test")
    with pytest.raises(UserError, match="no split 'dog_train'"):
        load_detection(str(devkit / "VOC2007"), "dog_train")  # a class's list is no split


def test_the_evaluation_split_follows_the_training_splits_years(tmp_path):
    """Without an evaluation split named: each year that the training split reads gives its first of validation / val
    / valid / test that is no part of the training split there; a year without one gives none."""
    devkit = _devkit(tmp_path / "VOCdevkit")
    source = VocSource(devkit)
    assert source.eval_split("VOC2007/train") == "VOC2007/val"  # not VOC2012's val too
    assert source.eval_split("VOC2007/trainval") == "VOC2007/test"
    assert source.eval_split("VOC2007/trainval+VOC2012/trainval") == "VOC2007/test"  # VOC07+12: VOC2012 has no test
    assert source.eval_split("VOC2012/train") == "VOC2012/val"
    assert source.eval_split("VOC2012/trainval") == ""  # a share of the training split is held out
    assert source.eval_split("train") == "VOC2007/val+VOC2012/val"  # every year's train: every year's val
    assert VocSource(devkit / "VOC2007").eval_split("trainval") == "test"
    assert VocSource(devkit / "VOC2007").eval_split("train") == "val"


def test_a_years_training_split_is_evaluated_on_that_year(tmp_path):
    devkit = _devkit(tmp_path / "VOCdevkit")
    assert sorted(load_detection(str(devkit), "VOC2007/train").eval["image_id"]) == [12, 16, 17]


def test_every_file_has_an_id_of_its_own(tmp_path):
    """Ids that are numbers with a '_' stay numbers only while no two give one number: 11_0 and 1_10 would both be
    110 (and 000005 and 5 both 5), so each of these sets gets positions; COCO's evaluation then takes the split."""
    for ids in (["11_0", "1_10", "2_0"], ["000005", "5", "000007"]):
        root = _year(tmp_path / ids[0], ids, {}, 5)
        data = load_detection(str(root), "train", "train")
        assert sorted(data.train["image_id"]) == [0, 1, 2]
        CocoEvaluator(data.eval, data.classes)
    root = _year(tmp_path / "years", ["2008_000002", "2008_000010", "2009_000001"], {}, 5)
    assert load_detection(str(root), "train", "train").train["image_id"][:] == [2008000002, 2008000010, 2009000001]


def _bright_box(pixels: np.ndarray) -> list[int]:
    """``[x, y, w, h]`` of the bright pixels of a grey picture."""
    ys, xs = np.nonzero(pixels > 128)
    return [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)]


# EXIF orientation -> the transpose that turns the displayed picture into the stored one (the inverse of
# ImageOps.exif_transpose's)
STORE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def test_boxes_are_in_the_frame_of_the_pixels_they_label(tmp_path):
    """Photos stored turned (EXIF orientation), each with a bright box: annotated on the stored pixels (<size> the
    stored one's, as LabelImg writes it) for every quarter turn and transpose, on the displayed picture (<size> the
    displayed one's) for one, and for a half turn, whose <size> fits both. Every loaded box covers the bright pixels
    of the picture as displayed, and one line says which frame each group was read in."""
    root = tmp_path / "phone"
    for folder in ("Annotations", "JPEGImages"):
        (root / folder).mkdir(parents=True)
    cases = {"upright": (1, "stored"), "half": (3, "displayed"), "shown6": (6, "displayed")}
    cases |= {f"stored{o}": (o, "stored") for o in (5, 6, 7, 8)}
    for name, (turn, drawn_on) in cases.items():
        shown = np.full((40, 64), 20, np.uint8)
        shown[6:18, 40:58] = 230  # the object, as the viewer shows it
        picture = Image.fromarray(shown).convert("RGB")
        stored = picture.transpose(STORE[turn]) if turn > 1 else picture
        exif = Image.Exif()
        exif[0x0112] = turn
        stored.save(root / "JPEGImages" / f"{name}.jpg", quality=100, exif=exif)
        on = np.asarray(stored.convert("L")) if drawn_on == "stored" else shown
        x, y, w, h = _bright_box(on)
        size = (on.shape[1], on.shape[0])
        (root / "Annotations" / f"{name}.xml").write_text(
            _xml(name, size, [("dog", 0, 0, (x + 1, y + 1, x + w, y + h))])
        )
    source = VocSource(root)
    table, *_ = source.load("train", lambda path: (0, 0))
    for row in table:
        with Image.open(row["image"]["path"]) as image:
            displayed = np.asarray(ImageOps.exif_transpose(image).convert("L"))
        assert (row["width"], row["height"]) == (64, 40), row["image"]["path"]
        np.testing.assert_allclose(row["objects"]["bbox"], [_bright_box(displayed)], err_msg=row["image"]["path"])
    assert source.notes == [
        "Pascal VOC 'train': 6 of 7 images are stored turned (EXIF orientation); boxes read: 4 turned with the "
        "picture (their <size> is the stored picture's); 1 as drawn on the picture as displayed (their <size> is "
        "its); 1 as drawn on the picture as displayed (their <size> fits it and the stored one alike)"
    ]


def test_any_folder_so_laid_out_with_its_own_classes_and_bad_annotations_listed(tmp_path):
    root = tmp_path / "labelimg"
    _year(root, ["IMG_1", "IMG_2", "IMG_3", "IMG_4"], {}, 3)
    text = (root / "Annotations" / "IMG_1.xml").read_text()
    (root / "Annotations" / "IMG_1.xml").write_text(text.replace("<name>dog</name>", "<name>zebra</name>"))
    (root / "Annotations" / "IMG_3.xml").write_text(text.replace("<xmax>", "<xmax>x"))
    (root / "Annotations" / "IMG_4.xml").write_text("<annotation><object>")
    data = load_detection(str(root), "train", "train")
    assert data.classes == sorted(
        {o["name"] for i in (1, 2) for o in _parse_rec(root / "Annotations" / f"IMG_{i}.xml")}
    )
    assert data.train["image_id"][:] == [0, 1, 2, 3]  # ids that are no numbers: positions
    assert sorted(Path(p).name for p in data.unusable) == ["IMG_3.jpg", "IMG_4.jpg"]
    accelerator = types.SimpleNamespace(process_index=0, num_processes=1)
    scanned = without_unreadable(data, "image", accelerator, "skip", 0, 1, tmp_path / "run")
    assert len(scanned.data.train) == 2 and "IMG_3.xml: object 1" in scanned.files["bad_images.txt"]


def _raccoon(root: Path, count: int, images: str = "images", annotations: str = "annotations") -> Path:
    """The raccoon set's layout (``images/raccoon-<n>.jpg`` + ``annotations/raccoon-<n>.xml``, no ImageSets), as
    LabelImg writes its XML (``<folder>``, ``<path>``, ``<source>``, ``<segmented>``): ``count`` JPEGs with one to
    three boxes of raccoon or dog, each box drawn on the picture."""
    rng = np.random.default_rng(count)
    for folder in (images, annotations):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for n in range(1, count + 1):
        name, (width, height) = f"raccoon-{n}", (int(rng.integers(60, 90)), int(rng.integers(50, 80)))
        pixels = np.full((height, width, 3), 30, np.uint8)
        parts = [
            f'<annotation verified="yes"><folder>{images}</folder><filename>{name}.jpg</filename>'
            f"<path>/home/user/raccoon/{images}/{name}.jpg</path><source><database>Unknown</database></source>"
            f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size><segmented>0</segmented>"
        ]
        for _ in range(int(rng.integers(1, 4))):
            x0, y0 = int(rng.integers(1, width - 20)), int(rng.integers(1, height - 20))
            x1, y1 = int(rng.integers(x0 + 8, width + 1)), int(rng.integers(y0 + 8, height + 1))
            label = ["raccoon", "dog"][int(rng.random() < 0.3)]
            pixels[y0 - 1 : y1, x0 - 1 : x1] = 200
            parts.append(
                f"<object><name>{label}</name><pose>Unspecified</pose><truncated>0</truncated><difficult>0</difficult>"
                f"<bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            )
        Image.fromarray(pixels).save(root / images / f"{name}.jpg", quality=95)
        (root / annotations / f"{name}.xml").write_text("".join(parts) + "</annotation>\n")
    return root


def test_images_beside_annotations_without_image_sets_read_as_voc_with_a_seeded_tenth_held_out(tmp_path):
    """The raccoon layout (images/ + annotations/, no ImageSets), as shared sets and annotation tools lay it out, is
    Pascal VOC (it was taken for a COCO folder for its annotations/ folder): every XML is an image of the training
    split, its boxes and classes as the devkit's parser reads the XML, and 10 % is held out for evaluation as for
    every form without an evaluation split: datasets' seeded train_test_split of the whole split, the same on every
    load."""
    root = _raccoon(tmp_path / "raccoon", 25)
    assert detection_form(root) == "voc"
    data = load_detection(str(root))
    assert data.classes == ["dog", "raccoon"] and data.category_ids == [0, 1]
    assert len(data.eval) == math.ceil(0.1 * 25) and len(data.train) == 25 - len(data.eval)
    rows = {Path(row["image"]["path"]).stem: row for split in (data.train, data.eval) for row in split}
    assert sorted(rows) == sorted(f"raccoon-{n}" for n in range(1, 26))  # every XML, once
    for name, row in rows.items():
        assert Path(row["image"]["path"]) == root / "images" / f"{name}.jpg"
        objects = _parse_rec(root / "annotations" / f"{name}.xml")
        xml = ET.parse(root / "annotations" / f"{name}.xml").getroot()
        assert (row["width"], row["height"]) == (int(xml.findtext("size/width")), int(xml.findtext("size/height")))
        expected = [[x0 - 1, y0 - 1, x1 - x0 + 1, y1 - y0 + 1] for x0, y0, x1, y1 in (o["bbox"] for o in objects)]
        assert row["objects"]["bbox"] == expected
        assert [data.classes[c] for c in row["objects"]["category"]] == [o["name"] for o in objects]
    whole = load_detection(str(root), "train", "train").train  # the whole split, in its order
    held = whole.train_test_split(test_size=0.1, seed=0)["test"]["image_id"]
    assert data.eval["image_id"][:] == held and load_detection(str(root)).eval["image_id"][:] == held
    assert (
        load_detection(str(root), seed=1).eval["image_id"][:]
        == (whole.train_test_split(test_size=0.1, seed=1)["test"]["image_id"])
    )


def test_the_folder_names_are_read_in_any_case_and_image_sets_still_split(tmp_path):
    """Images/ + Annotations/ (and IMAGES/ + ANNOTATIONS/) read alike; ImageSets/Main lists, where there are some,
    are the splits (val evaluated); a folder whose annotations/ holds COCO's instances json is COCO's still."""
    first = _raccoon(tmp_path / "capital", 10, "Images", "Annotations")
    upper = _raccoon(tmp_path / "upper", 10, "IMAGES", "ANNOTATIONS")
    for root, images in ((first, "Images"), (upper, "IMAGES")):
        data = load_detection(str(root), "train", "train")
        assert len(data.train) == 10 and Path(data.train[0]["image"]["path"]).parent == root / images
    main = first / "ImageSets" / "Main"
    main.mkdir(parents=True)
    (main / "train.txt").write_text("".join(f"raccoon-{n}\n" for n in range(1, 8)))
    (main / "val.txt").write_text("raccoon-8\nraccoon-9\n")
    listed = load_detection(str(first))
    assert len(listed.train) == 7 and sorted(listed.eval["image_id"]) == [7, 8]  # positions among the 9 listed ids
    assert [Path(p["path"]).stem for p in listed.eval["image"]] == ["raccoon-8", "raccoon-9"]
    both = _raccoon(tmp_path / "both", 4)
    (both / "annotations" / "instances_train.json").write_text(json.dumps({"images": [], "categories": []}))
    assert detection_form(both) == "coco"


def test_difficult_boxes_are_never_training_targets(tmp_path):
    data = load_detection(str(_devkit(tmp_path / "VOCdevkit") / "VOC2007"), "trainval")
    dataset = DetectionDataset(data.train, lambda image, target: (torch.zeros(3, 8, 8), target))
    rows = data.train["objects"]
    assert any(1 in objects["iscrowd"] for objects in rows)
    for i, objects in enumerate(rows):
        _, target = dataset[i]
        assert target["labels"].tolist() == [c for c, d in zip(objects["category"], objects["iscrowd"]) if not d]


def test_dino_reads_a_voc_folder_as_its_images(tmp_path):
    data = detection_images(str(_devkit(tmp_path / "VOCdevkit")), "VOC2007/trainval")
    assert data is not None and data.classes == [] and len(data.train) >= 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_map_50_11pt_is_the_devkits(tmp_path, seed):
    """Detections near the boxes (difficult ones too), repeated ones and strays, scored by the evaluator from the
    loaded split and by the devkit's algorithm from the XMLs, in its 1-based corners (x0 + 1, y0 + 1, x1, y1)."""
    year = _devkit(tmp_path / "VOCdevkit") / "VOC2007"
    data = load_detection(str(year), "trainval", "test")
    rng = np.random.default_rng(seed)
    batch, devkit = [], []
    for row in data.eval:
        boxes, scores, labels = [], [], []
        for (x, y, w, h), c in zip(row["objects"]["bbox"], row["objects"]["category"]):
            for _ in range(int(rng.integers(0, 4))):
                x0, y0 = x + rng.normal(0, w * 0.15), y + rng.normal(0, h * 0.15)
                boxes.append([x0, y0, x0 + w * rng.uniform(0.7, 1.3), y0 + h * rng.uniform(0.7, 1.3)])
                labels.append(c if rng.random() < 0.85 else VOC_CLASSES.index(CLASSES[int(rng.integers(4))]))
        for _ in range(int(rng.integers(0, 3))):
            x0, y0 = rng.uniform(0, row["width"] - 10), rng.uniform(0, row["height"] - 10)
            boxes.append([x0, y0, x0 + rng.uniform(5, 30), y0 + rng.uniform(5, 30)])
            labels.append(VOC_CLASSES.index(CLASSES[int(rng.integers(4))]))
        scores = rng.uniform(0.01, 1, len(boxes)).tolist()
        batch.append(
            {
                "image_id": row["image_id"],
                "boxes": torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4),
                "scores": torch.tensor(scores),
                "labels": torch.tensor(labels, dtype=torch.int64),
            }
        )
        name = Path(row["image"]["path"]).stem
        for (x0, y0, x1, y1), s, c in zip(boxes, scores, labels):
            devkit.append((VOC_CLASSES[c], name, float(np.float32(s)), x0 + 1, y0 + 1, x1, y1))
    metrics = CocoEvaluator(data.eval, data.classes).evaluate([batch])
    annotations = {
        Path(p["path"]).stem: year / "Annotations" / f"{Path(p['path']).stem}.xml" for p in data.eval["image"]
    }
    assert metrics["map_50_11pt"] == pytest.approx(_devkit_map(devkit, annotations), abs=1e-9)
    assert 0.2 < metrics["map_50_11pt"] < 0.95  # neither all found nor none


FRCNN = ["--report_to", "none", "--num_workers", "0", "--batch_size", "2", "--plot_images", "0"]
FRCNN += ["--min_size", "64", "--max_size", "64", "--max_steps", "2", "--box_score_thresh", "0"]


@pytest.mark.slow
def test_faster_rcnn_trains_on_voc07_12_and_scores_as_the_devkit(tmp_path):
    devkit = _devkit(tmp_path / "VOCdevkit")
    run = tmp_path / "run"
    years = ["--train_split", "VOC2007/trainval+VOC2012/trainval", "--eval_split", "VOC2007/test"]
    proc = check(run_recipe("faster_rcnn", ["--data", str(devkit), *years, "--output_dir", str(run), *FRCNN]))
    assert "10 training images, 4 evaluation images, 20 classes: aeroplane, bicycle" in proc.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reported = [m for m in metrics if "eval/map_50_11pt" in m][-1]["eval/map_50_11pt"]
    year = devkit / "VOC2007"
    names = {int(i): i for i in (year / "ImageSets" / "Main" / "test.txt").read_text().split()}
    detections = [
        (VOC_CLASSES[r["category_id"]], names[r["image_id"]], r["score"], x + 1, y + 1, x + w, y + h)
        for r in json.loads((run / "predictions.json").read_text())
        for x, y, w, h in [r["bbox"]]
    ]
    assert detections  # box_score_thresh 0: every image has its detections
    annotations = {name: year / "Annotations" / f"{name}.xml" for name in names.values()}
    assert reported == pytest.approx(_devkit_map(detections, annotations), abs=1e-6)
