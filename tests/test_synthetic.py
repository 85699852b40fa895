"""common/synthetic.py: the digits_ssl set (schema, determinism, no leakage, speed, difficulty)."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from common import synthetic
from common.data import digits_dataset, load_classification


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One generation into a fresh cache, timed, with what each split's rendering got and made.

    ``rendered[split]`` = (glyphs drawn from (N, 8, 8), images (M, 32, 32, 3), labels (M,)).
    """
    root = tmp_path_factory.mktemp("cache")
    render_split, rendered = synthetic.render_split, {}

    def recording(glyphs, labels, variants, seed, split):
        images, image_labels = render_split(glyphs, labels, variants, seed, split)
        rendered[split] = (glyphs.copy(), images, image_labels)
        return images, image_labels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CV_RECIPES_CACHE", str(root))
        mp.setattr(synthetic, "render_split", recording)
        start = time.perf_counter()
        data = synthetic.digits_ssl_dataset(seed=0)
        seconds = time.perf_counter() - start
    return SimpleNamespace(data=data, seconds=seconds, root=root, rendered=rendered)


def _png_bytes(ds) -> list[bytes]:
    import datasets

    return [value["bytes"] for value in ds.cast_column("image", datasets.Image(decode=False))["image"]]


def test_schema_split_sizes_and_image_format(generated):
    import datasets

    data = generated.data
    assert set(data) == {"train", "test"}
    assert (len(data["train"]), len(data["test"])) == (1437 * synthetic.VARIANTS["train"], 360 * 3)
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
    assert [p.name for p in generated.root.iterdir()] == [f"digits_ssl-{synthetic.VERSION}-seed0"]  # renamed, no temp left


def test_generation_takes_seconds(generated):
    # About 5 s on 2 busy CPU cores; the bound leaves room for a loaded CI machine.
    assert generated.seconds < 30, f"generation took {generated.seconds:.1f} s"


def test_no_leakage_between_splits(generated):
    # render_split draws nothing but the glyphs it is given; each split's were exactly that split's digits.
    source = digits_dataset()
    for split in ("train", "test"):
        glyphs, _, labels = generated.rendered[split]
        assert np.array_equal(glyphs, np.stack([np.asarray(image) for image in source[split]["image"]]))
        assert np.array_equal(labels, np.repeat(source[split]["label"], synthetic.VARIANTS[split]))


def test_deterministic_and_cached(generated, tmp_path, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path))  # empty cache: a second, independent generation
    again = synthetic.digits_ssl_dataset(seed=0)
    for split in ("train", "test"):
        assert _png_bytes(again[split]) == _png_bytes(generated.data[split])  # same bytes: same pixels
        assert again[split]["label"] == generated.data[split]["label"]
    glyphs = generated.rendered["test"][0][:4]
    other_seed = synthetic.render_split(glyphs, np.arange(4), 1, 1, "test")[0]
    assert not np.array_equal(other_seed, synthetic.render_split(glyphs, np.arange(4), 1, 0, "test")[0])
    monkeypatch.setenv("CV_RECIPES_CACHE", str(generated.root))
    start = time.perf_counter()
    cached = synthetic.digits_ssl_dataset(seed=0)
    assert time.perf_counter() - start < 5 and _png_bytes(cached["test"]) == _png_bytes(generated.data["test"])


def test_png_encoder_is_lossless():
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    decoded = Image.open(io.BytesIO(synthetic._png(image)))
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), image)


def _weighted_knn(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int = 20,
                  temperature: float = 0.07, num_classes: int = 10) -> torch.Tensor:
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


def test_load_classification_finds_the_builtin(generated, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(generated.root))  # the fixture's cache: no regeneration
    data = load_classification("digits_ssl")
    assert (len(data.train), len(data.eval)) == (1437 * synthetic.VARIANTS["train"], 1080)
    assert (data.image_column, data.label_column, data.classes) == ("image", "label", [str(i) for i in range(10)])
