"""DINO's evaluation, beside recipes/dino.py: the weighted k-nearest-neighbour top-1 of frozen features
(the reference's ``eval_knn``), at any scale, and the pictures drawn with it (recipes/dino_figures.py).

Memory grows with images x feature size, never images x pixels, and no process holds the whole bank:

1. :func:`extract` runs a backbone in fp32 over this process's shard of a dataset (every
   ``num_processes``-th image, no padding) and returns L2-normalised features [n_shard, D] on the device.
2. :func:`knn_predict` scores every query against each process's bank shard in chunks of queries,
   keeps each shard's top k, and merges the shards' candidates with one all-gather of [Q, k] values:
   the global top k without moving the bank.
3. :func:`knn_accuracy` lets the k nearest vote for their class with weight exp(similarity / T), for
   several k from one top-k.

A single process is the same computation with one shard. recipes/dino.py builds the loaders once
(:func:`knn_loaders`) and calls :func:`knn_metrics` for the raw-pixel baseline and :func:`evaluate` for
the teacher; copy dino.py and its ``dino_*.py`` files together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn
from torchvision import transforms as T

from common.data.classification import ClassificationData, ClassificationDataset
from common.data.image_cache import image_caches
from common.data.images import needed_side
from common.loaders import eval_loader_for
from common.models import average_bn_statistics
from common.run import Run
from dino_figures import attention_maps, attention_overlay, neighbour_grid, unnormalise
from dino_inference import crop_pct_for


class KnnSettings(Protocol):
    """What the evaluation reads of recipes/dino.py's Config (whose comments say what each field means)."""

    seed: int
    batch_size: int  # images per batch of the bank and query loaders, per process
    num_workers: int
    cache_images: str  # '', ram or disk (common/data/image_cache.py)
    global_size: int
    knn_resize: int
    knn_train_limit: int
    knn_pixel_limit: int
    knn_pixel_size: int
    knn_k: list[int]
    knn_temperature: float
    plot_images: int


