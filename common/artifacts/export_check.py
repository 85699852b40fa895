"""The check an exported file passes before it is kept (:mod:`common.artifacts.export`): the inputs it runs on and
the tolerances it must meet.

Every file is written under a temporary name, run beside the eager wrapper (ONNX Runtime on the CPU,
fp32) on the example input and on the recipe's check inputs, which span what the model will see (batches
of one and several; for the detectors, photos of :data:`CHECK_SIZES`: small ones the graph upscales,
large ones, odd aspect ratios), and renamed only when every output is within its tolerance
(:data:`TOLERANCES`, by the output's kind):

- ``px`` (boxes): the largest coordinate difference at most 0.5 pixels;
- ``probability`` (scores, probabilities): the largest difference at most 1e-3;
- ``relative`` (logits, features; the default): the largest difference at most 1e-3 of the largest
  magnitude the eager output has on that input.

A detector's outputs are compared as a user reads them (:class:`Detections`): each image's detections
from the file are paired with eager's (same class, IoU at least 0.5, best first), paired boxes must agree
within 0.5 px and scores within 1e-3, and every detection must have its pair, except one scoring within
1e-3 of the lowest score read (the model's score floor, or the last score kept where an image reaches the
model's detection limit): a tie at the threshold may fall on either side of it. A segmenting detector's paired
masks (its fourth output, ``[K, M, M]`` probabilities over each box) are pasted into the input's size as the
recipe pastes them and must overlap with IoU at least :data:`MASK_IOU`. Otherwise nothing is kept
and the export is refused in one line naming the input (its shapes), the output and the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common import UserError

#: The export check's tolerance per kind of output (module docstring): pixels, probability, fraction of scale.
TOLERANCES = {"px": 0.5, "probability": 1e-3, "relative": 1e-3}
#: The photo sizes (height, width) a detector's export is checked on: small photos the graph upscales,
#: large ones it reduces, a tall and a wide one (odd aspect ratios), from 60 x 45 to 1000 x 750.
CHECK_SIZES = ((45, 60), (183, 245), (400, 120), (180, 640), (480, 640), (750, 1000))
#: A segmenting detector's export: each paired detection's masks, pasted and cut at 0.5, overlap at least this much.
MASK_IOU = 0.99


def tensors(outputs: Any) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


@dataclass(frozen=True)
class Detections:
    """How a detector's export is compared: as the detections a user reads. ``read``: the wrapper's outputs
    -> per image ``(boxes [K, 4] XYXY px, scores [K], labels [K])`` (after NMS where it runs outside the
    graph); ``floor``: the score above which detections are read (the model's own threshold); ``limit``: the
    most detections an image keeps (0: no limit)."""

    read: Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    floor: float = 0.0
    limit: int = 0


def photos(source: torch.Tensor | None = None, sizes: Sequence[tuple[int, int]] = CHECK_SIZES) -> list[torch.Tensor]:
    """Pictures [3, H, W] in 0..1 of each (H, W) of ``sizes`` to check a detector's export on: ``source`` (a
    real image [3, H, W] in 0..1) resized, else smooth colour fields with sharp-edged rectangles on them
    (edges and blobs at several scales, what a detector's features respond to); seeded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for h, w in sizes:
        if source is not None:
            picture = nn.functional.interpolate(source[None].float(), size=(h, w), mode="bilinear", antialias=True)
        else:
            picture = nn.functional.interpolate(torch.rand(1, 3, 4, 5, generator=g), size=(h, w), mode="bilinear")
            for _ in range(6):
                y0, x0 = int(torch.randint(h, (1,), generator=g)), int(torch.randint(w, (1,), generator=g))
                size = 1 + int(torch.randint(max(2, min(h, w) // 2), (1,), generator=g))
                picture[0, :, y0 : y0 + size, x0 : x0 + size] = torch.rand(3, 1, 1, generator=g)
        out.append(picture[0].clamp(0, 1))
    return out


def prepared(transform: Callable, pictures: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """``pictures`` ([3, H, W] in 0..1) through a recipe's box-aware evaluation ``transform`` as a detection
    dataset passes an image without objects: ``(image tensor, target)``, the target with its ``size``."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    out = []
    for picture in pictures:
        h, w = picture.shape[-2:]
        empty = {
            "boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w)),
            "labels": torch.zeros(0, dtype=torch.int64),
        }
        image, target = transform(F.to_pil_image(picture), empty)
        image = image.as_subclass(torch.Tensor)
        target.setdefault("size", tuple(image.shape[-2:]))
        out.append((image, target))
    return out


def image_batches(
    size: int, mean: Sequence[float], std: Sequence[float], batches: Sequence[int] = (1, 5)
) -> list[dict[str, torch.Tensor]]:
    """A fixed-size model's check inputs (``images``): batches [B, 3, size, size] of each size in ``batches``
    (one, and several beside the example's two) of :func:`photos` resized to ``size`` and normalised with
    the model's ``mean`` and ``std``, as its users' images reach it."""
    mean_, std_ = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in (mean, std))
    pictures = [(p - mean_) / std_ for p in photos(sizes=[(size, size)] * sum(batches))]
    starts = np.cumsum([0, *batches])
    return [{"images": torch.stack(pictures[a:b])} for a, b in zip(starts[:-1], starts[1:])]


def batched_checks(transform: Callable, collate: Callable, names: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """A batched detector's check inputs: each of :func:`photos` alone through its evaluation ``transform``,
    then all of them in one batch (``collate``: padded where sizes differ); each batch's first tensors
    named by ``names``."""
    items = prepared(transform, photos())
    return [dict(zip(names, collate(batch))) for batch in [*([item] for item in items), items]]


def _shapes(inputs: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {list(t.shape)}" for name, t in inputs.items())


def _elementwise(name: str, kind: str, got: torch.Tensor, expected: torch.Tensor) -> tuple[float, str | None]:
    """(the difference of one output in its kind's unit, what is wrong or None)."""
    if got.shape != expected.shape:
        return float("inf"), f"{name} has shape {list(got.shape)} where eager's has {list(expected.shape)}"
    if not expected.numel():
        return 0.0, None
    diff = float((got.double() - expected.double()).abs().max())
    if kind == "relative":  # a fraction of the output's scale on this input
        diff /= max(float(expected.double().abs().max()), 1e-12)
    tolerance = TOLERANCES[kind]
    if not diff <= tolerance:
        unit = {"px": " px", "probability": "", "relative": " of its largest magnitude"}[kind]
        return diff, f"{name} differ by {diff:.3g}{unit} (tolerance {tolerance:g}{unit})"
    return diff, None


def _mask_iou(
    got: torch.Tensor, got_box: torch.Tensor, expected: torch.Tensor, expected_box: torch.Tensor, size: Sequence[int]
) -> float:
    """IoU of two detections' masks (probabilities [M, M] over their XYXY boxes) pasted into an image of ``size``
    (h, w) as torchvision's Mask R-CNN pastes them and cut at 0.5; 1 where both are empty."""
    from torchvision.models.detection.roi_heads import paste_masks_in_image

    probs = torch.stack([got, expected]).float()[:, None]
    pasted = paste_masks_in_image(probs, torch.stack([got_box, expected_box]).float(), tuple(int(v) for v in size))
    a, b = pasted[0, 0] > 0.5, pasted[1, 0] > 0.5
    union = int((a | b).sum())
    return float((a & b).sum()) / union if union else 1.0


def detections_agree(
    got: tuple[torch.Tensor, ...],
    expected: tuple[torch.Tensor, ...],
    spec: Detections,
    file: str,
    size: Sequence[int] | None = None,
) -> tuple[float, float, str | None]:
    """One image's detections from the file against eager's: (the largest box difference in px over the
    pairs, the largest score difference, what is wrong or None); the rule is the module docstring's. ``size``: the
    input image's (h, w), where a segmenting detector's masks are pasted."""
    from torchvision.ops import box_iou

    (gb, gs, gl), (eb, es, el) = ((t.detach().cpu() for t in d[:3]) for d in (got, expected))
    masks = (got[3].detach().cpu(), expected[3].detach().cpu()) if len(got) > 3 and len(expected) > 3 else None
    gb, gs, eb, es = gb.double(), gs.double(), eb.double(), es.double()
    # the lowest score read: the model's floor, or the last score kept where an image reached the limit
    low = spec.floor
    for scores in (gs, es):
        if spec.limit and len(scores) >= spec.limit:
            low = max(low, float(scores.min()))
    loose = low + TOLERANCES["probability"]  # a detection scoring at most this may be on one side only
    iou = box_iou(eb, gb) if len(eb) and len(gb) else torch.zeros(len(eb), len(gb), dtype=torch.double)
    iou[el[:, None] != gl[None, :]] = -1.0  # pairs are of one class
    box_diff = score_diff = 0.0
    paired = torch.zeros(len(gb), dtype=torch.bool)
    for i in es.argsort(descending=True).tolist():
        candidates = iou[i].masked_fill(paired, -1.0)
        j = int(candidates.argmax()) if len(gb) else -1
        if j < 0 or candidates[j] < 0.5:
            if es[i] > loose:
                return (
                    box_diff,
                    score_diff,
                    (f"eager's detection of class {int(el[i])} scoring {float(es[i]):.3f} has none in {file}"),
                )
            continue
        paired[j] = True
        if max(es[i], gs[j]) > loose:
            box_diff = max(box_diff, float((eb[i] - gb[j]).abs().max()))
            score_diff = max(score_diff, float((es[i] - gs[j]).abs()))
            if masks is not None and size is not None:
                overlap = _mask_iou(masks[0][j], gb[j], masks[1][i], eb[i], size)
                if overlap < MASK_IOU:
                    return (
                        box_diff,
                        score_diff,
                        (
                            f"the mask of eager's detection of class {int(el[i])} and {file}'s overlap with IoU "
                            f"{overlap:.4f} (at least {MASK_IOU})"
                        ),
                    )
    for j in (~paired).nonzero().flatten().tolist():
        if gs[j] > loose:
            return (
                box_diff,
                score_diff,
                f"{file} has a detection of class {int(gl[j])} scoring {float(gs[j]):.3f} that eager has not",
            )
    for name, diff, kind in (("boxes", box_diff, "px"), ("scores", score_diff, "probability")):
        _, wrong = _elementwise(name, kind, torch.tensor([diff]), torch.tensor([0.0]))
        if wrong:
            return box_diff, score_diff, wrong
    return box_diff, score_diff, None


def checked(
    file: str,
    run: Callable[..., list[torch.Tensor]],
    cases: Sequence[tuple[Mapping[str, torch.Tensor], list[torch.Tensor]]],
    names: Sequence[str],
    kinds: Mapping[str, str],
    detections: Detections | None,
    tmp: Path,
) -> dict[str, float]:
    """``file`` (run by ``run``) on every ``(inputs, eager outputs)`` of ``cases``: per output the largest
    difference in its kind's unit (keys ``boxes``, ``scores`` for a detector); the first one outside its
    tolerance removes ``tmp`` and is one :class:`UserError` naming the input and the output."""
    worst: dict[str, float] = {}
    for inputs, expected in cases:
        got = [torch.as_tensor(np.asarray(g)) for g in tensors(run(*inputs.values()))]
        found: dict[str, float] = {}
        wrong = None
        if detections is not None:
            size = next(iter(inputs.values())).shape[-2:]  # one image [3, H, W]: where masks are pasted
            for g, e in zip(detections.read(got), detections.read(expected)):
                boxes, scores, wrong = detections_agree(g, e, detections, file, size)
                found = {"boxes": max(found.get("boxes", 0.0), boxes), "scores": max(found.get("scores", 0.0), scores)}
                if wrong:
                    break
        # every output, or beside a detector's detections the outputs ``kinds`` names (YOLO's raw scores)
        for name, g, e in zip(names, got, expected):
            if wrong or (detections is not None and name not in kinds):
                continue
            diff, wrong = _elementwise(name, kinds.get(name, "relative"), g.to(e.dtype), e)
            found[name] = max(diff, found.get(name, 0.0))
        if wrong:
            tmp.unlink(missing_ok=True)
            raise UserError(f"export refused: {file} on {_shapes(inputs)}: {wrong}; nothing was written")
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
    return worst


def export_metrics(
    file: str, worst: Mapping[str, float], kinds: Mapping[str, str], detections: Detections | None
) -> dict:
    """``export/<file>_<output>[_px | _rel]`` -> the largest difference, in the output's kind's unit."""
    if detections is not None:
        kinds = {**kinds, "boxes": "px", "scores": "probability"}
    suffix = {"px": "_px", "probability": "", "relative": "_rel"}
    return {f"export/{file}_{name}{suffix[kinds.get(name, 'relative')]}": v for name, v in worst.items()}
