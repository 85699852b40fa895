"""A run's training curves: ``plots/curves.png`` drawn from ``metrics.jsonl`` after each evaluation
(:meth:`common.run.Run.log_plots`), and the figure helpers every picture in ``common/`` and the recipes use.

Pure functions of host values; a figure is written as a PNG and returned as a PIL image (for the trackers).
matplotlib is imported inside the functions, so that a run that does not plot never pays its import time,
and figures are drawn on their own Agg canvas, never through pyplot: no global backend is set and no figure
is left open in the caller's process.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

DPI = 100  # figure inches * DPI = PNG pixels

# Keys of metrics.jsonl that are bookkeeping, not training dynamics: best-so-far copies, the epoch
# counter, throughput and timing (images_per_s, data_wait, s_per_step, eta_s) and per-image data counts.
_SKIP = re.compile(
    r"^(best|best_step)/|(^|/)(epoch|step)$|per_s$|data_wait|data_time|s_per_step|(^|/)eta(_s)?$"
    r"|_per_image$|^time/|max_memory_gib$"
)
_LINES_PER_PANEL = 6  # more lines than this in one panel and its legend hides the curves


def new_figure(width: float, height: float) -> Any:
    """A ``matplotlib.figure.Figure`` of ``width`` x ``height`` inches (x ``DPI`` pixels) on its own Agg
    canvas, with constrained layout (labels never clipped)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, path: Path) -> Image.Image:
    """Render ``figure`` at its exact size (no tight bounding box: sizes stay predictable), write it as
    a PNG at ``path`` (parent folders created) and return it as an RGB PIL image."""
    figure.canvas.draw()
    image = Image.fromarray(np.asarray(figure.canvas.buffer_rgba())[..., :3].copy())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return image


