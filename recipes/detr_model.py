"""DETR's model and loss, beside ``recipes/detr.py`` (which builds them from its config and trains them).

- ``DETR``: backbone -> 1x1 projection + 2-D sine positions -> post-norm transformer encoder and
  decoder -> class head (C + 1, the last is no-object) and 3-layer box MLP (normalised cx, cy, w, h),
  the outputs of every decoder layer for the auxiliary losses.
- ``HungarianMatcher``: predictions to targets one to one at the lowest cost (scipy), per layer.
- ``SetCriterion``: cross-entropy (no-object down-weighted), L1 and GIoU of matched boxes, per layer,
  as a dict of terms with the ``weight_dict`` that sums them.
- ``postprocess``: outputs -> scores, labels and boxes in each image's original pixels; ``detect``: a
  model's (or its ONNX export's) detections on a loader, for the evaluation and ``--predict``.

Tensor shapes are in the docstrings: B images, Q queries, C classes, T_i targets of image i, L decoder
layers, d the transformer width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou

from common import UserError
from common.artifacts.export import OnnxModel
from common.detection.boxes import rescale_boxes, without_tiny


# ============================================================================================
# Model: backbone -> projection + sine positions -> transformer -> class and box heads
# ============================================================================================
def sine_position_encoding(mask: torch.Tensor, d_model: int, temperature: float = 10000.0) -> torch.Tensor:
    """DETR's 2-D sine encoding: ``mask`` [B, H, W] (True = padding) -> [B, H, W, d_model].

    Each pixel's row and column are counted over valid pixels only, normalised to (0, 2 pi] by the
    image's own extent, and each encoded by d_model / 2 sines and cosines of geometric frequencies;
    the first half of the channels is y, the second x.
    """
    valid = (~mask).float()
    y = valid.cumsum(1)
    x = valid.cumsum(2)
    y = y / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = x / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    half = d_model // 2
    dim_t = temperature ** (2 * (torch.arange(half, device=mask.device) // 2) / half)
    pos_x, pos_y = x[..., None] / dim_t, y[..., None] / dim_t  # [B, H, W, half]
    pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3)


class EncoderLayer(nn.Module):
    """Post-norm (as in the paper) self-attention + feed-forward; positions added to queries and keys
    only, never to the values. Tensors [B, N, d]."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, src: torch.Tensor, pos: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        q = k = src + pos
        src = self.norm1(src + self.drop1(self.self_attn(q, k, src, key_padding_mask=padding, need_weights=False)[0]))
        return self.norm2(src + self.drop2(self.ff(src)))


