"""Exponential moving averages of weights: model EMA for evaluation, and the DINO teacher update.

Both use :func:`ema_update_`, one fused ``torch._foreach_lerp_`` over all tensors: a handful
of kernel launches per step instead of one per parameter as a Python loop would do.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def ema_update_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], momentum: float) -> None:
    """In place: ``target = momentum * target + (1 - momentum) * source`` for every pair.

    ``momentum`` close to 1 moves the targets slowly (0.9999 for model EMA, 0.996 -> 1 for a
    DINO teacher). Sources may live on another dtype; they are cast to each target's dtype.
    """
    targets, sources = list(targets), list(sources)
    if not targets:
        return
    sources = [s.to(t.dtype) if s.dtype != t.dtype else s for t, s in zip(targets, sources)]
    torch._foreach_lerp_(targets, sources, 1.0 - momentum)


class ModelEma:
    """A frozen copy of a model whose weights follow the model's by EMA.

    ``decay`` is the target momentum. With ``warmup`` the momentum ramps as
    ``min(decay, (1 + step) / (10 + step))`` so the EMA is not dominated by the random
    initialisation early in training (as TensorFlow's ExponentialMovingAverage ``num_updates``).
    Floating-point buffers (batch-norm statistics) are averaged like parameters; integer buffers
    (``num_batches_tracked``) are copied. The copy is in eval mode and never gets gradients.
    It has ``state_dict`` / ``load_state_dict`` so ``accelerator.register_for_checkpointing``
    saves and restores it with the run.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9998, warmup: bool = True) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay
        self.warmup = warmup

    @staticmethod
    def _split(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tensors that are averaged (float params and buffers) and tensors that are copied."""
        averaged, copied = [], []
        for t in list(model.parameters()) + list(model.buffers()):
            (averaged if t.is_floating_point() else copied).append(t)
        return averaged, copied

    def momentum(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Move the EMA towards ``model`` (the unwrapped model, same architecture)."""
        # Lists are rebuilt each call: Module.to() replaces buffer objects, so cached ones go stale.
        targets, target_copies = self._split(self.module)
        averaged, copied = self._split(model)
        ema_update_(targets, averaged, self.momentum(step))
        for target, source in zip(target_copies, copied):
            target.copy_(source)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)
