"""common/data/builtin: the registry and the built-in sets. digits (schema, fixed split), digits_ssl
(schema, determinism, no leakage, speed, difficulty), digits_det (schema, boxes, determinism, no
leakage, speed, cache) and digits_det_crops (every box of digits_det, cut as common.detection.boxes.crop_box
cuts)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from common.data.builtin import CLASSIFICATION, DETECTION, digits_det, digits_ssl
from common.data.builtin.digits import digits_dataset
from common.data.classification import load_classification
from common.data.images import decode_image
from common.detection.boxes import crop_box
from common.detection.data import load_detection
from common.detection.sources import features


def test_registry_names_every_builtin_set():
    assert list(CLASSIFICATION) == ["digits", "digits_ssl", "digits_det_crops"]
    assert list(DETECTION) == ["digits_det", "shapes_seg"]


def test_digits_has_hub_schema_and_fixed_split():
    import datasets

    d = digits_dataset()
    assert (len(d["train"]), len(d["test"])) == (1437, 360)
    assert isinstance(d["train"].features["image"], datasets.Image)
    assert d["train"].features["label"].names == [str(i) for i in range(10)]
    again = digits_dataset()
    assert d["test"]["label"] == again["test"]["label"]  # fixed seed: the same split every time
    counts = np.bincount(d["test"]["label"], minlength=10)
    assert counts.min() >= 34  # stratified: every digit is in the held-out split


# --------------------------------------------------------------------------------------------
# digits_ssl
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One generation into a fresh cache, with what each split's rendering got and made.

    ``rendered[split]`` = (glyphs drawn from (N, 8, 8), images (M, 32, 32, 3), labels (M,)).
    """
    root = tmp_path_factory.mktemp("cache")
    render_split, rendered = digits_ssl.render_split, {}

    def recording(glyphs, labels, variants, seed, split):
        images, image_labels = render_split(glyphs, labels, variants, seed, split)
        rendered[split] = (glyphs.copy(), images, image_labels)
        return images, image_labels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CV_RECIPES_CACHE", str(root))
        mp.setattr(digits_ssl, "render_split", recording)
        data = digits_ssl.digits_ssl_dataset(seed=0)
    return SimpleNamespace(data=data, root=root, rendered=rendered)


def _png_bytes(ds) -> list[bytes]:
    import datasets

    return [value["bytes"] for value in ds.cast_column("image", datasets.Image(decode=False))["image"]]


def test_ssl_schema_split_sizes_and_image_format(generated):
    import datasets

    data = generated.data
    assert set(data) == {"train", "test"}
    assert (len(data["train"]), len(data["test"])) == (1437 * digits_ssl.VARIANTS["train"], 360 * 3)
    for split in data.values():
        assert list(split.features) == ["image", "label"]
        assert isinstance(split.features["image"], datasets.Image)
        assert split.features["label"].names == [str(i) for i in range(10)]
    image = data["test"][0]["image"]
    assert image.mode == "RGB" and image.size == (32, 32)
    assert np.bincount(data["test"]["label"], minlength=10).min() >= 3 * 34  # every class, stratified
    # The dataset holds exactly the rendered pixels (PNG is lossless).
    decoded = np.stack([np.asarray(image) for image in data["test"]["image"]])
    assert np.array_equal(decoded, generated.rendered["test"][1])
    assert [p.name for p in generated.root.iterdir()] == [
        f"digits_ssl-{digits_ssl.VERSION}-seed0"
    ]  # renamed, no temp left


def test_ssl_no_leakage_between_splits(generated):
    # render_split draws nothing but the glyphs it is given; each split's were exactly that split's digits.
    source = digits_dataset()
    for split in ("train", "test"):
        glyphs, _, labels = generated.rendered[split]
        assert np.array_equal(glyphs, np.stack([np.asarray(image) for image in source[split]["image"]]))
        assert np.array_equal(labels, np.repeat(source[split]["label"], digits_ssl.VARIANTS[split]))


def test_ssl_deterministic_and_cached(generated, tmp_path, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path))  # empty cache: a second, independent generation
    again = digits_ssl.digits_ssl_dataset(seed=0)
    for split in ("train", "test"):
        assert _png_bytes(again[split]) == _png_bytes(generated.data[split])  # same bytes: same pixels
        assert again[split]["label"] == generated.data[split]["label"]
    glyphs = generated.rendered["test"][0][:4]
    other_seed = digits_ssl.render_split(glyphs, np.arange(4), 1, 1, "test")[0]
    assert not np.array_equal(other_seed, digits_ssl.render_split(glyphs, np.arange(4), 1, 0, "test")[0])
    monkeypatch.setenv("CV_RECIPES_CACHE", str(generated.root))
    monkeypatch.setattr(digits_ssl, "render_split", None)  # a cached set is read, never drawn again
    cached = digits_ssl.digits_ssl_dataset(seed=0)
    assert _png_bytes(cached["test"]) == _png_bytes(generated.data["test"])


def test_png_encoder_is_lossless():
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    decoded = Image.open(io.BytesIO(digits_ssl._png(image)))
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), image)


