"""The label-efficiency study of docs/pretraining.md: does a DINO backbone pre-trained on the unlabelled
training images of `digits_det` pay off when only a fraction of the boxes are labelled?

For Faster R-CNN, YOLO and DETR (one backbone for all three: the half-width resnet10t), at each label
fraction (``--train_fraction``), held-out mAP@0.5 of

- ``scratch``: random weights, trained for the whole budget: ``F`` steps plus the DINO pre-training's
  time converted into this detector's steps (its seconds per step measured in the same conditions);
- ``dino``: ``--init_backbone`` from one DINO run (configs/dino/digits_det.yaml), then ``F`` steps;
- ``crops`` (DETR only): DETR's own pre-training on the labelled boxes' crops (the fraction's boxes
  only), then ``F`` steps: under the budget by the DINO time it does not spend;
- ``scratch_F`` (Faster R-CNN, YOLO): random weights, ``F`` steps, the pre-training not counted (how
  much of ``dino``'s result is the pre-trained weights rather than the budget);
- ``dino_long`` (Faster R-CNN, YOLO; not by default: ``--starts``): the DINO backbone trained for scratch's
  steps, the pre-training not counted (whether the pre-trained weights still help once scratch has the
  time, as when one pre-training serves many runs).

The budget is counted in one-thread CPU time: every process runs with one compute thread and one
loader worker, ``--jobs`` of them side by side (2 on a 2-core machine), so the DINO run, the
calibration of each detector's seconds per step and the runs share the same conditions. The
pre-training is counted in full in every run that uses it (it serves all nine detector runs).

A detector's schedule keeps its steps at every fraction: ``F`` (or the budget) optimizer steps, the
warmup's length in steps as at 100 %, one evaluation at the end. Runs land in ``--out`` (one folder
each, kept: a run whose ``study.json`` exists is not run again), the table in ``<out>/table.md`` and the
plot in ``--plot``.

    python benchmarks/pretraining.py [--out runs/pretraining_study] [--fractions 0.1 0.25 1]
        [--seeds 0] [--seed_fractions 0.1] [--detectors faster_rcnn yolo detr] [--jobs 2]
        [--plot docs/pretraining.png] [--report_only]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_IMAGES = 2000  # digits_det's training scenes
RESNET10T_HALF = "{channels: [32, 64, 128, 256], stem_width: 16"
# per detector: fine-tuning steps F, batch size, warmup epochs at 100 % (the recipe's default), and the
# arguments that give it the shared backbone (Faster R-CNN's and DETR's defaults are this resnet10t)
DETECTORS: dict[str, dict] = {
    "faster_rcnn": {"steps": 500, "batch": 8, "warmup": 0.5, "args": []},
    "yolo": {
        "steps": 500,
        "batch": 16,
        "warmup": 1.0,
        "args": ["--model", "resnet10t", "--model_kwargs", RESNET10T_HALF + ", out_indices: [1, 2, 3]}"],
    },
    "detr": {"steps": 750, "batch": 16, "warmup": 1.0, "args": []},
}
STARTS = {d: ["scratch", "dino", "scratch_F", "dino_long"] for d in ("faster_rcnn", "yolo")}
STARTS["detr"] = ["scratch", "dino", "crops"]
LABELS = {
    "scratch": "from scratch (whole budget)",
    "dino": "DINO backbone (pre-training counted)",
    "crops": "box-crop pre-training (DETR's own)",
    "scratch_F": "from scratch, fine-tuning steps only",
    "dino_long": "DINO backbone, scratch's steps (pre-training not counted)",
}
COLOURS = {"scratch": "tab:blue", "dino": "tab:orange", "crops": "tab:green", "scratch_F": "tab:gray"}
COLOURS["dino_long"] = "tab:red"
TITLES = {"faster_rcnn": "Faster R-CNN", "yolo": "YOLO", "detr": "DETR"}


def run_recipe(out: Path, name: str, recipe: str, args: list[str]) -> dict:
    """Runs ``recipes/<recipe>.py`` with one compute thread into ``out/name``; returns its study.json
    (wall seconds, the last evaluation's metrics, the steps' median seconds)."""
    folder = out / name
    done = folder / "study.json"
    if done.exists():
        return json.loads(done.read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *args]
    cmd += ["--output_dir", str(folder), "--report_to", "none", "--num_workers", "1", "--export", "false"]
    log = out / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}): see {log}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if any(k.startswith(("eval/", "knn/")) for k in r)]
    per_step = [r["train/s_per_step"] for r in rows if "train/s_per_step" in r][1:]  # the first holds start-up
    result = {
        "name": name,
        "wall_s": wall,
        "steps": max((r["step"] for r in rows), default=0),
        "s_per_step": statistics.median(per_step) if per_step else None,
        "final": evals[-1] if evals else {},
    }
    done.write_text(json.dumps(result, indent=1))
    print(f"{name}: {wall:.0f} s, {json.dumps({k: round(v, 4) for k, v in result['final'].items()})}", flush=True)
    return result


def detector_args(detector: str, fraction: float, steps: int, seed: int) -> list[str]:
    """The overrides of a detector run: the shared backbone, the fraction, ``steps`` optimizer steps with
    the warmup as long in steps as at 100 %, and one evaluation at the end."""
    spec = DETECTORS[detector]
    per_epoch = max(1, round(fraction * TRAIN_IMAGES)) // spec["batch"]  # the sampler drops the last partial batch
    epochs = math.ceil(steps / per_epoch)
    warmup = spec["warmup"] * (TRAIN_IMAGES // spec["batch"]) / per_epoch
    return [
        *spec["args"],
        *("--train_fraction", str(fraction), "--seed", str(seed), "--max_steps", str(steps)),
        *("--epochs", str(epochs), "--warmup_epochs", f"{warmup:.4f}", "--eval_every", str(epochs)),
        *("--log_every", "25", "--checkpoint_every", "100000", "--plot_images", "0"),
    ]


def budgets(out: Path, jobs: int) -> dict:
    """The DINO pre-training (its wall time is the budget's pre-training share) beside a short calibration
    of each detector (seconds per step), in the study's conditions; both kept in ``out/budget.json``."""
    path = out / "budget.json"
    if path.exists():
        return json.loads(path.read_text())
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        dino = pool.submit(run_recipe, out, "dino", "dino", ["--config", "configs/dino/digits_det.yaml"])
        calibration = {}
        for d in DETECTORS:  # 60 steps at 100 %, logged every 10 (the first interval's start-up left out)
            extra = ["--log_every", "10"] + (["--pretrain_crops_epochs", "0"] if d == "detr" else [])
            calibration[d] = pool.submit(run_recipe, out, f"calibrate_{d}", d, detector_args(d, 1.0, 60, 0) + extra)
        pre = dino.result()
        per_step = {d: c.result()["s_per_step"] for d, c in calibration.items()}
    budget = {
        "dino_wall_s": pre["wall_s"],
        "dino_knn": pre["final"],
        "s_per_step": per_step,
        "extra_steps": {d: round(pre["wall_s"] / s) for d, s in per_step.items()},
    }
    path.write_text(json.dumps(budget, indent=1))
    print(json.dumps(budget, indent=1), flush=True)
    return budget


def study_runs(
    out: Path,
    budget: dict,
    fractions: list[float],
    seeds: list[int],
    seed_fractions: list[float],
    detectors: list[str],
    starts: list[str],
) -> list:
    """(name, detector, start, fraction, seed, steps, args) for every run: every fraction at the first seed,
    ``seed_fractions`` at the others."""
    backbone = str(out / "dino" / "teacher_backbone.safetensors")
    runs = []
    for seed in seeds:
        for fraction in fractions if seed == seeds[0] else [f for f in fractions if f in seed_fractions]:
            for detector in detectors:
                spec = DETECTORS[detector]
                for start in [s for s in STARTS[detector] if s in starts]:
                    longer = start in ("scratch", "dino_long")
                    steps = spec["steps"] + (budget["extra_steps"][detector] if longer else 0)
                    args = detector_args(detector, fraction, steps, seed)
                    if start.startswith("dino"):
                        args += ["--init_backbone", backbone]
                    if detector == "detr" and start != "crops":
                        args += ["--pretrain_crops_epochs", "0"]
                    name = f"{detector}_{start}_f{fraction:g}_s{seed}"
                    runs.append((name, detector, start, fraction, seed, steps, args))
    return runs


def report(out: Path, results: list[dict], budget: dict, plot: Path) -> str:
    """The markdown table (mean and range over seeds) and the plot of mAP@0.5 against the fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault((r["detector"], r["start"], r["fraction"]), []).append(r)
    fractions = sorted({r["fraction"] for r in results})
    lines = [
        "| detector | start | steps | " + " | ".join(f"{f:.0%} labels" for f in fractions) + " |",
        "|---|---|---|" + "---|" * len(fractions),
    ]
    figure, axes = plt.subplots(1, len(DETECTORS), figsize=(5 * len(DETECTORS), 4.8), sharey=True)
    for ax, detector in zip(axes, DETECTORS):
        for start in STARTS[detector]:
            row, xs, ys, lows, highs = [], [], [], [], []
            steps = ""
            for f in fractions:
                runs = cells.get((detector, start, f), [])
                values = [r["map_50"] for r in runs]
                if not values:
                    row.append("")
                    continue
                steps = str(runs[0]["steps"])
                mean = statistics.mean(values)
                spread = f" ({min(values):.3f}-{max(values):.3f}, {len(values)} seeds)" if len(values) > 1 else ""
                row.append(f"{mean:.3f}{spread}")
                xs.append(f), ys.append(mean), lows.append(mean - min(values)), highs.append(max(values) - mean)
            if not xs:  # a start not run (dino_long unless asked for)
                continue
            lines.append(f"| {detector} | {LABELS[start]} | {steps} | " + " | ".join(row) + " |")
            style = "--" if start == "scratch_F" else "-"
            ax.errorbar(
                xs,
                ys,
                yerr=[lows, highs],
                marker="o",
                linestyle=style,
                capsize=3,
                color=COLOURS[start],
                label=LABELS[start],
            )
        ax.set_xscale("log")
        ax.set_xticks(fractions, [f"{f:.0%}" for f in fractions])
        ax.minorticks_off()
        scratch = DETECTORS[detector]["steps"] + budget["extra_steps"][detector]
        plan = f"{scratch:,} steps from scratch, {DETECTORS[detector]['steps']:,} after a pre-training"
        ax.set_title(f"{TITLES[detector]}\n{plan}", fontsize=10)
        ax.set_xlabel(f"training images with labels (of {TRAIN_IMAGES:,})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out mAP@0.5")
    axes[0].set_ylim(0, 1)
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    figure.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, frameon=False)
    minutes = budget["dino_wall_s"] / 60
    figure.suptitle(
        f"digits_det, half-width resnet10t; equal one-thread CPU budget (DINO pre-training: {minutes:.1f} min)"
    )
    figure.tight_layout(rect=(0, 0.13, 1, 0.95))
    plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(plot, dpi=120)
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pretraining_study")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 1.0, 0.25, 0.02])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seed_fractions", type=float, nargs="+", default=[0.1], help="fractions run at every seed")
    parser.add_argument("--detectors", nargs="+", default=list(DETECTORS), choices=list(DETECTORS))
    parser.add_argument("--starts", nargs="+", default=["scratch", "dino", "crops", "scratch_F"], choices=list(LABELS))
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one compute thread each")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "pretraining.png")
    parser.add_argument("--report_only", action="store_true", help="table and plot from the runs done so far")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    budget = budgets(args.out, args.jobs)
    runs = study_runs(args.out, budget, args.fractions, args.seeds, args.seed_fractions, args.detectors, args.starts)
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {}
        for name, detector, start, fraction, seed, steps, run_args in runs:
            if args.report_only and not (args.out / name / "study.json").exists():
                continue
            futures[pool.submit(run_recipe, args.out, name, detector, run_args)] = (
                detector,
                start,
                fraction,
                seed,
                steps,
            )
        for future, (detector, start, fraction, seed, steps) in futures.items():
            final = future.result()
            results.append(
                {
                    "detector": detector,
                    "start": start,
                    "fraction": fraction,
                    "seed": seed,
                    "steps": steps,
                    "wall_s": final["wall_s"],
                    "map_50": final["final"]["eval/map_50"],
                }
            )
            if len(results) % 3 == 0 or len(results) == len(futures):
                print(report(args.out, results, budget, args.plot), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
