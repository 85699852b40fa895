"""``digits``: scikit-learn's bundled handwritten digits, and the drawing of their 8x8 glyphs that the
two rendered built-in sets (``digits_ssl``, ``digits_det``) share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import datasets

# Glyph value 0..255 after bilinear upscaling -> coverage in [0, 1]: a ramp that sharpens the
# blurry edges of an 8x8 glyph blown up 2-3x.
_SHARPEN = np.clip((np.arange(256, dtype=np.float32) / 255 - 0.15) / 0.45, 0.0, 1.0)


def digits_dataset() -> datasets.DatasetDict:
    """scikit-learn's bundled 1,797 handwritten digits (8x8 grey) as a hub-style ``DatasetDict``.

    Columns ``image`` (``datasets.Image``) and ``label`` (``ClassLabel`` '0'..'9'), as the hub's
    MNIST; a fixed, stratified, seeded split: 1,437 ``train`` and 360 ``test`` images.
    """
    import datasets
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    order = np.arange(len(pixels))
    train_idx, test_idx = train_test_split(order, test_size=0.2, random_state=0, stratify=digits.target)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )

    def split(idx: np.ndarray):
        return datasets.Dataset.from_dict(
            {"image": [Image.fromarray(pixels[i], mode="L") for i in idx], "label": digits.target[idx].tolist()},
            features=features,
        )

    return datasets.DatasetDict({"train": split(train_idx), "test": split(test_idx)})


def coverage(
    glyph: np.ndarray, cx: float, cy: float, height: float, aspect: float, angle: float, size: int
) -> np.ndarray:
    """Coverage (size, size) in [0, 1] of a (10, 10) uint8 zero-padded 8x8 glyph drawn ``height`` px
    tall and ``height * aspect`` px wide, centred at (cx, cy) px and tilted by ``angle`` radians on a
    square canvas (or patch) of side ``size`` px.

    PIL's affine transform maps each canvas pixel back into the glyph (bilinear, in C).
    """
    ku, kv = 8.0 / (height * aspect), 8.0 / height  # glyph px per canvas px
    cos, sin = np.cos(angle), np.sin(angle)
    # Canvas (x, y) px -> glyph (u, v) px; 5 = the glyph centre 4 + 1 of padding.
    affine = (cos * ku, sin * ku, 5 - ku * (cos * cx + sin * cy), -sin * kv, cos * kv, 5 + kv * (sin * cx - cos * cy))
    upscaled = Image.fromarray(glyph).transform((size, size), Image.AFFINE, affine, Image.BILINEAR)
    return _SHARPEN[np.asarray(upscaled)]


def blend(image: np.ndarray, cover: np.ndarray, colour: np.ndarray) -> None:
    """Alpha-blend ``colour`` (3,) into ``image`` (H, W, 3) float32, in place, by ``cover`` (H, W)."""
    image += cover[..., None] * (colour - image)
