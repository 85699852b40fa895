"""Pictures of detections, for the three detection recipes: ground truth and predictions drawn on the
original images (a grid in one PNG with a legend, and W&B box overlays), and precision-recall curves
per class. Which of them one evaluation writes: :func:`common.detection.outputs.save_evaluation_figures`.

Boxes are drawn with PIL and the DejaVu Sans font that matplotlib ships (a scalable font: PIL's bitmap
default is 7 px high), at a fixed drawing size whatever the image's own: a 96-px scene is enlarged, a
photo reduced, so that labels are equally legible on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from common.console import counted
from common.curves import new_figure, save_figure

# Matplotlib's "tab10": ten colours told apart by most readers, colour-blind ones included.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MAX_DRAWN = 30  # predictions drawn per image, the most confident: an untrained detector's hundreds hide the image
RECALL = np.linspace(0.0, 1.0, 101)  # COCOeval's recall thresholds (params.recThrs)
_LEGEND_CLASSES = 20  # more curves than this: thin grey lines, no legend (80 COCO names hide the plot)


def class_colour(index: int) -> tuple[int, int, int]:
    """The RGB colour of class ``index``: tab10, then evenly spread hues (golden-ratio steps)."""
    if 0 <= index < len(PALETTE):
        value = PALETTE[index]
        return int(value[1:3], 16), int(value[3:5], 16), int(value[5:7], 16)
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((index * 0.618034) % 1.0, 0.75, 0.85)
    return round(r * 255), round(g * 255), round(b * 255)


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans at ``size`` px (the file matplotlib ships, found without importing its font manager),
    else PIL's own scalable default."""
    try:
        import matplotlib

        return ImageFont.truetype(str(Path(matplotlib.__file__).parent / "mpl-data/fonts/ttf/DejaVuSans.ttf"), size)
    except (ImportError, OSError):
        return ImageFont.load_default(size)


def _boxes(x: Any) -> np.ndarray:
    """Boxes as float64 [N, 4] on the host (from tensors on any device, arrays, lists or None)."""
    return torch.as_tensor(x if x is not None else []).detach().cpu().double().reshape(-1, 4).numpy()


def _values(x: Any) -> list:
    return torch.as_tensor(x if x is not None else []).detach().cpu().reshape(-1).tolist()


def _name(classes: Sequence[str], c: int) -> str:
    return classes[c] if 0 <= c < len(classes) else str(c)


