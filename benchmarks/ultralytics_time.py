"""Time to accuracy: recipes/yolo.py against Ultralytics YOLOv8n, side by side, from scratch, at equal wall time.

Both train on the same photos (a Pascal VOC folder with ImageSets, BCCD say: its ``train`` list) and are scored on
the same held-out ones (its ``val`` list), each on one core of its own (``taskset``, one thread), started together:

ours          ``recipes/yolo.py --config <config> --max_time <budget>``: the budget covers the whole process
              (start-up, data, evaluations, weights); its mAP@0.5 is its final evaluation's (pycocotools).
ultralytics   ``YOLO("yolov8n.yaml").train(time=<budget in hours>, ...)`` in its own Python (``--ul_python``,
              a virtual environment with ``pip install ultralytics``; never this project's dependency), on a YOLO-txt
              copy of the same photos and boxes written here; its budget covers its training loop only. Reported:
              its own mAP@0.5 (``model.val`` of its best.pt, after its clock stopped) and the same weights' detections
              (conf 0.001, at most 100 per image) scored by this project's evaluator on the same ground truth.

Each side's wall time is measured from its process's start to its end. Output: one table row per budget, and
``<out>/results.json`` with each side's curve: mAP@0.5 at each evaluation against the wall time since the start
(ours: its lines stamped as they arrive; Ultralytics: its ``results.csv`` epoch times, shifted so that its last
epoch ends when its best.pt was written). ``--plot PNG`` draws the curves of every ``--out`` folder given
(``--plot_only`` runs nothing). Ultralytics needs no network here (the yaml builds the model; ``amp`` is off on
a CPU).

    HF_HUB_OFFLINE=1 WANDB_MODE=offline python benchmarks/ultralytics_time.py --voc /data/BCCD \\
        --ul_python /tmp/ulvenv/bin/python --budgets 5m 10m 25m --out /tmp/ulbench
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Ultralytics' side: train within the budget, validate its best weights, write its detections for our scoring
UL_SCRIPT = """
import json, sys, time
from pathlib import Path
from ultralytics import YOLO
data, hours, out, imgsz, batch = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = YOLO("yolov8n.yaml")
model.train(data=data, time=hours, epochs=1000, imgsz=imgsz, batch=batch, workers=0, device="cpu", seed=0,
            project=str(out.parent), name=out.name, exist_ok=True, plots=False, amp=False, verbose=False)
trained = time.time()
best = YOLO(str(out / "weights" / "best.pt"))
metrics = best.val(data=data, imgsz=imgsz, batch=batch, device="cpu", workers=0, plots=False, verbose=False)
rows = []
for r in best.predict(source=str(Path(data).parent / "images" / "val"), imgsz=imgsz, conf=0.001, max_det=100,
                      device="cpu", verbose=False, stream=True):
    for (x1, y1, x2, y2), s, c in zip(r.boxes.xyxy.tolist(), r.boxes.conf.tolist(), r.boxes.cls.tolist()):
        rows.append({"file": Path(r.path).name, "box": [x1, y1, x2, y2], "score": s, "label": int(c)})
json.dump({"map_50": float(metrics.box.map50), "map": float(metrics.box.map), "trained_at": trained,
           "detections": rows}, open(out / "ours_scoring.json", "w"))
