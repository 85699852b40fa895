"""The start's scan of every image (common/data/scan.py): seconds per 10,000 files, cold and cached.

Writes ``--files`` JPEGs of ``--size`` (default 500x375, ImageNet's typical size; a few of them broken)
into a temporary folder once, then times :func:`common.data.scan.scan_files` on them: cold (no cache) with 1
process and with ``--workers`` processes, then a second start (every answer from the cache, one
``stat`` per file). The cache lives in a temporary ``CV_RECIPES_CACHE`` for the run. Printed: seconds,
and seconds per 10,000 files.

    python benchmarks/scan.py [--files 10000] [--workers 2] [--size 500 375]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: common/


def write_photos(folder: Path, count: int, size: tuple[int, int]) -> list[str]:
    """``count`` JPEGs (smooth noise, so that they compress like photos), every 1,000th truncated."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    picture = Image.fromarray(base).resize(size, Image.BICUBIC)
    paths = []
    for i in range(count):
        path = folder / f"{i:06d}.jpg"
        picture.rotate(i % 360).save(path, quality=90)
        if i % 1000 == 999:
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        paths.append(str(path))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, nargs=2, default=[500, 375])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CV_RECIPES_CACHE"] = str(Path(tmp) / "cache")
        from common.data.scan import _cache_file, scan_files

        start = time.perf_counter()
        paths = write_photos(Path(tmp), args.files, tuple(args.size))
        took = time.perf_counter() - start
        print(f"{args.files:,} JPEGs of {args.size[0]}x{args.size[1]} written in {took:.1f} s")
        per = 10_000 / args.files
        sides = [("cold, 1 process", 0, True), (f"cold, {args.workers} processes", args.workers, True)]
        for label, workers, cold in sides + [("cached (second start)", args.workers, False)]:
            if cold:
                _cache_file(paths).unlink(missing_ok=True)
            start = time.perf_counter()
            bad, cached = scan_files(paths, workers)
            took = time.perf_counter() - start
            found = f"{len(bad)} unreadable, all from the cache: {cached}"
            print(f"{label:28} {took:7.2f} s  {took * per:7.2f} s per 10,000 files  ({found})")


if __name__ == "__main__":
    main()