def to_pil(image: Any) -> Image.Image:
    """An RGB PIL image from PIL, a uint8 array [H, W, 3], or a tensor [3, H, W] (uint8, or float in 0..1)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image.astype(np.uint8)).convert("RGB")
    pixels = image.detach().cpu()
    if pixels.is_floating_point():
        pixels = pixels.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy()).convert("RGB")


def _dashed_rectangle(draw: ImageDraw.ImageDraw, box: Sequence[float], width: int, dash: int) -> None:
    """A rectangle in black with white dashes on it: visible on dark and light images alike, and unlike
    the solid class-coloured predictions."""
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(0, 0, 0), width=width)
    for (ax, ay), (bx, by) in (((x0, y0), (x1, y0)), ((x1, y0), (x1, y1)), ((x1, y1), (x0, y1)), ((x0, y1), (x0, y0))):
        length = max(abs(bx - ax), abs(by - ay))
        for start in np.arange(0, length, 2 * dash):
            t0, t1 = start / max(length, 1e-9), min(start + dash, length) / max(length, 1e-9)
            draw.line(
                [(ax + (bx - ax) * t0, ay + (by - ay) * t0), (ax + (bx - ax) * t1, ay + (by - ay) * t1)],
                fill=(255, 255, 255),
                width=max(1, width - 1),
            )


def _place(
    candidates: list[tuple[float, float]],
    size: tuple[int, int],
    bounds: tuple[int, int],
    placed: list[tuple[float, float, float, float]],
) -> tuple[float, float, float, float]:
    """The first candidate top-left corner whose label rectangle (``size``) lies inside ``bounds`` and
    overlaps no rectangle already ``placed``; else the one overlapping them least. Appended to ``placed``."""
    w, h = size

    def cost(x: float, y: float) -> float:
        inside = 0.0 if 0 <= y and y + h <= bounds[1] else 1e9
        return inside + sum(
            max(0.0, min(x + w, c) - max(x, a)) * max(0.0, min(y + h, d) - max(y, b)) for a, b, c, d in placed
        )

    shifted = [(min(max(x, 0), bounds[0] - w), y) for x, y in candidates]  # slid sideways into the picture
    best = next((xy for xy in shifted if cost(*xy) == 0), min(shifted, key=lambda xy: cost(*xy)))
    placed.append((best[0], best[1], best[0] + w, best[1] + h))
    return placed[-1]


def draw_detections(
    image: Any,
    target_boxes: Any,
    target_labels: Any,
    pred_boxes: Any,
    pred_labels: Any,
    pred_scores: Any,
    classes: Sequence[str],
    score_threshold: float = 0.3,
    size: int = 512,
    max_predictions: int = MAX_DRAWN,
    pred_masks: Sequence[dict[str, Any]] | None = None,
) -> Image.Image:
    """One image with its ground truth and predictions, drawn at ``size`` px on its longer side (an
    image under half that is enlarged by a whole factor, so somewhat less).

    ``image``: the original image (what :func:`to_pil` takes); boxes XYXY in its pixels; labels class
    indices into ``classes``. Ground truth: black-and-white dashed boxes, the class name on a white
    label above the box. Predictions with score >= ``score_threshold`` (the ``max_predictions`` most
    confident): solid boxes in their class's colour, "name 0.87" on a label of that colour below the
    box. Labels move (inside the box, the other edge) rather than cover one another. A margin of one
    label's height around the image keeps labels of boxes at its edges whole. ``pred_masks``: each prediction's
    mask (COCO RLE in the original image's pixels), drawn under the boxes as a translucent fill of its colour."""
    picture = to_pil(image)
    scale = size / max(picture.size)
    # enlarged by a whole factor (nearest): every source pixel the same square, no blur on 96-px scenes
    scale = float(int(scale)) if scale >= 2 else scale
    resample = Image.NEAREST if scale >= 2 else Image.BICUBIC if scale >= 1 else Image.LANCZOS
    picture = picture.resize((max(1, round(picture.width * scale)), max(1, round(picture.height * scale))), resample)
    text = font(max(12, round(size / 32)))
    label_h = text.getbbox("Ag")[3] + 4
    margin, line = label_h + 2, max(2, round(size / 240))
    canvas = Image.new("RGB", (picture.width + 2 * margin, picture.height + 2 * margin), (245, 245, 245))
    scores = _values(pred_scores)
    keep = sorted((i for i, s in enumerate(scores) if s >= score_threshold), key=lambda i: -scores[i])[:max_predictions]
    if pred_masks is not None:  # the least confident first: the most confident on top
        picture = _with_masks(
            picture, [pred_masks[i] for i in keep[::-1]], [int(_values(pred_labels)[i]) for i in keep[::-1]]
        )
    canvas.paste(picture, (margin, margin))
    draw = ImageDraw.Draw(canvas)

    gt = _boxes(target_boxes) * scale + margin
    gt_names = [_name(classes, int(c)) for c in _values(target_labels)]
    pred, pred_classes = _boxes(pred_boxes)[keep] * scale + margin, [int(_values(pred_labels)[i]) for i in keep]
    for box, c in zip(pred[::-1], pred_classes[::-1]):  # the most confident last, on top
        draw.rectangle(box.tolist(), outline=class_colour(c), width=line + 1)
    for box in gt:  # thinner, over the predictions: a perfect prediction shows both
        _dashed_rectangle(draw, box.tolist(), line, dash=max(4, round(size / 60)))

    placed: list[tuple[float, float, float, float]] = []
    labels = [(box, name, (255, 255, 255), True) for box, name in zip(gt, gt_names)]
    labels += [
        (box, f"{_name(classes, c)} {scores[i]:.2f}", class_colour(c), False)
        for box, c, i in zip(pred, pred_classes, keep)
    ]
    for (x0, y0, x1, y1), caption, fill, is_gt in labels:
        w = text.getlength(caption) + 6
        above, top_in, below, bottom_in = (x0, y0 - label_h), (x0, y0), (x0, y1), (x0, y1 - label_h)
        order = [above, top_in, below, bottom_in] if is_gt else [below, bottom_in, above, top_in]
        order += [(x1 - w, y) for _, y in order]  # the same places, right-aligned
        a, b, c, d = _place(order, (round(w), label_h), canvas.size, placed)
        draw.rectangle((a, b, c - 1, d - 1), fill=fill, outline=(0, 0, 0) if is_gt else None)
        dark = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2] > 150  # dark text on a light label
        draw.text((a + 3, b + 2), caption, font=text, fill=(0, 0, 0) if dark else (255, 255, 255))
    return canvas