class DecoderLayer(nn.Module):
    """Post-norm self-attention among the queries, cross-attention to the encoder's memory,
    feed-forward. ``query_pos`` (the learned object queries) is added to the queries of both
    attentions, ``pos`` (the sine encoding) to the memory's keys."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2, self.drop3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        pos: torch.Tensor,
        query_pos: torch.Tensor,
        padding: torch.Tensor | None,
    ) -> torch.Tensor:
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.drop1(self.self_attn(q, k, tgt, need_weights=False)[0]))
        attended = self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=padding, need_weights=False)[
            0
        ]
        tgt = self.norm2(tgt + self.drop2(attended))
        return self.norm3(tgt + self.drop3(self.ff(tgt)))


class MLP(nn.Sequential):
    """``layers`` linear layers with ReLU between them (DETR's box head: 3 layers)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, layers: int) -> None:
        dims = [d_in] + [d_hidden] * (layers - 1)
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        super().__init__(*blocks, nn.Linear(dims[-1], d_out))


class DETR(nn.Module):
    """``(images [B, 3, H, W], mask [B, H, W] True on padding) -> {"pred_logits": [B, Q, C + 1],
    "pred_boxes": [B, Q, 4] normalised (cx, cy, w, h) of each image's unpadded extent, "aux_outputs":
    [{"pred_logits", "pred_boxes"}] for decoder layers 1 .. L-1}`` (DETR's output format).

    ``backbone`` is a timm ``features_only`` model whose last returned level is read (its
    ``feature_info`` gives the channels); ``num_classes`` excludes no-object; the defaults are the
    paper's DETR-R50 (6 + 6 layers of width 256, 100 queries)."""

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        num_queries: int = 100,
        d_model: int = 256,
        nheads: int = 8,
        enc_layers: int = 6,
        dec_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        aux_loss: bool = True,
    ) -> None:
        super().__init__()
        d = d_model
        self.backbone = backbone
        self.input_proj = nn.Conv2d(backbone.feature_info.channels()[-1], d, 1)
        self.query_embed = nn.Embedding(num_queries, d)
        self.encoder = nn.ModuleList(EncoderLayer(d, nheads, dim_feedforward, dropout) for _ in range(enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(d, nheads, dim_feedforward, dropout) for _ in range(dec_layers))
        self.decoder_norm = nn.LayerNorm(d)  # applied to every decoder layer's output (all feed the heads)
        self.class_embed = nn.Linear(d, num_classes + 1)
        self.bbox_embed = MLP(d, d, 4, 3)
        self.aux_loss = aux_loss
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Xavier-uniform for the transformer's matrices, as DETR initialises its transformer."""
        for module in (self.encoder, self.decoder):
            for p in module.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> dict:
        feature = self.backbone(images)[-1]  # [B, C_b, h, w]
        # the padding mask at the feature's resolution (nearest, as DETR)
        mask = F.interpolate(mask[:, None].float(), size=feature.shape[-2:]).bool()[:, 0]  # [B, h, w]
        src = self.input_proj(feature).flatten(2).transpose(1, 2)  # [B, h*w, d]
        # fp32 under autocast too, so `src + pos` is rounded once, by the attention's input projection, not twice
        pos = sine_position_encoding(mask, src.shape[-1]).flatten(1, 2)  # [B, h*w, d]
        padding = mask.flatten(1)  # [B, h*w]
        memory = src
        for layer in self.encoder:
            memory = layer(memory, pos, padding)
        query_pos = self.query_embed.weight[None].expand(images.shape[0], -1, -1)  # [B, Q, d]
        tgt = torch.zeros_like(query_pos)
        hidden = []
        for layer in self.decoder:
            tgt = layer(tgt, memory, pos, query_pos, padding)
            hidden.append(self.decoder_norm(tgt))
        hs = torch.stack(hidden)  # [L, B, Q, d]
        logits = self.class_embed(hs)
        # boxes in fp32 whatever the autocast: a bf16 fraction of the image is off by up to 1/256 of it
        with torch.autocast(hs.device.type, enabled=False):
            boxes = self.bbox_embed(hs.float()).sigmoid()
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])]
        return out


