"""Models shared by the recipes: timm models by name, SyncBatchNorm, frozen backbone stages, and batch
norm statistics averaged across processes. Their weights files: :mod:`common.weights`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import nn

from common import UserError


def hub_offline() -> bool:
    """Whether downloads are off (``HF_HUB_OFFLINE``, read as huggingface_hub reads it): a missing weights
    file is then one line at once, not a minute of retries."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


#: Seconds :func:`reachable` waits for an answer, the name look-up, the proxy and the TLS handshake included.
PROBE_S = 5.0


def reachable(url: str, timeout: float = PROBE_S) -> bool:
    """Whether ``url`` answers one HEAD request within ``timeout`` seconds, sent as huggingface_hub sends its
    own: through its shared HTTP client (``huggingface_hub.get_session()``: its proxies from ``HTTPS_PROXY`` /
    ``HTTP_PROXY`` / ``NO_PROXY``, its CA bundle, a client factory the user set). Asked before a download, so
    that a machine without network, or behind a proxy or firewall that breaks the connection or the TLS
    handshake, says so at once instead of after the hub client's retries (a minute and more). Any answer but a
    server error counts (a gated page's 401 is still the hub); a refused connection, a failed handshake, a
    proxy that refuses (407 included), hub offline mode or silence do not. The request runs in a thread, so a
    resolver or a peer that hangs cannot hold the run longer than ``timeout``."""
    import huggingface_hub

    answered: list[bool] = []

    def head() -> None:
        try:
            session = huggingface_hub.get_session()
            # httpx's client (huggingface_hub >= 1) follows redirects unless told; requests' head() never does:
            # the first answer is enough, wherever a redirect would lead (a CDN host)
            no_redirects = {"follow_redirects": False} if hasattr(session, "follow_redirects") else {}
            status = session.head(url, timeout=timeout, **no_redirects).status_code
        except Exception:  # every failure is the same answer (the client's classes differ by version)
            answered.append(False)
            return
        answered.append(status < 500 and status != 407)

    probe = threading.Thread(target=head, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(answered and answered[0])


def _cached_pretrained(name: str) -> dict[str, Any] | None:
    """When the hub cannot be reached (:func:`hub_offline`, or :func:`reachable` says no): timm's
    ``pretrained_cfg_overlay`` that loads ``name``'s weights from the local hub cache, or None when they are not
    there (then the caller says so in one line). Empty when the hub is reachable: timm downloads as usual."""
    import huggingface_hub
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    hub_id = getattr(cfg, "hf_hub_id", None)
    where = f"{huggingface_hub.constants.ENDPOINT}/{hub_id}" if hub_id else getattr(cfg, "url", None) or ""
    if not where or (not hub_offline() and reachable(where)):
        return {}
    if not hub_id:
        return None
    own = getattr(cfg, "hf_hub_filename", None)
    for filename in ["model.safetensors", *([own] if own else []), "pytorch_model.bin"]:  # timm's order
        path = huggingface_hub.try_to_load_from_cache(hub_id, filename)
        if isinstance(path, str):
            return {"file": path, "source": ""}
    return None


def create_timm_model(
    name: str, optional: dict[str, Any] | None = None, also: str = "", notes: list[str] | None = None, **kwargs: Any
) -> nn.Module:
    """``timm.create_model(name, **optional, **kwargs)``; where the model family does not take the
    ``optional`` arguments (``img_size`` for a convnet, say), again without them. An unknown name is
    one :class:`UserError` line instead of timm's traceback (``also`` names what else the recipe
    accepts). With ``pretrained=True``, a line naming the weights goes to ``notes`` (the start banner's); without
    network the weights come from the local cache, or their absence is one line within seconds."""
    model = _create_timm_model(name, optional, also, **kwargs)
    if kwargs.get("pretrained") and notes is not None:
        source = getattr(model, "pretrained_cfg", {}).get("hf_hub_id") or "timm's hub"
        notes.append(f"pretrained: timm's weights for '{name}' ({source}); a layer they do not hold starts new")
    return model


def _create_timm_model(name: str, optional: dict[str, Any] | None, also: str, **kwargs: Any) -> nn.Module:
    import timm

    try:
        if kwargs.get("pretrained") and "pretrained_cfg_overlay" not in kwargs:
            overlay = _cached_pretrained(name)
            if overlay is None:
                raise OSError("not cached")
            if overlay:
                kwargs["pretrained_cfg_overlay"] = overlay
        if optional:
            try:
                return timm.create_model(name, **optional, **kwargs)
            except TypeError:
                pass
        return timm.create_model(name, **kwargs)
    except RuntimeError as e:
        if "nknown model" in str(e) or "nvalid model" in str(e):
            raise UserError(f"unknown timm model '{name}'; see timm.list_models(){also}") from None
        if "No pretrained weights exist" in str(e):
            raise UserError(f"timm has no pretrained weights for '{name}': leave out --pretrained") from None
        raise
    except OSError as e:  # the hub's download errors (offline mode, no network, no such file) are OSErrors
        if not kwargs.get("pretrained"):
            raise
        cfg = timm.models.get_pretrained_cfg(name)
        source = getattr(cfg, "hf_hub_id", None) or getattr(cfg, "url", None) or "the hub"
        why = "HF_HUB_OFFLINE is set" if hub_offline() else "no network" if str(e) == "not cached" else type(e).__name__
        raise UserError(
            f"--pretrained: timm's weights for '{name}' ({source}) are not in the local cache and cannot be "
            f"downloaded ({why}): cache them once with network (timm.create_model('{name}', pretrained=True)), "
            "or start from a local weights file where the recipe takes one (--init_weights, --init_backbone)"
        ) from None


def sync_batchnorm(model: nn.Module, accelerator: Any) -> nn.Module:
    """With several CUDA processes, batch norm statistics over the global batch (SyncBatchNorm);
    otherwise the model unchanged. Frozen batch norm layers are not BatchNorm and stay as they are."""
    if accelerator.num_processes > 1 and accelerator.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def freeze_stages(body: nn.Module, freeze_at: int) -> None:
    """Freeze a timm features_only backbone's modules up to and including the one that gives
    feature level ``freeze_at - 1`` of all its levels (level 0 is the stem of a resnet; Detectron2's
    convention: 2 = the stem and the first stage): their weights get no gradient and stay out of the
    optimizer (their batch norm statistics still move unless the batch norm is frozen too)."""
    if freeze_at <= 0:
        return
    levels = body.feature_info.info  # every level, not only out_indices
    if freeze_at > len(levels):
        raise UserError(f"freeze_at {freeze_at}: model has only {len(levels)} stages")
    last = levels[freeze_at - 1]["module"].split(".")[0]
    for name, child in body.named_children():
        for p in child.parameters():
            p.requires_grad_(False)
        if name == last:
            return


@torch.no_grad()
def average_bn_statistics(model: nn.Module, accelerator: Any) -> None:
    """Average every batch-norm layer's running mean and variance over the processes, in place (timm's
    ``distribute_bn`` "reduce"): each process's statistics have seen only its own batches, and a model
    EMA's buffers follow each process's own model. Call on every process before evaluating; one process
    or SyncBatchNorm (statistics already global): nothing to do."""
    if accelerator.num_processes == 1:
        return
    for m in model.modules():
        if (
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, nn.SyncBatchNorm)
            and m.track_running_stats
        ):
            for buf in (m.running_mean, m.running_var):
                buf.copy_(accelerator.reduce(buf, reduction="mean"))