def _legend(width: int, classes: Sequence[str], score_threshold: float, text: Any) -> Image.Image:
    """A strip explaining the marks: ground truth, prediction, and each class's colour (up to 20)."""
    height, pad = text.getbbox("Ag")[3] + 12, 10
    items: list[tuple[str, Any]] = [
        ("ground truth", None),
        (f"prediction, score \u2265 {score_threshold:.2f} (colour = class)", -1),
    ]
    items += [(str(name), i) for i, name in enumerate(classes)] if len(classes) <= 20 else []
    rows, x = [[]], pad
    for caption, key in items:  # wrapped into as many rows as the width needs
        w = 2 * height + text.getlength(caption) + pad
        if x + w > width and rows[-1]:
            rows.append([])
            x = pad
        rows[-1].append((x, caption, key))
        x += w
    strip = Image.new("RGB", (width, len(rows) * height + pad), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    for r, row in enumerate(rows):
        y = pad // 2 + r * height
        for x, caption, key in row:
            swatch = (x, y + 3, x + 1.6 * height, y + height - 5)
            if key is None:
                _dashed_rectangle(draw, swatch, 2, dash=5)
            elif key == -1:
                draw.rectangle(swatch, outline=(60, 60, 60), width=3)
            else:
                draw.rectangle(swatch, fill=class_colour(key))
            draw.text((x + 2 * height - 4, y + 4), caption, font=text, fill=(0, 0, 0))
    return strip


MASK_ALPHA = 0.45  # a predicted mask's fill: this much of its class colour over the picture


def _with_masks(picture: Image.Image, masks: Sequence[dict[str, Any]], labels: Sequence[int]) -> Image.Image:
    """``picture`` (the image resized for drawing) with each mask (COCO RLE at the original size) filled in its
    class's colour at MASK_ALPHA and edged in it, resized to the picture by nearest neighbour."""
    from common.detection.masks import decoded

    out = np.asarray(picture.convert("RGB"), np.float32).copy()
    for rle, c in zip(masks, labels):
        h, w = rle["size"]
        inside = decoded(rle, h, w)
        inside = np.asarray(Image.fromarray(inside * 255).resize(picture.size, Image.NEAREST)) > 127
        colour = np.asarray(class_colour(c), np.float32)
        out[inside] = (1 - MASK_ALPHA) * out[inside] + MASK_ALPHA * colour
        padded = np.pad(inside, 1)  # its edge, opaque: pixels inside with a neighbour outside
        edge = inside & ~(padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:])
        out[edge] = colour
    return Image.fromarray(np.rint(out).astype(np.uint8))


