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
fp32) on the example input and on the recipe's check inputs, and renamed only when every output is within
its tolerance (:mod:`common.artifacts.export_check`); otherwise nothing is kept and the export is refused in one line
naming the input, the output and the difference.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common import RunStopped
from common.artifacts.export_check import Detections, checked, export_metrics, tensors

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
            cases.append((case, tensors(wrapper(*case.values()))))
    diffs: dict[str, float] = {"export/inputs": float(len(cases))}
    onnx_tmp, pt2_tmp = folder / "model.tmp.onnx", folder / "model.tmp.pt2"
    try:
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
            dims = {
                n: batch if n == "batch" else torch.export.Dim.AUTO for spec in dynamic.values() for n in spec.values()
            }
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
                    worst = checked("model.pt2", loaded, cases, output_names, kinds, detections, pt2_tmp)
                diffs.update(export_metrics("pt2", worst, kinds, detections))
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
        worst = checked("model.onnx", OnnxModel(onnx_tmp), cases, output_names, kinds, detections, onnx_tmp)
        diffs.update(export_metrics("onnx", worst, kinds, detections))
        # renamed only once both are checked: a refused or interrupted export leaves no half of one
        if pt2_tmp.is_file():
            pt2_tmp.replace(folder / "model.pt2")
        onnx_tmp.replace(folder / "model.onnx")
    finally:  # a refused, failed or stopped export leaves no temporary file
        onnx_tmp.unlink(missing_ok=True)
        pt2_tmp.unlink(missing_ok=True)
    return diffs


def export(run: Any, write: Callable[[Path], dict[str, float]], step: int | None = None) -> dict[str, float]:
    """The one way a recipe exports (``run``: :class:`common.run.Run`): ``write(folder)``, the recipe's function
    around :func:`export_model`, on the main process; its differences from eager logged to metrics.jsonl and
    told in one line; returns them ({} on the other processes). ``step`` None is ``--export --weights W``: the
    run begins, W's model is written into the run folder (no data read, nothing trained) and the run ends;
    otherwise the files go to ``<run>/export`` at the end of training, logged at ``step``."""
    if step is None:
        run.begin()
        with run.heartbeat("export"):  # torch.onnx's exporter and the checks: minutes for a detector
            diffs = _export_into(run, run.dir, write, 0)
        run.finish([run.dir / "model.onnx"])
        return diffs
    with run.heartbeat("export"):
        return _export_into(run, run.dir / "export", write, step)


def _export_into(run: Any, folder: Path, write: Callable[[Path], dict[str, float]], step: int) -> dict[str, float]:
    if not run.accelerator.is_main_process:
        return {}
    try:
        with run.interruptible("the export"):  # one process: a stop signal ends the exporter at once
            diffs = write(folder)
    except Exception as error:  # an exporter that wraps every error in its own: a stop is still a stop
        stop = _stop_in(error)
        if stop is None:
            raise
        raise stop from None
    run.log(diffs, step, echo=False)
    inside = folder.relative_to(run.dir) if folder.is_relative_to(run.dir) else folder  # the last line names run.dir
    files = [str(inside / name) for name in ("model.onnx", "model.pt2") if (folder / name).is_file()]
    checked = int(diffs.get("export/inputs", 1))
    run.print(f"export: {', '.join(files)}, checked against eager on {checked} inputs: {differences(diffs)}")
    return diffs


def _stop_in(error: BaseException) -> RunStopped | None:
    """The :class:`RunStopped` among ``error``'s causes and contexts, if any."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, RunStopped):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


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
