"""Figures a recipe draws after an evaluation: a confusion matrix, and small result tables (CSV and
fixed-width text). The training curves and the figure helpers are :mod:`common.curves`; pictures of
detections are :mod:`common.detection.figures`.

Pure functions of host values; each figure is written as a PNG and returned as a PIL image (for the
trackers); matplotlib is imported inside the functions.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common.curves import new_figure, save_figure


def _numpy(x: Any) -> np.ndarray:
    """A tensor (any device) or array-like as a host numpy array."""
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


def confusion_counts(pred: Any, true: Any, num_classes: int) -> np.ndarray:
    """Counts [K, K] int64 of (true class, predicted class) pairs: rows true, columns predicted, from
    class indices ``pred`` and ``true`` [N] (tensors on any device, or arrays) in 0..K-1."""
    pred, true = _numpy(pred).reshape(-1).astype(np.int64), _numpy(true).reshape(-1).astype(np.int64)
    if pred.shape != true.shape:
        raise ValueError(f"pred has {pred.size} values and true {true.size}")
    for name, x in (("pred", pred), ("true", true)):
        if x.size and (x.min() < 0 or x.max() >= num_classes):
            raise ValueError(f"{name} has class indices outside 0..{num_classes - 1}: {x.min()}..{x.max()}")
    return np.bincount(true * num_classes + pred, minlength=num_classes**2).reshape(num_classes, num_classes)


def plot_confusion_matrix(
    matrix: Any, labels: Sequence[str], path: Path, title: str = "confusion matrix"
) -> Image.Image:
    """A confusion matrix as a PNG at ``path``. ``matrix``: counts [K, K], rows true class, columns
    predicted; ``labels``: the K names (a detector's last one is "background").

    Colours are fractions of each true class (row-normalised; a row without samples stays white).
    Up to 30 classes every cell with a count shows it and every class is named; beyond, no cell text,
    an index tick every few classes and a square-root colour scale, so that the faint off-diagonal
    confusions of 1000 classes still show; the image stays under 1,700 px a side."""
    from matplotlib.colors import PowerNorm

    counts = _numpy(matrix).astype(np.int64)
    k = counts.shape[0]
    if counts.shape != (k, k) or len(labels) != k:
        raise ValueError(f"matrix {counts.shape} and {len(labels)} labels do not match")
    totals = counts.sum(1, keepdims=True)
    fractions = counts / np.maximum(totals, 1)
    small = k <= 30
    longest = max((len(str(s)) for s in labels), default=1) if small else 4
    side = max(4.5, 0.42 * k + 1.5) if small else min(15.0, 9 + 0.01 * k)
    figure = new_figure(side + 1.2 + 0.07 * min(longest, 24), side + 0.07 * min(longest, 24))
    ax = figure.add_subplot()
    image = ax.imshow(
        fractions,
        cmap="Blues",
        norm=PowerNorm(1.0 if small else 0.5, vmin=0, vmax=1),
        interpolation="nearest" if small else "antialiased",
    )
    colorbar = figure.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    colorbar.set_label("fraction of the true class (row)", fontsize=9)
    accuracy = np.trace(counts) / max(counts.sum(), 1)
    ax.set_title(f"{title}\n{counts.sum():,} samples, {accuracy:.1%} on the diagonal", fontsize=11)
    ax.set_xlabel("predicted", fontsize=10)
    ax.set_ylabel("true", fontsize=10)
    if small:
        names = [s if len(s) <= 24 else s[:23] + "…" for s in map(str, labels)]
        ax.set_xticks(
            range(k),
            names,
            rotation=45 if k > 4 else 0,
            ha="right" if k > 4 else "center",
            rotation_mode="anchor",
            fontsize=9,
        )
        ax.set_yticks(range(k), names, fontsize=9)
        size = 9 if k <= 12 else 8
        for (i, j), n in np.ndenumerate(counts):
            if n:  # blank cells read faster than a sea of zeros
                ax.text(
                    j,
                    i,
                    f"{n}",
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="white" if fractions[i, j] > 0.55 else "black",
                )
    else:
        every = next(
            (e for e in (5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000) if k / e <= 20), k // 20
        )  # at most ~20 round-numbered ticks
        ticks = [t for t in range(0, k, every) if k - 1 - t >= every / 2] + [k - 1]
        names = [str(t) for t in ticks[:-1]] + [str(labels[-1]) if labels[-1] == "background" else str(k - 1)]
        ax.set_xticks(ticks, names, fontsize=9, rotation=90)
        ax.set_yticks(ticks, names, fontsize=9)
        ax.set_xlabel("predicted (class index)", fontsize=11)
        ax.set_ylabel("true (class index)", fontsize=11)
    return save_figure(figure, path)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def save_table_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """``rows`` as a CSV file with a header: the keys of all rows, in order of first appearance."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) <= 1 else f"{value:.4g}"  # fractions (AP, accuracy) aligned
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, width: int = 120) -> str:
    """``rows`` as a fixed-width text table within ``width`` characters: a header line, a rule, one line
    per row; numbers right-aligned (fractions to 3 decimals, other floats to 4 significant digits, NaN
    as "-"), text left-aligned. Too wide: the widest columns are shortened, with "…"."""
    columns = list(columns) if columns is not None else list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths, default=0) > 4:
        widths[widths.index(max(widths))] -= 1
    numeric = [all(isinstance(row.get(c), (int, float)) for row in rows if c in row) for c in columns]

    def line(values: Sequence[str]) -> str:
        fitted = [v if len(v) <= w else v[: w - 1] + "…" for v, w in zip(values, widths)]
        return "  ".join(v.rjust(w) if right else v.ljust(w) for v, w, right in zip(fitted, widths, numeric)).rstrip()

    return "\n".join([line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])


def per_class_line(what: str, rows: Sequence[Mapping[str, Any]], key: str, path: Path, lowest: int = 3) -> str:
    """One console line for a per-class table written to ``path`` (its rows: ``class`` and ``key``): where it is,
    how many classes, and the ``lowest`` classes by ``key``, so that 1,000 classes stay one line."""
    ranked = sorted((r for r in rows if not math.isnan(r[key])), key=lambda r: r[key])[:lowest]
    worst = ", ".join(f"{r['class']} {_cell(float(r[key]))}" for r in ranked)
    return f"{what}: {path} ({len(rows)} classes; lowest {key}: {worst or 'none'})"
