"""The classifier's model pieces and its input, beside recipes/classifier.py: DINO's linear evaluation head
on a frozen ViT (:class:`BlockProbe`), the loss a config asks for (:func:`create_criterion`), and timm's data
config and transforms, which training, prediction
and the exports (recipes/classifier_inference.py) feed the model with.

recipes/classifier.py builds the model from its Config; copy classifier.py and its ``classifier_*.py`` files
together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from timm.data import create_transform, resolve_data_config
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from common import UserError


class InputSettings(Protocol):
    """What the transforms read of recipes/classifier.py's Config."""

    img_size: int  # training and evaluation side, px
    crop_pct: float  # evaluation: resize to img_size / crop_pct, then centre crop
    interpolation: str  # the resampling filter
    mean: list[float]  # per RGB channel, 0..1 pixels; empty: the model's default
    std: list[float]
    scale: list[float]  # RandomResizedCrop area range
    ratio: list[float]  # RandomResizedCrop aspect range, w / h
    hflip: float
    color_jitter: float
    auto_augment: str
    reprob: float
    remode: str
    recount: int


class BlockProbe(torch.nn.Module):
    """DINO's linear evaluation head on a frozen timm ViT (eval_linear.py): the [CLS] token of each of the last
    ``blocks`` blocks, after the final norm, concatenated (with ``avgpool`` also the last block's mean patch
    token) into one linear layer initialised with std 0.01 and zero bias."""

    def __init__(self, backbone: torch.nn.Module, blocks: int, avgpool: bool, num_classes: int) -> None:
        super().__init__()
        if not hasattr(backbone, "forward_intermediates") or not hasattr(backbone, "blocks"):
            raise UserError(
                f"probe_blocks needs a timm ViT (blocks and a [CLS] token); '{type(backbone).__name__}' "
                "is not one: set --probe_blocks 0 for pooled features"
            )
        self.backbone, self.blocks, self.avgpool = backbone, blocks, avgpool
        self.pretrained_cfg = backbone.pretrained_cfg  # the transforms resolve as for the ViT itself
        self.head = torch.nn.Linear(backbone.embed_dim * (blocks + int(avgpool)), num_classes)
        torch.nn.init.normal_(self.head.weight, std=0.01)
        torch.nn.init.zeros_(self.head.bias)

    def get_classifier(self) -> torch.nn.Module:
        return self.head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        levels = self.backbone.forward_intermediates(
            images, indices=self.blocks, norm=True, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
        )
        features = [prefix[:, 0] for _, prefix in levels]  # [B, D] per block
        if self.avgpool:
            features.append(levels[-1][0].mean(dim=1))  # the last block's patch tokens, averaged
        return self.head(torch.cat(features, dim=-1))  # [B, D x (blocks + avgpool)] -> [B, K]


def data_config(cfg: InputSettings, model: torch.nn.Module) -> dict[str, Any]:
    """timm's data config of ``model`` at the run's resolution, crop and interpolation, with the run's
    ``mean`` / ``std`` where set (else the model's defaults)."""
    args = {"input_size": (3, cfg.img_size, cfg.img_size), "crop_pct": cfg.crop_pct, "interpolation": cfg.interpolation}
    if cfg.mean:
        args.update(mean=tuple(cfg.mean), std=tuple(cfg.std))
    return resolve_data_config(args, model=model)


def create_transforms(cfg: InputSettings, model: torch.nn.Module) -> tuple[Callable, Callable]:
    """timm's training transform (random resized crop, flip, jitter / AutoAugment, random erasing) and
    evaluation transform (resize to img_size / crop_pct, centre crop), normalised as :func:`data_config` says."""
    data_cfg = data_config(cfg, model)
    train_tf = create_transform(
        **data_cfg,
        is_training=True,
        scale=tuple(cfg.scale),
        ratio=tuple(cfg.ratio),
        hflip=cfg.hflip,
        color_jitter=cfg.color_jitter or None,
        auto_augment=cfg.auto_augment or None,
        re_prob=cfg.reprob,
        re_mode=cfg.remode,
        re_count=cfg.recount,
    )
    return train_tf, create_transform(**data_cfg, is_training=False)


def create_criterion(cfg: Any, mixed: bool) -> torch.nn.Module:
    """The classification loss of a config (``smoothing``, ``bce_loss``, ``bce_target_thresh``); ``mixed``:
    Mixup/CutMix makes the targets soft and already smoothed. Takes logits [B, K] and targets: class indices [B],
    or soft targets [B, K] when ``mixed``."""
    if cfg.bce_loss:  # one sigmoid per class (ResNet strikes back, DeiT III), on hard or soft targets
        return BinaryCrossEntropy(
            smoothing=0.0 if mixed else cfg.smoothing, target_threshold=cfg.bce_target_thresh or None
        )
    if mixed:
        return SoftTargetCrossEntropy()
    if cfg.smoothing > 0:
        return LabelSmoothingCrossEntropy(cfg.smoothing)
    return torch.nn.CrossEntropyLoss()
