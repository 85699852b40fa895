"""Every shipped config in configs/ starts and trains: 2 optimizer steps and its evaluation, at the config's
own model and resolution on the CPU, on a small generated stand-in of the dataset it names (same schema:
the hub dataset's columns and class count, a COCO folder's layout and category ids; for the own_photos
configs a folder of camera-size JPEGs in the layout each names, one of them truncated). One config per
recipe also runs under bf16 autocast, and one with 2 gloo processes. (CPUs without native bf16 emulate
it far slower than fp32, so the bf16 runs are the small-resolution configs.)

The tier is marked ``configs`` and runs after the default suite: ``python -m pytest -m configs``.
What it changes in a config: the data (the stand-in), the batch size (2 per process), the step count, the
tracker and the workers; pretrained hub weights are switched off (no network) and a weights file the config
starts from (``init_weights``, ``init_backbone``) is replaced by a generated file of the same model (DETR's
``init_weights``: a checkpoint in the reference's format, tests/test_detr_reference.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image, ImageDraw

from conftest import ROOT, load_recipe, recipe_cmd, recipe_env

pytestmark = pytest.mark.configs

CONFIGS = sorted(p for p in (ROOT / "configs").glob("*/*.yaml") if p.parent.name != "accelerate")
MODES = {  # beyond fp32 in one process, per recipe: the config run under bf16 autocast, the one with 2 processes
    "bf16": {
        "classifier": "cifar10_resnet50",
        "dino": "digits_ssl",
        "yolo": "digits_det",
        "detr": "digits_det",
        "faster_rcnn": "digits_det",
    },
    "2proc": {
        "classifier": "cifar10_resnet50",
        "dino": "digits_ssl",
        "yolo": "digits_det",
        "detr": "digits_det",
        "faster_rcnn": "digits_det",
    },
}
DETECTORS = ("yolo", "detr", "faster_rcnn")  # one image per process and step: 800-1333 px on a CPU
COCO_CATEGORIES = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]  # COCO's 80 ids
OWN_PHOTOS = "/data/my_photos"  # what every configs/*/own_photos.yaml names: a user's folder of photos
# a phone's and a web page's photo sizes (w, h), landscape and portrait, 178 px to 12 MP
PHOTO_SIZES = [(178, 134), (255, 190), (640, 480), (480, 640), (1024, 576), (1200, 1200), (2000, 1500), (1500, 2000)]
PHOTO_SIZES += [(4032, 3024)]
PHOTO_CATEGORIES = [  # a user's own classes: ids as an annotation tool numbers them, none of them COCO's
    {"id": 3, "name": "raccoon", "supercategory": "animal"},
    {"id": 7, "name": "heron", "supercategory": "animal"},
    {"id": 12, "name": "otter", "supercategory": "animal"},
]


# ---------------------------------------------------------------------------------------------------
# Stand-in datasets: the schema of what each config names, a handful of images
# ---------------------------------------------------------------------------------------------------
def _picture(rng: np.random.Generator, width: int, height: int, boxes=()) -> Image.Image:
    """Noise with filled rectangles at ``boxes`` (COCO xywh), so that crops and boxes see structure."""
    image = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    for x, y, w, h in boxes or [(width // 4, height // 4, width // 2, height // 2)]:
        draw.rectangle([x, y, x + w, y + h], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return image


def _boxes(rng: np.random.Generator, width: int, height: int) -> list[list[float]]:
    out = []
    for _ in range(int(rng.integers(1, 4))):
        w, h = float(rng.integers(width // 8, width // 3)), float(rng.integers(height // 8, height // 3))
        out.append([float(rng.integers(0, width - w)), float(rng.integers(0, height - h)), w, h])
    return out


def _classification(
    folder: Path, image_column: str, classes: int, splits: dict[str, int], size: tuple[int, int]
) -> str:
    """A save_to_disk DatasetDict: ``image_column`` (Image) and ``label`` (ClassLabel of ``classes``)."""
    import datasets

    rng = np.random.default_rng(0)
    features = datasets.Features(
        {image_column: datasets.Image(), "label": datasets.ClassLabel(names=[f"class_{i}" for i in range(classes)])}
    )
    dd = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {
                    image_column: [_picture(rng, *size) for _ in range(n)],
                    "label": [i % min(classes, 4) for i in range(n)],
                },
                features=features,
            )
            for split, n in splits.items()
        }
    )
    dd.save_to_disk(str(folder))
    return str(folder)


def _diamond(box: list[float]) -> list[float]:
    """The polygon of the diamond inscribed in a COCO box [x, y, w, h]: x1, y1, x2, y2, ... in pixels."""
    x, y, w, h = box
    return [x + w / 2, y, x + w, y + h / 2, x + w / 2, y + h, x, y + h / 2]


def _coco_folder(folder: Path, splits: dict[str, int], size: tuple[int, int], category_ids: list[int]) -> str:
    """annotations/instances_<split>.json and <split>/ images, categories with the given (odd) ids."""
    rng = np.random.default_rng(0)
    (folder / "annotations").mkdir(parents=True)
    next_id = 1
    for split, n in splits.items():
        (folder / split).mkdir()
        images, annotations = [], []
        for k in range(n):
            image_id = 1000 + 7 * k  # not 0..N-1, as in real datasets
            boxes = _boxes(rng, *size)
            _picture(rng, *size, boxes).save(folder / split / f"{image_id:012d}.jpg")
            images.append({"id": image_id, "file_name": f"{image_id:012d}.jpg", "width": size[0], "height": size[1]})
            for box in boxes:
                annotations.append(
                    {
                        "id": next_id,
                        "image_id": image_id,
                        "bbox": box,
                        "area": box[2] * box[3] / 2,
                        "iscrowd": 0,
                        # COCO's instances json has each object's polygon: here the diamond in its box
                        "segmentation": [_diamond(box)],
                        "category_id": int(rng.choice(category_ids[:5])),
                    }
                )
                next_id += 1
        categories = [{"id": c, "name": f"thing_{c}"} for c in category_ids]
        (folder / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": categories})
        )
    return str(folder)


def _cppe5(folder: Path, size: tuple[int, int]) -> str:
    """cppe-5's schema: image_id, image, width, height, objects{id, area, bbox (COCO xywh px), category}."""
    import datasets

    rng = np.random.default_rng(0)
    names = ["Coverall", "Face_Shield", "Gloves", "Goggles", "Mask"]
    features = datasets.Features(
        {
            "image_id": datasets.Value("int64"),
            "image": datasets.Image(),
            "width": datasets.Value("int32"),
            "height": datasets.Value("int32"),
            "objects": {
                "id": datasets.Sequence(datasets.Value("int64")),
                "area": datasets.Sequence(datasets.Value("int64")),
                "bbox": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
                "category": datasets.Sequence(datasets.ClassLabel(names=names)),
            },
        }
    )
    out = {}
    for split, n in (("train", 4), ("test", 2)):
        rows = {"image_id": [], "image": [], "width": [], "height": [], "objects": []}
        for k in range(n):
            boxes = _boxes(rng, *size)
            rows["image_id"].append(k * 3 + (split == "test") * 100)
            rows["image"].append(_picture(rng, *size, boxes))
            rows["width"].append(size[0])
            rows["height"].append(size[1])
            rows["objects"].append(
                {
                    "id": list(range(len(boxes))),
                    "area": [int(b[2] * b[3]) for b in boxes],
                    "bbox": boxes,
                    "category": [int(c) for c in rng.integers(0, 5, len(boxes))],
                }
            )
        out[split] = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict(out).save_to_disk(str(folder))
    return str(folder)