# --------------------------------------------------------------------------------------------
# Training curves
# --------------------------------------------------------------------------------------------
class MetricsReader:
    """A run's ``metrics.jsonl`` read as it grows: each :meth:`read` parses only the complete lines added
    since the last one, so a long run's epoch-end curves do not re-read its whole history. A file that no
    longer starts with what was read (rewritten by a resume that dropped lines past its checkpoint, or
    replaced) is read again from its start."""

    def __init__(self, metrics_jsonl: Path) -> None:
        self.path = Path(metrics_jsonl)
        self.offset = 0  # bytes parsed: the end of the last complete line
        self._last = b""  # the last complete line read, with its newline: checks the file kept it
        self._series: dict[str, list[tuple[float, float]]] = {}

    def _unchanged(self, f: Any) -> bool:
        if not self.offset:
            return True
        f.seek(self.offset - len(self._last))
        return f.read(len(self._last)) == self._last

    def read(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Key -> (steps, values) float64 arrays, in file order (see :func:`read_metrics`)."""
        if not self.path.is_file():
            self.offset, self._last, self._series = 0, b"", {}
        else:
            with open(self.path, "rb") as f:
                if not self._unchanged(f):
                    self.offset, self._last, self._series = 0, b"", {}
                f.seek(self.offset)
                new = f.read()
            complete = new[: new.rfind(b"\n") + 1]  # a line still being written waits for the next read
            for line in complete.splitlines():
                self._parse(line)
            if complete:
                self.offset += len(complete)
                self._last = complete[complete.rfind(b"\n", 0, len(complete) - 1) + 1 :]
        return {k: (np.array([s for s, _ in v]), np.array([x for _, x in v])) for k, v in self._series.items()}

    def _parse(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._series.setdefault(key, []).append((float(step), float(value)))


def read_metrics(metrics_jsonl: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Key -> (steps, values) float64 arrays, in file order, from a run's ``metrics.jsonl`` (one JSON
    object per line with a ``step``). Non-numeric values are left out; NaN and inf are kept. A line
    that is not valid JSON (a run killed while writing) is skipped."""
    return MetricsReader(metrics_jsonl).read()


def _base(key: str) -> str:
    """``train/loss_ce_3`` -> ``train/loss_ce``: a term and its copies on auxiliary outputs (DETR's decoder
    layers) share a panel, and so a scale."""
    return re.sub(r"_\d+$", "", key)


def _panels(keys: Sequence[str]) -> list[tuple[str, list[str], bool]]:
    """(title, keys, evaluation?) per panel: losses (a shared panel when there are at most 4, else the
    total alone and a panel per term with its auxiliary copies), learning rates, evaluation metrics by
    prefix (their losses apart: another scale), then every other training value (grad_norm: own scale)."""
    keys = [k for k in keys if not _SKIP.search(k)]
    train = [k for k in keys if k.startswith("train/")]
    losses = sorted((k for k in train if k.split("/", 1)[1].startswith("loss")), key=lambda k: (k != "train/loss", k))
    rates = sorted(k for k in train if re.fullmatch(r"train/lr(_.*)?", k))
    panels: list[tuple[str, list[str], bool]] = []

    def add(title: str, group: list[str], evaluation: bool) -> None:
        size = -(-len(group) // -(-len(group) // _LINES_PER_PANEL)) if group else 1  # 8 lines: 4 + 4, not 6 + 2
        for start in range(0, len(group), size):
            panels.append((title if len(group) > 1 else group[0], group[start : start + size], evaluation))

    def by_base(group: list[str]) -> None:
        for base in dict.fromkeys(map(_base, group)):
            add(base, [k for k in group if _base(k) == base], False)

    if len(losses) <= 4:
        add("training loss", losses, False)
    else:
        by_base(losses)
    add("learning rate", rates, False)
    others = [k for k in keys if not k.startswith("train/")]
    for prefix in dict.fromkeys(k.split("/", 1)[0] if "/" in k else "" for k in others):
        group = [k for k in others if (k.split("/", 1)[0] if "/" in k else "") == prefix]
        add(f"{prefix or 'other'} metrics", [k for k in group if "loss" not in k], True)
        add(f"{prefix or 'other'} loss", [k for k in group if "loss" in k], True)
    by_base([k for k in train if k not in losses and k not in rates])
    return panels


def _smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing); NaNs are skipped, not spread."""
    out, mean, total = np.full_like(values, np.nan), 0.0, 0.0
    for i, v in enumerate(values):
        if math.isfinite(v):
            mean, total = weight * mean + (1 - weight) * v, weight * total + (1 - weight)
            out[i] = mean / total
    return out


def _x(series: Mapping[str, tuple[np.ndarray, np.ndarray]], key: str) -> tuple[np.ndarray, str]:
    """The x values of ``key``: its steps, or, when a phase logs every value at one step (DETR's
    backbone pretraining, all at step 0) and has its own ``<prefix>/epoch``, that epoch."""
    steps = series[key][0]
    epoch = series.get(key.split("/", 1)[0] + "/epoch", (None, None))[1]
    if "/" in key and len(steps) > 1 and np.all(steps == steps[0]) and epoch is not None and len(epoch) == len(steps):
        return epoch, f"{key.split('/', 1)[0]} epoch"
    return steps, "step"


def plot_curves(metrics_jsonl: Path | MetricsReader, path: Path) -> Image.Image | None:
    """Training curves of a run, as one PNG at ``path``: training losses (every ``train/loss*``),
    learning rate, each evaluation metric (``eval/*``, ``eval_ema/*``, ``knn/*``) against the step with
    markers (evaluations are sparse), and any other training value (``train/grad_norm``).

    Bookkeeping keys (``best/*``, ``epoch``, throughput, timing, ``eta``) are left out. Long noisy
    curves get a smoothed line over the raw one; a y axis spanning more than a decade of positive
    values is logarithmic; non-finite values leave a gap and a dotted red line at their step; a
    series that is -1 throughout (COCO's "no ground truth of this size") is left out. Returns None
    when there is nothing to plot. ``metrics_jsonl``: the file, or a :class:`MetricsReader` kept between calls
    (:meth:`common.run.Run.log_plots`), which reads only the lines added since its last call."""
    from matplotlib.ticker import FuncFormatter

    reader = metrics_jsonl if isinstance(metrics_jsonl, MetricsReader) else MetricsReader(metrics_jsonl)
    series = {k: v for k, v in reader.read().items() if not np.all(v[1] == -1)}
    panels = _panels(list(series))
    if not panels:
        return None
    columns = 1 if len(panels) == 1 else 2 if len(panels) <= 4 else 3 if len(panels) <= 9 else 4
    rows = -(-len(panels) // columns)
    figure = new_figure(4.8 * columns, 3.2 * rows + 0.3)
    figure.suptitle(f"training curves: {reader.path.parent.name}", fontsize=12)
    for index, (title, keys, evaluation) in enumerate(panels):
        ax = figure.add_subplot(rows, columns, index + 1)
        finite_values, bad_steps = [], set()
        for key in keys:
            (steps, xlabel), values = _x(series, key), series[key][1]
            finite = np.isfinite(values)
            finite_values.append(values[finite])
            bad_steps.update(steps[~finite].tolist())
            label = key.split("/", 1)[-1]
            if not evaluation and len(values) > 50 and "/lr" not in key:  # noisy: raw faint, smoothed on top
                (line,) = ax.plot(steps, values, lw=0.8, alpha=0.3)
                ax.plot(
                    steps,
                    _smooth(values, 0.9 if len(values) > 300 else 0.6),
                    lw=1.8,
                    color=line.get_color(),
                    label=label,
                )
            else:
                ax.plot(
                    steps,
                    values,
                    marker="o" if evaluation or finite.sum() <= 30 else None,
                    ms=4 if evaluation else 3,
                    lw=1.5,
                    label=label,
                )
        for step in sorted(bad_steps):
            ax.axvline(step, color="red", ls=":", lw=1.2, label="non-finite" if step == min(bad_steps) else None)
        positive = np.concatenate(finite_values)
        if not evaluation and len(positive) and positive.min() > 0 and positive.max() / positive.min() > 10:
            ax.set_yscale("log")  # plain numbers on the ticks (200, not 2x10^2); 2s and 5s when under 2 decades
            few = positive.max() / positive.min() < 100
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(
                FuncFormatter(lambda v, _, few=few: f"{v:g}" if few and f"{v:e}"[0] in "25" else "")
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.tick_params(labelsize=8, which="both")
        ax.grid(alpha=0.3)
        if len(keys) > 1 or bad_steps:
            ax.legend(fontsize=8, loc="best", framealpha=0.8)
    return save_figure(figure, path)
