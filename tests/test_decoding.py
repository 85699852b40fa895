"""Camera-size JPEGs decoded reduced (common.images.decode_image with ``shorter``, issue 25, item 2): the
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

from common.images import decode_image, needed_side
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
    from common.detection import DetectionDataset
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
    from types import SimpleNamespace

    from common import UserError
    from common.data import ClassificationDataset
    from common.image_cache import cache_images
    from conftest import detection_table

    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    table = detection_table([{"path": str(photo), "bytes": None}], [[[10.0, 10.0, 50.0, 50.0]]])
    transform = create_transform(224, is_training=False, crop_pct=0.875)
    plain = ClassificationDataset(table, "image", "", transform, shorter=256)
    expected = plain[0][0]
    for where in ("ram", "disk"):
        cached = ClassificationDataset(table, "image", "", transform, shorter=256)
        run = SimpleNamespace(cfg=SimpleNamespace(cache_images=where, num_workers=1), notes=[])
        cache_images(run, cached)
        assert cached.cache.images[0].shape == (378, 504, 3) and cached.cache.sizes[0] == (4032, 3024)
        assert torch.equal(cached[0][0], expected) and "1 images decoded once" in run.notes[0]
    assert len(list((tmp_path / "cache" / "images").rglob("*.npy"))) == 1  # disk: kept for the next run
    monkeypatch.setattr("common.image_cache.available_memory", lambda: 100_000)
    run = SimpleNamespace(cfg=SimpleNamespace(cache_images="ram", num_workers=1), notes=[])
    with pytest.raises(UserError, match=r"cache_images ram needs 0.0 GiB for 1 images; 0.0 GiB of available memory"):
        cache_images(run, ClassificationDataset(table, "image", "", transform, shorter=256))
