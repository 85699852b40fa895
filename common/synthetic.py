"""``digits_ssl``: a harder built-in set for self-supervised learning, made from the 8x8 digits.

Every digit of :func:`common.data.digits_dataset` is redrawn several times on a 32x32 RGB canvas:
random height, aspect, tilt, position and colour, over a random gradient background with a noise
texture, clutter strokes, blobs and one or two distractors (a short stroke or a fragment of
another digit, smaller or fainter). Raw pixels then say little about the class (weighted kNN on
pixels, as DINO's evaluation: about 20 % top-1, against about 98 % on the plain digits) while a
network still reads the digit (a small supervised CNN: above 80 %), which leaves room for a
self-supervised method to show what it learns.

Train images are drawn only from the source's 1,437 train digits and test images only from its
360 test digits, distractor fragments included, so nothing of a test digit leaks into training.
Generation is deterministic in ``seed`` (one numpy Generator per split and image, no global RNG),
takes a few seconds and is cached on disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 32  # canvas side, pixels
SS = 2  # supersampling of the strokes and blobs: drawn at SS x SIZE, box-filtered down (antialiasing)
VERSION = "v1"  # part of the cache folder name: change it whenever the rendering changes
VARIANTS = {"train": 4, "test": 3}  # images per source digit: 5,748 train and 1,080 test images
_SPLIT_ID = {"train": 0, "test": 1}  # seeds the two splits' Generators apart
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601 luminance of an RGB colour

# Pixel centres, (SIZE, SIZE) each, in pixels: x to the right, y down.
_YY, _XX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
# (SIZE, 4) linear-interpolation weights from a 4-point grid to the canvas, for the noise texture.
_UP4 = np.maximum(0.0, 1.0 - np.abs((np.arange(SIZE) + 0.5) / (SIZE / 4) - 0.5 - np.arange(4)[:, None])).T
_UP4 = (_UP4 / _UP4.sum(1, keepdims=True)).astype(np.float32)
# Lookup table from bilinearly upscaled glyph values 0..255 to coverage in [0, 1]: a ramp that
# sharpens the blurry edges of an 8x8 glyph blown up 2-3x.
_SHARPEN = np.clip((np.arange(256, dtype=np.float32) / 255 - 0.15) / 0.45, 0.0, 1.0)


def _coverage(glyph: Image.Image, cx: float, cy: float, height: float, aspect: float, angle: float) -> np.ndarray:
    """Coverage (SIZE, SIZE) in [0, 1] of a (10, 10) zero-padded 8x8 'L' glyph drawn ``height`` px
    tall and ``height * aspect`` px wide, centred at (cx, cy) px and tilted by ``angle`` radians.

    PIL's affine transform maps each canvas pixel back into the glyph (bilinear, in C).
    """
    ku, kv = 8.0 / (height * aspect), 8.0 / height  # glyph px per canvas px
    cos, sin = np.cos(angle), np.sin(angle)
    # Canvas (x, y) px -> glyph (u, v) px; 5 = the glyph centre 4 + 1 of padding.
    affine = (cos * ku, sin * ku, 5 - ku * (cos * cx + sin * cy), -sin * kv, cos * kv, 5 + kv * (sin * cx - cos * cy))
    return _SHARPEN[np.asarray(glyph.transform((SIZE, SIZE), Image.AFFINE, affine, resample=Image.BILINEAR))]


def _blend(image: np.ndarray, coverage: np.ndarray, colour: np.ndarray) -> None:
    """Alpha-blend ``colour`` (3,) into ``image`` (SIZE, SIZE, 3) float32 where ``coverage`` is set."""
    image += coverage[..., None] * (colour.astype(np.float32) - image)


def _rgba(rgb: np.ndarray, alpha: float) -> tuple[int, int, int, int]:
    return (*(int(c) for c in rgb), round(255 * alpha))


def _render(rng: np.random.Generator, glyph: Image.Image, others: list[Image.Image]) -> np.ndarray:
    """One (SIZE, SIZE, 3) uint8 image of ``glyph`` (padded 'L', see :func:`_coverage`); ``others``
    (glyphs of the other classes, same split) supply the distractor fragments. Colours in 0..255."""
    # Background: a linear gradient between two random dark colours (the digit is the light one)
    # at a random angle, plus a low-frequency colour texture (a 4x4 random field, upsampled).
    c0, c1 = rng.uniform(0, 128, (2, 3)).astype(np.float32)
    theta = rng.uniform(0, 2 * np.pi)
    ramp = ((_XX - SIZE / 2) * np.float32(np.cos(theta)) + (_YY - SIZE / 2) * np.float32(np.sin(theta))) / SIZE + 0.5
    coarse = rng.normal(0, rng.uniform(10, 40), (3, 4, 4)).astype(np.float32)
    background = c0 + ramp[..., None] * (c1 - c0) + (_UP4 @ coarse @ _UP4.T).transpose(1, 2, 0)
    canvas = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8)).resize((SS * SIZE,) * 2, Image.NEAREST)
    draw = ImageDraw.Draw(canvas, "RGBA")  # RGBA fills blend into the RGB canvas
    # Clutter: long thin strokes that cross the canvas, and soft blobs (3 nested discs).
    for _ in range(rng.integers(2, 5)):
        points = rng.uniform(-4, SIZE + 4, (rng.integers(2, 4), 2)) * SS
        draw.line(points.ravel().tolist(), _rgba(rng.uniform(0, 255, 3), rng.uniform(0.4, 0.9)),
                  width=round(SS * rng.uniform(0.7, 2.0)), joint="curve")
    for _ in range(rng.integers(0, 3)):
        (bx, by), radius, fill = rng.uniform(0, SIZE, 2) * SS, rng.uniform(3, 8) * SS, rng.uniform(0, 255, 3)
        for r in (1.0, 0.7, 0.4):
            draw.ellipse((bx - r * radius, by - r * radius, bx + r * radius, by + r * radius), _rgba(fill, 0.2))
    # Distractors, fainter than the digit: a short digit-like stroke, or a piece of another digit
    # (pieces are blended after the strokes, at the canvas resolution).
    pieces = []
    for _ in range(rng.integers(1, 3)):
        alpha, fill = rng.uniform(0.35, 0.7), rng.uniform(0, 255, 3)
        if rng.random() < 0.5:
            walk = np.cumsum(np.vstack([rng.uniform(2, SIZE - 2, (1, 2)), rng.uniform(-7, 7, (rng.integers(2, 5), 2))]), 0)
            draw.line((walk * SS).ravel().tolist(), _rgba(fill, alpha), width=round(SS * rng.uniform(1.5, 3.0)), joint="curve")
        else:
            left, top, w, h = *rng.integers(1, 5, 2), *rng.integers(3, 6, 2)  # a 3-5 px window of the glyph
            piece = Image.new("L", (10, 10))
            piece.paste(others[rng.integers(len(others))].crop((left, top, left + w, top + h)), (left, top))
            cover = _coverage(piece, *rng.uniform(4, SIZE - 4, 2), rng.uniform(9, 16), 1.0, rng.uniform(-0.5, 0.5))
            pieces.append((alpha * cover, fill))
    image = np.asarray(canvas.reduce(SS), np.float32)  # (SIZE, SIZE, 3), writable copy
    for cover, fill in pieces:
        _blend(image, cover, fill)
    # The digit: 14-26 px tall, centred within 5 px of the canvas centre, so at most 2 px off it.
    height, aspect = rng.uniform(14, 26), rng.uniform(0.8, 1.2)
    cx, cy = SIZE / 2 + rng.uniform(-5, 5, 2)
    cover = _coverage(glyph, cx, cy, height, aspect, float(np.clip(rng.normal(0, 0.2), -0.35, 0.35)))
    # Its colour: the first of 16 random light candidates whose luminance differs from that of the
    # canvas under the digit by at least 70 (of 255), so that a human can still read it.
    under = float((image @ _LUMA * cover).sum() / (cover.sum() + 1e-6))
    candidates = rng.uniform(128, 255, (16, 3))
    contrast = np.abs(candidates @ _LUMA - under)
    ok = np.flatnonzero(contrast >= 70)
    _blend(image, cover, candidates[ok[0] if len(ok) else contrast.argmax()])
    # Sensor noise: uniform, zero-mean, standard deviation 0-12.
    image += (rng.random(image.shape, dtype=np.float32) - 0.5) * np.float32(rng.uniform(0, 12) * 12**0.5)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def render_split(glyphs: np.ndarray, labels: np.ndarray, variants: int, seed: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N * variants, SIZE, SIZE, 3) uint8 and labels (N * variants,) from ``glyphs``
    ((N, 8, 8) uint8, 0..255) with ``labels`` (N,): image ``i`` shows glyph ``i // variants``.

    Only ``glyphs`` are drawn, distractor fragments included: pass one split's digits only.
    """
    source = np.repeat(np.arange(len(glyphs)), variants)
    padded = [Image.fromarray(np.pad(g, 1)) for g in glyphs]  # (10, 10): samples off the glyph read 0
    other_classes = {k: [padded[j] for j in np.flatnonzero(labels != k)] for k in np.unique(labels)}
    images = np.empty((len(source), SIZE, SIZE, 3), np.uint8)
    for i, s in enumerate(source):
        rng = np.random.default_rng([seed, _SPLIT_ID[split], i])  # one stream per image: order-free
        images[i] = _render(rng, padded[s], other_classes[labels[s]])
    return images, labels[source]


