"""Faster R-CNN's model, beside recipes/faster_rcnn.py (as recipes/faster_rcnn_data.py holds its data helpers):
torchvision's presets or a timm ``features_only`` backbone under torchvision's FPN, the region proposal network
and the RoI heads wired into one module (``TwoStageDetector``: the four losses when training, detections in the
input images' pixels when evaluating), the integer resize that keeps an exported graph's sizes those of eager,
the exported wrapper (one image -> boxes, scores, labels, NMS inside the graph) and ``detect`` (a model's
detections on a loader, for the evaluation and ``--predict``). ``create_model`` builds the detector from the
recipe's Config; copy faster_rcnn.py and its faster_rcnn_*.py files together.
"""

from __future__ import annotations

import inspect
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import timm
import torch
import torchvision
from accelerate import Accelerator
from torch import nn
from torchvision.models import MobileNet_V3_Large_Weights, ResNet50_Weights
from torchvision.models.detection.faster_rcnn import FasterRCNN, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNN, MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.roi_heads import RoIHeads, paste_masks_in_image
from torchvision.models.detection.rpn import AnchorGenerator, RegionProposalNetwork, RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from common import UserError
from common.artifacts.export import OnnxModel
from common.detection.boxes import rescale_boxes, without_tiny
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD
from common.detection.masks import rles_of
from common.models import create_timm_model, freeze_stages, hub_offline, reachable
from common.weights import load_backbone

# torchvision's Faster R-CNN presets -> the ImageNet weights --pretrained_backbone gives: torchvision's own choice,
# IMAGENET1K_V1, not "DEFAULT" (the later V2 classifiers); why: docs/faster_rcnn.md, "Backbones"
PRESETS = {
    "fasterrcnn_resnet50_fpn": ResNet50_Weights.IMAGENET1K_V1,
    "fasterrcnn_resnet50_fpn_v2": ResNet50_Weights.IMAGENET1K_V1,
    "fasterrcnn_mobilenet_v3_large_fpn": MobileNet_V3_Large_Weights.IMAGENET1K_V1,
    "fasterrcnn_mobilenet_v3_large_320_fpn": MobileNet_V3_Large_Weights.IMAGENET1K_V1,
    "maskrcnn_resnet50_fpn": ResNet50_Weights.IMAGENET1K_V1,  # Mask R-CNN: the same with a mask head (--masks true)
    "maskrcnn_resnet50_fpn_v2": ResNet50_Weights.IMAGENET1K_V1,
}
# A preset's backbone stages as torchvision's trainable_backbone_layers counts them (the stem is one); which
# stages: docs/faster_rcnn.md, "Backbones"
PRESET_STAGES = {name: 6 if "mobilenet" in name else 5 for name in PRESETS}
# The shorter side a preset's anchors are sized for (torchvision's min_size): at another size the objects shrink or
# grow with the image, and empty anchor_sizes scale the preset's anchors with them
PRESET_SIDES = {name: 320 if "320" in name else 800 for name in PRESETS}
# The RPN and RoI sampling budgets of a timm backbone whose fields are left empty / 0: the demo's, sized for at most
# 6 objects per 96 px scene; a preset keeps torchvision's own (docs/faster_rcnn.md, "Backbones")
TIMM_BUDGETS = {
    "rpn_pre_nms_top_n": [200, 200],
    "rpn_post_nms_top_n": [100, 100],
    "rpn_batch_size_per_image": 128,
    "box_batch_size_per_image": 32,
}
# The losses as torchvision names them -> as this recipe logs them (loss_weights: without "loss_"; mask only with
# --masks). Each is already a mean over the sampled anchors, proposals or mask pixels (docs/faster_rcnn.md)
LOSS_NAMES = {
    "loss_objectness": "loss_rpn_objectness",
    "loss_rpn_box_reg": "loss_rpn_box",
    "loss_classifier": "loss_roi_classifier",
    "loss_box_reg": "loss_roi_box",
    "loss_mask": "loss_mask",
}
# A mask head's output side, cells: its RoIAlign side (torchvision's 14) doubled by the transposed convolution
MASK_SIDE = 28
PASTE_PIXELS = 1 << 24  # masks pasted into full images at once: at most this many pixels (64 MB of float32)


