"""YOLO's model and loss, beside recipes/yolo.py (as recipes/yolo_data.py holds its data helpers):
the YOLOv3 feature pyramid on a timm ``features_only`` backbone with its per-size tables and box
decoding, the exported wrapper (images -> boxes, scores), GluonCV's target assignment and four
losses, YOLOv5's target rule and three losses (``rule="yolov5"``), the NMS post-processing and ``detect``
(a model's detections on a loader, for the evaluation and ``--predict``). recipes/yolo.py builds the model
from its Config (``create_model``) and imports the rest; copy yolo.py and its yolo_*.py files together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torchvision.ops import batched_nms, clip_boxes_to_image

from common.artifacts.export import OnnxModel
from common.detection.boxes import rescale_boxes, without_tiny

# YOLOv3's COCO anchors (w, h) in pixels of a 416 px input, small to large; GluonCV uses them as they
# are at every input size.
COCO_ANCHORS = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119], [116, 90], [156, 198], [373, 326]]
LOSS_TERMS = ("loss_obj", "loss_center", "loss_scale", "loss_cls")  # what yolo_loss returns
RULES = ("gluoncv", "yolov5")  # YOLOv3(rule=): whose box parametrisation, output-bias priors and loss go together
YOLOV5_LOSS_TERMS = ("loss_box", "loss_obj", "loss_cls")  # what yolov5_loss returns
# YOLOv5's hyp.scratch-low.yaml gains (box, obj, cls): the recipe's weight of each yolov5_loss term in the total
YOLOV5_LOSS_WEIGHTS = {"loss_box": 0.05, "loss_obj": 1.0, "loss_cls": 0.5}
YOLOV5_LEVEL_BALANCE = (4.0, 1.0, 0.4)  # objectness weight of each level, smallest stride first (YOLOv5's P3-P5)


# ============================================================================================
# Model: timm backbone -> YOLOv3 feature pyramid -> 3 scales x A anchors x (4 + 1 + C)
# ============================================================================================
def conv_bn(cin: int, cout: int, k: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1, inplace=True)
    )


def yolo_block(cin: int, c: int) -> nn.Sequential:
    """YOLOv3's five alternating 1x1 / 3x3 convolutions before each output."""
    return nn.Sequential(
        conv_bn(cin, c, 1), conv_bn(c, 2 * c, 3), conv_bn(2 * c, c, 1), conv_bn(c, 2 * c, 3), conv_bn(2 * c, c, 1)
    )