def _generate(seed: int):
    import datasets

    from common.data import digits_dataset

    source = digits_dataset()
    splits = {}
    for split, ds in source.items():
        glyphs = np.stack([np.asarray(image, np.uint8) for image in ds["image"]])  # (N, 8, 8)
        images, labels = render_split(glyphs, np.asarray(ds["label"]), VARIANTS[split], seed, split)
        splits[split] = datasets.Dataset.from_dict(
            {"image": [Image.fromarray(x) for x in images], "label": labels.tolist()}, features=ds.features
        )
    return datasets.DatasetDict(splits)


def digits_ssl_dataset(seed: int = 0):
    """The ``digits_ssl`` set as a hub-style ``datasets.DatasetDict``: splits ``train`` (5,748)
    and ``test`` (1,080), columns ``image`` (RGB, 32x32) and ``label`` (``ClassLabel`` '0'..'9').

    Cached in ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``digits_ssl-v1-seed<seed>``.
    The cache is written to a temporary folder and renamed, so a concurrent process sees either
    no cache or a complete one; where two processes race, the first rename wins.
    """
    import datasets

    root = Path(os.environ.get("CV_RECIPES_CACHE") or Path.home() / ".cache" / "cv-recipes")
    cache = root / f"digits_ssl-{VERSION}-seed{seed}"
    if (cache / "dataset_dict.json").exists():
        return datasets.load_from_disk(str(cache))
    data = _generate(seed)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=root))
    except OSError:  # a read-only cache location costs a regeneration next time, nothing more
        return data
    try:
        data.save_to_disk(str(tmp))
        tmp.rename(cache)
    except OSError:
        if not (cache / "dataset_dict.json").exists():  # not another process's win: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(cache))