def _weighted_knn(
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    queries: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int = 10,
) -> torch.Tensor:
    """Predicted classes as DINO's eval_knn: cosine similarity, k neighbours voting exp(sim / T)."""
    bank, queries = (torch.nn.functional.normalize(x.flatten(1).float(), dim=1) for x in (bank, queries))
    sims, idx = (queries @ bank.T).topk(k, dim=1)
    votes = torch.zeros(len(queries), num_classes).scatter_add_(1, bank_labels[idx], (sims / temperature).exp())
    return votes.argmax(1)


def test_raw_pixels_do_not_give_the_class_away(generated):
    (_, bank, bank_labels), (_, queries, labels) = generated.rendered["train"], generated.rendered["test"]
    predicted = _weighted_knn(torch.from_numpy(bank), torch.from_numpy(bank_labels), torch.from_numpy(queries))
    accuracy = (predicted == torch.from_numpy(labels)).float().mean().item()
    assert 0.2 < accuracy < 0.6, f"raw-pixel kNN top-1 {accuracy:.3f}"  # plain digits: 0.98


def test_each_image_repeats_its_digit_in_separate_copies(generated):
    # v3's design: 4-6 copies of one glyph whose boxes do not overlap, so the light strokes form several
    # separate blobs (a glyph may break into two; copies that found no room are left out).
    from scipy import ndimage

    _, images, _ = generated.rendered["test"]
    blobs = np.array([ndimage.label(image[..., 0] > 130, structure=np.ones((3, 3)))[1] for image in images])
    assert (blobs >= 2).all() and (blobs >= 3).mean() > 0.95, np.bincount(blobs)


def test_load_classification_finds_digits_ssl(generated, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(generated.root))  # the fixture's cache: no regeneration
    data = load_classification("digits_ssl")
    assert (len(data.train), len(data.eval)) == (1437 * digits_ssl.VARIANTS["train"], 1080)
    assert (data.image_column, data.label_column, data.classes) == ("image", "label", [str(i) for i in range(10)])


# --------------------------------------------------------------------------------------------
# digits_det and digits_det_crops
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """One generation of digits_det into a fresh cache, recording the glyphs each split drew."""
    root = tmp_path_factory.mktemp("cache")
    render_scenes, rendered = digits_det.render_scenes, {}

    def recording(glyphs, labels, count, seed, split):
        rendered[split] = glyphs.copy()
        return render_scenes(glyphs, labels, count, seed, split)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CV_RECIPES_CACHE", str(root))
        mp.setattr(digits_det, "render_scenes", recording)
        folder = digits_det.digits_det_folder()
        data = load_detection("digits_det")
    return SimpleNamespace(root=root, folder=folder, rendered=rendered, data=data)


@pytest.fixture
def cache(scenes, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(scenes.root))  # the fixture's cache: no regeneration
    return scenes.root


def _xyxy(bbox) -> np.ndarray:
    b = np.asarray(bbox, np.float64).reshape(-1, 4)
    return np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], 1)


def test_digits_det_schema_sizes_and_boxes(scenes):
    data = scenes.data
    assert (len(data.train), len(data.eval)) == (2000, 400)
    assert data.classes == [str(i) for i in range(10)]
    assert data.train.features == features() == data.eval.features
    assert [p.name for p in scenes.root.iterdir()] == ["digits_det-v1-seed0"]  # renamed, no temp left
    assert (scenes.folder / "annotations" / "instances_val.json").exists()
    image = decode_image(data.eval[0]["image"], "")
    assert image.size == (96, 96) and image.mode == "RGB"
    heights, counts = [], []
    for split in (data.train, data.eval):
        for row in split:
            boxes = _xyxy(row["objects"]["bbox"])
            counts.append(len(boxes))
            heights += (boxes[:, 3] - boxes[:, 1]).tolist()
            assert (row["width"], row["height"]) == (96, 96) and not any(row["objects"]["iscrowd"])
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 96).all()
            # digits may touch, never overlap much
            lt = np.maximum(boxes[:, None, :2], boxes[None, :, :2])
            rb = np.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
            inter = (rb - lt).clip(0).prod(-1)
            area = (boxes[:, 2:] - boxes[:, :2]).prod(-1)
            iou = inter / (area[:, None] + area[None] - inter)
            assert (iou[~np.eye(len(boxes), dtype=bool)] < 0.3).all()
    assert min(counts) == 1 and max(counts) == 6 and 3 < np.mean(counts) < 4
    assert min(heights) >= 10 and max(heights) <= 50 and np.median(heights) < 30  # many small digits
    labels = np.concatenate([row["objects"]["category"] for row in data.eval])
    assert np.bincount(labels, minlength=10).min() > 60  # every digit, roughly balanced


def test_digits_det_is_cached(scenes, cache, monkeypatch):
    monkeypatch.setattr(digits_det, "render_scenes", None)  # a cached set is read, never drawn again
    assert digits_det.digits_det_folder() == scenes.folder
    data = load_detection("digits_det")
    assert list(data.eval["objects"]) == list(scenes.data.eval["objects"])