def mark_fsdp_blocks(model: nn.Module) -> list[str]:
    """Name the model's repeated blocks in ``model._no_split_modules``, where Accelerate's FSDP
    ``TRANSFORMER_BASED_WRAP`` (configs/accelerate/fsdp.yaml) looks for the classes to shard one by one:
    every module held in an ``nn.Sequential`` or ``nn.ModuleList`` that has parameters and sub-modules (a ViT
    block, a CNN stage's residual block, a detector's transformer layer or FPN convolution), not a single
    layer (a unit per convolution costs a gather each) and not a container without ``forward``
    (``fully_shard`` refuses those). timm models name none, and then only the root would be a unit, every
    weight gathered at once. Harmless without FSDP; returns the class names."""
    names = set()
    for parent in model.modules():
        if not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        for child in parent.children():
            has_forward = type(child).forward is not nn.Module.forward
            if has_forward and next(child.children(), None) is not None and next(child.parameters(), None) is not None:
                names.add(type(child).__name__)
    model._no_split_modules = sorted(names)
    return model._no_split_modules


def fsdp_units(model: nn.Module) -> int:
    """How many modules FSDP2's ``fully_shard`` made into units of their own, the root included; 0
    outside FSDP2. One unit means every weight is gathered at once in each forward and backward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return 0
    return sum(isinstance(module, FSDPModule) for module in model.modules())
