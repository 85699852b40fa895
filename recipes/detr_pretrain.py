"""DETR's backbone pre-training on the training set's own boxes, beside ``recipes/detr.py``.

Without network there are no ImageNet weights, and from random weights the demo's DETR finds the boxes
but never learns the classes (docs/detr.md). So, before DETR, every ground-truth box of the training
split is cut out with a little context, resized to a small square and classified by the detector's own
backbone plus a linear head (``pretrain_crops_*`` in detr.py's Config); the head is then dropped and
the backbone goes on into DETR.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.v2 import functional as TF
from tqdm.auto import tqdm

from common import UserError
from common.data.images import decode_image
from common.detection.boxes import crop_box
from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, DetectionData
from common.loaders import KeyedDataset, eval_loader_for, sample_seed, train_loader_for
from common.meters import Meters, prefixed
from common.run import Run
from common.schedules import schedule, set_group_values, weight_decay_groups


# ============================================================================================
# Data: every box of the detection set as a classification sample
# ============================================================================================
class BoxCropDataset(KeyedDataset):
    """Every box of a normalised detection dataset as a classification sample ``(image [3, size, size]
    float normalised with the ImageNet mean and std as detr_data.py's data_transforms does, class index)``, cut by
    ``crop_box`` (crowd regions and boxes under 1 px left out).

    ``shift`` > 0 (training): the window moves by up to that fraction of its side on each axis, drawn
    per ``(epoch, index)`` (keys as DetectionDataset's: a :class:`common.loaders.KeyedDataset`, so each
    epoch draws anew), so that the classifier does not learn that a digit always sits in the middle.
    Scenes are decoded per crop, nothing is cached: any size of dataset stays on disk, and DataLoader
    workers do the decoding.
    """

    def __init__(self, ds: Any, size: int = 32, margin: float = 0.15, shift: float = 0.0, seed: int = 0) -> None:
        self.ds, self.size, self.margin, self.shift, self.seed = ds, size, margin, shift, seed
        objects = ds.select_columns(["objects"])[:]["objects"]
        self.items = [
            (row, box, category)
            for row, o in enumerate(objects)
            for box, category, crowd in zip(o["bbox"], o["category"], o["iscrowd"])
            if not crowd and box[2] >= 1 and box[3] >= 1
        ]  # (row, COCO box, class)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        row, box, category = self.items[int(index)]
        image = decode_image(self.ds[row]["image"], f"row {row} of the detection dataset")
        shift = (0.0, 0.0)
        if self.shift > 0:
            shift = tuple(
                np.random.default_rng(sample_seed(self.seed, epoch, index)).uniform(-self.shift, self.shift, 2)
            )
        crop = TF.to_dtype(
            TF.pil_to_tensor(crop_box(image, box, self.size, self.margin, shift)), torch.float32, scale=True
        )
        return TF.normalize(crop, IMAGENET_MEAN, IMAGENET_STD), int(category)


# ============================================================================================
# Model: the detector's backbone + a linear head
# ============================================================================================
class CropClassifier(nn.Module):
    """``images [B, 3, s, s] -> logits [B, C]``: the detector's own backbone, global average pooling of
    the level DETR reads, a linear layer. Trained on box crops, it shapes exactly the layers (and the
    dilation) the transformer will see; the head is thrown away afterwards."""

    def __init__(self, backbone: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_info.channels()[-1], num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images)[-1].mean((2, 3)))


# ============================================================================================
# Training: AdamW, one warmup epoch then cosine; top-1 on the evaluation split's boxes per epoch
# ============================================================================================
def pretrain_backbone(cfg: Any, backbone: nn.Module, data: DetectionData, run: Run) -> dict[str, float] | None:
    """Train ``backbone`` in place as a classifier of the ground-truth boxes of ``data.train`` (cut out
    by BoxCropDataset with a ``pretrain_crops_margin`` of context, resized to
    ``pretrain_crops_size``, the window shifted by up to ``pretrain_crops_shift``): AdamW (no weight
    decay on biases and norms), one warmup epoch then cosine, label smoothing 0.1. The crops are split
    across processes like any training set. Top-1 on the evaluation split's boxes is logged after every
    epoch as ``pretrain/top1`` (at step 0: DETR's steps have not started); returns the last values, or
    None when a stop signal (SIGTERM/SIGINT) ended it. ``max_steps`` caps its steps as it caps DETR's.

    ``cfg`` is detr.py's Config; read here: ``pretrain_crops_*``, ``seed``, ``num_workers``, ``max_steps``."""
    accelerator = run.accelerator
    train_set = BoxCropDataset(
        data.train, cfg.pretrain_crops_size, cfg.pretrain_crops_margin, cfg.pretrain_crops_shift, cfg.seed
    )
    eval_set = BoxCropDataset(data.eval, cfg.pretrain_crops_size, cfg.pretrain_crops_margin)
    if len(train_set) < cfg.pretrain_crops_batch_size * accelerator.num_processes:
        raise UserError(
            f"the training split has {len(train_set)} boxes to pre-train the backbone on, fewer than one "
            f"global batch ({cfg.pretrain_crops_batch_size} x {accelerator.num_processes} processes); "
            "lower --pretrain_crops_batch_size (or skip the pre-training: --pretrain_crops_epochs 0)"
        )
    train_loader = train_loader_for(
        train_set, cfg.pretrain_crops_batch_size, cfg.seed, cfg.num_workers, accelerator.num_processes
    )
    eval_loader = eval_loader_for(eval_set, cfg.pretrain_crops_batch_size, cfg.num_workers)
    model = CropClassifier(backbone, len(data.classes))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.05), lr=cfg.pretrain_crops_lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total = cfg.pretrain_crops_epochs * len(train_loader)
    if cfg.max_steps > 0:  # a short run (a smoke test, say) shortens the pre-training too
        total = min(total, cfg.max_steps)
    lr_values = schedule("cosine", cfg.pretrain_crops_lr, 0.0, total, min(len(train_loader), total))
    run.print(
        f"backbone pre-training on {len(train_set):,} box crops of {cfg.pretrain_crops_size} px for "
        f"{cfg.pretrain_crops_epochs} epoch{'s' * (cfg.pretrain_crops_epochs != 1)}, before DETR's steps"
    )
    meters = Meters(accelerator.device)
    progress = tqdm(
        total=total, disable=None if accelerator.is_main_process else True, desc="pretrain backbone", dynamic_ncols=True
    )
    step, values, stopped = 0, {}, False
    for epoch in range(cfg.pretrain_crops_epochs):
        if step >= total or stopped:
            break
        train_loader.set_epoch(epoch)  # the prepared loader: Accelerate's counter and the sampler
        model.train()
        for images, labels in train_loader:
            set_group_values(optimizer, "lr", float(lr_values[step]))
            with accelerator.autocast():
                logits = model(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meters.update(n=len(images), loss=loss)
            step += 1
            progress.update(1)
            stopped = run.should_stop()  # every process agrees (common/run.py)
            if stopped or step >= total:
                break
        if stopped:
            break
        model.eval()
        with torch.no_grad():
            for images, labels in eval_loader:
                with accelerator.autocast():
                    predicted = model(images).argmax(-1)
                predicted, labels = accelerator.gather_for_metrics((predicted, labels))
                meters.update(n=len(labels), top1=100 * (predicted == labels).float().mean())
        values = {k: v for k, v in meters.summary(accelerator).items() if k in ("loss", "top1")}
        run.log({**prefixed(values, "pretrain"), "pretrain/epoch": epoch}, 0, echo=False)  # logged at step 0:
        # DETR's steps have not started, so the console line says what it is instead of "step 0"
        run.print(f"backbone pre-training epoch {epoch}: " + "  ".join(f"{k} {v:.4g}" for k, v in values.items()))
    progress.close()
    # the classifier, its optimizer and loaders leave Accelerate's lists (and the DDP wrapper its hooks
    # on the backbone): checkpoints hold DETR alone, and DETR's prepare starts afresh
    accelerator.free_memory(model, optimizer, train_loader, eval_loader)
    return None if stopped else values
