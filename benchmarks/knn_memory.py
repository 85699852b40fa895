"""Peak memory of DINO's kNN evaluation as the bank grows: it must grow with images x feature size.

Each measurement runs in a fresh process: the kNN evaluation of recipes/dino.py (dino_knn.py: fp32
features of a ViT-Tiny at 224 px, the raw-pixel baseline at 32 px, the query-chunked top k) over a bank
of N generated 224 px labelled images and 100 queries, and reports how far the process's anonymous
resident memory rose above where it started (the memory-mapped dataset's file pages left out).
The same is measured for a whole-image pixel bank (N x 3 x 224 x 224 floats), which the raw-pixel
baseline at 32 px avoids. Printed side by side: the extra memory of 1,800 over 300 bank images.

    python benchmarks/knn_memory.py            # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> float:
    """A /proc/self/status memory field in MiB (Linux)."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class PeakAnonymous:
    """The largest anonymous resident memory (RssAnon, MiB) while the block runs, sampled every 5 ms.
    Anonymous: the memory-mapped dataset file's pages, which the kernel can drop, do not count."""

    def __enter__(self) -> PeakAnonymous:
        import threading

        self.start, self.peak, self._stop = _status("RssAnon"), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def make_images(folder: Path, count: int) -> None:
    """``count`` labelled 256 px noise images as a saved dataset (memory-mapped when read back)."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    table = datasets.Dataset.from_dict(
        {
            "image": [Image.fromarray(rng.integers(0, 255, (256, 256, 3), np.uint8)) for _ in range(count)],
            "label": [i % 10 for i in range(count)],
        },
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    table.save_to_disk(str(folder))


def measure(folder: str, bank_images: int, mode: str) -> float:
    """Peak growth of anonymous memory (MiB) during one evaluation; ``mode``: "knn" (the recipe's) or "full_pixels"."""
    sys.path.insert(0, str(ROOT))
    import datasets
    import timm
    import torch

    from common.data.classification import ClassificationDataset
    from common.loaders import eval_loader_for

    torch.manual_seed(0)
    table = datasets.load_from_disk(folder).cast_column("image", datasets.Image(decode=False))
    total = bank_images + 100
    sys.path.insert(0, str(ROOT / "recipes"))
    from dino_knn import eval_transform, extract, knn_accuracy, knn_predict  # the recipe's kNN: resize 256, crop 224

    tf = eval_transform(224, 256)
    bank = ClassificationDataset(table.select(range(bank_images)), "image", "label", tf)
    queries = ClassificationDataset(table.select(range(bank_images, total)), "image", "label", tf)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=0).eval()
    device = torch.device("cpu")
    with torch.no_grad(), PeakAnonymous() as memory:
        if mode == "knn":
            for backbone, size in ((None, 32), (model, 0)):  # raw pixels at 32 px, then the backbone
                bank_f, bank_y = extract(backbone, eval_loader_for(bank, 64, 0), device, size)
                test_f, test_y = extract(backbone, eval_loader_for(queries, 64, 0), device, size)
                knn_accuracy(*knn_predict(bank_f, bank_y, test_f, test_y, 200), [20], 0.07, 10)
        else:  # whole 224 px images flattened into the bank
            bank_px = torch.cat([x.flatten(1) for x, _ in eval_loader_for(bank, 64, 0)])
            test_px = torch.cat([x.flatten(1) for x, _ in eval_loader_for(queries, 64, 0)])
            (test_px @ bank_px.T).topk(20, dim=1)
    return memory.peak - memory.start


def main() -> None:
    import tempfile

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help only
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_images(Path(tmp) / "images", 1900)
        for mode in ("knn", "full_pixels"):
            for n in (300, 1800):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", str(Path(tmp) / "images"), str(n), mode],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[(mode, n)] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'evaluation':<34} {'300 bank':>10} {'1,800 bank':>11} {'extra for 1,500 images':>24}")
    for mode, label in (("knn", "recipe (fp32 features, 32 px pixels)"), ("full_pixels", "whole 224 px pixel bank")):
        a, b = results[(mode, 300)], results[(mode, 1800)]
        print(f"{label:<34} {a:>8.0f} MB {b:>9.0f} MB {b - a:>21.0f} MB")
    knn_extra = results[("knn", 1800)] - results[("knn", 300)]
    px_extra = results[("full_pixels", 1800)] - results[("full_pixels", 300)]
    print(f"ratio of the extra memory, whole pixels / recipe: {px_extra / max(knn_extra, 1.0):.1f}x")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        main()
