"""Camera-size JPEGs decoded reduced (common.data.images.decode_image with ``shorter``, issue 25, item 2): the
crops the classifier's and DINO's transforms cut are the same pictures as from the full decode (PSNR at
least 35 dB for the same random draws: the same crop box, flip and jitter), small images and other
formats are decoded as before, and the sides the transforms need are what their geometry says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter
from timm.data import create_transform

from common.data.images import decode_image, needed_side
from common.loaders import sample_seed, seeded


def _photo(path: Path, size: tuple[int, int] = (4032, 3024)) -> Path:
    """A photo-like JPEG: smooth colour fields, edges and fine texture, blurred as a lens would."""
    rng = np.random.default_rng(0)
    small = Image.fromarray(rng.integers(0, 255, (size[1] // 64, size[0] // 64, 3), dtype=np.uint8))
    image = small.resize(size, Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(60):
        x, y = int(rng.integers(0, size[0])), int(rng.integers(0, size[1]))
        r = int(rng.integers(40, 400))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    noise = rng.normal(0, 12, (size[1], size[0], 3))
    image = Image.fromarray(np.clip(np.asarray(image) + noise, 0, 255).astype(np.uint8)).filter(
        ImageFilter.GaussianBlur(2)
    )
    image.save(path, quality=92)
    return path


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float) -> float:
    return 10 * math.log10(peak**2 / float(((a - b) ** 2).mean()))


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    return _photo(tmp_path_factory.mktemp("photo") / "camera.jpg")


def test_needed_sides_follow_the_crop_geometry():
    assert needed_side(224, crop_pct=0.875) == 256  # resize to 256, centre crop 224
    # a crop of 8 % of the area at aspect 3/4: its narrow side is sqrt(0.08 * 0.75) = 0.245 of the shorter side
    assert needed_side(224, 0.08, (3 / 4, 4 / 3)) == math.ceil(224 / (math.sqrt(0.08) * math.sqrt(0.75)))
    assert needed_side(32) == 32


@pytest.mark.parametrize("train", [True, False])
def test_the_classifiers_crops_are_the_same_pictures_from_a_reduced_decode(photo, train):
    value = {"path": str(photo), "bytes": None}
    if train:
        transform = create_transform(224, is_training=True, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
        side = needed_side(224, 0.08, (3 / 4, 4 / 3))
    else:
        transform = create_transform(224, is_training=False, crop_pct=0.875)
        side = needed_side(224, crop_pct=0.875)
    reduced = decode_image(value, "camera.jpg", side)
    # training crops need 1/2 (at 1/4 a small crop would hold under 224 px); the evaluation's resize 1/8
    assert min(reduced.size) >= side and reduced.size == ((2016, 1512) if train else (504, 378))
    full = decode_image(value, "camera.jpg")
    assert full.size == (4032, 3024)
    worst = math.inf
    for k in range(8):  # the same random draws on both: the same crop box (in fractions), flip and jitter
        with seeded(sample_seed(0, 0, k)):
            a = transform(full)
        with seeded(sample_seed(0, 0, k)):
            b = transform(reduced)
        worst = min(worst, psnr(a, b, float(a.max() - a.min())))
    assert worst >= 35, worst


def test_small_images_and_other_formats_decode_as_before(tmp_path):
    small = _photo(tmp_path / "small.jpg", (500, 375))
    assert decode_image({"path": str(small)}, "small.jpg", 300).size == (500, 375)  # 1/2 would be under 300
    Image.new("RGB", (1600, 1200), (10, 200, 30)).save(tmp_path / "big.png")
    assert decode_image({"path": str(tmp_path / "big.png")}, "big.png", 100).size == (1600, 1200)  # not a JPEG


def test_a_detectors_boxes_follow_a_reduced_decode(photo):
    """DETR's evaluation resize (shorter side to 96) of a 4032x3024 photo decoded at 1/8: the same picture
    (35 dB), the box in the same place within 0.5 px, and ``orig_size`` still the file's own, so that the
    detections are taken back to the photo's pixels."""
    from common.detection.data import DetectionDataset
    from conftest import detection_table, load_recipe

    detr = load_recipe("detr")
    cfg = detr.Config()
    box = [1000.0, 800.0, 1200.0, 900.0]  # x, y, w, h in the photo's pixels
    table = detection_table([{"path": str(photo), "bytes": None}], [[box]])
    full = DetectionDataset(table, detr.data_transforms(cfg, False))[0]
    reduced = DetectionDataset(table, detr.data_transforms(cfg, False), shorter=cfg.scales[-1])[0]
    assert full[0].shape == reduced[0].shape == (3, 72, 96)  # the longer side capped at max_size 96
    assert psnr(full[0], reduced[0], float(full[0].max() - full[0].min())) >= 35
    assert torch.allclose(
        full[1]["boxes"].as_subclass(torch.Tensor), reduced[1]["boxes"].as_subclass(torch.Tensor), atol=0.5
    )
    assert full[1]["orig_size"] == reduced[1]["orig_size"] == (3024, 4032)


