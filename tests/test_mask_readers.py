"""Instance masks kept by the detection readers (``objects.segmentation``, :mod:`common.detection.masks`): COCO json
(both layouts), Ultralytics' segment labels, Pascal VOC's ``SegmentationObject`` PNGs and hub tables whose objects
carry a ``segmentation``. Each is checked against the tool that defines its format where that tool is installed:
pycocotools' ``COCO.annToMask`` for COCO json, Ultralytics' own label parser for its segment rows. Box-only data of
every form keeps the schema without masks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common import UserError
from common.detection.masks import has_masks, mask_of
from common.detection.sources import features, load_coco_split

pycocotools = pytest.importorskip("pycocotools")
from pycocotools import mask as coco_mask  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402


def _picture(path: Path, size: tuple[int, int]) -> Path:
    """A grey image of ``size`` (width, height)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), 90, np.uint8)).save(path)
    return path


# ---- COCO json -------------------------------------------------------------------------------------------------
def _blob(height: int, width: int, y: slice, x: slice) -> np.ndarray:
    mask = np.zeros((height, width), np.uint8)
    mask[y, x] = 1
    mask[y.start, x.start] = 0  # a hole in a corner: no box in disguise
    return mask


def _coco_with_masks(root: Path) -> Path:
    """A COCO folder of two images (40 x 30 and 24 x 32), odd category ids (3, 7, 11), and one annotation of each
    kind of segmentation: a polygon (two pieces), a compressed RLE, a crowd region's uncompressed RLE, and none."""
    for name, size in (("a.png", (40, 30)), ("b.png", (24, 32))):
        _picture(root / "train" / name, size)
    compressed = coco_mask.encode(np.asfortranarray(_blob(30, 40, slice(5, 20), slice(20, 35))))
    crowd = _blob(32, 24, slice(10, 30), slice(2, 12)).flatten(order="F")  # column-major, as COCO counts runs
    changes = np.flatnonzero(np.diff(np.concatenate([[0], crowd, [2]])))  # starts of runs (a final 2: the end)
    counts = np.diff(np.concatenate([[0], changes])).tolist()
    annotations = [
        {
            "segmentation": [[2.5, 3.0, 15.0, 3.5, 9.0, 14.25], [1, 20, 8, 20, 8, 28, 1, 28]],
            "area": 91.0,
            "bbox": [1, 3, 14, 25],
        },
        {
            "segmentation": {"size": [30, 40], "counts": compressed["counts"].decode()},
            "area": 224.0,
            "bbox": [20, 5, 15, 15],
        },
        {"segmentation": [], "area": 12.0, "bbox": [30, 22, 4, 3]},  # no mask: "" (Roboflow writes [] so)
        {"segmentation": {"size": [32, 24], "counts": counts}, "area": 199.0, "bbox": [2, 10, 10, 20], "iscrowd": 1},
        {"segmentation": [[3, 2, 20, 2, 20, 8]], "area": 51.0, "bbox": [3, 2, 17, 6]},
    ]
    image_of = [1, 1, 1, 2, 2]
    category_of = [7, 3, 11, 3, 11]
    for n, ann in enumerate(annotations):
        ann.update(id=100 + n, image_id=image_of[n], category_id=category_of[n], iscrowd=ann.get("iscrowd", 0))
    coco = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 40, "height": 30},
            {"id": 2, "file_name": "b.png", "width": 24, "height": 32},
        ],
        "annotations": annotations,
        "categories": [{"id": c, "name": f"c{c}"} for c in (11, 3, 7)],
    }
    path = root / "annotations" / "instances_train.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(coco))
    return path


