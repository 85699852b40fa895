"""A Pascal VOC folder's files, found and read as the VOC devkit reads them (``VOCdevkit/VOCcode/VOCreadxml.m``):
the roots a folder is or holds (:func:`voc_roots`, :func:`is_root`), each root's split lists (:func:`split_lists`)
and one annotation XML (:func:`parse_xml`). What they become, the normalised schema of
:mod:`common.detection.sources`, and the rules for roots, splits, boxes and masks: :mod:`common.detection.voc`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The folder names of a VOC root's annotations and images, in any case; the first that is there is taken.
ANNOTATIONS, IMAGES = ("annotations",), ("jpegimages", "images")


def sub_folder(path: Path, names: tuple[str, ...]) -> Path | None:
    """The folder in ``path`` named one of ``names`` in any case (the first of ``names`` found; of two spellings of
    one name, the first in sorted order: ``Annotations`` before ``annotations``), or None."""
    try:
        found: dict[str, Path] = {}
        for child in sorted(path.iterdir()):
            if child.name.lower() in names and child.is_dir():
                found.setdefault(child.name.lower(), child)
    except OSError:  # not a folder, or one that cannot be listed
        return None
    return next((found[name] for name in names if name in found), None)


def xml_files(folder: Path) -> list[Path]:
    """The ``.xml`` files (the suffix in any case) directly in ``folder``, sorted."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == ".xml" and p.is_file())


def is_root(path: Path) -> bool:
    """Whether ``path`` is a VOC root: an annotations folder with an XML beside an images folder (:data:`ANNOTATIONS`,
    :data:`IMAGES`)."""
    annotations = sub_folder(path, ANNOTATIONS)
    if annotations is None or sub_folder(path, IMAGES) is None:
        return False
    return any(p.suffix.lower() == ".xml" for p in annotations.iterdir())


def voc_roots(path: Path) -> dict[str, Path]:
    """The VOC roots ``path`` is or holds (itself; else its sub-folders, or theirs), by name ('' for ``path`` itself,
    else the folder's name); empty when none."""
    if is_root(path):
        return {"": path}
    for pattern in ("*", "*/*"):
        found = sorted(p for p in path.glob(pattern) if p.is_dir() and is_root(p))
        if found:
            names = [p.name for p in found]
            if len(set(names)) < len(names):
                return {str(p.relative_to(path)): p for p in found}
            return dict(zip(names, found))
    return {}


def _image_lists(folder: Path | None) -> dict[str, list[str]]:
    """List name -> image ids of the ``<split>.txt`` files in ``folder`` (the first word of each line; a class's
    ``<class>_<split>.txt`` left out); empty for None."""
    files = sorted(folder.glob("*.txt")) if folder else []
    stems = {f.stem for f in files}
    lists = {}
    for f in files:
        head, _, tail = f.stem.rpartition("_")
        if head and tail in stems:
            continue
        lists[f.stem] = [line.split()[0] for line in f.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return lists


#: The name that the lists of ``ImageSets/Segmentation/`` (the images with segmentation PNGs) carry before theirs.
SEGMENTATION = "Segmentation/"


def split_lists(root: Path) -> dict[str, list[str]]:
    """Split name -> image ids, from ``ImageSets/Main/<split>.txt`` (the folder names in any case; a class's
    ``<class>_<split>.txt`` left out); without them every annotation is the ``train`` split. The lists of
    ``ImageSets/Segmentation/`` (VOC2012's 1,464 ``train`` and 1,449 ``val`` images with object masks) are the
    splits ``Segmentation/<split>``."""
    sets = sub_folder(root, ("imagesets",))
    lists = _image_lists(sub_folder(sets, ("main",)) if sets else None)
    if not lists:
        annotations = sub_folder(root, ANNOTATIONS)
        lists = {"train": [p.stem for p in xml_files(annotations)] if annotations else []}
    segmentation = _image_lists(sub_folder(sets, ("segmentation",)) if sets else None)
    return lists | {f"{SEGMENTATION}{name}": ids for name, ids in segmentation.items()}


def parse_xml(xml: Path) -> tuple[dict[str, Any], str]:
    """One annotation: ``filename``, ``size`` (width, height; 0 where not given) and ``objects`` (name, difficult,
    xmin, ymin, xmax, ymax as written); or why it cannot be used."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except FileNotFoundError:
        return {}, f"no annotation {xml.parent.name}/{xml.name}"
    except (OSError, ET.ParseError) as e:
        return {}, f"{xml.name}: {type(e).__name__}: {e}"
    objects = []
    for n, obj in enumerate(root.findall("object"), 1):
        name, box = (obj.findtext("name") or "").strip(), obj.find("bndbox")
        if not name or box is None:
            return {}, f"{xml.name}: object {n} has no <name> or no <bndbox>"
        try:
            xmin, ymin, xmax, ymax = (float(box.findtext(k) or "") for k in ("xmin", "ymin", "xmax", "ymax"))
            difficult = int(float(obj.findtext("difficult") or 0))
        except ValueError:
            return {}, f"{xml.name}: object {n} ({name}) has a <bndbox> or <difficult> that is not numbers"
        if xmax < xmin or ymax < ymin:
            return {}, f"{xml.name}: object {n} ({name}) has xmax < xmin or ymax < ymin"
        objects.append((name, difficult, xmin, ymin, xmax, ymax))
    try:
        size = (int(float(root.findtext("size/width") or 0)), int(float(root.findtext("size/height") or 0)))
    except ValueError:
        size = (0, 0)
    return {"filename": (root.findtext("filename") or "").strip(), "size": size, "objects": objects}, ""
