"""Inference speed of each recipe's demo model: eager PyTorch against its ONNX export run by ONNX Runtime,
side by side in one process, on the CPU (default) at batch 1 and 8.

For each recipe the default config's model (random weights: the speed does not depend on them) is
exported with the recipe's own ``export_files`` (recipes/<recipe>_inference.py: what ``--export`` writes)
and both sides run the same input: what the exported graph takes (classifier and DINO: normalised images
at the demo size; YOLO: letterboxed images; DETR: images and padding mask; Faster R-CNN: one image per
call, so a batch of 8 is 8 calls for ONNX and one list of 8 for eager). The sides alternate in ABBA
order over ``--repeats`` repeats of ``--iters`` calls after ``--warmup`` calls; printed: the median
images/s of each side and the ratio ONNX Runtime / eager (above 1 = ONNX Runtime is faster). ABBA order
and rates: benchmarks/timing.py.

    HF_HUB_OFFLINE=1 python benchmarks/inference.py [--recipes classifier yolo] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import timing  # same folder; puts the repository root and recipes/ on sys.path
from common.artifacts.export import OnnxModel
from common.config import parse_config

RECIPES = ("classifier", "dino", "yolo", "detr", "faster_rcnn")
CLASSES = [str(i) for i in range(10)]
META = {"classes": CLASSES, "category_ids": list(range(10))}


def sides(name: str, folder: Path, batch: int) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(eager call, ONNX Runtime call, images per call) for recipe ``name`` at ``batch``; exports into ``folder``."""
    recipe = importlib.import_module(name)  # recipes/<name>.py: its Config and model
    shipping = importlib.import_module(f"{name}_inference")  # beside it: export_files, what --export writes
    cfg = parse_config(recipe.Config, ["--report_to", "none"])
    torch.manual_seed(0)
    if name == "classifier":
        model = recipe.create_model(cfg, len(CLASSES)).eval()
        shipping.export_files(model, cfg, CLASSES, folder, name)
        inputs, eager = (torch.randn(batch, 3, cfg.img_size, cfg.img_size),), model
    elif name == "dino":
        model = recipe.create_backbone(cfg).eval()
        shipping.export_files(model, cfg, folder, name)
        inputs, eager = (torch.randn(batch, 3, cfg.global_size, cfg.global_size),), model
    elif name == "yolo":  # YOLOv3's COCO anchors (pixels at 416), scaled to the demo's size, per level
        coco = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
        anchors = torch.tensor(coco, dtype=torch.float32) * cfg.img_size / 416
        per_level = anchors.reshape(3, 3, 2)[:, : cfg.anchors_per_level].reshape(-1, 2)
        from yolo_model import Exported

        model = recipe.create_model(cfg, len(CLASSES), per_level).eval()
        shipping.export_files(model, cfg, META, folder, name)
        inputs, eager = (torch.rand(batch, 3, cfg.img_size, cfg.img_size),), Exported(model).eval()
    elif name == "detr":
        from detr_model import Exported

        model = recipe.create_model(cfg, len(CLASSES)).eval()
        shipping.export_files(model, cfg, META, folder, name)
        side = cfg.scales[-1]
        inputs = (torch.randn(batch, 3, side, side), torch.zeros(batch, side, side, dtype=torch.bool))
        eager = Exported(model).eval()
    else:
        from faster_rcnn_model import create_model

        model = create_model(dataclasses.replace(cfg, pretrained=False), len(CLASSES)).eval()
        shipping.export_files(model, cfg, META, folder, name)
        images = [torch.rand(3, cfg.min_size[-1], cfg.min_size[-1]) for _ in range(batch)]
        onnx = OnnxModel(folder / "model.onnx")

        @torch.no_grad()
        def run_list():
            return model(images)

        return run_list, (lambda: [onnx(i) for i in images]), batch
    onnx = OnnxModel(folder / "model.onnx")

    def run_eager():
        with torch.no_grad():
            return eager(*inputs)

    return run_eager, (lambda: onnx(*inputs)), batch


def images_per_second(call: Callable[[], object], calls: int, images: int) -> Callable[[], float]:
    """One measurement: images/s over ``calls`` calls of ``call``, each on ``images`` images."""
    return lambda: timing.per_second(lambda _: call(), calls, images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch and ONNX Runtime intra-op threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import platform

    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(
        f"{cpu}, {torch.get_num_threads()} torch threads; Python {platform.python_version()}, "
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}"
    )
    print(f"{'recipe':12} {'batch':>5} {'eager img/s':>12} {'onnxruntime img/s':>18} {'ratio ort/eager':>16}")
    for name in args.recipes:
        for batch in args.batches:
            with tempfile.TemporaryDirectory() as tmp:
                eager, ort, count = sides(name, Path(tmp), batch)
                for call in (eager, ort):
                    images_per_second(call, args.warmup, count)()
                measures = {"eager": images_per_second(eager, args.iters, count)}
                measures["ort"] = images_per_second(ort, args.iters, count)
                rates = timing.alternate(measures, args.repeats)
            e, o = rates["eager"], rates["ort"]
            print(f"{name:12} {batch:>5} {e:>12.1f} {o:>18.1f} {o / e:>16.3f}", flush=True)


if __name__ == "__main__":
    main()
