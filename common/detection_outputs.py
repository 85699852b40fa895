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
    ``transform`` and ``collate``, on the run's device, with a progress bar."""
    from common.detection import DetectionDataset
    from common.detection_sources import image_table
    from common.images import image_files
    from common.loaders import eval_loader_for, on_device

    table = image_table(image_files(path))
    loader = eval_loader_for(DetectionDataset(table, transform), batch_size, num_workers, collate_fn=collate)
    return table, on_device(run.progress(loader, "predict"), run.accelerator.device)


def save_predictions(run: Any, batches: Iterable[Sequence[dict[str, Any]]], table: Any, meta: Mapping[str, Any],
                     score_threshold: float, root: str | Path) -> dict[str, float]:
    """``--predict``: on the main process, the detections of ``batches`` (the recipe's detection pass
    over ``table``, :func:`prediction_batches`: per image ``image_id``, ``boxes`` XYXY in original
    pixels, ``scores``, ``labels`` as class indices of ``meta["classes"]``, the weights' metadata)
    scoring at least ``score_threshold`` go to ``predictions.json`` (one entry per image: ``file``,
    ``width``, ``height``, ``detections``: ``class``, ``category_id``, ``score``, ``box`` [x0, y0, x1,
    y1] in the original image's pixels, most confident first) and are drawn on each image under ``predictions/``, at the
    image's path relative to ``root`` (the ``--predict`` folder) as PNG. Other processes write nothing.
    Returns the number of images and of detections."""
    import torch

    from common.images import decode_image
    from common.plots import draw_detections

    run.begin()
    classes, category_ids = meta["classes"], meta["category_ids"]
    totals = {"images": float(len(table)), "detections": 0.0}
    if run.accelerator.is_main_process:
        root = Path(root)
        folder = run.dir / "predictions"
        rows = table.select_columns(["image", "image_id", "width", "height"])[:]
        files = {int(i): Path(v["path"]) for i, v in zip(rows["image_id"], rows["image"])}
        sizes = {int(i): (int(w), int(h)) for i, w, h in zip(rows["image_id"], rows["width"], rows["height"])}
        entries = []
        for batch in batches:
            for p in batch:
                image_id = int(p["image_id"])
                scores = torch.as_tensor(p["scores"]).detach().float().cpu()
                keep = (scores >= score_threshold).nonzero().flatten()
                keep = keep[scores[keep].argsort(descending=True)]  # most confident first
                boxes = torch.as_tensor(p["boxes"]).as_subclass(torch.Tensor).detach().float().cpu()[keep]
                labels, scores = torch.as_tensor(p["labels"]).detach().cpu()[keep], scores[keep]
                (w, h), file = sizes[image_id], files[image_id]
                found = [{"class": str(classes[int(c)]), "category_id": int(category_ids[int(c)]),
                          "score": round(float(s), 5), "box": [round(float(v), 2) for v in b]}
                         for b, s, c in zip(boxes, scores, labels)]
                entries.append({"file": str(file), "width": w, "height": h, "detections": found})
                image = decode_image({"path": str(file)}, str(file))  # the original, for drawing
                drawn = draw_detections(image, np.zeros((0, 4)), [], boxes.numpy(), labels.numpy(), scores.numpy(),
                                        classes, score_threshold, size=max(512, min(max(w, h), 1600)))
                relative = file.relative_to(root) if root.is_dir() else Path(file.name)
                out = (folder / relative).with_suffix(".png")
                out.parent.mkdir(parents=True, exist_ok=True)
                drawn.save(out)
                totals["detections"] += len(found)
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
