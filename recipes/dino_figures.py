"""DINO's pictures, beside recipes/dino.py (recipes/dino_knn.py draws them at each evaluation): what a
backbone sees, as attention maps over the images (ViTs), and each query's nearest neighbours in the kNN bank.

Images come as float [.., 3, H, W] in 0..1 (:func:`unnormalise` undoes the normalisation); tensors on any
device or arrays. Each image is drawn at least ~170 px wide however small it is (the built-in demo's digits
are 32 px), so the figures read the same for 32-px digits and 224-px photos. matplotlib is imported only
when a picture is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from common.curves import new_figure, save_figure

_CELL = 1.9  # inches per image on the page (x DPI = 190 px)
_MATCH, _MISMATCH = "#1a9641", "#d7191c"  # green / red captions: neighbour of the query's class or not


def _hwc(images: Any) -> np.ndarray:
    """Float images [..., 3 or 1, H, W] -> float32 [..., H, W, 3] clipped to 0..1."""
    x = np.asarray(images.detach().float().cpu() if hasattr(images, "detach") else images, np.float32)
    x = np.moveaxis(x, -3, -1).clip(0, 1)
    return np.repeat(x, 3, -1) if x.shape[-1] == 1 else x


def _upsample(image: np.ndarray, size: int) -> np.ndarray:
    """[H, W, 3] 0..1 -> [s*H, s*W, 3], enlarged by a whole factor s (nearest) to at least ``size`` px
    on the longer side: small images shown as their pixels, not blurred."""
    factor = max(1, -(-size // max(image.shape[:2])))
    return image.repeat(factor, 0).repeat(factor, 1)


def attention_overlay(images: Any, maps: Any, path: Path, colormap: str = "inferno", alpha: float = 0.5) -> Image.Image:
    """Each image beside itself overlaid with its attention map, as one PNG at ``path``.

    ``images``: float [B, 3, H, W] in 0..1. ``maps``: non-negative attention [B, h, w] (a ViT's [CLS]
    attention over its h x w patches, say), each stretched to its own 0..1 range (attention is
    relative), enlarged bilinearly to the displayed image and blended over it with ``colormap`` at
    ``alpha``. Two image-overlay pairs per row from 4 images on, three from 9."""
    from matplotlib import colormaps

    pictures = _hwc(images)
    heat = np.asarray(maps.detach().float().cpu() if hasattr(maps, "detach") else maps, np.float32)
    if heat.ndim != 3 or len(heat) != len(pictures):
        raise ValueError(f"maps must be [B, h, w] for {len(pictures)} images; got shape {heat.shape}")
    count = len(pictures)
    pairs = 1 if count < 4 else 2 if count < 9 else 3  # image-overlay pairs per row
    rows = -(-count // pairs)
    figure = new_figure(2 * pairs * _CELL, rows * (_CELL + 0.25) + 0.1)
    cmap = colormaps[colormap]
    for b in range(count):
        shown = _upsample(pictures[b], 190)
        lo, hi = float(heat[b].min()), float(heat[b].max())
        scaled = (heat[b] - lo) / (hi - lo) if hi > lo else np.zeros_like(heat[b])
        # mode "F" keeps the float values through PIL's bilinear resize
        up = np.asarray(Image.fromarray(scaled, mode="F").resize(shown.shape[1::-1], Image.BILINEAR))
        blended = (1 - alpha) * shown + alpha * cmap(np.clip(up, 0, 1))[..., :3]
        for column, (picture, title) in enumerate(
            ((shown, f"image {b}"), (blended, f"attention ({heat.shape[1]}x{heat.shape[2]})"))
        ):
            ax = figure.add_subplot(rows, 2 * pairs, (b // pairs) * 2 * pairs + (b % pairs) * 2 + column + 1)
            ax.imshow(picture, interpolation="antialiased")
            ax.set_title(title, fontsize=9)
            ax.set_axis_off()
    return save_figure(figure, path)


def neighbour_grid(
    queries: Any,
    neighbours: Any,
    path: Path,
    query_labels: Sequence[str] | None = None,
    neighbour_labels: Sequence[Sequence[str]] | None = None,
    similarities: Any = None,
) -> Image.Image:
    """Each query and its nearest neighbours, one row per query, as one PNG at ``path``.

    ``queries``: float [Q, 3, H, W] in 0..1, drawn first in each row inside a blue frame;
    ``neighbours``: [Q, k, 3, H, W], nearest first. Optional captions: ``query_labels`` [Q] and
    ``neighbour_labels`` [Q][k] class names (a neighbour's name in green with a tick when it is
    the query's, red with a cross when not), ``similarities`` [Q, k] (cosine similarity, written under
    each neighbour)."""
    from matplotlib.patches import Rectangle

    query_pixels, bank = _hwc(queries), _hwc(neighbours)
    if bank.ndim != 5 or len(bank) != len(query_pixels):
        raise ValueError(f"neighbours must be [Q, k, 3, H, W] for {len(query_pixels)} queries; got {bank.shape}")
    sims = (
        None
        if similarities is None
        else np.asarray(
            similarities.detach().float().cpu() if hasattr(similarities, "detach") else similarities, np.float64
        )
    )
    count, k = bank.shape[:2]
    captions = query_labels is not None or neighbour_labels is not None or sims is not None
    row_height = _CELL + (0.45 if captions else 0.3)
    figure = new_figure((k + 1.25) * _CELL, count * row_height + 0.35)
    figure.suptitle("queries (framed) and their nearest neighbours, nearest first", fontsize=11)
    grid = figure.add_gridspec(count, k + 2, width_ratios=[1, 0.25] + [1] * k)  # a gap after the query
    for q in range(count):
        ax = figure.add_subplot(grid[q, 0])
        shown = _upsample(query_pixels[q], 190)
        ax.imshow(shown, interpolation="antialiased")
        ax.add_patch(
            Rectangle(
                (-0.5, -0.5), shown.shape[1], shown.shape[0], fill=False, edgecolor="#2166ac", lw=5, clip_on=False
            )
        )
        ax.set_axis_off()
        ax.set_title(
            f"query: {query_labels[q]}" if query_labels is not None else f"query {q}",
            fontsize=10,
            color="#2166ac",
            fontweight="bold",
        )
        for j in range(k):
            ax = figure.add_subplot(grid[q, j + 2])
            ax.imshow(_upsample(bank[q, j], 190), interpolation="antialiased")
            ax.set_axis_off()
            parts, colour = [], "black"
            if neighbour_labels is not None:
                name = str(neighbour_labels[q][j])
                parts.append(name)
                if query_labels is not None:  # a mark as well as a colour: red and green look alike to many
                    same = name == str(query_labels[q])
                    colour, parts[-1] = (_MATCH, f"\u2713 {name}") if same else (_MISMATCH, f"\u2717 {name}")
            if sims is not None:
                parts.append(f"cos {sims[q, j]:.3f}")
            if parts:
                ax.set_title("  ".join(parts), fontsize=10, color=colour)
    return save_figure(figure, path)


@torch.no_grad()
def attention_maps(backbone: nn.Module, images: torch.Tensor) -> torch.Tensor | None:
    """The last block's [CLS] -> patch attention, mean over heads, as [B, h, w] (None for a backbone
    without timm ViT blocks). Without a class token: the attention each patch receives, averaged over
    all queries, i.e. what the average-pooled feature is built from."""
    blocks = getattr(backbone, "blocks", None)
    if blocks is None or not hasattr(blocks[-1], "attn") or not hasattr(blocks[-1].attn, "attn_drop"):
        return None
    attn_module, captured = blocks[-1].attn, []
    fused = getattr(attn_module, "fused_attn", False)
    attn_module.fused_attn = False  # the explicit softmax path exposes the probabilities to the hook
    hook = attn_module.attn_drop.register_forward_hook(lambda m, inp, out: captured.append(inp[0].detach()))
    try:
        backbone(images)
    finally:
        hook.remove()
        attn_module.fused_attn = fused
    attn = captured[0].float().mean(dim=1)  # [B, tokens, tokens]
    prefix = getattr(backbone, "num_prefix_tokens", 1)
    weights = attn[:, 0, prefix:] if prefix else attn.mean(dim=1)  # [B, patches]
    side = int(math.isqrt(weights.shape[1]))
    return weights.reshape(-1, side, side).cpu()


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    """ImageNet-normalised [..., 3, H, W] -> pixel values in 0..1 (for pictures)."""
    mean, std = torch.tensor(IMAGENET_DEFAULT_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_DEFAULT_STD).view(3, 1, 1)
    return (images.float().cpu() * std + mean).clamp(0, 1)
