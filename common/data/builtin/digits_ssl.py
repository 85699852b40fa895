"""``digits_ssl``: a harder built-in set for self-supervised learning, made from the 8x8 digits.

Each image shows one digit of :func:`.digits.digits_dataset` drawn 4-6 times on a 32x32 RGB canvas:
every copy has its own height (7-11 px), width (0.8-1.2 of it), tilt (up to 0.3 rad) and place, and
no two copies' boxes overlap. Colours and the sensor-noise level are the same in every image. Why
(the earlier versions' story: docs/notes/dino.md, "How digits_ssl came to be"):

- whatever differs between images and is shared by all crops of one image becomes the cue a
  self-supervised method matches crops by, instead of the digit: per-image colours, clutter, noise
  level, or the place of a single digit (which a zero-padded convnet reads from the canvas border).
  Here the copies' places, sizes and tilts are drawn independently, so none of them is a property
  of the image; only the glyph is;
- every crop shows the class: a local crop (5-40 % of the canvas) holds a copy or part of one,
  where a single small digit would leave most local crops empty;
- raw pixels must match an arrangement of copies, which no training image repeats, so a kNN on
  pixels is far from solving the set (tests/test_builtin.py bounds it) while a trained teacher is not.

Train images come only from the source's 1,437 train digits and test images only from its 360 test
digits. Generation is deterministic in ``seed`` (a numpy Generator per split and image), takes
seconds, and is cached on disk.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from common.data.builtin.cache import cached_folder
from common.data.builtin.digits import blend, coverage, digits_dataset

if TYPE_CHECKING:
    import datasets

SIZE = 32  # canvas side, pixels
VERSION = "v3"  # part of the cache folder name: change it whenever the rendering changes
VARIANTS = {"train": 2, "test": 3}  # images per source digit: 2,874 train and 1,080 test images
_SPLIT_ID = {"train": 0, "test": 1}  # seeds the two splits' Generators apart
BACKGROUND, FOREGROUND, NOISE = 40.0, 220.0, 3.0  # grey levels, 0..255; NOISE: the noise std
COPIES, HEIGHT, ASPECT, TILT = (4, 6), (7.0, 11.0), (0.8, 1.2), 0.3  # per image; per copy (px, width/height, rad)
PLACE_TRIES = 30  # places tried per copy before it is left out (the first copy always fits)
_INK = np.full(3, FOREGROUND, np.float32)  # the digits' colour, RGB


class _Draws:
    """One image's random numbers: U(0, 1) draws from its own Generator, handed out in order as
    plain floats (a numpy call per draw would cost more than the drawing it parameterises)."""

    def __init__(self, rng: np.random.Generator, count: int = 1 + COPIES[1] * (3 + 2 * PLACE_TRIES)) -> None:
        self.values, self.next = rng.random(count).tolist(), 0  # count: the most one image can take

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        self.next += 1
        return low + (high - low) * self.values[self.next - 1]


def _render(d: _Draws, noise: np.ndarray, glyph: np.ndarray) -> np.ndarray:
    """One (SIZE, SIZE, 3) uint8 image of ``glyph`` ((10, 10), see :func:`.digits.coverage`) drawn 4-6
    times; ``noise`` is (SIZE, SIZE, 3) U(0, 1). Colours are in 0..255, positions and lengths in
    canvas px.
    """
    image = np.full((SIZE, SIZE, 3), BACKGROUND, np.float32)
    copies = COPIES[0] + int(d.uniform(0, COPIES[1] - COPIES[0] + 1))
    boxes: list[tuple[float, float, float, float]] = []  # placed copies: centre x, y and half width, height
    for _ in range(copies):
        height, aspect, angle = d.uniform(*HEIGHT), d.uniform(*ASPECT), d.uniform(-TILT, TILT)
        half_w, half_h = 0.4 * height * aspect, 0.5 * height  # the glyph's ink is about 0.8 of its cell wide
        margin_x = 0.5 * height * max(aspect, 1.0) + 1  # keeps a tilted copy on the canvas
        for _ in range(PLACE_TRIES):
            cx, cy = d.uniform(margin_x, SIZE - margin_x), d.uniform(half_h + 1, SIZE - half_h - 1)
            if all(abs(cx - x) > half_w + w or abs(cy - y) > half_h + h for x, y, w, h in boxes):
                break
        else:
            if boxes:  # no room left: fewer copies
                continue
        boxes.append((cx, cy, half_w, half_h))
        blend(image, coverage(glyph, cx, cy, height, aspect, angle, SIZE), _INK)
    # Sensor noise: uniform, zero-mean, standard deviation NOISE, independent per pixel and channel.
    image += (noise - 0.5) * np.float32(NOISE * 12**0.5)
    return np.rint(image.clip(0, 255)).astype(np.uint8)


def render_split(
    glyphs: np.ndarray, labels: np.ndarray, variants: int, seed: int, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """Images (N * variants, SIZE, SIZE, 3) uint8 and labels (N * variants,) from ``glyphs``
    ((N, 8, 8) uint8, 0..255, at least two classes) with ``labels`` (N,): image ``i`` shows glyph
    ``i // variants``. Only ``glyphs`` are drawn: pass one split's digits, and nothing of another
    split can appear.
    """
    source = np.repeat(np.arange(len(glyphs)), variants)
    padded = np.pad(glyphs, ((0, 0), (1, 1), (1, 1)))  # (N, 10, 10): samples off a glyph read 0
    images = np.empty((len(source), SIZE, SIZE, 3), np.uint8)
    for i, s in enumerate(source):
        rng = np.random.default_rng([seed, _SPLIT_ID[split], i])  # one stream per image: order-free
        draws = _Draws(rng)
        images[i] = _render(draws, rng.random((SIZE, SIZE, 3), np.float32), padded[s])
    return images, labels[source]


def _png(image: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image, stored without compression: the sensor noise makes
    these images incompressible anyway, and PIL's default level spends time for nothing."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


def _generate(seed: int) -> datasets.DatasetDict:
    import datasets

    source = digits_dataset()
    splits = {}
    for split, ds in source.items():
        glyphs = np.stack([np.asarray(image, np.uint8) for image in ds["image"]])  # (N, 8, 8)
        images, labels = render_split(glyphs, np.asarray(ds["label"]), VARIANTS[split], seed, split)
        pngs = [{"bytes": _png(x), "path": None} for x in images]  # what datasets.Image stores
        splits[split] = datasets.Dataset.from_dict({"image": pngs, "label": labels.tolist()}, features=ds.features)
    return datasets.DatasetDict(splits)


def digits_ssl_dataset(seed: int = 0) -> datasets.DatasetDict:
    """The ``digits_ssl`` set as a hub-style ``datasets.DatasetDict``: splits ``train`` (2,874)
    and ``test`` (1,080), columns ``image`` (RGB, 32x32) and ``label`` (``ClassLabel`` '0'..'9').
    ``seed`` changes the drawings, never which source digits go to which split.

    Cached in ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``digits_ssl-v3-seed<seed>``
    (:func:`.cache.cached_folder`).
    """
    import datasets

    folder = cached_folder(
        f"digits_ssl-{VERSION}-seed{seed}", "dataset_dict.json", lambda tmp: _generate(seed).save_to_disk(str(tmp))
    )
    return datasets.load_from_disk(str(folder))
