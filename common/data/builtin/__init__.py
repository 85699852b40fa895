"""Every built-in data set, and the one registry of their names.

Built-in sets need no network, are deterministic, are generated in seconds and cached on disk
(:mod:`.cache`), and have the schema of their hub counterparts, so one code path loads both:

- classification (``--data`` of the classifier and DINO): ``digits`` (scikit-learn's 8x8 digits,
  :mod:`.digits`), ``digits_ssl`` (a harder set for self-supervised learning, :mod:`.digits_ssl`) and
  ``digits_det_crops`` (every box of ``digits_det`` as a 32-px crop, :mod:`.digits_det`);
- detection (``--data`` of the detectors): ``digits_det``, scenes of several digits as a COCO-json
  folder (:mod:`.digits_det`), and ``shapes_seg``, scenes of flat shapes with their polygons, for instance
  segmentation (:mod:`.shapes_seg`).

A leaf package: it imports nothing from ``common`` but :class:`common.UserError`, so that the
data layers above it (``common.data.classification``, ``common.detection.data``) can name it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.data.builtin.digits import digits_dataset
from common.data.builtin.digits_det import digits_det_crops_dataset, digits_det_folder
from common.data.builtin.digits_ssl import digits_ssl_dataset
from common.data.builtin.shapes_seg import shapes_seg_folder

# Name -> a function of no argument returning the set: a hub-style datasets.DatasetDict with
# ``image`` and ``label`` (ClassLabel) columns for classification, a COCO-json folder for detection.
CLASSIFICATION: dict[str, Callable[[], Any]] = {
    "digits": digits_dataset,
    "digits_ssl": digits_ssl_dataset,
    "digits_det_crops": digits_det_crops_dataset,
}
DETECTION: dict[str, Callable[[], Path]] = {"digits_det": digits_det_folder, "shapes_seg": shapes_seg_folder}