# ============================================================================================
# Loss: Hungarian matching, then cross-entropy (no-object down-weighted), L1 and GIoU per layer
# ============================================================================================
class HungarianMatcher(nn.Module):
    """One-to-one assignment of predictions to targets at the lowest total cost
    ``cost_class * -p(target class) + cost_bbox * L1(boxes) + cost_giou * -GIoU(boxes)``.

    ``forward(outputs, targets)``: ``outputs`` with ``pred_logits`` [B, Q, C + 1] and ``pred_boxes``
    [B, Q, 4] (normalised cxcywh), ``targets`` a list of B dicts with ``labels`` [T_i] and ``boxes``
    [T_i, 4] (normalised cxcywh) -> a list of B pairs ``(query indices, target indices)``, int64 CPU
    tensors of length min(Q, T_i) (empty for an image without objects).
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0) -> None:
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise UserError("matcher costs cannot all be 0")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def cost(self, outputs: dict, targets: list[dict]) -> torch.Tensor:
        """[B, Q, sum T_i] on the device: every prediction against every target of the batch (the
        blocks off the diagonal are never used; one batched computation is cheaper than B small ones)."""
        logits, boxes = outputs["pred_logits"].float(), outputs["pred_boxes"].float()
        prob = logits.flatten(0, 1).softmax(-1)  # [B*Q, C + 1]
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_boxes = torch.cat([t["boxes"] for t in targets]).float()
        cost_class = -prob[:, tgt_ids]  # -p(class): 1 - p in the paper, the constant does not matter
        cost_bbox = torch.cdist(boxes.flatten(0, 1), tgt_boxes, p=1)
        cost_giou = -generalized_box_iou(
            box_convert(boxes.flatten(0, 1), "cxcywh", "xyxy"), box_convert(tgt_boxes, "cxcywh", "xyxy")
        )
        c = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        return c.view(*logits.shape[:2], -1)

    @torch.no_grad()
    def match_layers(self, layers: list[dict], targets: list[dict]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``forward`` for several outputs at once (the final layer and the auxiliary ones): their cost
        matrices are stacked and copied to the host in one ``.cpu()``. scipy needs them there, so this
        one copy is the step's only host-device synchronisation, inherent to Hungarian matching."""
        sizes = [len(t["boxes"]) for t in targets]
        costs = torch.stack([self.cost(o, targets) for o in layers]).cpu()  # [L, B, Q, sum T]
        matches = []
        for layer_cost in costs:
            pairs = []
            for i, c in enumerate(layer_cost.split(sizes, -1)):  # image i's targets, from every query of image i
                rows, cols = linear_sum_assignment(c[i].numpy())
                pairs.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
            matches.append(pairs)
        return matches

    def forward(self, outputs: dict, targets: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.match_layers([outputs], targets)[0]


class SetCriterion(nn.Module):
    """DETR's loss: match, then per layer

    - ``loss_ce``: cross-entropy over all queries, unmatched ones towards no-object (class C) with
      weight ``eos_coef``, the weighted mean (sum of weight x CE / sum of weights);
    - ``loss_bbox``: L1 of matched boxes (normalised cxcywh), summed / num_boxes;
    - ``loss_giou``: 1 - GIoU of matched boxes, summed / num_boxes;
    - logged only (no gradient): ``class_error`` (100 - accuracy of matched queries, %) and
      ``cardinality_error`` (|predicted objects - true objects| per image, predicted = not no-object).

    ``num_boxes`` is the batch's target count averaged over processes (all_reduce, at least 1), so every
    process normalises alike. Auxiliary layers' terms carry the suffix ``_i`` (``loss_ce_0`` ...).
    ``weight_dict`` names the weight of each term that enters the total; ``losses`` picks groups from
    ``labels``, ``boxes``, ``cardinality``.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        weight_dict: dict[str, float],
        eos_coef: float,
        losses: list[str],
    ) -> None:
        super().__init__()
        self.num_classes, self.matcher, self.weight_dict, self.eos_coef, self.losses = (
            num_classes,
            matcher,
            weight_dict,
            eos_coef,
            losses,
        )
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(self, outputs, targets, indices, num_boxes, log: bool = True) -> dict[str, torch.Tensor]:
        logits = outputs["pred_logits"].float()
        batch_idx, src_idx = self._src(indices, logits.device)
        matched = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)]).to(logits.device)
        classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        classes[batch_idx, src_idx] = matched
        out = {"loss_ce": F.cross_entropy(logits.transpose(1, 2), classes, self.empty_weight)}
        if log:
            with torch.no_grad():
                correct = (logits[batch_idx, src_idx].argmax(-1) == matched).float()
                out["class_error"] = 100 - 100 * correct.sum() / max(len(matched), 1)  # no match: 100
        return out

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes) -> dict[str, torch.Tensor]:
        logits = outputs["pred_logits"]
        count = (logits.argmax(-1) != logits.shape[-1] - 1).sum(1).float()  # [B]
        truth = torch.tensor([float(len(t["labels"])) for t in targets], device=logits.device)
        return {"cardinality_error": F.l1_loss(count, truth)}

    def loss_boxes(self, outputs, targets, indices, num_boxes) -> dict[str, torch.Tensor]:
        batch_idx, src_idx = self._src(indices, outputs["pred_boxes"].device)
        src = outputs["pred_boxes"][batch_idx, src_idx].float()  # [M, 4]
        tgt = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)]).to(src.device).float()
        giou = torch.diag(generalized_box_iou(box_convert(src, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy")))
        return {
            "loss_bbox": F.l1_loss(src, tgt, reduction="none").sum() / num_boxes,
            "loss_giou": (1 - giou).sum() / num_boxes,
        }

    @staticmethod
    def _src(indices, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(image index, query index) of every matched prediction, as one host-to-device copy each."""
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for src, _ in indices])
        return batch_idx.to(device, non_blocking=True), src_idx.to(device, non_blocking=True)

    def get_loss(self, loss: str, outputs, targets, indices, num_boxes, **kwargs) -> dict[str, torch.Tensor]:
        fns = {"labels": self.loss_labels, "cardinality": self.loss_cardinality, "boxes": self.loss_boxes}
        if loss not in fns:
            raise ValueError(f"unknown loss '{loss}', expected one of {sorted(fns)}")
        return fns[loss](outputs, targets, indices, num_boxes, **kwargs)

    def forward(self, outputs: dict, targets: list[dict]) -> dict[str, torch.Tensor]:
        device = outputs["pred_logits"].device
        layers = [outputs] + list(outputs.get("aux_outputs", []))
        matches = self.matcher.match_layers(layers, targets)  # every layer matched on its own, one host copy
        # the mean over processes of the target count: a device all-reduce, never read on the host
        num_boxes = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(num_boxes)
            num_boxes = num_boxes / dist.get_world_size()
        num_boxes = num_boxes.clamp(min=1)
        losses: dict[str, torch.Tensor] = {}
        for i, (layer, indices) in enumerate(zip(layers, matches)):
            suffix = "" if i == 0 else f"_{i - 1}"
            for loss in self.losses:
                kwargs = {"log": False} if loss == "labels" and i > 0 else {}  # class_error of the last layer only
                terms = self.get_loss(loss, layer, targets, indices, num_boxes, **kwargs)
                losses.update({k + suffix: v for k, v in terms.items()})
        return losses


