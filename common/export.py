"""A trained model as files other runtimes load: ONNX (and ``torch.export``'s ``.pt2`` where it traces),
each checked against the eager model before it is kept, and an exported ONNX file run back as a model.

What is exported is a recipe's *wrapper*: a module from the input tensor to the outputs a user wants
(a classifier's logits, a backbone's features, a detector's boxes and scores), with the weights'
metadata (:func:`common.weights.weights_metadata`: recipe, config, classes, normalisation) and a plain
description of the input and outputs in the ONNX file's ``metadata_props``. :func:`read_onnx_metadata`
gives the metadata back, so ``--predict --weights model.onnx`` rebuilds the recipe's config from the
file alone.

Two exporters:

- ``torch.export`` (default): the wrapper is traced with a dynamic batch dimension (and image sides
  where asked); the program is converted to ``model.onnx`` by torch.onnx's dynamo exporter and saved as
  ``model.pt2`` where that format can hold it (not every symbolic shape operation serialises).
- TorchScript (``legacy=True``): for models whose outputs have data-dependent sizes (NMS inside the
  graph, as torchvision's detectors), which ``torch.export`` cannot trace. The input is one image
  ``[3, H, W]`` of any size; no ``.pt2`` is written.

Every file is written under a temporary name, run beside the eager wrapper (ONNX Runtime on the CPU,
fp32) on the example input and on the recipe's check inputs, which span what the model will see (batches
of one and several; for the detectors, photos of :data:`CHECK_SIZES`: small ones the graph upscales,
large ones, odd aspect ratios), and renamed only when every output is within its tolerance
(:data:`TOLERANCES`, by the output's kind):

- ``px`` (boxes): the largest coordinate difference at most 0.5 pixels;
- ``probability`` (scores, probabilities): the largest difference at most 1e-3;
- ``relative`` (logits, features; the default): the largest difference at most 1e-3 of the largest
  magnitude the eager output has on that input.

A detector's outputs are compared as a user reads them (:class:`Detections`): each image's detections
from the file are paired with eager's (same class, IoU at least 0.5, best first), paired boxes must agree
within 0.5 px and scores within 1e-3, and every detection must have its pair, except one scoring within
1e-3 of the lowest score read (the model's score floor, or the last score kept where an image reaches the
model's detection limit): a tie at the threshold may fall on either side of it. Otherwise nothing is kept
and the export is refused in one line naming the input (its shapes), the output and the difference.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common import UserError

#: The export check's tolerance per kind of output (module docstring): pixels, probability, fraction of scale.
TOLERANCES = {"px": 0.5, "probability": 1e-3, "relative": 1e-3}
#: The photo sizes (height, width) a detector's export is checked on: small photos the graph upscales,
#: large ones it reduces, a tall and a wide one (odd aspect ratios), from 60 x 45 to 1000 x 750.
CHECK_SIZES = ((45, 60), (183, 245), (400, 120), (180, 640), (480, 640), (750, 1000))
#: The largest batch the exported graphs are traced for (``torch.export``'s dynamic batch dimension).
MAX_BATCH = 1024


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters' progress lines and tracer warnings kept off the console (a failure still raises)."""
    loggers = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _tensors(outputs: Any) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


@dataclass(frozen=True)
class Detections:
    """How a detector's export is compared: as the detections a user reads. ``read``: the wrapper's outputs
    -> per image ``(boxes [K, 4] XYXY px, scores [K], labels [K])`` (after NMS where it runs outside the
    graph); ``floor``: the score above which detections are read (the model's own threshold); ``limit``: the
    most detections an image keeps (0: no limit)."""

    read: Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    floor: float = 0.0
    limit: int = 0