def test_cached_images_are_the_decoded_ones_and_a_cache_too_large_is_refused(photo, tmp_path, monkeypatch):
    """--cache_images: each image decoded once at the size the transform needs (in RAM, or as .npy files
    reused by a later run); the dataset then gives the same samples as without it; a cache that would
    not fit is one line before anything is decoded."""
    from common import UserError
    from common.data.classification import ClassificationDataset
    from common.data.image_cache import image_caches
    from conftest import detection_table

    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    table = detection_table([{"path": str(photo), "bytes": None}], [[[10.0, 10.0, 50.0, 50.0]]])
    transform = create_transform(224, is_training=False, crop_pct=0.875)
    plain = ClassificationDataset(table, "image", "", transform, shorter=256)
    expected = plain[0][0]
    assert image_caches("", 1, (table, "image", 256)) == ([None], "")  # --cache_images off: nothing decoded
    for where in ("ram", "disk"):
        (cache,), line = image_caches(where, 1, (table, "image", 256))
        cached = ClassificationDataset(table, "image", "", transform, shorter=256, cache=cache)
        assert cached.cache.images[0].shape == (378, 504, 3) and cached.cache.sizes[0] == (4032, 3024)
        assert torch.equal(cached[0][0], expected) and "1 images decoded once" in line
    assert len(list((tmp_path / "cache" / "images").rglob("*.npy"))) == 1  # disk: kept for the next run
    monkeypatch.setattr("common.data.image_cache.available_memory", lambda: 100_000)
    with pytest.raises(UserError, match=r"cache_images ram needs 0.0 GiB for 1 images; 0.0 GiB of available memory"):
        image_caches("ram", 1, (table, "image", 256))


# --------------------------------------------------------------------------------------------
# EXIF orientation: photos read as viewers and annotation tools show them
# --------------------------------------------------------------------------------------------
def _turned(displayed: Image.Image, path: Path, **save: object) -> Path:
    """``displayed`` written as a phone held upright writes it: the pixels stored turned 90 degrees
    anticlockwise, with EXIF orientation 6 (a viewer turns them 90 degrees clockwise to show them)."""
    from PIL import ExifTags

    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    displayed.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif.tobytes(), **save)
    return path


@pytest.fixture(scope="module")
def turned_photo(photo, tmp_path_factory) -> Path:
    """``photo`` (4032x3024) as a phone stores it: 3024x4032 pixels with orientation 6."""
    return _turned(Image.open(photo), tmp_path_factory.mktemp("turned") / "phone.jpg", quality=95)