def test_coco_masks_decode_as_pycocotools_decodes_them(tmp_path):
    path = _coco_with_masks(tmp_path / "coco")
    ds, classes, ids = load_coco_split(path, [tmp_path / "coco" / "train"], "coco")
    assert has_masks(ds) and ds.features == features(masks=True)
    assert (classes, ids) == (["c3", "c7", "c11"], [3, 7, 11])
    reference = COCO(str(path))
    for row in ds:
        anns = reference.loadAnns(reference.getAnnIds(imgIds=[row["image_id"]]))
        objects = row["objects"]
        assert [ids[c] for c in objects["category"]] == [a["category_id"] for a in anns]
        assert objects["area"] == [a["area"] for a in anns]  # the json's, not recomputed
        assert objects["iscrowd"] == [a["iscrowd"] for a in anns]
        for ann, segmentation in zip(anns, objects["segmentation"]):
            if not ann["segmentation"]:
                assert segmentation == ""
                continue
            assert json.loads(segmentation) == ann["segmentation"]  # kept as given
            mask = mask_of(segmentation, row["height"], row["width"])
            np.testing.assert_array_equal(mask, reference.annToMask(ann))
            assert mask.sum() > 0
    crowd = ds[1]["objects"]["segmentation"][0]  # the uncompressed counts spell the region they were made of
    np.testing.assert_array_equal(mask_of(crowd, 32, 24), _blob(32, 24, slice(10, 30), slice(2, 12)))


def test_roboflow_segmentation_export_keeps_masks_and_box_only_exports_keep_the_schema(tmp_path):
    """Roboflow writes ``segmentation: []`` for box-only annotations: alone, no masks (the schema unchanged);
    beside polygons, ``""`` for those objects."""
    folder = tmp_path / "roboflow" / "train"
    _picture(folder / "a.jpg", (32, 32))
    anns = [
        {"id": 0, "image_id": 0, "category_id": 1, "bbox": [2, 2, 10, 10], "area": 100, "segmentation": []},
        {
            "id": 1,
            "image_id": 0,
            "category_id": 1,
            "bbox": [4, 4, 8, 8],
            "area": 30,
            "segmentation": [[4, 4, 12, 4, 4, 12]],
        },
    ]
    coco = {
        "images": [{"id": 0, "file_name": "a.jpg", "width": 32, "height": 32}],
        "categories": [{"id": 0, "name": "cells"}, {"id": 1, "name": "rbc"}],
        "annotations": anns,
    }
    (folder / "_annotations.coco.json").write_text(json.dumps(coco))
    ds, _, _ = load_coco_split(folder / "_annotations.coco.json", [folder], "rf")
    assert ds[0]["objects"]["segmentation"] == ["", "[[4, 4, 12, 4, 4, 12]]"]
    anns[1]["segmentation"] = []
    (folder / "_annotations.coco.json").write_text(json.dumps(coco))
    ds, _, _ = load_coco_split(folder / "_annotations.coco.json", [folder], "rf")
    assert not has_masks(ds) and ds.features == features()


@pytest.mark.parametrize(
    "segmentation, message",
    [
        ({"size": [30, 40], "counts": "abc"}, "run-length mask of size [30, 40]"),
        ([[1, 2, 3, 4, 5]], "odd number"),
        ([["a", 1, 2, 3, 4, 5]], "not polygons"),
        (7, "expected polygons or a run-length encoding"),
    ],
)
def test_coco_segmentations_that_cannot_be_masks_are_one_clear_error(tmp_path, segmentation, message):
    folder = tmp_path / "train"
    _picture(folder / "a.jpg", (20, 20))
    coco = {
        "images": [{"id": 0, "file_name": "a.jpg", "width": 20, "height": 20}],
        "categories": [{"id": 1, "name": "x"}],
        "annotations": [{"id": 5, "image_id": 0, "category_id": 1, "bbox": [2, 2, 5, 5], "segmentation": segmentation}],
    }
    (folder / "_annotations.coco.json").write_text(json.dumps(coco))
    with pytest.raises(UserError, match="annotation 5 in") as e:
        load_coco_split(folder / "_annotations.coco.json", [folder], "x")
    assert message in str(e.value)


