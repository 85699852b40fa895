"""Pictures of detections: ground truth and predictions drawn on images, as PNG files and as
W&B box overlays. Every detection recipe's "plots" step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from common.detection import IMAGENET_MEAN, IMAGENET_STD


def _boxes(x: Any) -> torch.Tensor:
    return torch.as_tensor(x if x is not None else []).detach().cpu().float().reshape(-1, 4).as_subclass(torch.Tensor)


def _values(x: Any) -> list:
    return torch.as_tensor(x if x is not None else []).detach().cpu().reshape(-1).tolist()


def draw_detections(image: Image.Image | torch.Tensor, target_boxes: Any, target_labels: Any, pred_boxes: Any,
                    pred_labels: Any, pred_scores: Any, classes: Sequence[str], score_threshold: float = 0.3,
                    min_size: int = 256) -> Image.Image:
    """The image with ground truth in green and predictions (score >= ``score_threshold``) in red,
    labelled "class score". Boxes XYXY in the image's pixels. ``image``: PIL, uint8 [3, H, W], or a
    float [3, H, W] normalised with the ImageNet mean and std (what the YOLO and DETR recipes' transforms
    give). An image whose shorter side is under ``min_size`` is first enlarged by an integer factor
    (nearest), so that labels stay legible on 96-px scenes."""
    from torchvision.utils import draw_bounding_boxes

    pixels = F.pil_to_tensor(image.convert("RGB")) if isinstance(image, Image.Image) else image.detach().cpu()
    if pixels.is_floating_point():  # undo the normalisation; out-of-range values would wrap around in uint8
        mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
        pixels = (pixels.float() * std + mean).clamp(0, 1).mul(255).round().to(torch.uint8)
    factor = max(1, -(-min_size // min(pixels.shape[-2:])))
    if factor > 1:
        pixels = pixels.repeat_interleave(factor, -2).repeat_interleave(factor, -1)
    gt = _boxes(target_boxes) * factor
    names = [classes[int(c)] if 0 <= int(c) < len(classes) else str(int(c)) for c in _values(target_labels)]
    if len(gt):
        pixels = draw_bounding_boxes(pixels, gt, labels=names, colors="lime", width=max(1, factor // 2))
    scores = _values(pred_scores)
    keep = [i for i, s in enumerate(scores) if s >= score_threshold]
    pred, labels = _boxes(pred_boxes)[keep] * factor, [_values(pred_labels)[i] for i in keep]
    captions = [f"{classes[int(c)] if 0 <= int(c) < len(classes) else int(c)} {scores[i]:.2f}"
                for i, c in zip(keep, labels)]
    if len(pred):
        pixels = draw_bounding_boxes(pixels, pred, labels=captions, colors="red", width=max(1, factor // 2))
    return F.to_pil_image(pixels)


def wandb_boxes(target_boxes: Any, target_labels: Any, pred_boxes: Any, pred_labels: Any, pred_scores: Any,
                classes: Sequence[str], score_threshold: float = 0.3) -> dict[str, Any]:
    """``boxes=`` for ``wandb.Image(image, boxes=...)``: ground truth and predictions (score >=
    ``score_threshold``), XYXY in the image's pixels, with the class-id -> name mapping."""
    class_labels = {i: name for i, name in enumerate(classes)}

    def box_data(boxes: Any, labels: Any, scores: list[float] | None) -> list[dict[str, Any]]:
        out = []
        for i, (box, c) in enumerate(zip(_boxes(boxes).tolist(), _values(labels))):
            if scores is not None and scores[i] < score_threshold:
                continue
            entry = {"position": {"minX": box[0], "minY": box[1], "maxX": box[2], "maxY": box[3]},
                     "domain": "pixel", "class_id": int(c), "box_caption": class_labels.get(int(c), str(int(c)))}
            if scores is not None:
                entry["scores"] = {"score": scores[i]}
                entry["box_caption"] += f" {scores[i]:.2f}"
            out.append(entry)
        return out

    return {"ground_truth": {"box_data": box_data(target_boxes, target_labels, None), "class_labels": class_labels},
            "predictions": {"box_data": box_data(pred_boxes, pred_labels, _values(pred_scores)),
                            "class_labels": class_labels}}


def save_detections(images: Sequence[torch.Tensor], targets: Sequence[dict[str, Any]],
                    predictions: Sequence[dict[str, Any]], classes: Sequence[str], path: Path,
                    wandb_run: Any = None, step: int = 0, score_threshold: float = 0.3) -> None:
    """Ground truth (green) and predictions (red) of a few images side by side in one PNG at ``path``;
    with ``wandb_run`` (a ``wandb`` run), also each plain image at its own size with its boxes as
    W&B box overlays under the key ``detections``. ``images``: what :func:`draw_detections` takes;
    ``targets``: ``boxes`` and ``labels``; ``predictions``: ``boxes``, ``labels`` (0-based, as
    ``classes``) and ``scores``; boxes XYXY in each image's pixels. Every recipe's "plots" step."""
    pictures = [draw_detections(image, t["boxes"], t["labels"], p["boxes"], p["labels"], p["scores"], classes,
                                score_threshold) for image, t, p in zip(images, targets, predictions)]
    height = max(p.height for p in pictures)
    canvas = np.concatenate([np.pad(np.asarray(p), ((0, height - p.height), (0, 0), (0, 0))) for p in pictures], axis=1)
    Image.fromarray(canvas).save(path)
    if wandb_run is not None:
        import wandb

        none = torch.zeros(0, 4)  # the plain image, at its own size: W&B draws the boxes, in its pixels
        logged = [wandb.Image(draw_detections(image, none, [], none, [], [], classes, min_size=1),
                              boxes=wandb_boxes(t["boxes"], t["labels"], p["boxes"], p["labels"], p["scores"], classes,
                                                score_threshold))
                  for image, t, p in zip(images, targets, predictions)]
        wandb_run.log({"detections": logged}, step=step)