def test_digits_det_crops_are_every_box_cut_as_crop_box_cuts(scenes, cache):
    """The crops set (a detector backbone's pretraining data) holds every box of each split once, in
    order, with its category; each crop is common.detection.boxes.crop_box of its box (32 px, margin 0.15), which
    the leaf package cannot import and repeats: the same pixels. It loads as a built-in classification set."""
    crops = digits_det.digits_det_crops_dataset()
    for split, table in (("train", scenes.data.train), ("test", scenes.data.eval)):
        categories = [c for objects in table["objects"] for c in objects["category"]]
        assert crops[split]["label"] == categories
    expected = [
        np.asarray(crop_box(decode_image(row["image"], ""), box, 32, 0.15))
        for row in scenes.data.eval
        for box in row["objects"]["bbox"]
    ]
    got = [np.asarray(image) for image in crops["test"]["image"]]
    assert got[0].shape == (32, 32, 3) and len(got) == len(expected)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    loaded = load_classification("digits_det_crops")
    assert loaded.classes == [str(i) for i in range(10)] and len(loaded.eval) == len(crops["test"])


def test_digits_det_is_deterministic_and_splits_draw_from_disjoint_digits(scenes):
    source = digits_dataset()
    glyphs = {split: np.stack([np.asarray(image) for image in source[split]["image"]]) for split in ("train", "test")}
    assert np.array_equal(scenes.rendered["train"], glyphs["train"])  # train scenes: train digits only
    assert np.array_equal(scenes.rendered["val"], glyphs["test"])  # val scenes: test digits only
    # A fresh rendering of the first val scenes equals the cached PNGs (lossless) and annotations.
    labels = np.asarray(source["test"]["label"])
    images, boxes, classes = digits_det.render_scenes(glyphs["test"], labels, 12, 0, "val")
    for i, row in enumerate(scenes.data.eval.select(range(12))):
        assert np.array_equal(np.asarray(decode_image(row["image"], "")), images[i])
        assert row["objects"]["bbox"] == boxes[i].tolist() and row["objects"]["category"] == classes[i].tolist()
    other = digits_det.render_scenes(glyphs["test"], labels, 12, 1, "val")[0]
    assert not np.array_equal(other, images)


def test_digits_det_boxes_are_tight_around_the_digits():
    """Every edge row and column of a box crosses the digit, and just outside the box there is at
    most the digit's faint antialiased rim (pixels under INK coverage). Differences are taken from
    the digit-free background, relative to the digit's full contrast (``peak``)."""
    source = digits_dataset()["test"]
    glyphs = np.pad(np.stack([np.asarray(image) for image in source["image"]]), ((0, 0), (1, 1), (1, 1)))
    labels = np.asarray(source["label"])
    for i in range(60):
        image, boxes, _, background = digits_det._scene(np.random.default_rng([0, 1, i]), glyphs, labels)
        diff = np.abs(image.astype(np.float32) - background).max(-1)  # (S, S), grey levels
        for x0, y0, x1, y1 in boxes:
            inside = diff[y0:y1, x0:x1]
            peak = np.percentile(inside, 95)
            assert peak > 80  # the digit stands out
            for edge in (inside[0], inside[-1], inside[:, 0], inside[:, -1]):
                assert edge.max() > 0.12 * peak
            ring = np.zeros(diff.shape, bool)  # the pixels around the box, less the other digits' boxes
            ring[max(y0 - 1, 0) : y1 + 1, max(x0 - 1, 0) : x1 + 1] = True
            ring[y0:y1, x0:x1] = False
            for b in boxes:
                if b != (x0, y0, x1, y1):
                    ring[b[1] : b[3], b[0] : b[2]] = False
            if ring.any():
                assert diff[ring].max() < 0.45 * peak and diff[ring].mean() < 15


# --------------------------------------------------------------------------------------------
# Sources: a COCO-json folder (two layouts) and a hub-schema dataset give the same rows


def test_shapes_seg_scenes_are_drawn_from_their_polygons_which_never_share_a_pixel():
    """``shapes_seg``: each shape's pixels are its polygon as pycocotools rasterises it (the masks are exact up
    to anti-aliased edges), no two shapes overlap, and a scene is a function of its seed."""
    import numpy as np
    from pycocotools import mask as coco_mask

    from common.data.builtin.shapes_seg import SEG_CLASSES, SEG_SIZE, _coverage, _scene

    for i in range(8):
        image, polygons, classes = _scene(np.random.default_rng([0, 1, i]))
        again, _, _ = _scene(np.random.default_rng([0, 1, i]))
        assert np.array_equal(image, again) and 1 <= len(polygons) <= 5 and set(classes) <= set(range(len(SEG_CLASSES)))
        masks = [coco_mask.decode(coco_mask.frPyObjects([p], SEG_SIZE, SEG_SIZE))[..., 0] for p in polygons]
        assert sum(m.astype(int) for m in masks).max() <= 1 if masks else True  # disjoint
        for polygon, mask in zip(polygons, masks):
            drawn = _coverage(np.asarray(polygon).reshape(-1, 2)) >= 0.5
            assert np.logical_and(drawn, mask).sum() / np.logical_or(drawn, mask).sum() >= 0.9
