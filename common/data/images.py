"""Image files: decoding a dataset's image values, listing the images a ``--predict`` path names, and
telling the complete ones from the broken ones without decoding them.

Every image is read as viewers show it: a photo whose EXIF orientation tag says it is stored turned
(phones and cameras store the sensor's pixels and tag how to turn them) is decoded turned upright, and
its sizes are the displayed ones, as annotation tools and COCO's ``width`` / ``height`` give them. The
tag is read from the header, so a size costs no decoding.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import ExifTags, Image, ImageOps

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


def decode_image(value: dict[str, Any] | Image.Image, name: str, shorter: int = 0) -> Image.Image:
    """:func:`decode_sized` without the original size."""
    return decode_sized(value, name, shorter)[0]


def decode_sized(
    value: dict[str, Any] | Image.Image, name: str, shorter: int = 0
) -> tuple[Image.Image, tuple[int, int]]:
    """An RGB PIL image from a ``datasets.Image(decode=False)`` value, and the file's own ``(width,
    height)``; UserError naming the file.

    ``shorter`` > 0: a JPEG whose shorter side is larger is decoded reduced (1/2, 1/4 or 1/8, in the
    JPEG decoder, at a fraction of the cost), as far as its shorter side stays at least ``shorter``
    pixels: what a transform that needs that many pixels (:func:`needed_side`) then makes of it is the
    same picture, without the full decode of a camera-size photo."""
    if isinstance(value, Image.Image):
        return upright(value).convert("RGB"), upright_size(value)
    path = value.get("path") or name
    try:
        image, size = open_reduced(value, shorter)
        image.load()
        return upright(image).convert("RGB"), size
    except Exception as e:
        raise UserError(f"cannot read image '{path}': {type(e).__name__}: {e}") from None


def open_reduced(value: dict[str, Any], shorter: int = 0) -> tuple[Image.Image, tuple[int, int]]:
    """A ``datasets.Image(decode=False)`` value opened (its header read, nothing decoded) with the JPEG
    reduction of :func:`decode_sized` asked for, so that :func:`upright_size` of it is already the decoded
    size; and the file's own ``(width, height)`` as displayed (:func:`upright_size`). The image's pixels
    are as stored: :func:`upright` turns them once loaded. Errors are PIL's."""
    image = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])
    size = upright_size(image)
    if shorter and image.format == "JPEG" and min(size) > shorter:
        k = shorter / min(size)  # PIL picks the largest reduction that keeps at least this size
        image.draft(image.mode, (math.ceil(image.width * k), math.ceil(image.height * k)))
    return image, size


def orientation(image: Image.Image) -> int:
    """The EXIF orientation tag of an opened image, from its header: 1 (stored upright, or no tag) to 8;
    5-8 swap width and height. A PNG's tag counts only where its ``eXIf`` chunk comes before the pixel
    data (as PNG asks), since PIL would decode the whole image to look further."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    try:
        value = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # a malformed EXIF block: the pixels are still readable, as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def upright_size(image: Image.Image) -> tuple[int, int]:
    """``(width, height)`` of ``image`` as displayed (:func:`orientation`), without decoding it."""
    width, height = image.size
    return (height, width) if orientation(image) >= 5 else (width, height)


def upright(image: Image.Image) -> Image.Image:
    """``image`` turned as its EXIF orientation tag says (:func:`orientation`): a new image without the tag,
    so turning it again leaves it; ``image`` itself when it is stored upright."""
    return ImageOps.exif_transpose(image) if orientation(image) != 1 else image


def needed_side(size: int, scale: float = 1.0, ratio: Sequence[float] = (1.0, 1.0), crop_pct: float = 1.0) -> int:
    """The shorter side an image needs so that a transform still finds ``size`` pixels on each side of
    what it keeps: a random-resized crop (area fraction at least ``scale`` of the image, aspect ratio
    within ``ratio``: its sides are at least ``sqrt(scale * ratio)`` and ``sqrt(scale / ratio)`` of the
    shorter side) or a resize to ``size / crop_pct`` then a centre crop (``scale`` 1)."""
    aspect = min(math.sqrt(ratio[0]), 1 / math.sqrt(ratio[1]), 1.0)
    return math.ceil(size / (math.sqrt(scale) * aspect * crop_pct))


def unreadable(path: str | Path | io.BytesIO) -> str:
    """Why the image file ``path`` (or image bytes) cannot be used ('' when it can), without decoding it:
    it must open, its header must give a size, and its data must be complete (a JPEG ends with its
    end-of-image marker, allowing a little padding or trailing metadata; other formats pass PIL's
    ``verify``, which checks a PNG's chunk checksums)."""
    try:
        with Image.open(path) as image:
            image.verify()
            kind = image.format
        if kind == "JPEG":
            if isinstance(path, io.BytesIO):
                tail = path.getvalue()[-1024:]
            else:
                with open(path, "rb") as f:
                    f.seek(max(0, Path(path).stat().st_size - 1024))
                    tail = f.read()
            if b"\xff\xd9" not in tail:
                return "truncated JPEG: no end-of-image marker"
        return ""
    except Image.UnidentifiedImageError:
        empty = path.getbuffer().nbytes == 0 if isinstance(path, io.BytesIO) else Path(path).stat().st_size == 0
        return "empty file" if empty else "not an image PIL can identify"
    except Exception as e:  # PIL raises many kinds for a broken file; the name and message say which
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"[:120]


def readable_images(files: Sequence[Path], what: str = "images") -> tuple[list[Path], str]:
    """The ``files`` that are complete images (:func:`unreadable`), and one line naming the others (''
    when there are none); none readable is one :class:`UserError` naming them."""
    reasons = {f: unreadable(f) for f in files}
    good = [f for f, why in reasons.items() if not why]
    bad = [(f, why) for f, why in reasons.items() if why]
    listed = listing(bad, 5)
    if not good:
        raise UserError(f"none of the {len(files)} {what} can be read: {listed}")
    line = f"{len(bad)} of {len(files)} {what} cannot be read and are skipped: {listed}" if bad else ""
    return good, line


def listing(found: Sequence[tuple[Any, ...]], limit: int = 3) -> str:
    """``a.jpg (reason), b.png (reason), ... and N more``: the unreadable files ``found``, each a tuple that
    ends with its path and the reason (``(path, why)``, or ``(row, path, why)``), named without folders."""
    shown = ", ".join(f"{Path(entry[-2]).name} ({entry[-1]})" for entry in found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")