def photos(source: torch.Tensor | None = None, sizes: Sequence[tuple[int, int]] = CHECK_SIZES) -> list[torch.Tensor]:
    """Pictures [3, H, W] in 0..1 of each (H, W) of ``sizes`` to check a detector's export on: ``source`` (a
    real image [3, H, W] in 0..1) resized, else smooth colour fields with sharp-edged rectangles on them
    (edges and blobs at several scales, what a detector's features respond to); seeded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for h, w in sizes:
        if source is not None:
            picture = nn.functional.interpolate(source[None].float(), size=(h, w), mode="bilinear", antialias=True)
        else:
            picture = nn.functional.interpolate(torch.rand(1, 3, 4, 5, generator=g), size=(h, w), mode="bilinear")
            for _ in range(6):
                y0, x0 = int(torch.randint(h, (1,), generator=g)), int(torch.randint(w, (1,), generator=g))
                size = 1 + int(torch.randint(max(2, min(h, w) // 2), (1,), generator=g))
                picture[0, :, y0 : y0 + size, x0 : x0 + size] = torch.rand(3, 1, 1, generator=g)
        out.append(picture[0].clamp(0, 1))
    return out


def prepared(transform: Callable, pictures: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """``pictures`` ([3, H, W] in 0..1) through a recipe's box-aware evaluation ``transform`` as a detection
    dataset passes an image without objects: ``(image tensor, target)``, the target with its ``size``."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    out = []
    for picture in pictures:
        h, w = picture.shape[-2:]
        empty = {
            "boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w)),
            "labels": torch.zeros(0, dtype=torch.int64),
        }
        image, target = transform(F.to_pil_image(picture), empty)
        image = image.as_subclass(torch.Tensor)
        target.setdefault("size", tuple(image.shape[-2:]))
        out.append((image, target))
    return out


def image_batches(
    size: int, mean: Sequence[float], std: Sequence[float], batches: Sequence[int] = (1, 5)
) -> list[dict[str, torch.Tensor]]:
    """A fixed-size model's check inputs (``images``): batches [B, 3, size, size] of each size in ``batches``
    (one, and several beside the example's two) of :func:`photos` resized to ``size`` and normalised with
    the model's ``mean`` and ``std``, as its users' images reach it."""
    mean_, std_ = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in (mean, std))
    pictures = [(p - mean_) / std_ for p in photos(sizes=[(size, size)] * sum(batches))]
    starts = np.cumsum([0, *batches])
    return [{"images": torch.stack(pictures[a:b])} for a, b in zip(starts[:-1], starts[1:])]