# ---- tables with an objects column -----------------------------------------------------------------------------
def test_hub_tables_keep_their_objects_segmentation(tmp_path):
    """Polygons as a hub table holds them (a list of per-object dicts, float32 points); a saved normalised split
    with masks reads back unchanged; a segmentation column with nothing in it keeps the schema without masks."""
    import datasets

    from common.detection.sources import normalise

    polygons = [
        [[2.0, 2.0, 14.0, 2.0, 2.0, 12.0]],
        [[10.5, 10.5, 20.0, 12.0, 14.0, 22.0], [1.0, 20.0, 4.0, 20.0, 4.0, 23.0]],
    ]
    schema = datasets.Features(
        {
            "image": datasets.Image(),
            "objects": datasets.Sequence(
                {
                    "bbox": datasets.Sequence(datasets.Value("float32"), length=4),
                    "category": datasets.ClassLabel(names=["a", "b"]),
                    "segmentation": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                }
            ),
        }
    )
    image = Image.fromarray(np.zeros((24, 32, 3), np.uint8))
    objects = {"bbox": [[2, 2, 12, 10], [1, 10.5, 19, 12.5]], "category": [0, 1], "segmentation": polygons}
    table = datasets.Dataset.from_dict({"image": [image], "objects": [objects]}, features=schema)
    ds, names = normalise(table, "hub", "train")
    assert names == ["a", "b"] and ds.features == features(masks=True)
    row = ds[0]
    for polygon, segmentation in zip(polygons, row["objects"]["segmentation"]):
        assert json.loads(segmentation) == polygon  # these points are exact in float32
        expected = coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects(polygon, 24, 32)))
        np.testing.assert_array_equal(mask_of(segmentation, 24, 32), expected)

    coco, _, _ = load_coco_split(_coco_with_masks(tmp_path / "coco"), [tmp_path / "coco" / "train"], "coco")
    again, _ = normalise(coco, "saved", "train")
    assert again.features == coco.features and again["objects"] == coco["objects"]

    box_only = table.map(lambda r: {"objects": {**r["objects"], "segmentation": [[], []]}}, features=schema)
    ds, _ = normalise(box_only, "hub", "train")
    assert not has_masks(ds) and ds.features == features()


# ---- Ultralytics segment labels --------------------------------------------------------------------------------
SEGMENT_ROWS = (
    "0 0.1 0.1 0.5 0.125 0.3 0.75\n"  # a triangle
    "1 0.5 0.25 0.9 0.25 0.9 0.5 0.7 0.9 0.5 0.5\n"  # a pentagon
    "0 0.1 0.1 0.5 0.125 0.3 0.75\n"  # the triangle again: counts once
    "1 0.95 -0.005 1.005 0.2 0.96 0.3\n"  # past the right edge, within the 1 % tolerance: clipped
)


def _yolo_segments(root: Path) -> Path:
    """A split of 80 x 40 images: a file of segment rows, one of box rows, one missing; the yaml."""
    for name in ("seg.jpg", "box.jpg", "none.jpg"):
        _picture(root / "images" / "train" / name, (80, 40))
    (root / "labels" / "train").mkdir(parents=True)
    (root / "labels" / "train" / "seg.txt").write_text(SEGMENT_ROWS)
    (root / "labels" / "train" / "box.txt").write_text("1 0.5 0.5 0.25 0.5\n")
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nnames: [a, b]\n")
    return root / "data.yaml"


def _load_yolo(yaml: Path):
    from common.detection.sources import _image_size
    from common.detection.yolo_txt import load_split

    ds, _, _, unusable = load_split(yaml, "train", lambda p: _image_size({"path": p}, p))
    assert not unusable
    return {Path(r["image"]["path"]).stem: r for r in ds}, ds


def _shoelace(xy: np.ndarray) -> float:
    x, y = xy[:, 0], xy[:, 1]
    return abs(float(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))) / 2


