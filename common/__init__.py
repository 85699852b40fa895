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


class UserError(Exception):
    """Bad input from the user: printed as one ``error: ...`` line, exit status 2, no traceback."""


class RunStopped(Exception):
    """A stop signal after the training loop (during the last saves or the export): the run ends at
    once, everything already written stays, and the message says how to finish it (exit status 0)."""


class StepsFailed(Exception):
    """Steps after the weights were saved that failed (model folder, export, hub push, W&B artifacts): each was
    told in one ``error:`` line with the command that redoes it, after the end summary; the weights and the rest
    of the run stay (exit status 1)."""
