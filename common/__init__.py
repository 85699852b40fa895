"""Shared plumbing for the recipes in ``recipes/``.

What lives here: plumbing, data, evaluation and pictures that a recipe can use without owning a method.

- plumbing: configuration, schedules, meters, EMA, the run (Accelerator, run folder, trackers,
  checkpoints and resume, signals, the non-finite guard), the training loop's bookkeeping, timm
  models and weights files;
- data: classification and detection datasets, loaders, the built-in sets;
- evaluation: COCO mAP, and the kNN evaluation of a backbone's features (DINO's, or any backbone's);
- pictures: training curves, confusion matrices and tables; detections and precision-recall curves;
  attention maps and nearest neighbours (DINO's, or any backbone's).

What does not: a method's own parts (its heads, losses, matchers, its augmentations) live in its
recipe or in a sibling file beside it (``recipes/detr_model.py``, ``recipes/yolo_data.py``), so that
reading a recipe and its siblings shows the whole method and ``common/`` holds no method's choices.

The modules are layered, leaves first, and nothing imports upward (``tests/test_layout.py``); their
map is ``docs/layout.md``.
"""

import sys


def _import_timm_without_wandb() -> None:
    """Import timm with ``wandb`` hidden, so that a run that does not report to W&B does not load it.

    ``import timm`` imports ``timm.utils.summary``, which imports wandb whenever it is installed, for timm's
    own ``train.py`` logging that no recipe uses; wandb's import is the largest share of a recipe's start-up
    after torch's. The recipes report to W&B through :mod:`common.trackers` and Accelerate's tracker, which
    import wandb themselves when a run asks for it, so hiding it here changes nothing else. A missing or
    broken timm is left to :func:`common.requirements.check_requirements`, which names it in one line."""
    if "timm" in sys.modules or "wandb" in sys.modules:
        return
    sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError at once
    try:
        import timm  # noqa: F401
    except ImportError:
        pass
    finally:
        del sys.modules["wandb"]


_import_timm_without_wandb()


class UserError(Exception):
    """Bad input from the user: printed as one ``error: ...`` line, exit status 2, no traceback."""


class RunStopped(BaseException):
    """A stop signal honoured outside the training steps (an evaluation, its plots, the last saves, the export,
    ``--predict``): the run ends at once, everything already written stays, and the message (empty when the lines
    were printed already) says what was done and how to go on (exit status 0). A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that code which turns every ``Exception`` into its own error (the ONNX exporter,
    a guarded step after the weights) lets it through."""


class StepsFailed(Exception):
    """Steps after the weights were saved that failed (model folder, export, hub push, W&B artifacts): each was
    told in one ``error:`` line with the command that redoes it, after the end summary; the weights and the rest
    of the run stay (exit status 1)."""