def test_segment_rows_keep_their_polygons_in_pixels(tmp_path):
    rows, ds = _load_yolo(_yolo_segments(tmp_path / "ds"))
    assert has_masks(ds) and ds.features == features(masks=True)
    scale = np.array([80, 40])
    expected = [
        np.array([[0.1, 0.1], [0.5, 0.125], [0.3, 0.75]]) * scale,
        np.array([[0.5, 0.25], [0.9, 0.25], [0.9, 0.5], [0.7, 0.9], [0.5, 0.5]]) * scale,
        (np.array([[0.95, -0.005], [1.005, 0.2], [0.96, 0.3]]) * scale).clip(0, scale),
    ]
    seg = rows["seg"]["objects"]
    assert seg["category"] == [0, 1, 1] and len(seg["segmentation"]) == 3
    for segmentation, points, box, area in zip(seg["segmentation"], expected, seg["bbox"], seg["area"]):
        (polygon,) = json.loads(segmentation)  # one polygon per object, in pixels
        np.testing.assert_allclose(np.reshape(polygon, (-1, 2)), points, atol=1e-4)
        x0, y0 = points.min(0)
        np.testing.assert_allclose(box, [x0, y0, *(points.max(0) - [x0, y0])], atol=1e-6)  # the box is the polygon's
        assert area == pytest.approx(_shoelace(points), abs=1e-3)  # the polygon's area, not the box's
        mask = mask_of(segmentation, 40, 80)
        assert 0 < mask.sum() < box[2] * box[3] + 2 * (box[2] + box[3]) + 4
    assert rows["box"]["objects"]["segmentation"] == [""]  # a file of box rows beside them: no mask
    assert rows["box"]["objects"]["area"] == [20 * 20]
    assert rows["none"]["objects"]["segmentation"] == []