class ModelSettings(Protocol):
    """What the model reads of recipes/faster_rcnn.py's Config (a dataclass; its comments say more)."""

    model: str  # a timm model (features_only) or a torchvision preset (PRESETS)
    model_kwargs: dict  # extra timm.create_model / torchvision FasterRCNN arguments
    pretrained: bool  # timm: ImageNet backbone; presets: COCO weights
    pretrained_backbone: bool  # presets: ImageNet backbone weights
    init_backbone: str  # timm: safetensors of the same timm model for the backbone
    out_indices: list[int]  # timm feature levels (1 = stride 4)
    fpn_channels: int  # FPN width at every level
    extra_pool: bool  # one more FPN level by max-pooling the coarsest
    anchor_sizes: list[list[float]]  # px per FPN level, as many at each; empty: the model's own
    aspect_ratios: list[float]  # height / width, at every level
    min_size: list[int]  # shorter side, px: one drawn per training image, evaluation at the last
    max_size: int  # longer side at most, px
    rpn_pre_nms_top_n: list[int]  # proposals per level before NMS, [train, eval]; empty: the model's own
    rpn_post_nms_top_n: list[int]  # proposals per image after NMS, [train, eval]; empty: the model's own
    rpn_batch_size_per_image: int  # anchors sampled per image for the RPN losses; 0: the model's own
    roi_size: int  # RoIAlign output side, cells (timm)
    roi_sampling_ratio: int  # bilinear samples per cell side (timm)
    box_head_dim: int  # the two-layer MLP head's width (timm)
    box_batch_size_per_image: int  # proposals sampled per image for the RoI losses; 0: the model's own
    box_score_thresh: float  # detections scoring below this are dropped
    box_nms_thresh: float  # per-class NMS IoU of the final detections
    box_detections_per_img: int  # detections kept per image
    freeze_at: int  # frozen backbone stages, stem counted as 1
    frozen_bn: bool  # backbone batch norm as fixed affine layers
    masks: bool  # a Mask R-CNN mask head on the same RoIs
    mask_head_dim: int  # the mask head's convolutions' width (timm)


# ============================================================================================
# Model: (transform) -> backbone + FPN -> RPN -> RoI heads
# ============================================================================================
class TimmFPN(nn.Module):
    """A timm ``features_only`` backbone and torchvision's FPN: ``[B, 3, H, W] -> OrderedDict`` of
    ``[B, fpn_channels, H / s, W / s]`` for the strides s of ``out_indices`` (plus one coarser
    max-pooled level with ``extra_pool``). ``out_channels`` is what the RPN and RoI heads read."""

    def __init__(self, body: nn.Module, fpn_channels: int, extra_pool: bool) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(
            body.feature_info.channels(), fpn_channels, LastLevelMaxPool() if extra_pool else None
        )
        self.out_channels = fpn_channels

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(self.body(x))))


