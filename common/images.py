"""Image files: decoding a dataset's image values, and listing the images a ``--predict`` path names."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

from common import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")


def image_files(path: str | Path) -> list[Path]:
    """The images ``--predict`` names: one image file, or every image under a folder (recursively,
    sorted). Nothing to read is one :class:`UserError`."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise UserError(f"predict: '{path}' is not an image ({', '.join(IMAGE_SUFFIXES)})")
        return [path]
    if not path.is_dir():
        raise UserError(f"predict: '{path}' does not exist")
    found = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not found:
        raise UserError(f"predict: no images ({', '.join(IMAGE_SUFFIXES)}) under '{path}'")
    return found


def decode_image(value: dict[str, Any] | Image.Image, name: str) -> Image.Image:
    """An RGB PIL image from a ``datasets.Image(decode=False)`` value; UserError naming the file."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    path = value.get("path") or name
    try:
        image = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])
        image.load()
        return image.convert("RGB")
    except Exception as e:
        raise UserError(f"cannot read image '{path}': {type(e).__name__}: {e}") from None