def test_box_rows_only_keep_the_schema_and_bad_segment_files_stay_left_out(tmp_path):
    yaml = _yolo_segments(tmp_path / "ds")
    (tmp_path / "ds" / "labels" / "train" / "seg.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    _, ds = _load_yolo(yaml)
    assert not has_masks(ds) and ds.features == features()
    (tmp_path / "ds" / "labels" / "train" / "seg.txt").write_text(SEGMENT_ROWS + "0 0.5 0.5 0.2 0.2\n")  # mixed
    from common.detection.sources import _image_size
    from common.detection.yolo_txt import load_split

    ds, _, _, unusable = load_split(yaml, "train", lambda p: _image_size({"path": p}, p))
    assert [Path(p).name for p in unusable] == ["seg.jpg"] and "mixes polygon and box rows" in next(
        iter(unusable.values())
    )
    assert not has_masks(ds)  # the only segment file is left out: nothing has a mask


def test_segment_rows_read_as_ultralytics_reads_them(tmp_path):
    """Where Ultralytics is installed (its own environment: /tmp/ulvenv/bin/python -m pytest ...): its
    verify_image_label's segments, scaled by the image's size, are the polygons here, row for row."""
    ultralytics = pytest.importorskip("ultralytics")
    if tuple(int(v) for v in ultralytics.__version__.split(".")[:3]) < (8, 4, 183):
        pytest.skip(f"ultralytics {ultralytics.__version__}: its label rules predate 8.4.183")
    from ultralytics.data.utils import verify_image_label

    rows, _ = _load_yolo(_yolo_segments(tmp_path / "ds"))
    image = tmp_path / "ds" / "images" / "train" / "seg.jpg"
    label = tmp_path / "ds" / "labels" / "train" / "seg.txt"
    answer = verify_image_label((str(image), str(label), "", False, 2, 0, 0, False))
    classes, segments = answer[1][:, 0], answer[3]
    objects = rows["seg"]["objects"]
    assert objects["category"] == classes.astype(int).tolist()
    for segmentation, theirs in zip(objects["segmentation"], segments):
        ours = np.reshape(json.loads(segmentation)[0], (-1, 2))
        np.testing.assert_allclose(ours, (theirs * [80, 40]).clip(0, [80, 40]), atol=1e-4)


# ---- Pascal VOC segmentation -----------------------------------------------------------------------------------
def _voc_palette() -> list[int]:
    """The devkit's colour map (VOClabelcolormap.m): index i's colour from its bits, 255 the void colour."""
    palette = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


def _voc_year(root: Path, seed: int, ids: list[str], segmented: list[str]) -> dict[str, np.ndarray]:
    """One VOC year: 48 x 40 images of 2-3 objects (dog, cat, person) as drawn rectangles; for the ``segmented``
    ids their object PNG (value i = the XML's i-th object, a void band of 255 around each, the last object of
    the first image hidden: no pixels) and class PNG. Main lists: train = every id but the last, val = the last;
    Segmentation lists: train = the first segmented, val = the rest. Returns each segmented id's object PNG."""
    rng = np.random.default_rng(seed)
    names = ["dog", "cat", "person"]
    for folder in ("Annotations", "JPEGImages", "ImageSets/Main", "ImageSets/Segmentation", "SegmentationObject"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "SegmentationClass").mkdir(exist_ok=True)
    pngs = {}
    for image_id in ids:
        width, height = 48, 40
        pixels = np.full((height, width, 3), 20, np.uint8)
        label = np.zeros((height, width), np.uint8)
        classes = np.zeros((height, width), np.uint8)
        parts = []
        count = int(rng.integers(2, 4))
        for n in range(1, count + 1):
            x0, y0 = int(rng.integers(1, 30)), int(rng.integers(1, 24))
            x1, y1 = x0 + int(rng.integers(6, 18)), y0 + int(rng.integers(6, 16))
            name = names[int(rng.integers(3))]
            hidden = image_id == segmented[0] and n == count  # an object without pixels (wholly covered)
            if not hidden:
                label[y0 - 1 : y1, x0 - 1 : x1] = 255  # the void band: the outline's pixels
                label[y0 : y1 - 1, x0 : x1 - 1] = n
                classes[y0 : y1 - 1, x0 : x1 - 1] = 1 + names.index(name)
                pixels[y0 - 1 : y1, x0 - 1 : x1] = 60 + 50 * n
            parts.append(
                f"<object><name>{name}</name><difficult>{int(n == 2)}</difficult><bndbox><xmin>{x0}</xmin>"
                f"<ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            )
        Image.fromarray(pixels).save(root / "JPEGImages" / f"{image_id}.jpg")
        (root / "Annotations" / f"{image_id}.xml").write_text(
            f"<annotation><filename>{image_id}.jpg</filename><size><width>{width}</width><height>{height}</height>"
            f"<depth>3</depth></size><segmented>{int(image_id in segmented)}</segmented>{''.join(parts)}</annotation>"
        )
        if image_id in segmented:
            for folder, values in (("SegmentationObject", label), ("SegmentationClass", classes)):
                png = Image.fromarray(values, mode="P")
                png.putpalette(_voc_palette())
                png.save(root / folder / f"{image_id}.png")
            pngs[image_id] = label
    lists = {
        "Main/train": ids[:-1],
        "Main/val": ids[-1:],
        "Segmentation/train": segmented[:1],
        "Segmentation/val": segmented[1:],
    }
    for name, listed in lists.items():
        (root / "ImageSets" / f"{name}.txt").write_text("".join(f"{i}\n" for i in listed))
    return pngs


def test_voc_segmentation_lists_read_each_objects_pixels(tmp_path):
    from common.detection.data import load_detection
    from common.detection.masks import masks_of

    year = tmp_path / "VOCdevkit" / "VOC2012"
    ids = ["2008_000002", "2008_000003", "2008_000007", "2008_000008"]
    pngs = _voc_year(year, 0, ids, segmented=["2008_000003", "2008_000008"])
    data = load_detection(str(year), "Segmentation/train")  # evaluated on Segmentation/val
    assert has_masks(data.train) and has_masks(data.eval) and data.train.features == features(masks=True)
    assert data.train["image_id"] == [2008000003] and data.eval["image_id"] == [2008000008]
    for row in (data.train[0], data.eval[0]):
        label = pngs[f"{row['image_id'] // 10**6}_{row['image_id'] % 10**6:06d}"]
        objects = row["objects"]
        masks = masks_of(objects["segmentation"], row["height"], row["width"])
        for n, (segmentation, mask, area, box) in enumerate(
            zip(objects["segmentation"], masks, objects["area"], objects["bbox"]), 1
        ):
            np.testing.assert_array_equal(mask, label == n)  # value n: the n-th object; the void band in none
            if segmentation:
                assert area == mask.sum() and mask[label == 255].sum() == 0
            else:  # no pixels: no mask, and the box's area
                assert not (label == n).any() and area == box[2] * box[3]
        assert objects["iscrowd"][1] == 1  # difficult objects keep their masks, still never targets
    assert "" in data.train[0]["objects"]["segmentation"]

    boxes = load_detection(str(year), "train", "val")  # Main lists: decided per split, by its own images
    assert boxes.train.features == features()  # one of its 3 images has a PNG: boxes only, and a line says so
    assert has_masks(boxes.eval)  # its one image has its PNG
    (line,) = boxes.notes
    assert "'train': 1 of 3 images with objects have SegmentationObject PNGs: read as boxes only" in line
    assert "(Segmentation/train, Segmentation/val list the images with masks)" in line


def test_voc_segmentation_lists_over_several_years_and_a_png_that_does_not_fit(tmp_path):
    from common.detection.data import load_detection

    devkit = tmp_path / "VOCdevkit"
    _voc_year(devkit / "VOC2007", 1, ["000005", "000007", "000009"], segmented=["000005", "000009"])
    _voc_year(devkit / "VOC2012", 2, ["2008_000002", "2008_000003"], segmented=["2008_000002", "2008_000003"])
    one = load_detection(str(devkit), "VOC2012/Segmentation/train")
    assert one.train["image_id"] == [2008000002] and one.eval["image_id"] == [2008000003]
    both = load_detection(str(devkit), "Segmentation/train")  # the plain name: every year's list of that name
    assert sorted(both.train["image_id"]) == [5, 2008000002] and sorted(both.eval["image_id"]) == [9, 2008000003]
    assert has_masks(both.train) and has_masks(both.eval)
    assert load_detection(str(devkit), "VOC2007/train").eval["image_id"] == [9]  # Main lists as before

    Image.new("P", (20, 20)).save(devkit / "VOC2012" / "SegmentationObject" / "2008_000003.png")
    data = load_detection(str(devkit), "VOC2012/Segmentation/train")
    ((path, why),) = data.unusable.items()
    assert Path(path).name == "2008_000003.jpg" and "is 20 x 20, its image 48 x 40" in why
    assert data.eval[0]["objects"]["bbox"] == []  # left out, listed, as a broken XML is


def test_voc_object_pngs_of_a_photo_stored_turned_are_turned_with_its_boxes(tmp_path):
    """A photo stored 40 x 30 with EXIF orientation 6 (shown 30 x 40) whose XML <size> and PNG are the stored
    picture's: the mask turns with the picture, as the box does, and stays inside that box."""
    from common.detection.sources import _image_size
    from common.detection.voc import VocSource

    root = tmp_path / "labelled"
    for folder in ("Annotations", "JPEGImages", "SegmentationObject"):
        (root / folder).mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 30), (80, 80, 80)).save(root / "JPEGImages" / "p.jpg", exif=exif)
    label = np.zeros((30, 40), np.uint8)
    label[4:12, 20:36] = 1  # stored pixels: rows 5..12, columns 21..36 (1-based, as the box below)
    Image.fromarray(label, mode="P").save(root / "SegmentationObject" / "p.png")
    (root / "Annotations" / "p.xml").write_text(
        "<annotation><filename>p.jpg</filename><size><width>40</width><height>30</height></size><object>"
        "<name>tag</name><bndbox><xmin>21</xmin><ymin>5</ymin><xmax>36</xmax><ymax>12</ymax></bndbox></object>"
        "</annotation>"
    )
    ds, _, _, unusable = VocSource(root).load("train", lambda p: _image_size({"path": p}, p))
    assert not unusable and has_masks(ds)
    row = ds[0]
    assert (row["width"], row["height"]) == (30, 40)
    mask = mask_of(row["objects"]["segmentation"][0], 40, 30)
    np.testing.assert_array_equal(mask, np.asarray(Image.fromarray(label).transpose(Image.Transpose.ROTATE_270)))
    x, y, w, h = row["objects"]["bbox"][0]
    ys, xs = np.nonzero(mask)
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (x, y, x + w, y + h)
