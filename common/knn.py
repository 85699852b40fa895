"""Weighted k-nearest-neighbour evaluation of frozen features (DINO's ``eval_knn``), at any scale.

Memory grows with images x feature size, never images x pixels, and no process holds the whole bank:

1. :func:`extract` runs a backbone in fp32 over this process's shard of a dataset (every
   ``num_processes``-th image, no padding) and returns L2-normalised features [n_shard, D] on the device.
2. :func:`knn_predict` scores every query against each process's bank shard in chunks of queries,
   keeps each shard's top k, and merges the shards' candidates with one all-gather of [Q, k] values:
   the global top k without moving the bank.
3. :func:`knn_accuracy` lets the k nearest vote for their class with weight exp(similarity / T), for
   several k from one top-k.

A single process is the same computation with one shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shard(dataset: Any, process_index: int, num_processes: int) -> torch.utils.data.Subset:
    """This process's images: indices ``process_index, process_index + num_processes, ...`` (no padding,
    so no image counts twice)."""
    return torch.utils.data.Subset(dataset, range(process_index, len(dataset), num_processes))


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