class YOLOv3(nn.Module):
    """``forward(images [B, 3, H, W]) -> raw [B, N, 5 + C]``, N = sum over the 3 levels (large stride
    first) of H_l * W_l * A, ordered (level, y, x, anchor); the 5 are (tx, ty, tw, th, objectness).
    ``anchors`` [3 * A, 2] px, small to large (A anchors per level, 3 in YOLOv3). ``rule`` (see RULES): how
    (tx, ty, tw, th) decode and how the output biases start, "gluoncv" (trained by yolo_loss) or "yolov5"
    (trained by yolov5_loss)."""

    def __init__(
        self, backbone: nn.Module, num_classes: int, anchors: torch.Tensor, neck_channels: int, rule: str = "gluoncv"
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, not {rule!r}")
        super().__init__()
        self.rule = rule
        self.backbone, self.num_classes = backbone, num_classes
        c3, c4, c5 = backbone.feature_info.channels()[-3:]
        self.strides = backbone.feature_info.reduction()[-3:][::-1]  # [32, 16, 8]: the order of the outputs
        c = [neck_channels, neck_channels // 2, neck_channels // 4]
        self.num_anchors = a = len(anchors) // 3  # per level
        self.register_buffer("anchors", anchors.float().view(3, a, 2).flip(0).contiguous())  # large-stride level first
        self.blocks = nn.ModuleList([yolo_block(c5, c[0]), yolo_block(c4 + c[1], c[1]), yolo_block(c3 + c[2], c[2])])
        self.transitions = nn.ModuleList([conv_bn(c[0], c[1], 1), conv_bn(c[1], c[2], 1)])
        self.outputs = nn.ModuleList(
            [nn.Sequential(conv_bn(ci, 2 * ci, 3), nn.Conv2d(2 * ci, a * (5 + num_classes), 1)) for ci in c]
        )
        self._tables: dict[tuple, dict[str, torch.Tensor]] = {}  # see tables()
        for out in self.outputs:  # start with objectness ~0.01 so the first steps are not all false positives,
            bias = out[-1].bias.view(a, 5 + num_classes)  # and class probabilities at the 1/C prior, so the
            nn.init.constant_(bias[:, 4], -4.6)  # first steps go to telling digits apart, not to learning the prior
            nn.init.constant_(bias[:, 5:], -math.log(max(num_classes - 1, 1)))
        if rule == "yolov5":  # YOLOv5's priors instead (YOLOv5 adds them to the default init; here they are set):
            for out, s in zip(self.outputs, self.strides):  # objectness: ~8 objects per 640 x 640 image over
                bias = out[-1].bias.view(a, 5 + num_classes)  # a level's (640 / s)^2 cells; classes: ~0.6 / C
                nn.init.constant_(bias[:, 4], math.log(8 / (640 / s) ** 2))
                nn.init.constant_(bias[:, 5:], math.log(0.6 / (num_classes - 0.99)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c3, c4, c5 = self.backbone(images)[-3:]
        route, outs = None, []
        for level, feature in enumerate((c5, c4, c3)):
            if route is not None:
                route = F.interpolate(self.transitions[level - 1](route), size=feature.shape[-2:], mode="nearest")
                feature = torch.cat([route, feature], dim=1)
            route = self.blocks[level](feature)
            out = self.outputs[level](route)  # [B, A * (5 + C), H, W]
            b, _, h, w = out.shape
            a = self.num_anchors
            outs.append(out.view(b, a, 5 + self.num_classes, h, w).permute(0, 3, 4, 1, 2).reshape(b, h * w * a, -1))
        return torch.cat(outs, dim=1)

    def level_shapes(self, height: int, width: int) -> list[tuple[int, int]]:
        """(H_l, W_l) of each output for an input of this size (host ints: no device sync)."""
        return [(math.ceil(height / s), math.ceil(width / s)) for s in self.strides]

    def tables(self, height: int, width: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Constant tensors for an input size, made once per size and device (multi-scale training
        uses a few sizes), so a training step copies nothing from the host:
        per prediction ``cells`` [N, 2] (cell corner x, y), ``strides`` [N, 1] px, ``anchors`` [N, 2] px;
        per level ``level_offsets``, ``level_w``, ``level_h``, ``level_strides`` [3]."""
        key = (height, width, str(device))
        if key in self._tables and not torch.compiler.is_compiling():
            return self._tables[key]
        shapes = self.level_shapes(height, width)
        cells, strides, anchors, k = [], [], [], self.num_anchors
        for (h, w), s, a in zip(shapes, self.strides, self.anchors):
            y, x = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            cells.append(torch.stack([x, y], dim=-1).view(h * w, 1, 2).expand(h * w, k, 2).reshape(-1, 2).float())
            strides.append(torch.full((h * w * k, 1), float(s), device=device))
            anchors.append(a.view(1, k, 2).expand(h * w, k, 2).reshape(-1, 2))
        offsets = np.cumsum([0] + [h * w * k for h, w in shapes])[:-1].tolist()
        table = {
            "cells": torch.cat(cells),
            "strides": torch.cat(strides),
            "anchors": torch.cat(anchors),
            "level_offsets": torch.tensor(offsets, device=device),
            "level_w": torch.tensor([w for _, w in shapes], device=device),
            "level_h": torch.tensor([h for h, _ in shapes], device=device),
            "level_strides": torch.tensor(self.strides, dtype=torch.float32, device=device),
        }
        if not torch.compiler.is_compiling():  # traced tensors must not outlive the trace
            self._tables[key] = table
        return table

    def decode(self, raw: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """raw [B, N, 5 + C] -> boxes [B, N, 4] (xyxy px of the input) and scores [B, N, C]
        (objectness x class probability). Rule "gluoncv": centre in the cell (offset sigmoid, 0..1 cells),
        size anchor x exp; "yolov5": see yolov5_boxes."""
        t = self.tables(height, width, raw.device)
        raw = raw.float()
        if self.rule == "yolov5":
            boxes = yolov5_boxes(raw[..., :4], t["cells"], t["strides"], t["anchors"])
            return boxes, raw[..., 4:5].sigmoid() * raw[..., 5:].sigmoid()
        xy = (raw[..., :2].sigmoid() + t["cells"]) * t["strides"]
        wh = raw[..., 2:4].clamp(max=8.0).exp() * t["anchors"]  # clamp: exp must not overflow early in training
        boxes = torch.cat([xy - wh / 2, xy + wh / 2], dim=-1)
        return boxes, raw[..., 4:5].sigmoid() * raw[..., 5:].sigmoid()


class Exported(nn.Module):
    """What is exported: images -> (boxes [B, N, 4] px, scores [B, N, C]); NMS stays outside (see
    ``postprocess``), so the graph has static shapes."""

    def __init__(self, model: YOLOv3) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.decode(self.model(images), images.shape[-2], images.shape[-1])


# ============================================================================================
# Loss: GluonCV's YOLOv3 target assignment and four losses
# ============================================================================================
def batch_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of xyxy boxes a [B, N, 4] and b [B, M, 4] -> [B, N, M] (torchvision's box_iou is 2-D only)."""
    lt = torch.maximum(a[:, :, None, :2], b[:, None, :, :2])
    rb = torch.minimum(a[:, :, None, 2:], b[:, None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    return inter / (area_a[:, :, None] + area_b[:, None, :] - inter).clamp(min=1e-9)


@torch.no_grad()
def assign_targets(
    model: YOLOv3, gt_boxes: torch.Tensor, gt_labels: torch.Tensor, gt_weights: torch.Tensor, height: int, width: int
) -> dict[str, torch.Tensor]:
    """Each ground truth -> the one anchor (of all 3 * A) with the best shape IoU (both centred at 0),
    in the cell of its level that holds its centre. Shapes: gt_* [B, M(, 4)], weight 0 = padding.

    Returns dense targets over the N predictions: ``obj`` [B, N] (the box's mixup weight at assigned
    anchors, else 0), ``center`` [B, N, 2] (offset in the cell, 0..1), ``scale`` [B, N, 2]
    (log(size / anchor)), ``box_weight`` [B, N] (2 - w*h / (W*H)), ``cls`` [B, N] (class index).
    When two boxes claim the same anchor of the same cell, one of them wins (as in GluonCV).
    """
    b, m = gt_labels.shape
    a = model.num_anchors
    n = sum(h * w * a for h, w in model.level_shapes(height, width))  # host ints
    table = model.tables(height, width, gt_boxes.device)
    all_anchors = model.anchors.view(3 * a, 2)  # level-major (large stride first), A per level
    wh = (gt_boxes[..., 2:] - gt_boxes[..., :2]).clamp(min=1.0)  # [B, M, 2]
    centre = (gt_boxes[..., 2:] + gt_boxes[..., :2]) / 2
    inter = torch.minimum(wh[..., None, :], all_anchors).prod(-1)  # [B, M, 3A]
    shape_iou = inter / (wh.prod(-1)[..., None] + all_anchors.prod(-1) - inter)
    best = shape_iou.argmax(-1)  # [B, M]
    level, k = best // a, best % a
    strides = table["level_strides"][level]  # [B, M]
    grid_w, grid_h = table["level_w"][level], table["level_h"][level]
    cell = (centre / strides[..., None]).floor().long()
    cx, cy = torch.minimum(cell[..., 0].clamp(min=0), grid_w - 1), torch.minimum(cell[..., 1].clamp(min=0), grid_h - 1)
    index = table["level_offsets"][level] + (cy * grid_w + cx) * a + k
    index = torch.where(gt_weights > 0, index, torch.full_like(index, n))  # padding -> a spare slot, dropped below
    rows = torch.arange(b, device=gt_boxes.device)[:, None].expand(b, m)

    def scatter(values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        out = torch.full((b, n + 1, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
        out[rows, index] = values
        return out[:, :n]

    return {
        "obj": scatter(gt_weights),
        "center": scatter(centre / strides[..., None] - torch.stack([cx, cy], -1).float()),
        "scale": scatter(torch.log(wh / all_anchors[best])),
        "box_weight": scatter(2.0 - wh.prod(-1) / (height * width)),
        "cls": scatter(gt_labels),
    }


def yolo_loss(
    model: YOLOv3,
    raw: torch.Tensor,
    targets: dict[str, torch.Tensor],
    height: int,
    width: int,
    ignore_iou: float,
    label_smoothing: bool,
) -> dict[str, torch.Tensor]:
    """The four YOLOv3 losses, each summed over predictions and averaged over images.

    raw [B, N, 5 + C]; targets from the collate: boxes [B, M, 4], labels [B, M], weights [B, M].
    """
    t = assign_targets(model, targets["boxes"], targets["labels"], targets["weights"], height, width)
    raw = raw.float()
    batch = raw.shape[0]
    positive = t["obj"] > 0  # [B, N]
    with torch.no_grad():  # ignore: negatives whose predicted box already overlaps a ground truth well
        boxes, _ = model.decode(raw.detach(), height, width)
        iou = batch_iou(boxes, targets["boxes"]).masked_fill(targets["weights"][:, None, :] <= 0, 0.0)
        ignored = (iou.amax(-1) > ignore_iou) & ~positive
    obj_weight = torch.where(positive, t["obj"], (~ignored).float())
    obj = F.binary_cross_entropy_with_logits(raw[..., 4], positive.float(), weight=obj_weight, reduction="sum")
    box_w = (t["obj"] * t["box_weight"])[..., None]  # mixup ratio x (2 - wh) at positives, 0 elsewhere
    center = F.binary_cross_entropy_with_logits(
        raw[..., :2], t["center"], weight=box_w.expand(-1, -1, 2), reduction="sum"
    )
    scale = (F.l1_loss(raw[..., 2:4], t["scale"], reduction="none") * box_w).sum()
    num_classes = raw.shape[-1] - 5
    cls_t = F.one_hot(t["cls"], num_classes).float()
    if label_smoothing:
        eps = min(1.0 / num_classes, 1.0 / 40)
        cls_t = cls_t * (1 - eps) + (1 - cls_t) * eps
    cls = F.binary_cross_entropy_with_logits(
        raw[..., 5:], cls_t, weight=t["obj"][..., None].expand_as(cls_t), reduction="sum"
    )
    return {
        "loss_obj": obj / batch,
        "loss_center": center / batch,
        "loss_scale": scale / batch,
        "loss_cls": cls / batch,
    }


# ============================================================================================
# Loss: YOLOv5's target rule (several cells, several anchors per box) and three losses
# ============================================================================================
def yolov5_boxes(
    t: torch.Tensor, cells: torch.Tensor | float, strides: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """YOLOv5's box parametrisation: (tx, ty, tw, th) [..., 4] at cells [..., 2] (corner x, y in cells; 0 gives
    the box relative to the cell's corner), strides [..., 1] px, anchors [..., 2] px -> xyxy [..., 4] px.
    Centre (2 sigmoid - 0.5 + cell) x stride: -0.5..1.5 cells from the corner, so a neighbouring cell's
    prediction can reach the box; size (2 sigmoid)^2 x anchor: 0..4 anchors, bounded (no exp to overflow)."""
    xy = (t[..., :2].sigmoid() * 2 - 0.5 + cells) * strides
    wh = (t[..., 2:4].sigmoid() * 2) ** 2 * anchors
    return torch.cat([xy - wh / 2, xy + wh / 2], dim=-1)


def box_ciou(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Complete IoU of xyxy boxes a and b [..., 4], pair by pair -> [...]: IoU - (centre distance^2 /
    enclosing diagonal^2) - alpha v, v the squared difference of the aspect angles (x 4 / pi^2), alpha =
    v / (1 - IoU + v) held constant (Zheng et al. 2020). torchvision's complete_box_iou_loss is 1 - this on
    proper boxes, but divides by the raw heights: a zero-height box (th -> -inf) gives NaN gradients."""
    a, b = a.float(), b.float()
    wa, ha = (a[..., 2] - a[..., 0]).clamp(min=0), (a[..., 3] - a[..., 1]).clamp(min=0)
    wb, hb = (b[..., 2] - b[..., 0]).clamp(min=0), (b[..., 3] - b[..., 1]).clamp(min=0)
    iw = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    ih = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = iw * ih
    iou = inter / (wa * ha + wb * hb - inter + eps)
    cw = torch.maximum(a[..., 2], b[..., 2]) - torch.minimum(a[..., 0], b[..., 0])  # enclosing box
    ch = torch.maximum(a[..., 3], b[..., 3]) - torch.minimum(a[..., 1], b[..., 1])
    diagonal = cw**2 + ch**2 + eps
    centres = (
        (a[..., 0] + a[..., 2] - b[..., 0] - b[..., 2]) ** 2 + (a[..., 1] + a[..., 3] - b[..., 1] - b[..., 3]) ** 2
    ) / 4
    v = (4 / math.pi**2) * (torch.atan(wb / (hb + eps)) - torch.atan(wa / (ha + eps))) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return iou - centres / diagonal - alpha * v


@torch.no_grad()
def assign_yolov5(
    model: YOLOv3,
    gt_boxes: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_weights: torch.Tensor,
    height: int,
    width: int,
    anchor_t: float = 4.0,
) -> dict[str, torch.Tensor]:
    """YOLOv5's rule: each ground truth -> every anchor (of all 3 * A, every level) whose shape is within
    ``anchor_t`` of the box's (max over w and h of max(r, 1 / r), r = box / anchor, below anchor_t), each at up
    to 3 cells of that anchor's level: the cell holding the centre, the horizontal neighbour on the side
    nearer the centre (left if the centre's offset in the cell is < 0.5, right if > 0.5) and likewise the
    vertical one, a neighbour only where it is inside the grid. gt_* [B, M(, 4)] (xyxy px), weight 0 = padding.

    Returns dense candidates, [B, M, 3A, 3] (gt, anchor in model.anchors' order, cell: centre, horizontal
    neighbour, vertical neighbour), shapes fixed by B, M and A (no host sync, no data-dependent shape):
    ``index`` (into the N predictions; where not valid, a prediction index all the same, safe to gather),
    ``valid`` (bool), ``box`` [..., 4] (the gt's xyxy px, broadcast: a view), ``cls``, ``weight`` (the gt's).
    """
    b, m = gt_labels.shape
    a = model.num_anchors
    device = gt_boxes.device
    table = model.tables(height, width, device)
    j = torch.arange(3 * a, device=device)
    level, k = j // a, j % a  # [3A]: model.anchors.view(3A, 2) is level-major, large stride first
    anchors = model.anchors.view(3 * a, 2)
    stride = table["level_strides"][level]  # [3A] px
    grid = torch.stack([table["level_w"][level], table["level_h"][level]], -1).float()  # [3A, 2] cells (x, y)
    boxes = gt_boxes.float()  # fp32 whatever the caller hands over: a cell or a ratio near 4 is decided here
    wh = (boxes[..., 2:] - boxes[..., :2]).clamp(min=0)  # [B, M, 2] px
    r = wh[:, :, None, :] / anchors  # [B, M, 3A, 2]; a side 0 gives 1 / r = inf: no anchor
    shape_ok = torch.maximum(r, 1 / r).amax(-1) < anchor_t  # [B, M, 3A]
    centre = (boxes[..., :2] + boxes[..., 2:]) / 2
    g = centre[:, :, None, :] / stride[:, None]  # [B, M, 3A, 2] centre in cells of each anchor's level
    cell = torch.minimum(g.floor().clamp(min=0), grid - 1)  # a centre on the far edge stays in the last cell
    frac = g - cell  # [B, M, 3A, 2] offset of the centre in its cell, 0..1
    step = torch.where(frac < 0.5, -1.0, 1.0)  # towards the nearer neighbour (at exactly 0.5: none)
    inside = torch.where(frac < 0.5, cell >= 1, (frac > 0.5) & (cell <= grid - 2))  # [B, M, 3A, 2]
    shift = torch.diag_embed(step * inside)  # [B, M, 3A, 2 (neighbour: x, y), 2 (x, y)]; 0 where none
    cells = torch.cat([cell[..., None, :], cell[..., None, :] + shift], dim=-2).long()  # [B, M, 3A, 3, 2]
    width_l = table["level_w"][level][:, None]  # [3A, 1]
    index = table["level_offsets"][level][:, None] + (cells[..., 1] * width_l + cells[..., 0]) * a + k[:, None]
    matched = (gt_weights > 0)[..., None] & shape_ok  # [B, M, 3A]
    valid = matched[..., None] & torch.cat([torch.ones_like(inside[..., :1]), inside], dim=-1)
    shape = (b, m, 3 * a, 3)
    return {
        "index": index,
        "valid": valid,
        "box": boxes[:, :, None, None, :].expand(*shape, 4),
        "cls": gt_labels[:, :, None, None].expand(shape),
        "weight": gt_weights[:, :, None, None].expand(shape),
    }


def yolov5_loss(
    model: YOLOv3, raw: torch.Tensor, targets: dict[str, torch.Tensor], height: int, width: int, anchor_t: float = 4.0
) -> dict[str, torch.Tensor]:
    """YOLOv5's three losses over assign_yolov5's candidates; raw [B, N, 5 + C] (any dtype: the geometry is
    fp32); targets from the collate: boxes [B, M, 4] xyxy px, labels [B, M], weights [B, M] (mixup, 0 = padding).

    ``loss_box``: the weighted sum of 1 - CIoU(decoded candidate, its gt) over valid candidates / their count;
    ``loss_cls``: BCE of the candidates' class logits with the one-hot label, weighted, / (count x C);
    ``loss_obj``: BCE of every prediction's objectness with a target of 0, or at a valid candidate its CIoU
    (clamped at 0, held constant; where candidates share a prediction one of them wins, as in YOLOv5), the mean
    over each level's predictions of all images x YOLOV5_LEVEL_BALANCE, summed over levels.
    Not multiplied by the batch size, nor by YOLOV5_LOSS_WEIGHTS (the recipe applies those).
    """
    if model.rule != "yolov5":  # the loss decodes with YOLOv5's parametrisation: so must the model at inference
        raise ValueError(f"yolov5_loss trains a YOLOv3 built with rule='yolov5', not {model.rule!r}")
    t = assign_yolov5(model, targets["boxes"], targets["labels"], targets["weights"], height, width, anchor_t)
    raw = raw.float()
    b, n, d = raw.shape
    table = model.tables(height, width, raw.device)
    index, valid = t["index"].reshape(b, -1), t["valid"].reshape(b, -1)  # [B, K], K = M x 3A x 3 candidates
    rows = raw.gather(1, index[..., None].expand(-1, -1, d))  # [B, K, 5 + C]
    stride = table["strides"][index]  # [B, K, 1] px
    # CIoU ignores translation: boxes from the cell's corner keep fp32 digits lost hundreds of px from 0
    corner = table["cells"][index] * stride  # [B, K, 2] px
    pred = yolov5_boxes(rows[..., :4], 0.0, stride, table["anchors"][index])  # [B, K, 4] px from the corner
    ciou = box_ciou(pred, t["box"].reshape(b, -1, 4) - corner.repeat(1, 1, 2))  # [B, K]
    weight = t["weight"].reshape(b, -1).float()
    count = valid.sum().clamp(min=1)  # a tensor: no sync
    zero = raw.new_zeros(())
    loss_box = torch.where(valid, weight * (1 - ciou), zero).sum() / count  # where, not x valid: NaN-safe
    num_classes = d - 5
    onehot = (t["cls"].reshape(b, -1, 1) == torch.arange(num_classes, device=raw.device)).float()  # no range check
    bce = F.binary_cross_entropy_with_logits(rows[..., 5:], onehot, reduction="none").sum(-1)  # [B, K]
    loss_cls = torch.where(valid, weight * bce, zero).sum() / (count * num_classes)
    spare = torch.where(valid, index, n)  # candidates that are not valid write to a spare column, dropped
    obj_target = raw.new_zeros(b, n + 1).scatter_(1, spare, ciou.detach().clamp(min=0))[:, :n]  # [B, N]
    balance = dict(zip(sorted(model.strides), YOLOV5_LEVEL_BALANCE))  # by stride: the demo's are 4, 8, 16
    loss_obj, start = zero, 0
    for (h, w), s in zip(model.level_shapes(height, width), model.strides):  # host ints: fixed slices
        end = start + h * w * model.num_anchors
        level = F.binary_cross_entropy_with_logits(raw[:, start:end, 4], obj_target[:, start:end])  # mean
        loss_obj, start = loss_obj + balance[s] * level, end
    return {"loss_box": loss_box, "loss_obj": loss_obj, "loss_cls": loss_cls}


# ============================================================================================
# Detection: NMS post-processing, and a model's detections on a loader (evaluation, --predict)
# ============================================================================================
@torch.no_grad()
def postprocess(boxes: torch.Tensor, scores: torch.Tensor, conf: float, iou: float, max_det: int) -> list[dict]:
    """Per image: every (box, class) with score > conf, class-wise NMS, the top ``max_det``.
    boxes [B, N, 4], scores [B, N, C] -> [{boxes [K, 4], scores [K], labels [K]}]."""
    results = []
    for bx, sc in zip(boxes, scores):
        idx, cls = (sc > conf).nonzero(as_tuple=True)
        s = sc[idx, cls]
        top = s.topk(min(len(s), 10 * max_det)).indices  # bounded NMS cost early in training
        idx, cls, s = idx[top], cls[top], s[top]
        keep = batched_nms(bx[idx], s, cls, iou)[:max_det]
        results.append({"boxes": bx[idx[keep]], "scores": s[keep], "labels": cls[keep]})
    return results


@torch.no_grad()
def detect(
    model: YOLOv3 | OnnxModel,
    loader: Iterable,
    accelerator: Accelerator,
    conf_threshold: float,
    nms_iou: float,
    max_detections: int,
) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader`` (common.detection.data's collate: images, mask, targets), per image: ``image_id``
    and the detections (``boxes`` XYXY in the original image's pixels, clipped to it, ``scores``, ``labels``
    as class indices 0..C-1) after :func:`postprocess` with ``conf_threshold``, ``nms_iou`` and
    ``max_detections``; the model in eval mode, or its ONNX export (the same boxes and scores before NMS)."""
    unwrapped = accelerator.unwrap_model(model) if isinstance(model, nn.Module) else None
    for images, _, targets in loader:
        if unwrapped is None:
            boxes, scores = (t.to(images.device) for t in model(images))
        else:
            with accelerator.autocast():
                raw = model(images)
            boxes, scores = unwrapped.decode(raw, images.shape[-2], images.shape[-1])  # fp32
        predictions = postprocess(boxes, scores, conf_threshold, nms_iou, max_detections)
        for p, t in zip(predictions, targets):  # letterbox padding and cells at the border reach past the image
            p["boxes"] = clip_boxes_to_image(rescale_boxes(p["boxes"], t["size"], t["orig_size"]), t["orig_size"])
            p["image_id"] = t["image_id"]
        yield [without_tiny(p) for p in predictions]  # clipped to slivers at the border
