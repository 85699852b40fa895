"""DINO's networks, beside recipes/dino.py (which builds them from its Config): the projection head,
the wrapper that runs a backbone once per crop size, and the teacher made from the student.

Shapes: B images per process, n crops of one size, D the backbone's feature width, K = out_dim.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class DINOHead(nn.Module):
    """3-layer MLP (GELU, optional BatchNorm) -> bottleneck -> L2 normalisation -> weight-normalised
    linear to out_dim."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        norm_last_layer: bool = True,
        use_bn: bool = False,
    ) -> None:
        super().__init__()
        bn = [nn.BatchNorm1d(hidden_dim)] if use_bn else []  # no Identity: keep the reference's key names
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            *bn,
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            *([nn.BatchNorm1d(hidden_dim)] if use_bn else []),
            nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        magnitude = self.last_layer.parametrizations.weight.original0  # g: one norm per output unit
        with torch.no_grad():
            magnitude.fill_(1.0)
        magnitude.requires_grad_(not norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1, p=2))


class MultiCropWrapper(nn.Module):
    """Concatenate crops of equal size, run the backbone once per size, then the head on all."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops: list[torch.Tensor]) -> torch.Tensor:
        features, start = [], 0
        while start < len(crops):  # sizes are host ints: grouping never syncs with the device
            end = start + 1
            while end < len(crops) and crops[end].shape[-1] == crops[start].shape[-1]:
                end += 1
            features.append(self.backbone(torch.cat(crops[start:end])))  # [n_crops*B, D]
            start = end
        return self.head(torch.cat(features))  # [n_crops*B, out_dim]


def create_teacher(student: MultiCropWrapper) -> MultiCropWrapper:
    """The teacher: an exact copy of the (unwrapped) student, never trained by gradients; the reference
    builds it without drop path or dropout."""
    teacher = copy.deepcopy(student).requires_grad_(False)
    for m in teacher.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
        elif isinstance(m, nn.Dropout):
            m.p = 0.0
    return teacher