"""


def seconds(text: str) -> float:
    from common.budget import seconds_of

    return seconds_of(text)


def yolo_copy(voc: Path, folder: Path) -> tuple[Path, object]:
    """A YOLO-txt copy (images/{train,val}, labels/{train,val}, data.yaml) of the VOC folder's train and val lists,
    with the boxes as this project reads them (so both sides learn and are scored on the very same boxes)."""
    from common.detection.data import load_detection

    data = load_detection(str(voc), "train", "val", seed=0)
    for split, ds in (("train", data.train), ("val", data.eval)):
        (folder / "images" / split).mkdir(parents=True, exist_ok=True)
        (folder / "labels" / split).mkdir(parents=True, exist_ok=True)
        for row in ds:
            source = Path(row["image"]["path"])
            target = folder / "images" / split / source.name
            if not target.exists():
                target.symlink_to(source)
            w, h = row["width"], row["height"]
            lines = [
                f"{c} {(x + bw / 2) / w:.6f} {(y + bh / 2) / h:.6f} {bw / w:.6f} {bh / h:.6f}"
                for (x, y, bw, bh), c in zip(row["objects"]["bbox"], row["objects"]["category"])
            ]
            (folder / "labels" / split / source.with_suffix(".txt").name).write_text("\n".join(lines) + "\n")
    names = "\n".join(f"  {i}: {n}" for i, n in enumerate(data.classes))
    (folder / "data.yaml").write_text(f"path: {folder}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return folder / "data.yaml", data


def score(data: object, detections: list[dict]) -> dict[str, float]:
    """This project's COCO evaluation of detections given per file name (XYXY pixels, class index)."""
    import numpy as np

    from common.detection.coco_eval import CocoEvaluator

    ids = {Path(r["image"]["path"]).name: int(r["image_id"]) for r in data.eval}
    per_image: dict[int, list[dict]] = {i: [] for i in ids.values()}
    for d in detections:
        per_image[ids[d["file"]]].append(d)
    batch = [
        {
            "image_id": i,
            "boxes": np.array([d["box"] for d in rows], np.float32).reshape(-1, 4),
            "scores": np.array([d["score"] for d in rows], np.float32),
            "labels": np.array([d["label"] for d in rows], np.int64),
        }
        for i, rows in per_image.items()
    ]
    return CocoEvaluator(data.eval, data.classes).evaluate([batch])


def stamped(proc: subprocess.Popen, log, started: float) -> threading.Thread:
    """Copy ``proc``'s output to ``log``, each line behind the seconds since ``started`` at its arrival."""

    def copy() -> None:
        for line in proc.stdout:
            log.write(f"[{time.time() - started:8.1f}] {line}")
            log.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def our_curve(log: Path) -> list[tuple[float, float]]:
    """(seconds since the start, mAP@0.5) of each of our evaluations, from the stamped log."""
    found = re.findall(r"^\[\s*([\d.]+)\] step \d+: .*?eval/map_50 ([\d.]+)", log.read_text(), re.M)
    return [(float(t), float(m)) for t, m in found]


def their_curve(run: Path, trained_s: float) -> list[tuple[float, float]]:
    """(seconds since the start, mAP@0.5) of each Ultralytics epoch's validation: results.csv's training time,
    shifted so that the last epoch ends when its best.pt was written."""
    with open(run / "results.csv") as f:
        rows = [{k.strip(): v for k, v in row.items()} for row in csv.DictReader(f)]
    shift = trained_s - float(rows[-1]["time"])
    return [(float(r["time"]) + shift, float(r["metrics/mAP50(B)"])) for r in rows]