def _photo(rng: np.random.Generator, width: int, height: int, boxes=()) -> Image.Image:
    """A camera-like picture: a smooth random background (a 6 x 8 grid of colours upsampled, as a JPEG of a
    real scene compresses) with a filled ellipse in each of ``boxes`` (COCO xywh, px)."""
    grid = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
    image = grid.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for x, y, w, h in boxes:
        draw.ellipse([x, y, x + w, y + h], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return image


def _photo_boxes(rng: np.random.Generator, width: int, height: int) -> list[list[float]]:
    """2-3 boxes of 10-45 % of each side, whole pixels, inside the picture."""
    out = []
    for _ in range(int(rng.integers(2, 4))):
        w, h = int(width * rng.uniform(0.1, 0.45)), int(height * rng.uniform(0.1, 0.45))
        out.append([float(rng.integers(0, width - w)), float(rng.integers(0, height - h)), float(w), float(h)])
    return out


def own_photos(folder: Path, recipe: str, count: int = len(PHOTO_SIZES)) -> str:
    """A user's folder of photos in the layout ``recipe``'s own_photos.yaml names: ``count`` training JPEGs of
    camera sizes and aspect ratios (PHOTO_SIZES, then random ones), a quarter as many for evaluation, and one
    truncated JPEG among the training photos (the run leaves it out and lists it in bad_images.txt).
    classifier: ``train/<class>/`` and ``validation/<class>/``; dino: the photos in the folder itself;
    detectors: ``annotations/instances_{train,val}.json`` (COCO, written here field by field, PHOTO_CATEGORIES'
    odd ids) with ``train/`` and ``val/``."""
    rng = np.random.default_rng(0)
    sizes = PHOTO_SIZES + [
        (int(s * r), int(s)) if rng.random() < 0.5 else (int(s), int(s * r))
        for s, r in zip(rng.integers(400, 1600, count), rng.choice([4 / 3, 3 / 2, 16 / 9, 1.0], count))
    ]
    splits = {"train": sizes[:count], "val": sizes[count : count + max(2, count // 4)]}
    names = [c["name"] for c in PHOTO_CATEGORIES]
    folder.mkdir(parents=True)
    coco: dict[str, dict] = {}
    for split, split_sizes in splits.items():
        images, annotations = [], []
        for k, (width, height) in enumerate(split_sizes + ([(1024, 768)] if split == "train" else [])):
            boxes = _photo_boxes(rng, width, height) if recipe in DETECTORS else []
            name = names[k % len(names)]
            if recipe == "classifier":
                path = folder / ("train" if split == "train" else "validation") / name / f"IMG_{k:04d}.jpg"
            elif recipe == "dino":  # a camera's names: a name holding "val", "test", ... is a split to datasets
                path = folder / f"IMG_{k + (0 if split == 'train' else 100):04d}.jpg"
            else:
                path = folder / split / f"IMG_{k:04d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            _photo(rng, width, height, boxes).save(path, quality=90)
            if k == len(split_sizes):  # the extra training photo: its second half lost, as an interrupted copy
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            image_id = 5000 + 11 * k
            images.append({"id": image_id, "file_name": path.name, "width": width, "height": height})
            for x, y, w, h in boxes:
                annotations.append(
                    {
                        "id": 900 + len(annotations),
                        "image_id": image_id,
                        "category_id": PHOTO_CATEGORIES[int(rng.integers(len(names)))]["id"],
                        "bbox": [x, y, w, h],
                        "area": w * h,
                        "iscrowd": 0,
                    }
                )
        coco[split] = {"images": images, "annotations": annotations, "categories": PHOTO_CATEGORIES}
    if recipe in DETECTORS:
        (folder / "annotations").mkdir()
        for split, content in coco.items():
            (folder / "annotations" / f"instances_{split}.json").write_text(json.dumps(content, indent=1))
    return str(folder)


def stand_in(data: str, root: Path, recipe: str = "") -> tuple[str, list[str]]:
    """(a local dataset of the same schema as ``data``, the split flags it needs). The built-in sets, whole,
    would make the tier about evaluation time: their stand-ins have their schema and image size."""
    if data == OWN_PHOTOS:
        return own_photos(root / "my_photos", recipe), []
    if data in ("digits", "digits_ssl", "digits_det_crops"):
        return _classification(root / data, "image", 10, {"train": 8, "validation": 4}, (32, 32)), []
    if data == "digits_det":  # enough boxes for DETR's backbone pre-training: 64 box crops per process
        return _coco_folder(root / data, {"train": 80, "val": 2}, (96, 96), list(range(10))), []
    if data == "shapes_seg":
        return _coco_folder(root / data, {"train": 16, "val": 2}, (96, 96), [1, 2, 3, 4]), []
    if data == "uoft-cs/cifar10":
        return _classification(root / "cifar10", "img", 10, {"train": 8, "test": 4}, (32, 32)), []
    if data == "ILSVRC/imagenet-1k":
        return _classification(root / "imagenet", "image", 1000, {"train": 8, "validation": 4}, (320, 256)), []
    if data.startswith("frgfm/imagenette"):
        return _classification(root / "imagenette", "image", 10, {"train": 8, "validation": 4}, (320, 426)), []
    if data == "cppe-5":
        return _cppe5(root / "cppe5", (640, 480)), []
    if data == "/data/coco":
        return _coco_folder(root / "coco", {"train2017": 4, "val2017": 2}, (640, 480), COCO_CATEGORIES), []
    if data == "/data/voc_coco":
        return _coco_folder(root / "voc", {"train": 4, "val": 2}, (500, 375), list(range(1, 21))), []
    raise AssertionError(f"no stand-in for data '{data}': add one to tests/test_shipped_configs.py")


def weights_stand_in(model: str, model_kwargs: dict, path: Path) -> str:
    """A safetensors file of timm ``model`` with a 10-class head: what a classifier run writes. A detector's
    ``out_indices`` (which levels its ``features_only`` backbone returns) is not the plain model's argument."""
    import safetensors.torch
    import timm

    kwargs = {k: v for k, v in model_kwargs.items() if k != "out_indices"}
    net = timm.create_model(model, num_classes=10, **kwargs)
    safetensors.torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return str(path)


def detr_stand_in(config: dict, path: Path) -> str:
    """A DETR checkpoint in the reference's format (facebookresearch/detr's names, a resnet50 body and a
    COCO head) with the config's transformer sizes, its values strided views of small storages (a few MB)."""
    from test_detr_reference import write_reference_checkpoint

    return write_reference_checkpoint(
        path,
        d=config["d_model"],
        ff=config["dim_feedforward"],
        enc=config["enc_layers"],
        dec=config["dec_layers"],
        queries=config["num_queries"],
    )


# ---------------------------------------------------------------------------------------------------
# The tier
# ---------------------------------------------------------------------------------------------------
def _overrides(recipe: str, config: dict, tmp_path: Path) -> list[str]:
    fields = load_recipe(recipe).Config.__dataclass_fields__
    data, split_flags = stand_in(config.get("data", fields["data"].default), tmp_path, recipe)
    batch = "1" if recipe in DETECTORS else "2"  # 2 for Mixup/CutMix pairs and DINO's BatchNorm1d head
    args = [
        "--data",
        data,
        *split_flags,
        "--max_steps",
        "2",
        "--batch_size",
        batch,
        "--num_workers",
        "0",
        "--report_to",
        "none",
        "--output_dir",
        str(tmp_path / "run"),
    ]
    for flag in ("pretrained", "pretrained_backbone"):  # hub weights need the network
        if flag in fields and config.get(flag):
            args += [f"--{flag}", "false"]
    if "eval_batch_size" in fields:
        args += ["--eval_batch_size", "2"]
    for flag in ("init_weights", "init_backbone"):
        if config.get(flag) and recipe == "detr" and flag == "init_weights":  # the reference's COCO-trained DETR
            args += [f"--{flag}", detr_stand_in(config, tmp_path / "detr.pth")]
        elif config.get(flag):
            model = config.get("model", fields["model"].default)
            kwargs = config.get("model_kwargs", fields["model_kwargs"].default_factory())
            args += [f"--{flag}", weights_stand_in(model, kwargs, tmp_path / "init.safetensors")]
    return args


def _run(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, float]:
    """Run ``cmd`` with output to ``log``; returns (exit status, peak resident memory in MiB of the process tree's
    largest process, from the kernel's rusage of the waited child)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            proc.returncode = 0  # reaped by wait4
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024


CASES = [(p, "fp32") for p in CONFIGS] + [
    (p, mode) for mode, chosen in MODES.items() for p in CONFIGS if chosen.get(p.parent.name) == p.stem
]


@pytest.mark.parametrize("path,mode", CASES, ids=[f"{p.parent.name}/{p.stem}-{m}" for p, m in CASES])
def test_config_trains_two_steps(path: Path, mode: str, tmp_path: Path):
    recipe, nproc = path.parent.name, 2 if mode == "2proc" else 1
    config = yaml.safe_load(path.read_text()) or {}
    args = [
        "--config",
        str(path),
        *_overrides(recipe, config, tmp_path),
        "--mixed_precision",
        "bf16" if mode == "bf16" else "no",
    ]
    status, peak_mib = _run(recipe_cmd(recipe, args, nproc), recipe_env(nproc), tmp_path / "log.txt")
    log = (tmp_path / "log.txt").read_text()
    assert status == 0, f"{path.name} exit {status}:\n{log[-5000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 2, records[-1]
    evaluated = [k for r in records for k in r if k.startswith(("eval", "knn"))]
    if recipe == "dino" and config.get("data") == OWN_PHOTOS:  # unlabelled photos: nothing to classify, and said
        assert "no kNN evaluation" in log and not evaluated, log[-3000:]
    else:
        assert evaluated, f"{path.name}: no evaluation metrics in {sorted({k for r in records for k in r})}"
    if config.get("data") == OWN_PHOTOS:  # every readable photo trains; the truncated one is left out and listed
        listed = (tmp_path / "run" / "bad_images.txt").read_text()
        truncated = f"IMG_{len(PHOTO_SIZES):04d}.jpg"  # the training photo after the readable ones
        assert truncated in listed and "warning:" in log and "bad_images.txt" in log, log[-3000:]
        photos = len(PHOTO_SIZES) + 2 * (recipe == "dino")  # DINO trains on the whole folder, the 2 others too
        assert re.search(rf"\b{photos} training images", log), log[:3000]
    report = os.environ.get("CONFIG_TIER_REPORT")  # peak memory per config, for docs/testing.md
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"config": f"{recipe}/{path.stem}", "mode": mode, "peak_mib": round(peak_mib)}) + "\n")