def batched_checks(transform: Callable, collate: Callable, names: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """A batched detector's check inputs: each of :func:`photos` alone through its evaluation ``transform``,
    then all of them in one batch (``collate``: padded where sizes differ); each batch's first tensors
    named by ``names``."""
    items = prepared(transform, photos())
    return [dict(zip(names, collate(batch))) for batch in [*([item] for item in items), items]]


def _shapes(inputs: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {list(t.shape)}" for name, t in inputs.items())


def _elementwise(name: str, kind: str, got: torch.Tensor, expected: torch.Tensor) -> tuple[float, str | None]:
    """(the difference of one output in its kind's unit, what is wrong or None)."""
    if got.shape != expected.shape:
        return float("inf"), f"{name} has shape {list(got.shape)} where eager's has {list(expected.shape)}"
    if not expected.numel():
        return 0.0, None
    diff = float((got.double() - expected.double()).abs().max())
    if kind == "relative":  # a fraction of the output's scale on this input
        diff /= max(float(expected.double().abs().max()), 1e-12)
    tolerance = TOLERANCES[kind]
    if not diff <= tolerance:
        unit = {"px": " px", "probability": "", "relative": " of its largest magnitude"}[kind]
        return diff, f"{name} differ by {diff:.3g}{unit} (tolerance {tolerance:g}{unit})"
    return diff, None


def _detections_agree(
    got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], spec: Detections, file: str
) -> tuple[float, float, str | None]:
    """One image's detections from the file against eager's: (the largest box difference in px over the
    pairs, the largest score difference, what is wrong or None); the rule is the module docstring's."""
    from torchvision.ops import box_iou

    (gb, gs, gl), (eb, es, el) = ((t.detach().cpu() for t in d) for d in (got, expected))
    gb, gs, eb, es = gb.double(), gs.double(), eb.double(), es.double()
    # the lowest score read: the model's floor, or the last score kept where an image reached the limit
    low = spec.floor
    for scores in (gs, es):
        if spec.limit and len(scores) >= spec.limit:
            low = max(low, float(scores.min()))
    loose = low + TOLERANCES["probability"]  # a detection scoring at most this may be on one side only
    iou = box_iou(eb, gb) if len(eb) and len(gb) else torch.zeros(len(eb), len(gb), dtype=torch.double)
    iou[el[:, None] != gl[None, :]] = -1.0  # pairs are of one class
    box_diff = score_diff = 0.0
    paired = torch.zeros(len(gb), dtype=torch.bool)
    for i in es.argsort(descending=True).tolist():
        candidates = iou[i].masked_fill(paired, -1.0)
        j = int(candidates.argmax()) if len(gb) else -1
        if j < 0 or candidates[j] < 0.5:
            if es[i] > loose:
                return (
                    box_diff,
                    score_diff,
                    (f"eager's detection of class {int(el[i])} scoring {float(es[i]):.3f} has none in {file}"),
                )
            continue
        paired[j] = True
        if max(es[i], gs[j]) > loose:
            box_diff = max(box_diff, float((eb[i] - gb[j]).abs().max()))
            score_diff = max(score_diff, float((es[i] - gs[j]).abs()))
    for j in (~paired).nonzero().flatten().tolist():
        if gs[j] > loose:
            return (
                box_diff,
                score_diff,
                f"{file} has a detection of class {int(gl[j])} scoring {float(gs[j]):.3f} that eager has not",
            )
    for name, diff, kind in (("boxes", box_diff, "px"), ("scores", score_diff, "probability")):
        _, wrong = _elementwise(name, kind, torch.tensor([diff]), torch.tensor([0.0]))
        if wrong:
            return box_diff, score_diff, wrong
    return box_diff, score_diff, None


def _checked(
    file: str,
    run: Callable[..., list[torch.Tensor]],
    cases: Sequence[tuple[Mapping[str, torch.Tensor], list[torch.Tensor]]],
    names: Sequence[str],
    kinds: Mapping[str, str],
    detections: Detections | None,
    tmp: Path,
) -> dict[str, float]:
    """``file`` (run by ``run``) on every ``(inputs, eager outputs)`` of ``cases``: per output the largest
    difference in its kind's unit (keys ``boxes``, ``scores`` for a detector); the first one outside its
    tolerance removes ``tmp`` and is one :class:`UserError` naming the input and the output."""
    worst: dict[str, float] = {}
    for inputs, expected in cases:
        got = [torch.as_tensor(np.asarray(g)) for g in _tensors(run(*inputs.values()))]
        found: dict[str, float] = {}
        wrong = None
        if detections is not None:
            for g, e in zip(detections.read(got), detections.read(expected)):
                boxes, scores, wrong = _detections_agree(g, e, detections, file)
                found = {"boxes": max(found.get("boxes", 0.0), boxes), "scores": max(found.get("scores", 0.0), scores)}
                if wrong:
                    break
        # every output, or beside a detector's detections the outputs ``kinds`` names (YOLO's raw scores)
        for name, g, e in zip(names, got, expected):
            if wrong or (detections is not None and name not in kinds):
                continue
            diff, wrong = _elementwise(name, kinds.get(name, "relative"), g.to(e.dtype), e)
            found[name] = max(diff, found.get(name, 0.0))
        if wrong:
            tmp.unlink(missing_ok=True)
            raise UserError(f"export refused: {file} on {_shapes(inputs)}: {wrong}; nothing was written")
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
    return worst


def _metrics(file: str, worst: Mapping[str, float], kinds: Mapping[str, str], detections: Detections | None) -> dict:
    """``export/<file>_<output>[_px | _rel]`` -> the largest difference, in the output's kind's unit."""
    if detections is not None:
        kinds = {**kinds, "boxes": "px", "scores": "probability"}
    suffix = {"px": "_px", "probability": "", "relative": "_rel"}
    return {f"export/{file}_{name}{suffix[kinds.get(name, 'relative')]}": v for name, v in worst.items()}


def export_model(
    wrapper: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    output_names: Sequence[str],
    folder: str | Path,
    metadata: Mapping[str, str],
    dynamic: Mapping[str, Mapping[int, str]] | None = None,
    legacy: bool = False,
    checks: Sequence[Mapping[str, torch.Tensor]] = (),
    kinds: Mapping[str, str] | None = None,
    detections: Detections | None = None,
) -> dict[str, float]:
    """Export ``wrapper`` (eval mode, CPU, fp32; its forward takes ``inputs`` by position, named by their
    keys) to ``folder/model.onnx`` and, unless ``legacy``, ``folder/model.pt2``, each checked against the
    eager wrapper on ``inputs`` and on each of ``checks`` (inputs of the same names spanning what the model
    will see). ``kinds``: per output name, ``px``, ``probability`` or ``relative`` (the default), its
    tolerance's kind; ``detections``: a detector's outputs compared as detections (module docstring), and
    beside them only the outputs ``kinds`` names.
    ``dynamic``: per input, the dimensions left free and their names (``batch``: 1..MAX_BATCH; image sides:
    as the model allows); default, the first dimension of each, as ``batch``. ``metadata`` (strings) goes
    into the ONNX file with the inputs' and outputs' names. Returns per file and output the largest
    difference in the kind's unit (``export/onnx_boxes_px``, ``export/onnx_scores``,
    ``export/pt2_logits_rel``, ...) and ``export/inputs`` (how many inputs were compared); one outside its
    tolerance is one :class:`UserError` and leaves no file."""
    import onnx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = wrapper.eval().cpu().float()
    names = list(inputs)
    given = [t.detach().cpu() for t in inputs.values()]
    given = [t.float() if t.is_floating_point() else t for t in given]
    dynamic = dynamic if dynamic is not None else {name: {0: "batch"} for name in names}
    kinds = kinds or {}
    cases = []
    with torch.no_grad():
        for case in [dict(zip(names, given)), *checks]:
            case = {n: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu() for n, t in case.items()}
            cases.append((case, _tensors(wrapper(*case.values()))))
    diffs: dict[str, float] = {"export/inputs": float(len(cases))}
    onnx_tmp, pt2_tmp = folder / "model.tmp.onnx", folder / "model.tmp.pt2"
    if legacy:
        axes = {name: dict(dims) for name, dims in dynamic.items()}
        with _quiet():
            torch.onnx.export(
                wrapper,
                tuple(given),
                str(onnx_tmp),
                input_names=names,
                output_names=list(output_names),
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )
    else:
        # the batch must stay free (an error otherwise); image sides are left to torch.export's own
        # ranges (AUTO), as convolutions and poolings tie them to their strides
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        dims = {n: batch if n == "batch" else torch.export.Dim.AUTO for spec in dynamic.values() for n in spec.values()}
        shapes = tuple({axis: dims[n] for axis, n in dynamic.get(name, {}).items()} or None for name in names)
        # traced with a batch of 2 whatever was given: from a batch of 1, torch.export would specialise the
        # batch dimension to 1 and refuse to keep it dynamic
        traced = tuple(t[torch.arange(2) % len(t)] for t in given)
        program = torch.export.export(wrapper, traced, dynamic_shapes=shapes)
        try:  # the .pt2 format cannot hold every symbolic shape operation (a ceil of a free image side)
            torch.export.save(program, str(pt2_tmp))
        except Exception:
            pt2_tmp.unlink(missing_ok=True)
        if pt2_tmp.is_file():
            loaded = torch.export.load(str(pt2_tmp)).module()
            with torch.no_grad():
                worst = _checked("model.pt2", loaded, cases, output_names, kinds, detections, pt2_tmp)
            diffs.update(_metrics("pt2", worst, kinds, detections))
        with _quiet():
            torch.onnx.export(
                program,
                traced,
                str(onnx_tmp),
                input_names=names,
                output_names=list(output_names),
                dynamo=True,
                external_data=False,  # one self-contained file (models under 2 GB)
                verbose=False,
            )
    proto = onnx.load(str(onnx_tmp))
    described = {**metadata, "inputs": json.dumps(names), "outputs": json.dumps(list(output_names))}
    onnx.helper.set_model_props(proto, {k: str(v) for k, v in described.items()})
    onnx.save(proto, str(onnx_tmp))
    try:
        worst = _checked("model.onnx", OnnxModel(onnx_tmp), cases, output_names, kinds, detections, onnx_tmp)
    except UserError:
        pt2_tmp.unlink(missing_ok=True)
        raise
    diffs.update(_metrics("onnx", worst, kinds, detections))
    # renamed only once both are checked: a refused or interrupted export leaves no half of one
    if pt2_tmp.is_file():
        pt2_tmp.replace(folder / "model.pt2")
    onnx_tmp.replace(folder / "model.onnx")
    return diffs


def export_run(run: Any, folder: Path, write: Callable[[Path], dict[str, float]], step: int = 0) -> dict[str, float]:
    """A run's exports (``run``: :class:`common.run.Run`, begun): on the main process ``write(folder)`` (a
    recipe's function around :func:`export_model`), its differences from eager logged to metrics.jsonl
    at ``step`` and told in one line; returns them ({} on the other processes)."""
    if not run.accelerator.is_main_process:
        return {}
    diffs = write(Path(folder))
    run.log(diffs, step, echo=False)
    folder = Path(folder)
    inside = folder.relative_to(run.dir) if folder.is_relative_to(run.dir) else folder  # the last line names run.dir
    files = [str(inside / name) for name in ("model.onnx", "model.pt2") if (folder / name).is_file()]
    checked = int(diffs.get("export/inputs", 1))
    run.print(f"export: {', '.join(files)}, checked against eager on {checked} inputs: {differences(diffs)}")
    return diffs


def differences(diffs: Mapping[str, float]) -> str:
    """:func:`export_model`'s differences as a user reads them, each output's largest over the files:
    ``boxes 0.02 px, scores 3e-06`` (``relative``: ``features 2e-06 of scale``)."""
    worst: dict[str, tuple[float, str]] = {}
    for key, value in diffs.items():
        if key == "export/inputs":
            continue
        name = key.split("/", 1)[1].split("_", 1)[1]  # export/onnx_boxes_px -> boxes_px
        unit = " px" if name.endswith("_px") else " of scale" if name.endswith("_rel") else ""
        name = name.removesuffix("_px").removesuffix("_rel")
        worst[name] = (max(value, worst.get(name, (0.0, ""))[0]), unit)
    return ", ".join(f"{name} {value:.2g}{unit}" for name, (value, unit) in worst.items())


def read_onnx_metadata(path: str | Path) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file (strings); an unreadable file is one :class:`UserError`."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise UserError(f"weights '{path}' could not be read as ONNX: {type(e).__name__}: {e}") from None
    return {p.key: p.value for p in proto.metadata_props}


class OnnxModel:
    """An ONNX file run with ONNX Runtime on the CPU, called as the wrapper it was exported from: its
    input tensors by position in, the list of output tensors (CPU, as the file gives them) out."""

    def __init__(self, path: str | Path) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: the graph optimiser's notes are not the user's business
        # no busy-waiting between calls: idle threads would take the cores from the loader workers (and from
        # PyTorch where both run in one process)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        feed = {n: t.detach().cpu().numpy() for n, t in zip(self.input_names, inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in self.session.run(None, feed)]


def is_onnx(path: str | Path) -> bool:
    """Whether ``path`` names an ONNX file (by its suffix), as ``--weights`` may."""
    return Path(path).suffix.lower() == ".onnx"


def export_saved(run: Any, write: Callable[[Path], dict[str, float]]) -> dict[str, float]:
    """``--export --weights W``: the run (``run``: :class:`common.run.Run`) begins, ``write(run.dir)`` exports
    W's model (no data is read, nothing trained) and the run ends; returns the differences from eager."""
    run.begin()
    diffs = export_run(run, run.dir, write)
    run.finish([run.dir / "model.onnx"])
    return diffs
