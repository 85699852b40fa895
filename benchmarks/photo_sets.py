"""The three public photo sets of the YOLO race (benchmarks/ultralytics_time.py, benchmarks/RESULTS.md), laid out
as Pascal VOC folders with train and val lists, from clones of their GitHub repositories:

    git clone https://github.com/Shenggan/BCCD_Dataset        /data/src/BCCD_Dataset
    git clone https://github.com/experiencor/raccoon_dataset  /data/src/raccoon_dataset
    git clone https://github.com/experiencor/kangaroo         /data/src/kangaroo
    python benchmarks/photo_sets.py --sources /data/src --out /data/bench

writes /data/bench/{bccd,raccoon,kangaroo}/{JPEGImages,Annotations,ImageSets/Main/{train,val}.txt}. BCCD keeps its
own train and val lists; raccoon's and kangaroo's are made here: the stems sorted, ``random.Random(0).shuffle``,
the last 20 % (rounded) held out. What the repositories ship that a reader would trip on is mended, each change
printed: zero-area boxes (two in BCCD) are left out, bytes after a JPEG's end marker are stripped (the pixels are
unchanged) and a JPEG cut short gets its end marker, an XML's ``<filename>`` is made the image's name.
"""

from __future__ import annotations

import argparse
import random
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

# name -> (repository folder, its images, its annotations, its split lists or None)
SETS = {
    "bccd": ("BCCD_Dataset", "BCCD/JPEGImages", "BCCD/Annotations", "BCCD/ImageSets/Main"),
    "raccoon": ("raccoon_dataset", "images", "annotations", None),
    "kangaroo": ("kangaroo", "images", "annots", None),
}
END = b"\xff\xd9"  # a JPEG's end-of-image marker


def mended_jpeg(data: bytes) -> tuple[bytes, str]:
    """The JPEG's bytes ending at its end marker (what trails it stripped, or a missing one added), and what changed."""
    if data.endswith(END):
        return data, ""
    end = data.rfind(END)
    if end > 0 and not data[end + 2 :].strip(b"\x00"):
        return data[: end + 2], f"{len(data) - end - 2} bytes after the end marker stripped"
    return data + END, "cut short: its end marker added (the missing rows decode grey, as before)"


def lay_out(name: str, sources: Path, out: Path) -> None:
    repo, images, annotations, lists = SETS[name]
    root = sources / repo
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (folder / sub).mkdir(parents=True)
    stems = sorted(p.stem for p in (root / images).glob("*.jpg"))
    for stem in stems:
        data, change = mended_jpeg((root / images / f"{stem}.jpg").read_bytes())
        (folder / "JPEGImages" / f"{stem}.jpg").write_bytes(data)
        if change:
            print(f"{name}/{stem}.jpg: {change}")
        tree = ET.parse(root / annotations / f"{stem}.xml")
        xml = tree.getroot()
        if xml.findtext("filename") != f"{stem}.jpg" and xml.find("filename") is not None:
            print(f"{name}/{stem}.xml: <filename> {xml.findtext('filename')!r} made {stem}.jpg")
            xml.find("filename").text = f"{stem}.jpg"
        for obj in list(xml.iter("object")):
            box = [float(obj.find("bndbox").findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")]
            if box[2] <= box[0] or box[3] <= box[1]:
                print(f"{name}/{stem}.xml: zero-area {obj.findtext('name')} box {box} left out")
                xml.remove(obj)
        tree.write(folder / "Annotations" / f"{stem}.xml")
    if lists is not None:
        for split in ("train", "val"):
            shutil.copyfile(root / lists / f"{split}.txt", folder / "ImageSets/Main" / f"{split}.txt")
    else:
        shuffled = list(stems)
        random.Random(0).shuffle(shuffled)
        held_out = round(0.2 * len(shuffled))
        for split, chosen in (("train", shuffled[:-held_out]), ("val", shuffled[-held_out:])):
            (folder / "ImageSets/Main" / f"{split}.txt").write_text("".join(f"{s}\n" for s in sorted(chosen)))
    print(f"{name}: {len(stems)} photos in {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", required=True, help="the folder holding the three repositories' clones")
    parser.add_argument("--out", required=True, help="where bccd/, raccoon/ and kangaroo/ are written")
    parser.add_argument("--sets", nargs="+", default=sorted(SETS), choices=sorted(SETS))
    args = parser.parse_args()
    for name in args.sets:
        lay_out(name, Path(args.sources), Path(args.out))


if __name__ == "__main__":
    main()
