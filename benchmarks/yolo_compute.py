"""Compute per image and training speed: the YOLO recipe's model against Ultralytics yolov8n, side by side.

For each side: GFLOPs per image at the input size (torch's FlopCounterMode, multiply-adds counted as 2, as
Ultralytics prints GFLOPs), parameters, and images/s of a training step of the network alone (forward, a sum
of the outputs as the loss, backward, AdamW) on one thread, batch ``--batch``, after ``--warmup`` steps. The
recipe's side is built from a config and flags as recipes/yolo.py builds it; yolov8n from its yaml in the
Python of a virtual environment with ``pip install ultralytics`` (``--ul_python``; never this project's
dependency), both at ``--classes`` classes. Both run in one process each, one after the other, on the same core.

    python benchmarks/yolo_compute.py --ul_python /tmp/ulvenv/bin/python \\
        --config configs/yolo/own_photos.yaml --classes 3

Output: one line per side and the ratios (ours / yolov8n).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]

# the measurement, run in either Python: a module named on its command line, its input size and batch
MEASURE = """
import json, sys, time, torch
from torch.utils.flop_counter import FlopCounterMode
torch.set_num_threads(1)
def measure(model, size, batch, steps, warmup):
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.rand(batch, 3, size, size)
    def loss_of(out):  # every tensor the model returns in training mode, however nested
        if isinstance(out, torch.Tensor):
            return out.float().mean()
        parts = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
        return sum((loss_of(o) for o in parts), torch.zeros(()))
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        loss_of(model(images)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {"gflops": counter.get_total_flops() / 1e9, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "images_per_s": batch * steps / seconds}
"""

ULTRALYTICS = (
    MEASURE
    + """
from ultralytics.nn.tasks import DetectionModel
size, batch, steps, warmup, classes = (int(a) for a in sys.argv[1:6])
model = DetectionModel("yolov8n.yaml", nc=classes, verbose=False)
for p in model.parameters():
    p.requires_grad_(True)
print(json.dumps(measure(model, size, batch, steps, warmup)))
"""
)


def ours(args: argparse.Namespace) -> dict[str, float]:
    """The recipe's model from the config and flags, measured in this process."""
    namespace: dict = {}
    exec(MEASURE, namespace)  # noqa: S102  the same measurement code on both sides
    import yolo
    from common.config import parse_config

    cfg = parse_config(yolo.Config, ["--config", args.config, *args.ours])
    anchors = None
    if cfg.head == "anchor":  # k-means needs data: the config's anchors or a fixed spread of 3 x A shapes
        import torch

        a = cfg.anchors_per_level
        anchors = torch.tensor(cfg.anchors or [[8.0 * 1.6**i, 8.0 * 1.6**i] for i in range(3 * a)])
    model = yolo.create_model(cfg, args.classes, anchors)
    return {**namespace["measure"](model, cfg.img_size, args.batch, args.steps, args.warmup), "size": cfg.img_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ul_python", default="/tmp/ulvenv/bin/python", help="a Python with ultralytics installed")
    parser.add_argument("--config", default=str(ROOT / "configs/yolo/own_photos.yaml"))
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("ours", nargs=argparse.REMAINDER, help="-- then more flags for recipes/yolo.py's Config")
    args = parser.parse_args()
    args.ours = [a for a in args.ours if a != "--"]
    torch_threads = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "YOLO_OFFLINE": "1"}
    mine = ours(args)
    command = [args.ul_python, "-c", ULTRALYTICS, str(mine["size"]), str(args.batch), str(args.steps)]
    command += [str(args.warmup), str(args.classes)]
    out = subprocess.run(command, capture_output=True, text=True, env=torch_threads)
    if out.returncode:
        raise SystemExit(f"ultralytics side failed: {out.stderr.strip().splitlines()[-1:]}")
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    for name, r in (("ours", mine), ("yolov8n", theirs)):
        speed = f"{r['images_per_s']:.1f} images/s (a training step of the network, 1 thread, batch {args.batch})"
        print(f"{name:8} {r['gflops']:.2f} GFLOPs/image at {mine['size']} px  {r['params_m']:.2f} M params  {speed}")
    print(f"ratio ours / yolov8n: compute {mine['gflops'] / theirs['gflops']:.2f}x, "
          f"speed {mine['images_per_s'] / theirs['images_per_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