def plot(folders: list[Path], png: Path) -> None:
    """One panel per folder and budget: both sides' mAP@0.5 against wall minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f, b, r) for f in folders for b, r in json.loads((f / "results.json").read_text()).items()]
    cols, rows = min(len(panels), 3), math.ceil(len(panels) / 3)  # three panels a row: readable at page width
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (folder, budget, row) in zip(axes.flat, panels):
        sides = (("ours_curve", "YOLO recipe", "tab:blue"), ("ultralytics_curve", "yolov8n", "tab:orange"))
        for key, label, colour in sides:
            points = row.get(key, [])
            ax.plot([t / 60 for t, _ in points], [m for _, m in points], "o-", ms=3, label=label, color=colour)
        ax.set_title(f"{row.get('set', folder.name.rsplit('_', 1)[-1])}, {budget}")
        ax.set_xlabel("wall time (min)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("mAP@0.5 (held-out photos)")
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def last_eval(run: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval/map_50" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--voc", help="a Pascal VOC folder with ImageSets/Main/{train,val}.txt")
    parser.add_argument("--plot", help="draw the curves of --out and --also into this PNG")
    parser.add_argument("--also", nargs="*", default=[], help="more --out folders to draw beside it")
    parser.add_argument("--plot_only", action="store_true", help="only draw --plot from results already there")
    parser.add_argument("--ul_python", default="/tmp/ulvenv/bin/python", help="a Python with ultralytics installed")
    parser.add_argument("--budgets", nargs="+", default=["5m", "10m", "25m"])
    parser.add_argument("--config", default=str(ROOT / "configs/yolo/own_photos.yaml"))
    parser.add_argument("--imgsz", type=int, default=320, help="Ultralytics' input size (ours: the config's)")
    parser.add_argument("--batch", type=int, default=16, help="Ultralytics' batch (its default)")
    parser.add_argument("--cores", nargs=2, default=["0", "1"], help="the cores of ours and of Ultralytics")
    parser.add_argument("--out", default="/tmp/ulbench")
    parser.add_argument("ours", nargs=argparse.REMAINDER, help="-- then more flags for recipes/yolo.py")
    args = parser.parse_args()
    out = Path(args.out)
    if args.plot_only:
        return plot([out, *map(Path, args.also)], Path(args.plot))
    if not args.voc:
        parser.error("--voc is needed to run the race")
    data_yaml, data = yolo_copy(Path(args.voc), out / "yolo_txt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.setdefault("YOLO_CONFIG_DIR", str(out / "ultralytics_settings"))  # its settings file, not in $HOME
    unbuffered = {**env, "PYTHONUNBUFFERED": "1"}
    (out / "ul_train.py").write_text(UL_SCRIPT)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    extra = [a for a in args.ours if a != "--"]
    for budget in args.budgets:
        ours_dir, ul_dir = out / f"ours_{budget}", out / f"ultralytics_{budget}"
        ours_cmd = ["taskset", "-c", args.cores[0], sys.executable, str(ROOT / "recipes/yolo.py"), "--config",
                    args.config, "--data", args.voc, "--eval_split", "val", "--max_time", budget, "--num_workers",
                    "0", "--report_to", "none", "--output_dir", str(ours_dir), *extra]  # fmt: skip
        ul_cmd = ["taskset", "-c", args.cores[1], args.ul_python, str(out / "ul_train.py"), str(data_yaml),
                  str(seconds(budget) / 3600), str(ul_dir), str(args.imgsz), str(args.batch)]  # fmt: skip
        started = time.time()
        with open(out / f"ours_{budget}.log", "w") as a, open(out / f"ultralytics_{budget}.log", "w") as b:
            ours = subprocess.Popen(
                ours_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=unbuffered
            )
            copying = stamped(ours, a, started)
            ul = subprocess.Popen(ul_cmd, stdout=b, stderr=subprocess.STDOUT, env=env, cwd=out)
            ours.wait()
            ours_s = time.time() - started
            copying.join()
            ul.wait()
        if ours.returncode or ul.returncode:
            codes = f"ours exit {ours.returncode}, ultralytics exit {ul.returncode}"
            raise SystemExit(f"{budget}: {codes}: see {out}/*.log")
        theirs = json.loads((ul_dir / "ours_scoring.json").read_text())
        row = {
            "set": Path(args.voc).name,
            "budget_s": seconds(budget),
            "ours_wall_s": ours_s,
            "ours_map_50": last_eval(ours_dir)["eval/map_50"],
            "ultralytics_train_wall_s": theirs["trained_at"] - started,
            "ultralytics_own_map_50": theirs["map_50"],
            "ultralytics_map_50_our_scoring": score(data, theirs["detections"])["map_50"],
            "ours_curve": our_curve(out / f"ours_{budget}.log"),
            "ultralytics_curve": their_curve(ul_dir, theirs["trained_at"] - started),
        }
        results[budget] = row
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(
            f"{budget:>5}  ours {row['ours_map_50']:.3f} in {ours_s / 60:.1f} min  |  ultralytics "
            f"{row['ultralytics_own_map_50']:.3f} (its own), {row['ultralytics_map_50_our_scoring']:.3f} (ours) "
            f"in {row['ultralytics_train_wall_s'] / 60:.1f} min to its best.pt",
            flush=True,
        )

    if args.plot:
        plot([out, *map(Path, args.also)], Path(args.plot))


if __name__ == "__main__":
    main()