# ============================================================================================
# Data: the evaluation transform, the bank and the queries, each process its shard
# ============================================================================================
def eval_transform(size: int, resize: int = 0) -> T.Compose:
    """Shorter side to ``resize`` (the reference: 256 for a 224 crop; 0: to ``size``), centre crop ``size``."""
    return T.Compose(
        [
            T.Resize(resize or size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
        ]
    )


def shard(dataset: Any, process_index: int, num_processes: int) -> torch.utils.data.Subset:
    """This process's images: indices ``process_index, process_index + num_processes, ...`` (no padding,
    so no image counts twice)."""
    return torch.utils.data.Subset(dataset, range(process_index, len(dataset), num_processes))


def knn_loaders(
    cfg: KnnSettings, knn_set: ClassificationData, process_index: int, num_processes: int
) -> tuple[
    ClassificationDataset,
    ClassificationDataset,
    torch.utils.data.DataLoader,
    torch.utils.data.DataLoader,
    torch.utils.data.DataLoader,
    str,
]:
    """The kNN evaluation's data: ``(bank_set, query_set, bank_loader, query_loader, pixel_loader,
    cache_line)``.

    The sets are whole (knn_set's training split as the bank, at most knn_train_limit images, seeded; its
    evaluation split as the queries), at eval_transform, their images decoded once where ``cache_images``
    says (``cache_line``: the line for under the start banner, '' without). Each loader reads only this
    process's shard: of the bank, of the queries, and of the raw-pixel baseline's bank (at most
    knn_pixel_limit, seeded)."""
    bank = knn_set.train
    if 0 < cfg.knn_train_limit < len(bank):
        bank = bank.shuffle(seed=cfg.seed).select(range(cfg.knn_train_limit))
    knn_tf = eval_transform(cfg.global_size, cfg.knn_resize)
    side = needed_side(cfg.global_size, crop_pct=crop_pct_for(cfg.global_size, cfg.knn_resize))
    column = knn_set.image_column
    (bank_cache, query_cache), cache_line = image_caches(
        cfg.cache_images, cfg.num_workers, (bank, column, side), (knn_set.eval, column, side)
    )
    columns = column, knn_set.label_column
    bank_set = ClassificationDataset(bank, *columns, knn_tf, shorter=side, cache=bank_cache)
    query_set = ClassificationDataset(knn_set.eval, *columns, knn_tf, shorter=side, cache=query_cache)
    here = (process_index, num_processes)
    bank_loader = eval_loader_for(shard(bank_set, *here), cfg.batch_size, cfg.num_workers)
    query_loader = eval_loader_for(shard(query_set, *here), cfg.batch_size, cfg.num_workers)
    pixel_bank = bank_set
    if len(bank_set) > cfg.knn_pixel_limit:
        chosen = torch.randperm(len(bank_set), generator=torch.Generator().manual_seed(cfg.seed))
        pixel_bank = torch.utils.data.Subset(bank_set, chosen[: cfg.knn_pixel_limit].tolist())
    pixel_loader = eval_loader_for(shard(pixel_bank, *here), cfg.batch_size, cfg.num_workers)
    return bank_set, query_set, bank_loader, query_loader, pixel_loader, cache_line


# ============================================================================================
# Weighted kNN over sharded banks
# ============================================================================================
@torch.no_grad()
def extract(
    model: Callable[[torch.Tensor], torch.Tensor] | None, loader: Any, device: torch.device, pixel_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised fp32 features [n, D] and labels [n] of ``loader``'s images, on ``device``.

    ``model=None`` gives raw pixels, area-resized to ``pixel_size`` x ``pixel_size`` (a baseline whose
    size does not grow with the evaluation resolution). Runs outside autocast: the reference protocol
    extracts in fp32."""
    feats, labels = [], []
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        if model is None:
            f = F.interpolate(images.float(), size=(pixel_size, pixel_size), mode="area").flatten(1)
        else:
            with torch.autocast(device.type, enabled=False):
                f = model(images).float()
        feats.append(F.normalize(f, dim=1))
        labels.append(torch.as_tensor(targets, device=device))
    if not feats:
        return torch.zeros(0, 1, device=device), torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(feats), torch.cat(labels)


def _all_gather_rows(t: torch.Tensor) -> list[torch.Tensor]:
    """Every process's ``t`` (row counts may differ by process), in process order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [t]
    count = torch.tensor([len(t)], device=t.device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    rows = max(int(c) for c in counts)
    padded = torch.cat([t, t.new_zeros(rows - len(t), *t.shape[1:])])
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded)
    return [o[: int(c)] for o, c in zip(out, counts)]


@torch.no_grad()
def knn_predict(
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    queries: torch.Tensor,
    query_labels: torch.Tensor,
    k: int,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k most cosine-similar bank images of every query, over all processes' shards.

    ``bank`` [n_shard, D] and ``queries`` [q_shard, D] are this process's shards. Returns, identically on
    every process, similarities [Q, k] (descending), their bank labels [Q, k] and the query labels [Q],
    all queries of all processes. Memory per process: the bank shard, all queries' features and a
    [chunk, n_shard] similarity block."""
    all_queries = torch.cat(_all_gather_rows(queries))
    all_query_labels = torch.cat(_all_gather_rows(query_labels))
    k_local = min(k, len(bank))
    sims, labels = [], []
    for start in range(0, len(all_queries), chunk):
        sim = all_queries[start : start + chunk] @ bank.T  # [chunk, n_shard]
        top, index = sim.topk(k_local, dim=1)
        sims.append(top)
        labels.append(bank_labels[index])
    sims = torch.cat(sims) if sims else all_queries.new_zeros(0, k_local)
    labels = torch.cat(labels) if labels else all_query_labels.new_zeros(0, k_local)
    # every process's candidates for every query: the global top k is among them
    sims, labels = (
        torch.cat(_all_gather_rows(sims.T.contiguous())).T,
        torch.cat(_all_gather_rows(labels.T.contiguous())).T,
    )
    top, index = sims.topk(min(k, sims.shape[1]), dim=1)
    return top, labels.gather(1, index), all_query_labels


def knn_accuracy(
    similarities: torch.Tensor,
    neighbour_labels: torch.Tensor,
    query_labels: torch.Tensor,
    ks: Sequence[int],
    temperature: float,
    num_classes: int,
) -> dict[int, float]:
    """Top-1 (%) of the weighted vote of the first k neighbours, for each k in ``ks`` (the neighbours
    sorted by similarity, as :func:`knn_predict` returns them)."""
    weights = (similarities / temperature).exp()
    out = {}
    for k in ks:
        votes = torch.zeros(len(weights), num_classes, device=weights.device)
        votes.scatter_add_(1, neighbour_labels[:, :k], weights[:, :k])
        out[k] = float((votes.argmax(dim=1) == query_labels).float().mean() * 100) if len(weights) else 0.0
    return out


def knn_top1(
    train_f: torch.Tensor,
    train_y: torch.Tensor,
    test_f: torch.Tensor,
    test_y: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
) -> float:
    """Weighted kNN (DINO's eval_knn) on whole feature sets in one process: each of the k most
    cosine-similar training features votes for its class with weight exp(similarity / temperature).
    Returns top-1 in percent. (:func:`knn_metrics` runs the same on sharded banks.)"""
    num_classes = num_classes or int(max(train_y.max(), test_y.max())) + 1
    sims, labels, queries = knn_predict(train_f, train_y, test_f, test_y, k)
    return knn_accuracy(sims, labels, queries, [min(k, len(train_f))], temperature, num_classes)[min(k, len(train_f))]


# ============================================================================================
# The evaluation: kNN top-1 of a backbone, and its pictures
# ============================================================================================
def knn_metrics(
    backbone: nn.Module | None,
    name: str,
    bank_loader: torch.utils.data.DataLoader,
    query_loader: torch.utils.data.DataLoader,
    num_classes: int,
    cfg: KnnSettings,
    run: Run,
) -> tuple[dict[str, float], torch.Tensor]:
    """Weighted kNN on fp32 features, the loaders reading this process's shards of the bank and queries:
    knn/<name>_top1 (the first of knn_k) and knn/<name>_top1_k<k>, and this process's bank features
    [n, D]. ``backbone=None``: raw pixels, area-resized to knn_pixel_size."""
    device = run.accelerator.device
    bank_f, bank_y = extract(backbone, run.progress(bank_loader, f"kNN bank ({name})"), device, cfg.knn_pixel_size)
    test_f, test_y = extract(backbone, run.progress(query_loader, f"kNN queries ({name})"), device, cfg.knn_pixel_size)
    sims, labels, queries = knn_predict(bank_f, bank_y, test_f, test_y, max(cfg.knn_k))
    scores = knn_accuracy(
        sims, labels, queries, [min(k, sims.shape[1]) for k in cfg.knn_k], cfg.knn_temperature, num_classes
    )
    out = {f"knn/{name}_top1": scores[min(cfg.knn_k[0], sims.shape[1])]}
    out.update({f"knn/{name}_top1_k{k}": scores[min(k, sims.shape[1])] for k in cfg.knn_k[1:]})
    return out, bank_f


def evaluate(
    backbone: nn.Module,
    bank_set: ClassificationDataset,
    query_set: ClassificationDataset,
    bank_loader: torch.utils.data.DataLoader,
    query_loader: torch.utils.data.DataLoader,
    classes: list[str],
    cfg: KnnSettings,
    run: Run,
) -> tuple[dict[str, float], dict[str, Image.Image]]:
    """Teacher kNN top-1; on the main process also the nearest-neighbour grid and (ViT) attention maps,
    saved under run.plots_dir. The sets are whole, the loaders this process's shards (knn_loaders)."""
    accelerator = run.accelerator
    backbone.eval()
    average_bn_statistics(backbone, accelerator)  # each process's BN statistics saw its own batches: their mean
    result, bank_f = knn_metrics(backbone, "teacher", bank_loader, query_loader, len(classes), cfg, run)
    pictures = {}
    if cfg.plot_images > 0:  # every process searches its bank shard for the first queries' neighbours
        count = min(cfg.plot_images, len(query_set))
        images = torch.stack([query_set[i][0] for i in range(count)])  # [count, 3, H, W]
        plot_f, _ = extract(backbone, [(images, [0] * count)], accelerator.device)
        bank_index = torch.arange(
            accelerator.process_index, len(bank_set), accelerator.num_processes, device=accelerator.device
        )  # this shard's rows in the whole bank
        similarity, index, _ = knn_predict(bank_f, bank_index, plot_f, bank_index[:count], 5)
        similarity, index = similarity[:count], index[:count]  # every process asked the same queries
        if accelerator.is_main_process:
            neighbours = [[bank_set[j] for j in row] for row in index.tolist()]  # (image, label) pairs
            pictures["neighbours"] = neighbour_grid(
                unnormalise(images),
                unnormalise(torch.stack([torch.stack([x for x, _ in r]) for r in neighbours])),
                run.plots_dir / "neighbours.png",
                [classes[query_set[i][1]] for i in range(count)],
                [[classes[y] for _, y in r] for r in neighbours],
                similarity.cpu(),
            )
            maps = attention_maps(backbone, images.to(accelerator.device))
            if maps is not None:  # ViTs: where the [CLS] token looks
                pictures["attention"] = attention_overlay(unnormalise(images), maps, run.plots_dir / "attention.png")
    backbone.train()  # the reference's teacher runs in train mode (batch statistics) while training
    return result, pictures