# ============================================================================================
# Post-processing: outputs -> detections in the original image's pixels (evaluation, --predict)
# ============================================================================================
@torch.no_grad()
def detections(outputs: dict, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DETR's outputs -> ``boxes [B, Q, 4]`` XYXY in the pixels of images of ``sizes`` ([B, 2] as (h, w)),
    ``scores [B, Q]`` and ``labels [B, Q]``: softmax, the best class other than no-object per query. Predicted
    boxes are fractions of the unpadded image, so its size is all that is needed, whatever resize the
    transforms did. No NMS and no threshold; batched, so that it can be exported."""
    prob = outputs["pred_logits"].float().softmax(-1)
    scores, labels = prob[..., :-1].max(-1)
    h, w = sizes.to(prob.device, torch.float32).unbind(1)
    scale = torch.stack([w, h, w, h], 1)[:, None]  # [B, 1, 4]
    return box_convert(outputs["pred_boxes"].float(), "cxcywh", "xyxy") * scale, scores, labels


def postprocess(outputs: dict, orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """:func:`detections` in each image's original ``(h, w)`` (``orig_sizes`` [B, 2]), per image
    ``{scores [Q], labels [Q], boxes [Q, 4]}``."""
    boxes, scores, labels = detections(outputs, orig_sizes)
    return [{"scores": s, "labels": c, "boxes": b} for s, c, b in zip(scores, labels, boxes)]


def detect(model: nn.Module | OnnxModel, loader: Iterable, accelerator: Accelerator) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader`` (recipes/detr_data.py's collate: images, mask, targets), per image: ``image_id``
    and the detections (``boxes`` XYXY in the original image's pixels, ``scores``, ``labels`` as class indices
    0..C-1); the model in eval mode, or its ONNX export (boxes in the resized image's pixels, taken back to the
    original's)."""
    for images, mask, targets in loader:
        orig = torch.tensor([t["orig_size"] for t in targets])
        if isinstance(model, OnnxModel):
            boxes, scores, labels = (t.to(images.device) for t in model(images, mask))
            found = [
                {"boxes": rescale_boxes(b, t["size"], t["orig_size"]), "scores": s, "labels": c}
                for b, s, c, t in zip(boxes, scores, labels, targets)
            ]
        else:
            with torch.no_grad(), accelerator.autocast():
                found = postprocess(model(images, mask), orig)
        yield [without_tiny({"image_id": t["image_id"], **d}) for d, t in zip(found, targets)]


class Exported(nn.Module):
    """What is exported: ``(images [B, 3, H, W]`` normalised and padded, ``mask [B, H, W]`` True on padding)
    -> :func:`detections` (boxes in the pixels of each unpadded input image, scores, labels)."""

    def __init__(self, model: DETR) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = ~mask  # each image fills the top-left corner of the padded batch
        sizes = torch.stack([valid[:, :, 0].sum(1), valid[:, 0, :].sum(1)], 1)  # [B, 2] (h, w)
        return detections(self.model(images, mask), sizes)