class ExactResize(GeneralizedRCNNTransform):
    """torchvision's transform with each image's resized size computed in integers: the shorter side to
    ``min_size`` unless the longer would pass ``max_size`` (then the longer to ``max_size``), the other
    side rounded down exactly. torchvision computes the scale in float64 when eager and in float32 in a
    traced graph, which round one pixel apart on about one photo size in six (750 x 1000 -> 800 or 799
    rows), and a graph that resizes to another size finds other boxes and scores."""

    @classmethod
    def like(cls, transform: GeneralizedRCNNTransform) -> ExactResize:
        return cls(transform.min_size, transform.max_size, transform.image_mean, transform.image_std)

    def resize(self, image: torch.Tensor, target: dict | None = None) -> tuple[torch.Tensor, dict | None]:
        if self.training and self._skip_resize:
            return image, target
        size = self.torch_choice(self.min_size) if self.training else self.min_size[-1]
        sides = torch._shape_as_tensor(image)[-2:]  # (h, w), int64: traced as the graph's input shape
        short, long = sides.min(), sides.max()
        by_short = size * long <= self.max_size * short
        new = sides * torch.where(by_short, size, self.max_size) // torch.where(by_short, short, long)
        new = [new[0], new[1]] if torch.jit.is_tracing() else new.tolist()  # the graph keeps them symbolic
        out = nn.functional.interpolate(image[None], size=new, mode="bilinear", align_corners=False)[0]
        if target is not None:
            target["boxes"] = resize_boxes(target["boxes"], image.shape[-2:], out.shape[-2:])
            if "masks" in target:  # as torchvision resizes them: nearest, to the image's new size
                masks = nn.functional.interpolate(target["masks"][:, None].float(), size=out.shape[-2:])
                target["masks"] = masks[:, 0].byte()
        return out, target


class TwoStageDetector(nn.Module):
    """Faster R-CNN (Mask R-CNN with mask heads) as one forward, so that DDP sees every parameter's gradient:

    training ``(images, targets) -> {loss_rpn_objectness, loss_rpn_box, loss_roi_classifier, loss_roi_box}``
    (and ``loss_mask``); eval ``images -> [{boxes [K, 4] XYXY in the input image's pixels, labels [K] (1..C),
    scores [K]}]``, with mask heads also ``mask_probs [K, 28, 28]``: each detection's mask probabilities over its
    box (:func:`pasted_masks` places them in an image). ``images``: a list of [3, H_i, W_i] in 0..1.
    """

    def __init__(
        self, transform: GeneralizedRCNNTransform, backbone: nn.Module, rpn: RegionProposalNetwork, roi_heads: RoIHeads
    ) -> None:
        super().__init__()
        self.transform, self.backbone, self.rpn, self.roi_heads = transform, backbone, rpn, roi_heads
        # Box regressions leave their heads in fp32 whatever the autocast: BoxCoder casts anchors and proposals
        # to the regression's dtype, and bf16 would round every box (docs/faster_rcnn.md, "Mixed precision")
        for head in (rpn.head, roi_heads.box_predictor, roi_heads.mask_predictor):
            if head is not None:
                head.register_forward_hook(_float_outputs)
        # Anchors in fp32 whatever the autocast: torchvision's AnchorGenerator builds them in the features' dtype
        rpn.anchor_generator.register_forward_pre_hook(_fp32_grid)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        original_sizes = [tuple(image.shape[-2:]) for image in images]
        # resize (min_size / max_size), normalise (ImageNet mean/std), pad to a multiple of 32: an
        # ImageList of [B, 3, H, W] with each image's resized size; target boxes are resized with it
        batch, targets = self.transform(images, targets)
        features = self.backbone(batch.tensors)  # level name -> [B, F, H / s, W / s]
        proposals, rpn_losses = self.rpn(batch, features, targets)  # per image [post_nms_top_n, 4] px
        detections, roi_losses = self.roi_heads(features, proposals, batch.image_sizes, targets)
        if self.training:
            return {LOSS_NAMES[k]: v for k, v in {**rpn_losses, **roi_losses}.items()}
        # masks stay at 28 x 28 over their boxes: torchvision's postprocess would paste each into a full image here
        probs = [d.pop("masks")[:, 0] for d in detections] if "masks" in (detections[0] if detections else {}) else []
        found = self.transform.postprocess(detections, batch.image_sizes, original_sizes)  # back to input px
        for d, p in zip(found, probs):
            d["mask_probs"] = p
        return found

    @property
    def masks(self) -> bool:
        """Whether the model segments (has mask heads)."""
        return self.roi_heads.has_mask()


