"""YOLO's anchor-free head (``--head free``), beside recipes/yolo_model.py's anchor head: a light
path-aggregation neck, a decoupled head per level (a box branch predicting each side's distance as a
distribution, a class branch), task-aligned assignment and its three losses. The method follows the public
descriptions of TOOD (Feng et al. 2021: the alignment metric, top-k positives inside the box), GFL (Li et al.
2020: distribution focal loss over integer bins) and YOLOv8 (the decoupled head on a PAN neck, the gains);
the code is this project's own.

Also here: ``cs3darknet_xs``, a width-scaled timm CSPDarknet (half cs3darknet_s's width) whose compute per
image, with this neck and head, is at most yolov8n's: equal time means at least as many images seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common import UserError
from yolo_model import batch_iou, box_ciou

FREE_LOSS_TERMS = ("loss_box", "loss_dfl", "loss_cls")  # what free_loss returns
# YOLOv8's gains (box 7.5, dfl 1.5, cls 0.5): each term is already a mean over the assigned score mass
FREE_LOSS_WEIGHTS = {"loss_box": 7.5, "loss_dfl": 1.5, "loss_cls": 0.5}
BINS = 16  # distance bins per side: 0 .. 15 strides (GFL's reg_max + 1)


# ============================================================================================
# A backbone sized for the clock: timm's CSPDarknet (cs3 stages, dark blocks, SiLU) at a quarter width
# ============================================================================================
SMALL_BACKBONES = {"cs3darknet_xs": (0.25, 0.5)}  # name -> (width, depth) multipliers of cs3darknet_l's


def small_backbone(name: str, **kwargs) -> nn.Module:
    """A ``features_only`` CSPDarknet built from timm's own blocks at the widths and depths of
    ``SMALL_BACKBONES[name]`` (timm ships cs3darknet_s, 0.5 x 0.5, as its smallest); no pretrained weights
    exist for it (``--init_backbone`` still loads a file of the same layout)."""
    from timm.models import build_model_with_cfg
    from timm.models.cspnet import CspModelCfg, CspNet, CspStagesCfg, CspStemCfg

    width, depth = SMALL_BACKBONES[name]
    chs = lambda c: max(8, int(c * width + 4) // 8 * 8)  # noqa: E731  timm's make_divisible(c * width, 8)
    cfg = CspModelCfg(
        stem=CspStemCfg(out_chs=(chs(32), chs(64)), kernel_size=3, stride=2, pool=""),
        stages=CspStagesCfg(
            out_chs=tuple(chs(c) for c in (128, 256, 512, 1024)),
            depth=tuple(max(1, int(d * depth)) for d in (3, 6, 9, 3)),
            stride=2,
            bottle_ratio=1.0,
            block_ratio=0.5,
            stage_type="cs3",
            block_type="dark",
        ),
        act_layer="silu",
    )
    if kwargs.pop("pretrained", False):
        raise UserError(f"'{name}' has no pretrained weights: leave out --pretrained (or take cs3darknet_s)")
    out_indices = kwargs.pop("out_indices", (2, 3, 4))
    return build_model_with_cfg(
        CspNet,
        "cs3darknet_s",  # timm's nearest entry, for its (unused) pretrained settings
        False,
        model_cfg=cfg,
        feature_cfg=dict(flatten_sequential=True, out_indices=out_indices),
        features_only=True,
        **kwargs,
    )


# ============================================================================================
# Model: backbone -> PAN neck (top-down, then bottom-up) -> per level a box and a class branch
# ============================================================================================
def conv_bn_silu(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU(inplace=True)
    )


class CSPBlock(nn.Module):
    """Two 1x1 halves, one through two 3x3 convolutions, concatenated and mixed by a 1x1 (YOLOv5's C3 with
    one bottleneck, without its shortcut: the neck's fusion block)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        half = cout // 2
        self.skip, self.main = conv_bn_silu(cin, half, 1), conv_bn_silu(cin, half, 1)
        self.convs = nn.Sequential(conv_bn_silu(half, half, 3), conv_bn_silu(half, half, 3))
        self.mix = conv_bn_silu(2 * half, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(torch.cat([self.skip(x), self.convs(self.main(x))], dim=1))


class YOLOFree(nn.Module):
    """``forward(images [B, 3, H, W]) -> raw [B, N, 4 * BINS + C]``, N = sum over the 3 levels (large stride
    first, as the anchor head) of H_l * W_l, ordered (level, y, x): per cell 4 x BINS logits of the distances
    from the cell's centre to the box's left, top, right and bottom side (in strides), then C class logits.
    ``neck_channels``: the widest (stride-32) level's channels; stride 16 has half, stride 8 a quarter.
    ``prior_size``: the input side (px) the class bias assumes, about 5 objects per image at the start."""

    def __init__(self, backbone: nn.Module, num_classes: int, neck_channels: int, prior_size: int = 640) -> None:
        super().__init__()
        self.backbone, self.num_classes = backbone, num_classes
        c3, c4, c5 = backbone.feature_info.channels()[-3:]
        self.strides = backbone.feature_info.reduction()[-3:][::-1]  # [32, 16, 8]: the order of the outputs
        n3, n4, n5 = max(neck_channels // 4, 8), max(neck_channels // 2, 8), neck_channels
        self.reduce5 = conv_bn_silu(c5, n5, 1)
        self.top_down4, self.top_down3 = CSPBlock(n5 + c4, n4), CSPBlock(n4 + c3, n3)
        self.down3, self.bottom_up4 = conv_bn_silu(n3, n3, 3, 2), CSPBlock(n3 + n4, n4)
        self.down4, self.bottom_up5 = conv_bn_silu(n4, n4, 3, 2), CSPBlock(n4 + n5, n5)
        box_c, cls_c = max(16, n3 // 4, 4 * BINS), max(n3, min(num_classes, 100))  # YOLOv8's branch widths
        self.box_branches, self.cls_branches = nn.ModuleList(), nn.ModuleList()
        for ci, stride in zip((n5, n4, n3), self.strides):
            box = nn.Sequential(
                conv_bn_silu(ci, box_c, 3), conv_bn_silu(box_c, box_c, 3), nn.Conv2d(box_c, 4 * BINS, 1)
            )
            cls = nn.Sequential(
                conv_bn_silu(ci, cls_c, 3), conv_bn_silu(cls_c, cls_c, 3), nn.Conv2d(cls_c, num_classes, 1)
            )
            nn.init.constant_(box[-1].bias, 1.0)  # every bin alike: each side starts at 7.5 strides, the bins' mean
            # about 5 objects per image among (prior_size / stride)^2 cells, so the first steps are not all positives
            nn.init.constant_(cls[-1].bias, math.log(5 / num_classes / (prior_size / stride) ** 2))
            self.box_branches.append(box)
            self.cls_branches.append(cls)
        self.register_buffer("bins", torch.arange(BINS, dtype=torch.float32), persistent=False)
        self._tables: dict[tuple, dict[str, torch.Tensor]] = {}  # see tables()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c3, c4, c5 = self.backbone(images)[-3:]
        p5 = self.reduce5(c5)
        p4 = self.top_down4(torch.cat([F.interpolate(p5, size=c4.shape[-2:], mode="nearest"), c4], 1))
        p3 = self.top_down3(torch.cat([F.interpolate(p4, size=c3.shape[-2:], mode="nearest"), c3], 1))
        n4 = self.bottom_up4(torch.cat([self.down3(p3), p4], 1))
        n5 = self.bottom_up5(torch.cat([self.down4(n4), p5], 1))
        outs = []
        for feature, box, cls in zip((n5, n4, p3), self.box_branches, self.cls_branches):
            out = torch.cat([box(feature), cls(feature)], 1)  # [B, 4 * BINS + C, H, W]
            outs.append(out.flatten(2).transpose(1, 2))  # [B, H * W, 4 * BINS + C]
        return torch.cat(outs, dim=1)

    def level_shapes(self, height: int, width: int) -> list[tuple[int, int]]:
        """(H_l, W_l) of each output for an input of this size (host ints: no device sync)."""
        return [(math.ceil(height / s), math.ceil(width / s)) for s in self.strides]

    def tables(self, height: int, width: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per prediction ``points`` [N, 2] (the cell's centre, px) and ``strides`` [N, 1] px, made once per input
        size and device, so a training step copies nothing from the host."""
        key = (height, width, str(device))
        if key in self._tables and not torch.compiler.is_compiling():
            return self._tables[key]
        points, strides = [], []
        for (h, w), s in zip(self.level_shapes(height, width), self.strides):
            y, x = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            points.append((torch.stack([x, y], dim=-1).view(h * w, 2).float() + 0.5) * s)
            strides.append(torch.full((h * w, 1), float(s), device=device))
        table = {"points": torch.cat(points), "strides": torch.cat(strides)}
        if not torch.compiler.is_compiling():  # traced tensors must not outlive the trace
            self._tables[key] = table
        return table

    def distances(self, raw: torch.Tensor) -> torch.Tensor:
        """raw [B, N, 4 * BINS + C] -> each side's expected distance [B, N, 4] (l, t, r, b) in strides, 0..BINS-1."""
        logits = raw[..., : 4 * BINS].float().unflatten(-1, (4, BINS))
        return logits.softmax(-1) @ self.bins

    def decode(self, raw: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """raw [B, N, 4 * BINS + C] -> boxes [B, N, 4] (xyxy px of the input) and class scores [B, N, C]."""
        t = self.tables(height, width, raw.device)
        ltrb = self.distances(raw) * t["strides"]
        boxes = torch.cat([t["points"] - ltrb[..., :2], t["points"] + ltrb[..., 2:]], dim=-1)
        return boxes, raw[..., 4 * BINS :].float().sigmoid()


# ============================================================================================
# Loss: task-aligned assignment (TOOD), then CIoU, distribution focal and class BCE losses
# ============================================================================================
@torch.no_grad()
def assign_aligned(
    scores: torch.Tensor,
    boxes: torch.Tensor,
    points: torch.Tensor,
    gt_boxes: torch.Tensor,
    gt_labels: torch.Tensor,
    gt_weights: torch.Tensor,
    topk: int = 10,
    alpha: float = 0.5,
    beta: float = 6.0,
) -> dict[str, torch.Tensor]:
    """Task-aligned assignment. Shapes: predictions' ``scores`` [B, N, C] (probabilities) and ``boxes``
    [B, N, 4] xyxy px, their ``points`` [N, 2] px; ground truths ``gt_*`` [B, M(, 4)], weight 0 = padding.

    A prediction is a candidate for a ground truth when its point lies inside the box; each box takes its
    ``topk`` candidates of highest alignment t = s^alpha * IoU^beta > 0 (s: the predicted score of the box's
    class, IoU: of the predicted box with it); a prediction two boxes took goes to the one its box overlaps
    most. Returns ``positive`` [B, N] bool, the assigned ``boxes`` [B, N, 4] (a unit box at negatives),
    ``labels`` [B, N], and ``scores`` [B, N, C]: the class's soft target t / max t of its box x the box's best
    IoU among its positives x the box's mixup weight (0 elsewhere). Dense, no host sync: every image pads
    its boxes to M.
    """
    b, m = gt_labels.shape
    eps = 1e-9
    real = gt_weights > 0  # [B, M]
    sides = torch.cat([points - gt_boxes[..., None, :2], gt_boxes[..., None, 2:] - points], dim=-1)  # [B, M, N, 4]
    inside = (sides.amin(-1) > eps) & real[..., None]  # [B, M, N]
    iou = batch_iou(gt_boxes, boxes) * inside
    class_score = scores.gather(-1, gt_labels[:, None, :].expand(-1, scores.shape[1], -1)).transpose(1, 2)
    metric = class_score.pow(alpha) * iou.pow(beta) * inside  # [B, M, N]
    top = metric.topk(min(topk, metric.shape[-1]), dim=-1).indices
    # fewer than topk candidates with some alignment (a predicted box that misses the box has none): only those
    chosen = torch.zeros_like(inside).scatter_(-1, top, True) & (metric > 0)
    # a prediction chosen by several boxes: the box it overlaps most
    owner = iou.masked_fill(~chosen, -1.0).argmax(1)  # [B, N]
    chosen &= F.one_hot(owner, m).transpose(1, 2).bool()
    positive = chosen.any(1)  # [B, N]
    best_metric = (metric * chosen).amax(-1, keepdim=True)  # [B, M, 1] over each box's positives
    best_iou = (iou * chosen).amax(-1, keepdim=True)
    soft = (metric * chosen * best_iou / (best_metric + eps)).amax(1)  # [B, N]: one box per prediction now
    rows = torch.arange(b, device=gt_boxes.device)[:, None]
    target_boxes = torch.where(positive[..., None], gt_boxes[rows, owner], gt_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]))
    labels = gt_labels[rows, owner]
    soft = soft * gt_weights[rows, owner] * positive
    return {
        "positive": positive,
        "boxes": target_boxes,
        "labels": labels,
        "scores": F.one_hot(labels, scores.shape[-1]).float() * soft[..., None],
    }


def free_loss(
    model: YOLOFree,
    raw: torch.Tensor,
    targets: dict[str, torch.Tensor],
    height: int,
    width: int,
    mean_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The anchor-free head's three losses, each a sum over predictions divided by the total soft target mass
    (the sum of the assigned class scores over the batch, at least 1), as YOLOv8 normalises them; with several
    processes the mass is their mean (``mean_over_processes``, an all-reduce), so that the gradient DDP averages
    is that of one process on the whole global batch:

    - ``loss_box``: 1 - CIoU of the predicted and assigned boxes, weighted by the soft target;
    - ``loss_dfl``: GFL's distribution focal loss, the cross-entropy of each side's bins with the two integer
      bins around the true distance (weighted by nearness), mean over the 4 sides, weighted likewise;
    - ``loss_cls``: BCE of every prediction's class logits with the soft targets (0 at negatives).

    raw [B, N, 4 * BINS + C]; targets from the collate: boxes [B, M, 4] px, labels [B, M], weights [B, M].
    """
    raw = raw.float()  # geometry and the losses in fp32 under autocast
    t = model.tables(height, width, raw.device)
    boxes, scores = model.decode(raw, height, width)
    cls_logits = raw[..., 4 * BINS :]
    a = assign_aligned(
        scores.detach(),
        boxes.detach(),
        t["points"],
        targets["boxes"].float(),
        targets["labels"],
        targets["weights"].float(),
    )
    mass = a["scores"].sum()
    mass = (mean_over_processes(mass) if mean_over_processes is not None else mass).clamp(min=1.0)
    weight = a["scores"].sum(-1)  # [B, N]: 0 at negatives
    box_term = 1 - box_ciou(boxes, a["boxes"])  # [B, N]; finite gradients on collapsed boxes too
    # the true distances in strides, just inside the last bin so that both neighbours exist
    true = torch.cat([t["points"] - a["boxes"][..., :2], a["boxes"][..., 2:] - t["points"]], -1) / t["strides"]
    true = true.clamp(0, BINS - 1 - 0.01)
    left = true.long()
    near_left = left + 1 - true  # weight of the lower bin: 1 when the distance is exactly an integer
    log_p = raw[..., : 4 * BINS].unflatten(-1, (4, BINS)).log_softmax(-1)  # [B, N, 4, BINS]
    dfl = -(
        log_p.gather(-1, left[..., None])[..., 0] * near_left
        + log_p.gather(-1, left[..., None] + 1)[..., 0] * (1 - near_left)
    ).mean(-1)
    cls = F.binary_cross_entropy_with_logits(cls_logits, a["scores"], reduction="sum")
    return {
        "loss_box": (box_term * weight).sum() / mass,
        "loss_dfl": (dfl * weight).sum() / mass,
        "loss_cls": cls / mass,
    }
