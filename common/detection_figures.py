"""Figures of a detector's evaluation: precision-recall curves per class, and every picture of one
evaluation pass at once (:func:`save_evaluation_figures`) from :class:`common.coco_eval.EvalDetails`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from common.figures import format_table, new_figure, plot_confusion_matrix, save_figure, save_table_csv

RECALL = np.linspace(0.0, 1.0, 101)  # COCOeval's recall thresholds (params.recThrs)
_LEGEND_CLASSES = 20  # more curves than this: thin grey lines, no legend (80 COCO names hide the plot)


def plot_pr_curves(precision: Any, classes: Sequence[str], ap50: Any, path: Path) -> Image.Image:
    """Precision-recall curves at IoU 0.5 as a PNG at ``path``: one per class with ground truth,
    labelled "class AP50" when there are at most 20 classes (thin grey lines without a legend
    otherwise), and their mean in bold, "all classes mAP@0.5 x.xxx".

    ``precision``: COCOeval's ``eval["precision"]`` [T=10 IoUs, R=101 recall points, K, A=4 areas,
    M=3 maxDets] (:attr:`common.coco_eval.EvalDetails.precision`), of which IoU 0.5, all areas and
    100 detections are drawn; or those curves already taken, [R, K]. -1 marks a class without ground
    truth: it is left out. ``ap50``: per-class AP@0.5 [K] (NaN without ground truth), or None to
    take it from ``precision``."""
    curves = np.asarray(precision, np.float64)
    curves = curves[0, :, :, 0, -1] if curves.ndim == 5 else curves  # [R, K]
    valid = (curves > -1).all(0)
    ap = np.where(valid, curves.mean(0), np.nan) if ap50 is None else np.asarray(ap50, np.float64).reshape(-1)
    shown = np.flatnonzero(valid)
    legend = len(shown) <= _LEGEND_CLASSES
    figure = new_figure(9.5 if legend else 7.0, 6.0)
    ax = figure.add_subplot()
    for k in shown:
        if legend:
            ax.plot(RECALL, curves[:, k], lw=1.2, label=f"{classes[k]} {ap[k]:.3f}")
        else:
            ax.plot(RECALL, curves[:, k], lw=0.6, color="grey", alpha=0.45)
    if len(shown):
        ax.plot(RECALL, curves[:, shown].mean(1), lw=3.0, color="#08306b",
                label=f"all classes mAP@0.5 {np.nanmean(ap[shown]):.3f}")
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="recall", ylabel="precision")
    missing = len(classes) - len(shown)
    ax.set_title(f"precision-recall at IoU 0.5, {len(shown)} classes"
                 + (" (grey: each class)" if not legend and len(shown) else "")
                 + (f"; {missing} without ground truth" if missing else ""), fontsize=11)
    ax.grid(alpha=0.3)
    if len(shown):
        ax.legend(fontsize=8 if len(shown) > 10 else 9, loc="upper left" if legend else "lower left",
                  bbox_to_anchor=(1.02, 1.0) if legend else None, frameon=False if legend else True)
    return save_figure(figure, path)


def save_evaluation_figures(details: Any, folder: Path, eval_split: Any = None, plot_images: int = 0,
                            score_threshold: float = 0.3, wandb_run: Any = None, step: int = 0) -> dict[str, Image.Image]:
    """Every picture of one detection evaluation under ``folder``, replacing the previous evaluation's
    (the trackers keep the history): ``pr_curves.png``, ``confusion_matrix.png`` (with the background
    row and column), ``per_class_ap.csv`` and, with ``eval_split`` (the normalised dataset that was
    evaluated) and ``plot_images`` > 0, ``detections.png``: its first ``plot_images`` images with ground
    truth and the predictions of this same pass (no second forward pass). ``details``:
    :class:`common.coco_eval.EvalDetails`. With ``wandb_run``, those images also go to W&B at ``step``
    with their boxes as interactive overlays. Returns the pictures by name for ``Run.log_plots``."""
    from common.coco_eval import CONFUSION_IOU, CONFUSION_SCORE

    folder = Path(folder)
    pictures = {
        "pr_curves": plot_pr_curves(details.precision, details.classes, details.ap50, folder / "pr_curves.png"),
        "confusion_matrix": plot_confusion_matrix(
            details.confusion, [*details.classes, "background"], folder / "confusion_matrix.png",
            f"detections (score \u2265 {CONFUSION_SCORE}, IoU \u2265 {CONFUSION_IOU}) against ground truth"),
    }
    save_table_csv(details.table(), folder / "per_class_ap.csv")
    if eval_split is not None and plot_images > 0:
        from common.plots import evaluation_samples, save_detections

        samples = evaluation_samples(eval_split, details.predictions, plot_images)
        pictures["detections"] = save_detections(*samples, details.classes, folder / "detections.png",
                                                 score_threshold, wandb_run=wandb_run, step=step)
    return pictures


def per_class_text(details: Any) -> str:
    """The per-class AP table (class, instances, AP@.5, AP@[.5:.95]) as fixed-width text, for the end
    of a run."""
    return "AP per class (last evaluation):\n" + format_table(details.table(), ["class", "instances", "ap50", "ap"])
