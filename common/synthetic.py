"""``digits_ssl``: a harder built-in set for self-supervised learning, made from the 8x8 digits.

Each digit of :func:`common.data.digits_dataset` is redrawn several times on a 32x32 RGB canvas at a
random height, aspect, tilt, position and colour, over a random gradient with a noise texture,
clutter strokes, blobs and one or two fainter distractors (a short stroke, or a piece of a digit of
another class). Raw pixels then say little about the class (DINO's weighted kNN on pixels: 42 %
top-1, 97.5 % on the plain digits) while a network still reads the digit (a small CNN trained on
the labels for 6 epochs on a CPU: 94 %): room for a self-supervised method to show what it learns.

Train images come only from the source's 1,437 train digits and test images only from its 360 test
digits, distractors included. Generation is deterministic in ``seed`` (a numpy Generator per split
and image), takes seconds, and is cached on disk.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    import datasets

SIZE = 32  # canvas side, pixels
SS = 2  # supersampling of the strokes and blobs: drawn at SS x SIZE, box-filtered down (antialiasing)
VERSION = "v1"  # part of the cache folder name: change it whenever the rendering changes
VARIANTS = {"train": 4, "test": 3}  # images per source digit: 5,748 train and 1,080 test images
_SPLIT_ID = {"train": 0, "test": 1}  # seeds the two splits' Generators apart
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601 luminance of an RGB colour

# Centres of a 4x4 grid of cells, (4, 4) each, in units of the canvas side, centred: -3/8..3/8.
_GY, _GX = (np.mgrid[0:4, 0:4].astype(np.float32) - 1.5) / 4
# Glyph value 0..255 after bilinear upscaling -> coverage in [0, 1]: a ramp that sharpens the
# blurry edges of an 8x8 glyph blown up 2-3x.
_SHARPEN = np.clip((np.arange(256, dtype=np.float32) / 255 - 0.15) / 0.45, 0.0, 1.0)


def _coverage(glyph: np.ndarray, cx: float, cy: float, height: float, aspect: float, angle: float,
              size: int = SIZE) -> np.ndarray:
    """Coverage (size, size) in [0, 1] of a (10, 10) uint8 zero-padded 8x8 glyph drawn ``height`` px
    tall and ``height * aspect`` px wide, centred at (cx, cy) px and tilted by ``angle`` radians
    (``size``: the canvas side; the detection set draws on larger canvases than this module).

    PIL's affine transform maps each canvas pixel back into the glyph (bilinear, in C).
    """
    ku, kv = 8.0 / (height * aspect), 8.0 / height  # glyph px per canvas px
    cos, sin = np.cos(angle), np.sin(angle)
    # Canvas (x, y) px -> glyph (u, v) px; 5 = the glyph centre 4 + 1 of padding.
    affine = (cos * ku, sin * ku, 5 - ku * (cos * cx + sin * cy),
              -sin * kv, cos * kv, 5 + kv * (sin * cx - cos * cy))
    upscaled = Image.fromarray(glyph).transform((size, size), Image.AFFINE, affine, Image.BILINEAR)
    return _SHARPEN[np.asarray(upscaled)]


def _blend(image: np.ndarray, coverage: np.ndarray, colour: np.ndarray) -> None:
    """Alpha-blend ``colour`` (3,) into ``image`` (SIZE, SIZE, 3) float32 where ``coverage`` is set."""
    image += coverage[..., None] * (colour - image)


class _Draws:
    """One image's random numbers: U(0, 1) draws from its own Generator, handed out in order as
    plain floats (a numpy call per draw would cost more than the drawing it parameterises)."""

    def __init__(self, rng: np.random.Generator, count: int = 256) -> None:
        self.values, self.next = rng.random(count).tolist(), 0  # an image takes at most 207

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        self.next += 1
        return low + (high - low) * self.values[self.next - 1]

    def integer(self, low: int, high: int) -> int:
        """Uniform in ``low .. high - 1``."""
        return int(self.uniform(low, high))

    def array(self, low: float, high: float, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        self.next += count
        return low + (high - low) * np.array(self.values[self.next - count : self.next], np.float32).reshape(shape)


def _rgba(rgb: np.ndarray, alpha: float) -> tuple[int, int, int, int]:
    """A PIL fill from a colour (3,) in 0..255 and an opacity in [0, 1]."""
    return int(rgb[0]), int(rgb[1]), int(rgb[2]), round(255 * alpha)


def _render(d: _Draws, noise: np.ndarray, glyph: np.ndarray, others: np.ndarray) -> np.ndarray:
    """One (SIZE, SIZE, 3) uint8 image of ``glyph`` ((10, 10), see :func:`_coverage`); ``others``
    ((M, 10, 10), digits of the other classes, same split) supply the distractor fragments;
    ``noise`` is (SIZE, SIZE, 3) U(0, 1). Colours are in 0..255, positions and lengths in canvas px."""
    # Background: a linear gradient between two random dark colours (the digit is the light one)
    # at a random angle, plus low-frequency colour noise (std 10-40); given on a 4x4 grid and
    # upsampled bilinearly.
    c0, c1 = d.array(0, 128, (3,)), d.array(0, 128, (3,))
    theta, amplitude = d.uniform(0, 2 * np.pi), d.uniform(17, 70)
    ramp = _GX * np.float32(np.cos(theta)) + _GY * np.float32(np.sin(theta)) + 0.5  # (4, 4), 0..1
    grid = c0 + ramp[..., None] * (c1 - c0) + d.array(-amplitude, amplitude, (4, 4, 3))
    canvas = Image.fromarray(grid.clip(0, 255).astype(np.uint8)).resize((SS * SIZE,) * 2, Image.BILINEAR)
    draw = ImageDraw.Draw(canvas, "RGBA")  # RGBA fills blend into the RGB canvas
    # Clutter: 2-4 long thin strokes that cross the canvas, and 0-2 soft blobs (3 nested discs).
    for _ in range(d.integer(2, 5)):
        points = [SS * d.uniform(-4, SIZE + 4) for _ in range(2 * d.integer(2, 4))]  # x0, y0, x1, ...
        fill, width = _rgba(d.array(0, 255, (3,)), d.uniform(0.4, 0.9)), round(SS * d.uniform(0.7, 2.0))
        draw.line(points, fill, width=width, joint="curve")
    for _ in range(d.integer(0, 3)):
        bx, by, radius = SS * d.uniform(0, SIZE), SS * d.uniform(0, SIZE), SS * d.uniform(3, 8)
        fill = d.array(0, 255, (3,))
        for r in (radius, 0.7 * radius, 0.4 * radius):
            draw.ellipse((bx - r, by - r, bx + r, by + r), _rgba(fill, 0.2))
    # 1-2 distractors, fainter than the digit: a short digit-like stroke, or a piece of a digit of
    # another class (pieces are blended after the strokes, at the canvas resolution).
    pieces = []
    for _ in range(d.integer(1, 3)):
        alpha, fill = d.uniform(0.35, 0.7), d.array(0, 255, (3,))
        if d.uniform() < 0.5:
            points = [d.uniform(2, SIZE - 2), d.uniform(2, SIZE - 2)]
            for _ in range(d.integer(2, 5)):  # a random walk of 7 px steps at most
                points += [points[-2] + d.uniform(-7, 7), points[-1] + d.uniform(-7, 7)]
            width = round(SS * d.uniform(1.5, 3.0))
            draw.line([SS * p for p in points], _rgba(fill, alpha), width=width, joint="curve")
        else:
            top, left, h, w = d.integer(1, 5), d.integer(1, 5), d.integer(3, 6), d.integer(3, 6)  # glyph px
            window = (slice(top, top + h), slice(left, left + w))
            piece = np.zeros((10, 10), np.uint8)
            piece[window] = others[d.integer(0, len(others))][window]
            cover = _coverage(piece, d.uniform(4, SIZE - 4), d.uniform(4, SIZE - 4), d.uniform(9, 16), 1.0,
                              d.uniform(-0.5, 0.5))
            pieces.append((alpha * cover, fill))
    image = np.asarray(canvas.reduce(SS), np.float32)  # (SIZE, SIZE, 3), a writable copy
    for cover, fill in pieces:
        _blend(image, cover, fill)
    # The digit: 14-26 px tall, centred within 5 px of the canvas centre (so at most 2 px off it),
    # tilted by up to 0.3 rad.
    height, aspect = d.uniform(14, 26), d.uniform(0.8, 1.2)
    cover = _coverage(glyph, SIZE / 2 + d.uniform(-5, 5), SIZE / 2 + d.uniform(-5, 5), height, aspect,
                      d.uniform(-0.3, 0.3))
    # Its colour: the first of 16 random light candidates whose luminance differs from that of the
    # canvas under the digit by at least 70 (of 255), so that a human can still read it.
    under = float((image @ _LUMA * cover).sum() / (cover.sum() + 1e-6))
    candidates = d.array(128, 255, (16, 3))
    contrast = np.abs(candidates @ _LUMA - under)
    ok = np.flatnonzero(contrast >= 70)
    _blend(image, cover, candidates[ok[0] if len(ok) else contrast.argmax()])
    # Sensor noise: uniform, zero-mean, standard deviation 0-12.
    image += (noise - 0.5) * np.float32(d.uniform(0, 12) * 12**0.5)
    return np.rint(image.clip(0, 255)).astype(np.uint8)


def render_split(glyphs: np.ndarray, labels: np.ndarray, variants: int, seed: int,
                 split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N * variants, SIZE, SIZE, 3) uint8 and labels (N * variants,) from ``glyphs``
    ((N, 8, 8) uint8, 0..255, at least two classes) with ``labels`` (N,): image ``i`` shows glyph
    ``i // variants``. Only ``glyphs`` are drawn, distractor fragments included: pass one split's
    digits, and nothing of another split can appear.
    """
    source = np.repeat(np.arange(len(glyphs)), variants)
    padded = np.pad(glyphs, ((0, 0), (1, 1), (1, 1)))  # (N, 10, 10): samples off a glyph read 0
    other_classes = {k: padded[labels != k] for k in np.unique(labels)}
    images = np.empty((len(source), SIZE, SIZE, 3), np.uint8)
    for i, s in enumerate(source):
        rng = np.random.default_rng([seed, _SPLIT_ID[split], i])  # one stream per image: order-free
        draws = _Draws(rng)
        images[i] = _render(draws, rng.random((SIZE, SIZE, 3), np.float32), padded[s], other_classes[labels[s]])
    return images, labels[source]