class Exported(nn.Module):
    """What is exported: one image ``[3, H, W]`` (0..1, any size; the model resizes and normalises it) ->
    ``boxes [K, 4]`` XYXY in its pixels, ``scores [K]``, ``labels [K]`` (0..C-1), NMS inside the graph; a
    segmenting model also ``mask_probs [K, 28, 28]`` over each box (pasted outside the graph: :func:`pasted_masks`)."""

    def __init__(self, model: TwoStageDetector) -> None:
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        found = self.model([image])[0]
        out = (found["boxes"], found["scores"], found["labels"] - 1)
        return (*out, found["mask_probs"]) if "mask_probs" in found else out


def _fp32_grid(module: nn.Module, inputs: tuple[Any, list[torch.Tensor]]) -> tuple[Any, list[torch.Tensor]]:
    """Forward pre-hook of the AnchorGenerator: each feature map [B, F, h, w] handed over as an fp32 view of
    one zero of that shape (no copy), since the generator reads only the maps' shapes, dtype and device."""
    image_list, features = inputs
    return image_list, [f.new_zeros((), dtype=torch.float32).expand(f.shape) for f in features]


def _float_outputs(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: the module's tensors (alone or in tuples and lists) returned as fp32."""
    if isinstance(output, torch.Tensor):
        return output.float()
    return type(output)(_float_outputs(module, inputs, o) for o in output)


def budgets(cfg: ModelSettings, own: dict[str, Any]) -> dict[str, int]:
    """The RPN and RoI sampling budgets as FasterRCNN's keywords (``rpn_pre_nms_top_n_train``, ...): each
    field that is set, else its value in ``own`` (TIMM_BUDGETS), else none (a preset keeps torchvision's)."""
    value = {k: getattr(cfg, k) or own.get(k) for k in TIMM_BUDGETS}
    out = {k: value[k] for k in ("rpn_batch_size_per_image", "box_batch_size_per_image") if value[k]}
    for k in ("rpn_pre_nms_top_n", "rpn_post_nms_top_n"):
        if value[k]:
            out.update({f"{k}_train": value[k][0], f"{k}_test": value[k][1]})
    return out


def preset_model(cfg: ModelSettings, num_classes: int, notes: list[str]) -> TwoStageDetector:
    """A torchvision preset (``cfg.model`` in PRESETS): its own backbone + FPN, heads sized as torchvision
    sizes them, for ``num_classes`` object classes (background is one more)."""
    box_kwargs = dict(
        box_score_thresh=cfg.box_score_thresh,
        box_nms_thresh=cfg.box_nms_thresh,
        box_detections_per_img=cfg.box_detections_per_img,
    )
    builder = getattr(torchvision.models.detection, cfg.model)
    # FasterRCNN passes unknown keywords on to its transform, which ignores them: check them here
    known = set(inspect.signature(MaskRCNN if cfg.model.startswith("maskrcnn") else FasterRCNN).parameters)
    known |= {"size_divisible", "fixed_size"}
    if set(cfg.model_kwargs) - known:
        raise UserError(
            f"model_kwargs {sorted(set(cfg.model_kwargs) - known)} do not fit {cfg.model}: the presets take "
            "torchvision's FasterRCNN arguments (--model_kwargs {} for none)"
        )
    downloads = [torchvision.models.get_model_weights(cfg.model).DEFAULT] if cfg.pretrained else []
    downloads += [PRESETS[cfg.model]] if cfg.pretrained_backbone else []
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    missing = [w.url for w in downloads if not (cache / Path(w.url).name).is_file()]
    flag = "--pretrained" if cfg.pretrained else "--pretrained_backbone"
    if missing and (hub_offline() or not reachable(missing[0])):  # say so now, not after urllib's time-outs
        why = (
            "HF_HUB_OFFLINE is set"
            if hub_offline()
            else f"{urllib.parse.urlsplit(missing[0]).hostname} is not reachable"
        )
        raise UserError(
            f"{flag}: torchvision's weights {', '.join(missing)} are not in {cache} and {why}: download them "
            f"there once with network, or train without {flag}"
        )
    try:
        m = builder(
            weights="DEFAULT" if cfg.pretrained else None,
            weights_backbone=PRESETS[cfg.model] if cfg.pretrained_backbone else None,
            num_classes=91 if cfg.pretrained else num_classes + 1,
            trainable_backbone_layers=PRESET_STAGES[cfg.model] - cfg.freeze_at
            if cfg.pretrained or cfg.pretrained_backbone
            else None,
            min_size=tuple(cfg.min_size),
            max_size=cfg.max_size,
            **budgets(cfg, {}),
            **box_kwargs,
            **cfg.model_kwargs,
        )
    except TypeError as e:
        raise UserError(
            f"model_kwargs {cfg.model_kwargs} do not fit {cfg.model} ({e}); "
            "the presets take torchvision's FasterRCNN arguments (--model_kwargs {} for none)"
        ) from None
    except OSError as e:  # urllib's URLError: no network, or a proxy in the way
        raise UserError(
            f"{flag}: torchvision's weights {', '.join(missing)} could not be downloaded to {cache} "
            f"({type(e).__name__}); download them there once with network, or train without {flag}"
        ) from None
    sizes = [list(s) for s in cfg.anchor_sizes]
    if not sizes and cfg.min_size[-1] != PRESET_SIDES[cfg.model]:  # the preset's anchors, scaled with the image
        scale = cfg.min_size[-1] / PRESET_SIDES[cfg.model]
        sizes = [[round(a * scale) for a in level] for level in m.rpn.anchor_generator.sizes]
        shown = ", ".join("/".join(map(str, level)) for level in sizes)
        notes.append(f"anchors: the preset's x {scale:.2g} for a shorter side of {cfg.min_size[-1]} px: {shown} px")
    if sizes:  # the preset's anchors replaced; a new RPN head when the count per position changes
        m.rpn.anchor_generator = AnchorGenerator(
            tuple(tuple(s) for s in sizes), (tuple(cfg.aspect_ratios),) * len(sizes)
        )
        per_position = m.rpn.anchor_generator.num_anchors_per_location()[0]
        if m.rpn.head.cls_logits.out_channels != per_position:
            m.rpn.head = RPNHead(m.backbone.out_channels, per_position)
    for weights in downloads:  # named in the start banner
        which = "--pretrained" if cfg.pretrained and weights == downloads[0] else "--pretrained_backbone"
        notes.append(f"{which.lstrip('-')}: torchvision's {weights} ({Path(weights.url).name})")
    if cfg.pretrained:  # COCO's 91-way predictors -> ours
        m.roi_heads.box_predictor = FastRCNNPredictor(m.roi_heads.box_predictor.cls_score.in_features, num_classes + 1)
        if m.roi_heads.has_mask():
            m.roi_heads.mask_predictor = MaskRCNNPredictor(256, 256, num_classes + 1)
    if cfg.masks and not m.roi_heads.has_mask():  # a Faster R-CNN preset: Mask R-CNN's mask head, new
        with_mask_heads(m.roi_heads, m.backbone.out_channels, 256, 2, num_classes)
    if cfg.frozen_bn:  # the presets freeze it themselves whenever they load weights
        m.backbone.body = timm.layers.freeze_batch_norm_2d(m.backbone.body)
    return TwoStageDetector(ExactResize.like(m.transform), m.backbone, m.rpn, m.roi_heads)


def with_mask_heads(roi_heads: RoIHeads, channels: int, width: int, sampling_ratio: int, num_classes: int) -> None:
    """Mask R-CNN's mask branch on ``roi_heads``, as torchvision builds it: RoIAlign 14 x 14 from the levels the box
    head reads, four 3 x 3 convolutions of ``width`` channels, a transposed convolution to 28 x 28 and one mask
    logit per class (background is one more of ``num_classes``); trained on the positive proposals' own class."""
    levels = roi_heads.box_roi_pool.featmap_names
    roi_heads.mask_roi_pool = MultiScaleRoIAlign(levels, MASK_SIDE // 2, sampling_ratio)
    roi_heads.mask_head = MaskRCNNHeads(channels, (width,) * 4, 1)
    roi_heads.mask_predictor = MaskRCNNPredictor(width, width, num_classes + 1)
    roi_heads.mask_predictor.register_forward_hook(_float_outputs)  # as the box predictor's: fp32 logits


def pasted_masks(probs: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> list[dict[str, Any]]:
    """Each detection's mask in an image of ``size`` (h, w) as COCO's compressed RLE: its ``probs`` [K, 28, 28]
    placed over its box (``boxes`` [K, 4] XYXY in that image's pixels) as torchvision's Mask R-CNN places them,
    then cut at 0.5. Pasted and encoded a few at a time, so that a photo's hundred masks are never all in memory."""
    per_chunk = max(1, PASTE_PIXELS // max(size[0] * size[1], 1))
    out: list[dict[str, Any]] = []
    for k in range(0, len(probs), per_chunk):
        pasted = paste_masks_in_image(probs[k : k + per_chunk, None].float(), boxes[k : k + per_chunk].float(), size)
        out += rles_of((pasted[:, 0] > 0.5).cpu().numpy())
    return out


def timm_model(cfg: ModelSettings, num_classes: int, notes: list[str]) -> TwoStageDetector:
    """A timm ``features_only`` backbone under TimmFPN, with this recipe's RPN and RoI heads, for
    ``num_classes`` object classes (background is one more)."""
    try:
        body = create_timm_model(
            cfg.model,
            also=f" or a torchvision preset ({', '.join(PRESETS)})",
            features_only=True,
            out_indices=tuple(cfg.out_indices),
            pretrained=cfg.pretrained,
            notes=notes,
            **cfg.model_kwargs,
        )
    except (IndexError, TypeError) as e:
        raise UserError(
            f"model '{cfg.model}' does not take out_indices {cfg.out_indices} and model_kwargs {cfg.model_kwargs}: {e}"
        ) from None
    if cfg.init_backbone:  # before freezing: frozen batch norm takes the loaded statistics
        notes.append(load_backbone(body, cfg.init_backbone))
    freeze_stages(body, cfg.freeze_at)
    if cfg.frozen_bn:
        body = timm.layers.freeze_batch_norm_2d(body)  # BatchNorm2d -> FrozenBatchNorm2d
    backbone = TimmFPN(body, cfg.fpn_channels, cfg.extra_pool)
    strides = body.feature_info.reduction() + ([2 * body.feature_info.reduction()[-1]] if cfg.extra_pool else [])
    sizes = [tuple(s) for s in cfg.anchor_sizes] or [(8 * s,) for s in strides]
    if not cfg.anchor_sizes:  # they follow the backbone: a new model or out_indices needs no new anchors
        notes.append(
            f"anchors: 8 x the FPN strides {'/'.join(map(str, strides))}: {'/'.join(str(s[0]) for s in sizes)} px"
        )
    if len(sizes) != len(strides) or len({len(s) for s in sizes}) != 1:
        raise UserError(
            f"anchor_sizes must give one list of sizes per FPN level, as many at each (the RPN "
            f"head is shared); the FPN has {len(strides)} levels (strides {strides}), got {cfg.anchor_sizes}"
        )
    anchors = AnchorGenerator(tuple(sizes), (tuple(cfg.aspect_ratios),) * len(sizes))
    budget = budgets(cfg, TIMM_BUDGETS)
    rpn = RegionProposalNetwork(
        anchors,
        RPNHead(cfg.fpn_channels, anchors.num_anchors_per_location()[0]),
        fg_iou_thresh=0.7,
        bg_iou_thresh=0.3,
        batch_size_per_image=budget["rpn_batch_size_per_image"],
        positive_fraction=0.5,
        nms_thresh=0.7,
        pre_nms_top_n=dict(training=budget["rpn_pre_nms_top_n_train"], testing=budget["rpn_pre_nms_top_n_test"]),
        post_nms_top_n=dict(training=budget["rpn_post_nms_top_n_train"], testing=budget["rpn_post_nms_top_n_test"]),
    )
    levels = [str(i) for i in range(len(cfg.out_indices))]  # RoIAlign reads the FPN levels, not "pool"
    roi_heads = RoIHeads(
        MultiScaleRoIAlign(levels, cfg.roi_size, cfg.roi_sampling_ratio),
        TwoMLPHead(cfg.fpn_channels * cfg.roi_size**2, cfg.box_head_dim),
        FastRCNNPredictor(cfg.box_head_dim, num_classes + 1),
        fg_iou_thresh=0.5,
        bg_iou_thresh=0.5,
        batch_size_per_image=budget["box_batch_size_per_image"],
        positive_fraction=0.25,
        bbox_reg_weights=None,
        score_thresh=cfg.box_score_thresh,
        nms_thresh=cfg.box_nms_thresh,
        detections_per_img=cfg.box_detections_per_img,
    )
    if cfg.masks:
        with_mask_heads(roi_heads, cfg.fpn_channels, cfg.mask_head_dim, cfg.roi_sampling_ratio, num_classes)
    # the order of min_size matters: training draws one per image, evaluation uses the last
    transform = ExactResize(tuple(cfg.min_size), cfg.max_size, IMAGENET_MEAN, IMAGENET_STD)
    return TwoStageDetector(transform, backbone, rpn, roi_heads)


def create_model(cfg: ModelSettings, num_classes: int, notes: list[str] | None = None) -> TwoStageDetector:
    """The detector for ``num_classes`` object classes (background is one more); the weights it starts from
    (pretrained, pretrained_backbone, init_backbone) are named in ``notes``."""
    notes = [] if notes is None else notes
    if cfg.model in PRESETS:
        return preset_model(cfg, num_classes, notes)
    return timm_model(cfg, num_classes, notes)


# ============================================================================================
# Detections of a model on a loader (evaluation and --predict)
# ============================================================================================
def detect(
    model: nn.Module | OnnxModel, loader: Iterable[tuple[list[torch.Tensor], list[dict]]], accelerator: Accelerator
) -> Iterator[list[dict[str, Any]]]:
    """Per batch of ``loader``, per image: ``image_id`` and the detections (``boxes`` XYXY in the original
    image's pixels, ``scores``, ``labels`` as class indices 0..C-1; a segmenting model's ``masks`` too, each
    detection's COCO RLE in the original image: :func:`common.detection.masks.rle_of`); the model in eval mode,
    or its ONNX export (one image at a time)."""
    for images, targets in loader:
        if isinstance(model, OnnxModel):
            names = ("boxes", "scores", "labels", "mask_probs")
            detections = [dict(zip(names, model(image))) for image in images]
        else:
            with torch.no_grad(), accelerator.autocast():
                detections = [{**d, "labels": d["labels"] - 1} for d in model(images)]  # boxes in the input's pixels
        found = []
        for d, t in zip(detections, targets):
            kept = without_tiny(
                {
                    "image_id": t["image_id"],
                    "boxes": rescale_boxes(torch.as_tensor(d["boxes"]), t["size"], t["orig_size"]),
                    "scores": torch.as_tensor(d["scores"]),
                    "labels": torch.as_tensor(d["labels"]),
                }
                | ({"mask_probs": torch.as_tensor(d["mask_probs"])} if "mask_probs" in d else {})
            )
            if "mask_probs" in kept:  # pasted at the original size, kept as run lengths
                kept["masks"] = pasted_masks(kept.pop("mask_probs"), kept["boxes"], tuple(t["orig_size"]))
            found.append(kept)
        yield found
