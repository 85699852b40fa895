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


def _listed(files: list[Path], limit: int = 3) -> str:
    """``a.json, b.json and 4 more``: the first ``limit`` of ``files``."""
    shown = ", ".join(map(str, files[:limit]))
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def _joined(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def no_known_form(path: Path, data: str) -> str:
    """'' when ``path`` (a folder in no form of :func:`detection_form`) may still be a saved dataset, tables of a hub
    repository or an image folder with metadata (datasets reads those); otherwise the one line to refuse it with:
    every form's evidence the folder holds (images, YOLO label files, .xml and .json annotations: how many and
    where), and what each form so evidenced still needs."""
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
    if not images and not (labels or xml or json):
        return f"{where}: found no images in it; expected {FORMS} (docs/data.md)"
    found = [f"{counted(len(images), 'image')}" + (f" ({_folders(images)})" if images else "")]
    needs = []
    if labels:
        found.append(f"{counted(len(labels), 'YOLO label file')} ({_folders(labels)})")
        if yaml:
            found.append(f"{_listed(yaml)}, no YOLO data yaml (path, train, val and names)")
            needs.append(
                "YOLO txt needs a data yaml at its top: name it with --data, or write data.yaml there "
                "(docs/data.md#yolo-txt)"
            )
        else:
            needs.append("YOLO txt needs a data.yaml naming the classes: write one (docs/data.md#yolo-txt)")
    if xml:
        found.append(f"{counted(len(xml), '.xml annotation')} ({_folders(xml)})")
        needs.append(
            "Pascal VOC needs Annotations/<id>.xml beside JPEGImages/<id>.jpg (or annotations/ beside images/) in one "
            "folder (docs/data.md#pascal-voc)"
        )
    if json:
        found.append(f"{counted(len(json), '.json file')} ({_listed(json) if len(json) <= 3 else _folders(json)})")
        needs.append(
            "COCO json needs annotations/instances_<split>.json or <split>/_annotations.coco.json "
            "(docs/data.md#coco-json)"
        )
    if not needs:
        return f"{where}: found {found[0]} and no annotations; a detector needs boxes: {FORMS} (docs/data.md)"
    return f"{where}: found {_joined(found)}; " + "; ".join(needs)