def _png(image: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image, stored without compression: the sensor noise makes
    these images incompressible anyway, and PIL's default level spends time for nothing."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


def _generate(seed: int) -> datasets.DatasetDict:
    import datasets

    from common.data import digits_dataset

    source = digits_dataset()
    splits = {}
    for split, ds in source.items():
        glyphs = np.stack([np.asarray(image, np.uint8) for image in ds["image"]])  # (N, 8, 8)
        images, labels = render_split(glyphs, np.asarray(ds["label"]), VARIANTS[split], seed, split)
        pngs = [{"bytes": _png(x), "path": None} for x in images]  # what datasets.Image stores
        splits[split] = datasets.Dataset.from_dict({"image": pngs, "label": labels.tolist()}, features=ds.features)
    return datasets.DatasetDict(splits)


def digits_ssl_dataset(seed: int = 0) -> datasets.DatasetDict:
    """The ``digits_ssl`` set as a hub-style ``datasets.DatasetDict``: splits ``train`` (5,748)
    and ``test`` (1,080), columns ``image`` (RGB, 32x32) and ``label`` (``ClassLabel`` '0'..'9').
    ``seed`` changes the drawings, never which source digits go to which split.

    Cached in ``$CV_RECIPES_CACHE`` (default ``~/.cache/cv-recipes``) as ``digits_ssl-v1-seed<seed>``,
    written to a temporary folder and renamed: a concurrent process sees no cache or a complete
    one, and of two racing processes the first rename wins.
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
