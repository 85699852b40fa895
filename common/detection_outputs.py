"""What the detection recipes write about their detections, the same for all three: the report of one
evaluation (metrics, pictures, ``predictions.json`` in the COCO results format) and, for
``--predict``, the detections on new images (``predictions.json`` and the images with their boxes).

Both use the dataset's own category ids (:attr:`common.detection.DetectionData.category_ids`, kept in
the weights' metadata), so the files can be scored or used with the user's own tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

PREDICTIONS = "predictions.json"  # in the run folder: evaluation (COCO results) and --predict (per image)


def write_json(value: Any, path: Path) -> None:
    """``value`` as JSON at ``path``, written to a temporary file and renamed (never half a file)."""
    tmp = Path(path).with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, separators=(",", ":"))
    tmp.replace(path)


def report_evaluation(run: Any, metrics: Mapping[str, float], details: Any, data: Any, plot_images: int, step: int,
                      best: Mapping[str, float] | None = None, epoch: int | None = None,
                      final: bool = False) -> dict[str, float]:
    """Everything one evaluation pass leaves behind: ``eval/<metric>`` (and ``best``) logged at ``step``;
    on the main process ``predictions.json`` (:meth:`common.coco_eval.EvalDetails.coco_results` in
    ``data.category_ids``) and the pictures (:func:`common.detection_figures.save_evaluation_figures`),
    sent to the trackers. ``final`` (``--eval_only``): then the per-class AP table and the end of the
    run. Call on every process. Returns the logged metrics (without ``epoch``)."""
    from common.detection_figures import per_class_text, save_evaluation_figures

    results = {f"eval/{k}": v for k, v in metrics.items()} | dict(best or {})
    run.log(results if epoch is None else {**results, "epoch": epoch}, step)
    pictures = {}  # PR curves, confusion matrix, per-class AP (CSV), detections on the first images
    if run.accelerator.is_main_process:
        write_json(details.coco_results(data.category_ids), run.dir / PREDICTIONS)
        pictures = save_evaluation_figures(details, run.plots_dir, data.eval, plot_images,
                                           wandb_run=run.wandb_run(), step=step)
    run.log_plots(step, **pictures)  # and the training curves
    if final:
        run.print(per_class_text(details))
        run.print(f"{run.dir / PREDICTIONS}: the COCO results format, in the dataset's image and category ids")
        run.finish()
    return results


def prediction_batches(run: Any, path: str, transform: Callable, collate: Callable, batch_size: int,
                       num_workers: int) -> tuple[Any, Iterator[Any]]:
    """``--predict``'s input: the images ``path`` names (one file or a folder) as a split without objects
    (:func:`common.detection_sources.image_table`) and its batches through the recipe's evaluation
    ``transform`` and ``collate``, on the run's device, with a progress bar. Prepared by Accelerate: each
    process gets its share of the images (the last round padded with repeats), so every process must
    pass its batches to :func:`save_predictions`."""
    from common.detection import DetectionDataset
    from common.detection_sources import image_table
    from common.images import image_files
    from common.loaders import eval_loader_for

    table = image_table(image_files(path))
    loader = eval_loader_for(DetectionDataset(table, transform), batch_size, num_workers, collate_fn=collate)
    return table, run.progress(run.accelerator.prepare(loader), "predict")


def _kept(prediction: dict[str, Any], score_threshold: float) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """One image's detections scoring at least ``score_threshold``, most confident first, on the host:
    (image_id, boxes [N, 4] float32 XYXY, scores [N] float32, labels [N] int64)."""
    import torch

    scores = torch.as_tensor(prediction["scores"]).detach().float().cpu()
    keep = (scores >= score_threshold).nonzero().flatten()
    keep = keep[scores[keep].argsort(descending=True)]
    boxes = torch.as_tensor(prediction["boxes"]).as_subclass(torch.Tensor).detach().float().cpu()[keep]
    labels = torch.as_tensor(prediction["labels"]).detach().cpu()[keep]
    return int(prediction["image_id"]), boxes.numpy(), scores[keep].numpy(), labels.numpy().astype(np.int64)


def save_predictions(run: Any, batches: Iterable[Sequence[dict[str, Any]]], table: Any, meta: Mapping[str, Any],
                     score_threshold: float, root: str | Path) -> dict[str, float]:
    """``--predict``: the detections of ``batches`` (the recipe's detection pass over ``table``,
    :func:`prediction_batches`: per image ``image_id``, ``boxes`` XYXY in original pixels, ``scores``,
    ``labels`` as class indices of ``meta["classes"]``, the weights' metadata) scoring at least
    ``score_threshold`` go to ``predictions.json`` (one entry per image: ``file``, ``width``, ``height``,
    ``detections``: ``class``, ``category_id``, ``score``, ``box`` [x0, y0, x1, y1] in the original
    image's pixels, most confident first) and are drawn on each image under ``predictions/``, at the
    image's path relative to ``root`` (the ``--predict`` folder) as PNG. Every process detects its share;
    each batch's detections are gathered to the main process, which writes them (an image repeated by
    the padding once). Returns the number of images and of detections."""
    from accelerate.utils import gather_object

    from common.images import decode_image
    from common.plots import draw_detections

    run.begin()
    accelerator = run.accelerator
    classes, category_ids = meta["classes"], meta["category_ids"]
    totals = {"images": float(len(table)), "detections": 0.0}
    root, folder = Path(root), run.dir / "predictions"
    rows = table.select_columns(["image", "image_id", "width", "height"])[:]
    files = {int(i): Path(v["path"]) for i, v in zip(rows["image_id"], rows["image"])}
    sizes = {int(i): (int(w), int(h)) for i, w, h in zip(rows["image_id"], rows["width"], rows["height"])}
    entries, seen = [], set()
    for batch in batches:
        found = [_kept(p, score_threshold) for p in batch]
        if accelerator.num_processes > 1:
            found = gather_object(found)  # a collective: every process has as many batches (the padding)
        if not accelerator.is_main_process:
            continue
        for image_id, boxes, scores, labels in found:
            if image_id in seen:
                continue
            seen.add(image_id)
            (w, h), file = sizes[image_id], files[image_id]
            detections = [{"class": str(classes[int(c)]), "category_id": int(category_ids[int(c)]),
                           "score": round(float(s), 5), "box": [round(float(v), 2) for v in b]}
                          for b, s, c in zip(boxes, scores, labels)]
            entries.append({"file": str(file), "width": w, "height": h, "detections": detections})
            image = decode_image({"path": str(file)}, str(file))  # the original, for drawing
            drawn = draw_detections(image, np.zeros((0, 4)), [], boxes, labels, scores, classes, score_threshold,
                                    size=max(512, min(max(w, h), 1600)))
            relative = file.relative_to(root) if root.is_dir() else Path(file.name)
            out = (folder / relative).with_suffix(".png")
            out.parent.mkdir(parents=True, exist_ok=True)
            drawn.save(out)
            totals["detections"] += len(detections)
    if accelerator.is_main_process:
        entries.sort(key=lambda e: e["file"])
        write_json(entries, run.dir / PREDICTIONS)
        run.print(f"{len(entries)} images, {int(totals['detections'])} detections scoring \u2265 {score_threshold}: "
                  f"{run.dir / PREDICTIONS}, pictures in {folder}")
    run.finish()
    return totals


def check_classes(weights: str, meta: Mapping[str, Any], data: Any) -> None:
    """``--eval_only``: the weights' classes and category ids (``meta``, :func:`common.models.read_metadata`)
    must be those of ``data`` (:class:`common.detection.DetectionData`; None: nothing to check);
    otherwise one :class:`common.UserError`."""
    if data is None:
        return
    from common import UserError

    if list(meta["classes"]) != list(data.classes) or list(meta["category_ids"]) != list(data.category_ids):
        pairs = lambda names, ids: ", ".join(f"{i}:{n}" for i, n in list(zip(ids, names))[:5])
        raise UserError(f"weights '{weights}' were trained on classes {pairs(meta['classes'], meta['category_ids'])}... "
                        f"({len(meta['classes'])}); the data has {pairs(data.classes, data.category_ids)}... "
                        f"({len(data.classes)})")
