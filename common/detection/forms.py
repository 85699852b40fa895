"""Which form a local detection dataset is in (:func:`detection_form`), and, for a folder in none, one line naming
what was looked for and what was found (:func:`no_known_form`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from common.console import counted
from common.data.images import IMAGE_SUFFIXES
from common.detection.voc import voc_roots
from common.detection.yolo_txt import find_yaml

FORMS = (
    "COCO json (annotations/instances_<split>.json, or Roboflow's <split>/_annotations.coco.json), "
    "YOLO txt (a data.yaml naming the classes, with images/ and labels/), "
    "Pascal VOC (Annotations/*.xml beside JPEGImages/, or annotations/ beside images/), "
    "or a saved or hub dataset with an 'objects' column"
)


def is_coco(path: Path) -> bool:
    """A COCO-json folder: ``annotations/instances_<split>.json``, or Roboflow's ``<split>/_annotations.coco.json``.
    An ``annotations/`` folder of other files (Pascal VOC's XMLs, LabelMe's json) is not one."""
    return path.is_dir() and (
        any((path / "annotations").glob("instances_*.json")) or any(path.glob("*/_annotations.coco.json"))
    )


def detection_form(path: Path) -> str:
    """``coco``, ``yolo`` (a data yaml, or a folder with one at its top), ``voc`` or '' (none of them)."""
    if is_coco(path):
        return "coco"
    if find_yaml(path) is not None:
        return "yolo"
    return "voc" if path.is_dir() and voc_roots(path) else ""


def _folders(files: list[Path], limit: int = 3) -> str:
    """``train/ (40), val/ (10)``: the top folders of ``files`` (relative paths) with their counts."""
    counts = Counter(f.parts[0] + "/" if len(f.parts) > 1 else "the top folder" for f in files)
    shown = ", ".join(f"{k} ({n})" for k, n in counts.most_common(limit))
    return shown + (f" and {len(counts) - limit} more folders" if len(counts) > limit else "")


def no_known_form(path: Path, data: str) -> str:
    """'' when ``path`` (a folder in no form of :func:`detection_form`) may still be a saved dataset, tables of a hub
    repository or an image folder with metadata (datasets reads those); otherwise the one line to refuse it with:
    what each form needs and what the folder holds instead."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    if any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return ""
    files = [
        p.relative_to(path)
        for p in sorted(path.rglob("*"))
        if p.is_file() and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts)
    ]
    if any(f.suffix in (".parquet", ".arrow") or f.name in ImageFolder.METADATA_FILENAMES for f in files):
        return ""
    images = [f for f in files if f.suffix.lower() in IMAGE_SUFFIXES]
    beside = {f.with_suffix("") for f in images}
    labels = [f for f in files if f.suffix == ".txt" and ("labels" in f.parts[:-1] or f.with_suffix("") in beside)]
    xml = [f for f in files if f.suffix.lower() == ".xml"]
    json = [f for f in files if f.suffix.lower() == ".json"]
    yaml = [f for f in files if f.suffix.lower() in (".yaml", ".yml")]
    where = f"'{data}' is in no detection form"
    if labels:
        found = (
            f"found {counted(len(images), 'image')} and {counted(len(labels), 'YOLO label file')} ({_folders(labels)})"
        )
        if yaml:
            return (
                f"{where}: {found} and {', '.join(map(str, yaml[:3]))}, no YOLO data yaml at its top "
                "(path, train, val and names): name it with --data, or write data.yaml there; docs/data.md#yolo-txt"
            )
        return f"{where}: {found} but no data.yaml: write one naming the classes (docs/data.md#yolo-txt)"
    if xml:
        return (
            f"{where}: found {counted(len(xml), '.xml annotation')} ({_folders(xml)}) and "
            f"{counted(len(images), 'image')} ({_folders(images)}); "
            "Pascal VOC needs Annotations/<id>.xml beside JPEGImages/<id>.jpg in one folder (docs/data.md#pascal-voc)"
        )
    if json:
        return (
            f"{where}: found {', '.join(map(str, json[:3]))} and {counted(len(images), 'image')}, but no "
            "annotations/instances_<split>.json nor <split>/_annotations.coco.json (docs/data.md#coco-json)"
        )
    if images:
        return (
            f"{where}: found {counted(len(images), 'image')} ({_folders(images)}) and no annotations; a detector needs "
            "boxes: "
            f"{FORMS} (docs/data.md)"
        )
    return f"{where}: found no images in it; expected {FORMS} (docs/data.md)"