def save_detections(
    images: Sequence[Any],
    targets: Sequence[dict[str, Any]],
    predictions: Sequence[dict[str, Any]],
    classes: Sequence[str],
    path: Path,
    score_threshold: float = 0.3,
    *,
    size: int = 512,
    wandb_run: Any = None,
    step: int = 0,
) -> Image.Image:
    """A grid of :func:`draw_detections` pictures, titled and with a legend, as one PNG at ``path``;
    returns it. ``images``: the original images (PIL, or what :func:`to_pil` takes); ``targets``:
    ``boxes`` and ``labels`` (and ``image_id``, for the titles); ``predictions``: ``boxes``, ``labels``
    (0-based, as ``classes``) and ``scores``; boxes XYXY in each original image's pixels.
    With ``wandb_run`` (a ``wandb`` run), also each plain image at its own size with its boxes as W&B
    box overlays under the key ``detections``."""
    text = font(max(12, round(size / 32)))
    title_h = text.getbbox("Ag")[3] + 10
    tiles = []
    for k, (image, t, p) in enumerate(zip(images, targets, predictions)):
        drawn = draw_detections(
            image,
            t["boxes"],
            t["labels"],
            p["boxes"],
            p["labels"],
            p["scores"],
            classes,
            score_threshold,
            size,
            pred_masks=p.get("masks"),
        )
        shown = sum(s >= score_threshold for s in _values(p["scores"]))
        objects = len(_values(t["labels"]))
        title = (
            f"image {t.get('image_id', k)}: {objects} object{'s' * (objects != 1)}, "
            f"{shown} prediction{'s' * (shown != 1)} \u2265 {score_threshold:.2f}"
            + (f" ({MAX_DRAWN} drawn)" if shown > MAX_DRAWN else "")
        )
        tile = Image.new("RGB", (drawn.width, drawn.height + title_h), (255, 255, 255))
        tile.paste(drawn, (0, title_h))
        ImageDraw.Draw(tile).text((4, 5), title, font=text, fill=(0, 0, 0))
        tiles.append(tile)
    if not tiles:
        raise ValueError("save_detections needs at least one image")
    columns = int(np.ceil(np.sqrt(len(tiles))))
    rows = -(-len(tiles) // columns)
    cell_w, cell_h, gap = max(t.width for t in tiles), max(t.height for t in tiles), 8
    width = columns * cell_w + (columns - 1) * gap
    legend = _legend(width, classes, score_threshold, text)
    grid = Image.new("RGB", (width, rows * cell_h + (rows - 1) * gap + legend.height), (255, 255, 255))
    for k, tile in enumerate(tiles):
        grid.paste(tile, ((k % columns) * (cell_w + gap), (k // columns) * (cell_h + gap)))
    grid.paste(legend, (0, grid.height - legend.height))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    if wandb_run is not None:
        import wandb

        logged = [
            wandb.Image(
                to_pil(image),
                boxes=wandb_boxes(
                    t["boxes"], t["labels"], p["boxes"], p["labels"], p["scores"], classes, score_threshold
                ),
            )
            for image, t, p in zip(images, targets, predictions)
        ]
        wandb_run.log({"detections": logged}, step=step)
    return grid


def wandb_boxes(
    target_boxes: Any,
    target_labels: Any,
    pred_boxes: Any,
    pred_labels: Any,
    pred_scores: Any,
    classes: Sequence[str],
    score_threshold: float = 0.3,
) -> dict[str, Any]:
    """``boxes=`` for ``wandb.Image(image, boxes=...)``: ground truth and predictions (score >=
    ``score_threshold``), XYXY in the image's pixels, with the class-id -> name mapping."""
    class_labels = {i: name for i, name in enumerate(classes)}

    def box_data(boxes: Any, labels: Any, scores: list[float] | None) -> list[dict[str, Any]]:
        out = []
        for i, (box, c) in enumerate(zip(_boxes(boxes).tolist(), _values(labels))):
            if scores is not None and scores[i] < score_threshold:
                continue
            entry = {
                "position": {"minX": box[0], "minY": box[1], "maxX": box[2], "maxY": box[3]},
                "domain": "pixel",
                "class_id": int(c),
                "box_caption": class_labels.get(int(c), str(int(c))),
            }
            if scores is not None:
                entry["scores"] = {"score": scores[i]}
                entry["box_caption"] += f" {scores[i]:.2f}"
            out.append(entry)
        return out

    return {
        "ground_truth": {"box_data": box_data(target_boxes, target_labels, None), "class_labels": class_labels},
        "predictions": {
            "box_data": box_data(pred_boxes, pred_labels, _values(pred_scores)),
            "class_labels": class_labels,
        },
    }


def plot_pr_curves(precision: Any, classes: Sequence[str], ap50: Any, path: Path) -> Image.Image:
    """Precision-recall curves at IoU 0.5 as a PNG at ``path``: one per class with ground truth,
    labelled "class AP50" when there are at most 20 classes (thin grey lines without a legend
    otherwise), and their mean in bold, "all classes mAP@0.5 x.xxx".

    ``precision``: COCOeval's ``eval["precision"]`` [T=10 IoUs, R=101 recall points, K, A=4 areas,
    M=3 maxDets] (:attr:`common.detection.coco_eval.EvalDetails.precision`), of which IoU 0.5, all areas and
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
        ax.plot(
            RECALL,
            curves[:, shown].mean(1),
            lw=3.0,
            color="#08306b",
            label=f"all classes mAP@0.5 {np.nanmean(ap[shown]):.3f}",
        )
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="recall", ylabel="precision")
    missing = len(classes) - len(shown)
    ax.set_title(
        f"precision-recall at IoU 0.5, {counted(len(shown), 'class', 'classes')}"
        + (" (grey: each class)" if not legend and len(shown) else "")
        + (f"; {missing} without ground truth" if missing else ""),
        fontsize=11,
    )
    ax.grid(alpha=0.3)
    if len(shown):
        ax.legend(
            fontsize=8 if len(shown) > 10 else 9,
            loc="upper left" if legend else "lower left",
            bbox_to_anchor=(1.02, 1.0) if legend else None,
            frameon=False if legend else True,
        )
    return save_figure(figure, path)
