"""What the detection recipes write about their detections, the same for all three: the report of one
evaluation (metrics; its pictures, drawn by :mod:`common.detection.figures`; the per-class AP table;
``predictions.json`` in the COCO results format) and, for ``--predict``, the detections on new images
(``detections.json``, another format, and the images with their boxes).

Both use the dataset's own category ids (:attr:`common.detection.data.DetectionData.category_ids`, kept in
the weights' metadata), so the files can be scored or used with the user's own tools.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from common import RunStopped, UserError
from common.artifacts.figures import per_class_line, plot_confusion_matrix, save_table_csv
from common.checkpoints import partial_stop
from common.console import counted
from common.data.images import decode_image
from common.detection.figures import draw_detections, plot_pr_curves, save_detections
from common.detection.masks import save_mask_png, segment_lines
from common.detection.yolo_txt import data_yaml, label_lines
from common.trackers import log_table

PREDICTIONS = "predictions.json"  # in the run folder: an evaluation's detections, the COCO results format
DETECTIONS = "detections.json"  # in the run folder: --predict's, per image file, corner boxes
PARTIAL = "detections.partial.json"  # in the run folder: what --predict had written when a stop signal came
LABELS = "labels"  # in the run folder: --predict's as YOLO label files, one per image (class cx cy w h [score])
DATA_YAML = "data.yaml"  # in the run folder beside labels/: the class names of the label files' indices


def write_json(value: Any, path: Path) -> None:
    """``value`` as JSON at ``path``, written to a temporary file and renamed (never half a file)."""
    tmp = Path(path).with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, separators=(",", ":"))
    tmp.replace(path)


def report_evaluation(
    run: Any,
    metrics: Mapping[str, float],
    details: Any,
    data: Any,
    plot_images: int,
    step: int,
    best: Mapping[str, float] | None = None,
    epoch: int | None = None,
    final: bool = False,
) -> dict[str, float]:
    """Everything one evaluation pass leaves behind: ``eval/<metric>`` (and ``best``) logged at ``step``;
    on the main process ``predictions.json`` (:meth:`common.detection.coco_eval.EvalDetails.coco_results` in
    ``data.category_ids``) and the pictures (:func:`save_evaluation_figures`),
    sent to the trackers. ``final`` (``--eval_only``): then the per-class AP table and the end of the
    run. Call on every process. Returns the logged metrics (without ``epoch``)."""
    results = {f"eval/{k}": v for k, v in metrics.items()} | dict(best or {})
    run.log(results if epoch is None else {**results, "epoch": epoch}, step)
    pictures = {}  # PR curves, confusion matrix, per-class AP (CSV), detections on the first images
    run.check_stop("the evaluation's files")  # a stop is honoured between the files (every process asks)
    if run.accelerator.is_main_process:
        write_json(details.coco_results(data.category_ids), run.dir / PREDICTIONS)
        pictures = save_evaluation_figures(
            details, run.plots_dir, data.eval, plot_images, wandb_run=run.wandb_run(), step=step
        )
    run.log_plots(step, **pictures)  # and the training curves
    log_table(run.accelerator, run.cfg.report_to, "eval/ap_per_class", details.table(), step)
    if final:
        run.print(ap_per_class_line(details, run.plots_dir))
        run.print(f"{run.dir / PREDICTIONS}: the COCO results format, in the dataset's image and category ids")
        run.finish()
    return results


def save_evaluation_figures(
    details: Any,
    folder: Path,
    eval_split: Any = None,
    plot_images: int = 0,
    score_threshold: float = 0.3,
    wandb_run: Any = None,
    step: int = 0,
) -> dict[str, Image.Image]:
    """Every picture of one detection evaluation under ``folder``, replacing the previous evaluation's
    (the trackers keep the history): ``pr_curves.png``, ``confusion_matrix.png`` (with the background
    row and column), ``per_class_ap.csv`` and, with ``eval_split`` (the normalised dataset that was
    evaluated) and ``plot_images`` > 0, ``detections.png``: its first ``plot_images`` images with ground
    truth and the predictions of this same pass (no second forward pass). ``details``:
    :class:`common.detection.coco_eval.EvalDetails`. With ``wandb_run``, those images also go to W&B at ``step``
    with their boxes as interactive overlays. Returns the pictures by name for ``Run.log_plots``."""
    from common.detection.coco_eval import CONFUSION_IOU, CONFUSION_SCORE

    folder = Path(folder)
    pictures = {
        "pr_curves": plot_pr_curves(details.precision, details.classes, details.ap50, folder / "pr_curves.png"),
        "confusion_matrix": plot_confusion_matrix(
            details.confusion,
            [*details.classes, "background"],
            folder / "confusion_matrix.png",
            f"detections (score \u2265 {CONFUSION_SCORE}, IoU \u2265 {CONFUSION_IOU}) against ground truth",
        ),
    }
    save_table_csv(details.table(), folder / "per_class_ap.csv")
    if eval_split is not None and plot_images > 0:
        samples = evaluation_samples(eval_split, details.predictions, plot_images)
        pictures["detections"] = save_detections(
            *samples, details.classes, folder / "detections.png", score_threshold, wandb_run=wandb_run, step=step
        )
    return pictures


def evaluation_samples(
    ds: Any, predictions: dict[int, dict[str, Any]], count: int
) -> tuple[list[Image.Image], list[dict[str, Any]], list[dict[str, Any]]]:
    """The first ``count`` images of a normalised detection split ``ds``
    (:mod:`common.detection.sources`), their ground truth (XYXY, crowd regions left out, ``image_id``)
    and their ``predictions`` (:attr:`common.detection.coco_eval.EvalDetails.predictions`; none where an image
    has no entry): what :func:`common.detection.figures.save_detections` takes, with no second forward
    pass."""
    images, targets, found = [], [], []
    for row in ds.select(range(min(count, len(ds)))):
        objects = row["objects"]
        keep = [i for i, crowd in enumerate(objects["iscrowd"]) if not crowd]
        xywh = np.array([objects["bbox"][i] for i in keep], np.float64).reshape(-1, 4)
        images.append(decode_image(row["image"], f"image_id {row['image_id']}"))
        targets.append(
            {
                "boxes": np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1),
                "image_id": row["image_id"],
                "labels": np.array([objects["category"][i] for i in keep], np.int64),
            }
        )
        found.append(predictions.get(int(row["image_id"]), {"boxes": np.zeros((0, 4)), "labels": [], "scores": []}))
    return images, targets, found


def ap_per_class_line(details: Any, folder: Path) -> str:
    """One line for the end of a run: where the last evaluation's AP per class is (``per_class_ap.csv`` in
    ``folder``, a tracker table too) and its three lowest classes by AP@.5."""
    return per_class_line("AP per class", details.table(), "ap50", Path(folder) / "per_class_ap.csv")


def _kept(
    prediction: dict[str, Any], score_threshold: float
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]] | None]:
    """One image's detections scoring at least ``score_threshold``, most confident first, on the host:
    (image_id, boxes [N, 4] float32 XYXY, scores [N] float32, labels [N] int64, the scores of the
    detections below the threshold [M] float32, and their masks (COCO RLEs) where the model segments, else None)."""
    import torch

    scores = torch.as_tensor(prediction["scores"]).detach().float().cpu()
    keep = (scores >= score_threshold).nonzero().flatten()
    keep = keep[scores[keep].argsort(descending=True)]
    boxes = torch.as_tensor(prediction["boxes"]).as_subclass(torch.Tensor).detach().float().cpu()[keep]
    labels = torch.as_tensor(prediction["labels"]).detach().cpu()[keep]
    below = scores[scores < score_threshold].numpy()
    masks = [prediction["masks"][int(i)] for i in keep] if "masks" in prediction else None
    image_id = int(prediction["image_id"])
    return image_id, boxes.numpy(), scores[keep].numpy(), labels.numpy().astype(np.int64), below, masks


def save_predictions(
    run: Any,
    batches: Iterable[Sequence[dict[str, Any]]],
    table: Any,
    meta: Mapping[str, Any],
    score_threshold: float,
    root: str | Path,
    model_threshold: tuple[str, float] | None = None,
    with_scores: bool = False,
    mask_pngs: bool = False,
) -> dict[str, float]:
    """``--predict``: the detections of ``batches`` (the recipe's detection pass over ``table``,
    :func:`common.detection.data.prediction_batches`:
    per image ``image_id``, ``boxes`` XYXY in original pixels, ``scores``,
    ``labels`` as class indices of ``meta["classes"]``, the weights' metadata) scoring at least
    ``score_threshold`` go to ``detections.json`` (one entry per image: ``file``, ``width``, ``height``,
    ``detections``: ``class``, ``category_id``, ``score``, ``box`` [x0, y0, x1, y1] in the original
    image's pixels, most confident first; a segmenting model's ``segmentation`` too, COCO's compressed RLE), are
    drawn on each image under ``predictions/``, at the image's path relative to ``root`` (the ``--predict``
    folder) as PNG, and written as YOLO label files under ``labels/`` at the same relative path (``.txt``; rows
    ``class cx cy w h`` normalised by the image's size, ``class`` the class index, and with ``with_scores`` the
    score after them: :func:`common.detection.yolo_txt.label_lines`; with masks Ultralytics' segment rows
    ``class x1 y1 x2 y2 ...``, each mask's outline: :func:`common.detection.yolo_txt.segment_lines`; empty for an
    image without detections) with ``data.yaml`` beside them naming the classes. ``mask_pngs``: each image's masks
    also as one PNG under ``masks/`` (pixel value = detection number in detections.json, from 1; 0 none). Every process
    detects its share; each batch's detections are gathered to the main process, which writes them (an image repeated by
    the padding once). ``model_threshold``: the field and value below which the model itself drops detections
    (YOLO's ``conf_threshold``), named in the counts. Returns the number of images and of detections."""
    from accelerate.utils import gather_object

    run.begin()
    accelerator = run.accelerator
    classes, category_ids = meta["classes"], meta["category_ids"]
    totals = {"images": float(len(table)), "detections": 0.0}
    root, folder = Path(root), run.dir / "predictions"
    rows = table.select_columns(["image", "image_id", "width", "height"])[:]
    files = {int(i): Path(v["path"]) for i, v in zip(rows["image_id"], rows["image"])}
    sizes = {int(i): (int(w), int(h)) for i, w, h in zip(rows["image_id"], rows["width"], rows["height"])}
    entries, seen, lower, segmented = [], set(), [], False
    if accelerator.is_main_process:  # the label files' class names, so that Ultralytics and the reader take them
        (run.dir / LABELS).mkdir(parents=True, exist_ok=True)
        (run.dir / DATA_YAML).write_text(data_yaml(classes), encoding="utf-8")
    try:
        for batch in batches:
            found = [_kept(p, score_threshold) for p in batch]
            if accelerator.num_processes > 1:
                found = gather_object(found)  # a collective: every process has as many batches (the padding)
            if not accelerator.is_main_process:
                continue
            for image_id, boxes, scores, labels, below, masks in found:
                if image_id in seen:
                    continue
                seen.add(image_id)
                lower.append(below)
                (w, h), file = sizes[image_id], files[image_id]
                detections = [
                    {
                        "class": str(classes[int(c)]),
                        "category_id": int(category_ids[int(c)]),
                        "score": round(float(s), 5),
                        "box": [round(float(v), 2) for v in b],
                    }
                    for b, s, c in zip(boxes, scores, labels)
                ]
                for detection, rle in zip(detections, masks or []):
                    detection["segmentation"] = rle
                entries.append({"file": str(file), "width": w, "height": h, "detections": detections})
                image = decode_image({"path": str(file)}, str(file))  # the original, for drawing
                drawn = draw_detections(
                    image,
                    np.zeros((0, 4)),
                    [],
                    boxes,
                    labels,
                    scores,
                    classes,
                    score_threshold,
                    size=max(512, min(max(w, h), 1600)),
                    pred_masks=masks,
                )
                relative = file.relative_to(root) if root.is_dir() else Path(file.name)
                out = (folder / relative).with_suffix(".png")
                out.parent.mkdir(parents=True, exist_ok=True)
                drawn.save(out)
                # the same detections as a YOLO label file: class indices, as Ultralytics trains on them (the
                # dataset's own category ids are in detections.json), the score only where asked for
                label = (run.dir / LABELS / relative).with_suffix(".txt")
                label.parent.mkdir(parents=True, exist_ok=True)
                shown = scores.tolist() if with_scores else None
                if masks is None:
                    label.write_text(label_lines(boxes.tolist(), labels.tolist(), (w, h), shown))
                else:  # Ultralytics' segment rows: each mask's outline
                    segmented = True
                    label.write_text(segment_lines(masks, boxes.tolist(), labels.tolist(), shown))
                    if mask_pngs:
                        save_mask_png(masks, (h, w), (run.dir / "masks" / relative).with_suffix(".png"))
                totals["detections"] += len(detections)
    except RunStopped as stop:  # a stop signal between two batches: what was predicted is kept, named as partial
        if accelerator.is_main_process:
            entries.sort(key=lambda e: e["file"])
            write_json(entries, run.dir / PARTIAL)
            also = ", with their pictures and label files"
            stop = partial_stop(stop, len(entries), len(table), run.dir / PARTIAL, also)
        raise stop from None
    if accelerator.is_main_process:
        entries.sort(key=lambda e: e["file"])
        write_json(entries, run.dir / DETECTIONS)
        field, floor = model_threshold or ("", 0.0)
        scoring = f"scoring \u2265 {max(score_threshold, floor)}"
        if floor > score_threshold:  # --predict_score cannot show what the model already dropped
            scoring += f" ({field}: the model drops lower scores; --predict_score {score_threshold} is below it)"
        elif floor > 0:
            scoring += f" (predict_score; the model drops scores below {floor}, {field})"
        found = counted(int(totals["detections"]), "detection") + " with masks" * segmented
        run.print(
            f"{counted(len(entries), 'image')}, {found} {scoring}: {run.dir / DETECTIONS}, pictures in {folder}, "
            f"{'segment label' if segmented else 'YOLO label'} files in {run.dir / LABELS} "
            f"(class indices of {run.dir / DATA_YAML}"
            f"{', then the score' if with_scores else ''})"
        )
        below = np.concatenate(lower) if lower else np.zeros(0)
        if len(below):  # a young model's detections may all score below the threshold: say they exist
            between = f"between {floor} and {score_threshold}" if floor > 0 else f"below {score_threshold}"
            best = _below(float(below.max()), score_threshold)
            more = counted(len(below), "more detection")
            run.print(f"{more} score {between} (the best {best}); --predict_score lower shows them")
    run.finish()
    return totals


def _below(value: float, threshold: float) -> str:
    """``value`` (< ``threshold``) with the digits that show it below: ``0.2996``, not ``0.3``, under 0.3."""
    for digits in (3, 4, 6, 9):
        if float(text := f"{value:.{digits}g}") < threshold:
            return text
    return repr(value)


def check_classes(weights: str, meta: Mapping[str, Any], data: Any) -> None:
    """``--eval_only``: the weights' classes (``meta``, :func:`common.weights.read_metadata`) must be those of
    ``data`` (:class:`common.detection.data.DetectionData`; None: nothing to check), by name and in order;
    otherwise one :class:`common.UserError`. Their ids may differ (a COCO json numbers them from 1, an Ultralytics
    export of the same set from 0): the evaluation writes the data's."""
    if data is None:
        return
    if list(meta["classes"]) != list(data.classes):

        def pairs(names: Sequence[str], ids: Sequence[int]) -> str:
            return ", ".join(f"{i}:{n}" for i, n in list(zip(ids, names))[:5])

        raise UserError(
            f"weights '{weights}' were trained on classes {pairs(meta['classes'], meta['category_ids'])}... "
            f"({len(meta['classes'])}); the data has {pairs(data.classes, data.category_ids)}... "
            f"({len(data.classes)})"
        )