def test_a_photo_with_an_orientation_tag_decodes_as_displayed_full_and_reduced(photo, turned_photo):
    """Orientation 6: the decode is the displayed picture (the same as the untagged photo through the
    classifier's evaluation transform), its size the displayed one, and the reduced decoding (1/8 in the
    JPEG decoder) still gives the full decode's picture within the tolerance of the tests above."""
    from common.data.classification import ClassificationDataset
    from conftest import detection_table

    with Image.open(turned_photo) as stored:
        assert stored.size == (3024, 4032)
    transform = create_transform(224, is_training=False, crop_pct=0.875)
    side = needed_side(224, crop_pct=0.875)
    full = decode_image({"path": str(turned_photo)}, "phone.jpg")
    reduced = decode_image({"path": str(turned_photo)}, "phone.jpg", side)
    assert (full.size, reduced.size) == ((4032, 3024), (504, 378))
    expected = transform(decode_image({"path": str(photo)}, "camera.jpg"))
    for picture in (full, reduced):
        assert psnr(transform(picture), expected, float(expected.max() - expected.min())) >= 35
    # the classifier's dataset (a table of paths, the undecoded values a folder gives) reads the same
    table = detection_table([{"path": str(turned_photo), "bytes": None}], [[]])
    for shorter in (0, side):
        image = ClassificationDataset(table, "image", "", transform, shorter=shorter)[0][0]
        assert psnr(image, expected, float(expected.max() - expected.min())) >= 35


def test_the_image_cache_keeps_a_tagged_photo_upright(photo, turned_photo, tmp_path, monkeypatch):
    """--cache_images ram and disk (written, then read back by a second run): the stored picture and the
    file's size are the displayed ones, and the estimate from the headers counts the displayed size."""
    from common.data.classification import ClassificationDataset
    from common.data.image_cache import image_caches
    from conftest import detection_table

    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    transform = create_transform(224, is_training=False, crop_pct=0.875)
    table = detection_table([{"path": str(turned_photo), "bytes": None}], [[]])
    expected = transform(decode_image({"path": str(photo)}, "camera.jpg"))
    for where in ("ram", "disk", "disk"):  # the second disk run reads the .npy the first one wrote
        (cache,), _ = image_caches(where, 1, (table, "image", 256))
        cached = ClassificationDataset(table, "image", "", transform, shorter=256, cache=cache)
        assert cached.cache.images[0].shape == (378, 504, 3) and cached.cache.sizes[0] == (4032, 3024)
        assert cached.cache.estimate() == 3 * 504 * 378
        assert psnr(cached[0][0], expected, float(expected.max() - expected.min())) >= 35


@pytest.mark.parametrize("reduced", [False, True])
def test_a_detectors_boxes_land_on_a_tagged_photos_objects(tmp_path, reduced):
    """A COCO folder whose json gives the displayed size (as annotation tools write it) and a box around
    the one bright object of the displayed picture, stored turned with orientation 6: through the
    detection dataset (full and reduced decoding) the box covers the bright pixels and ``orig_size`` is
    the displayed size; --predict's table of new images takes the displayed sizes from the headers."""
    import json

    from common.detection.data import DetectionDataset, load_detection
    from common.detection.sources import image_table
    from conftest import bright_rectangle, load_recipe

    box = (500, 150, 200, 300)  # x, y, w, h in the displayed 800x600 picture
    (tmp_path / "annotations").mkdir()
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        _turned(bright_rectangle(800, 600, box), tmp_path / split / f"{split}.jpg", quality=95)
        coco = {
            "images": [{"id": 1, "file_name": f"{split}.jpg", "width": 800, "height": 600}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": list(box), "area": 6e4}],
            "categories": [{"id": 1, "name": "object"}],
        }
        (tmp_path / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    data = load_detection(str(tmp_path))
    detr = load_recipe("detr")
    cfg = detr.Config()
    image, target = DetectionDataset(data.train, detr.data_transforms(cfg, False), shorter=96 if reduced else 0)[0]
    assert image.shape == (3, 72, 96) and target["orig_size"] == (600, 800)
    x0, y0, x1, y1 = target["boxes"][0].round().int().tolist()  # pixels of the 96x72 picture
    inside = image[:, y0 + 1 : y1 - 1, x0 + 1 : x1 - 1].mean()
    outside = torch.cat([image[:, :, : x0 - 1].flatten(), image[:, : y0 - 1, :].flatten()]).mean()
    assert inside > outside + 2  # normalised units: grey 230 against grey 30
    table = image_table([tmp_path / "train" / "train.jpg"])
    assert (table[0]["width"], table[0]["height"]) == (800, 600)
