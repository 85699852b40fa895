"""common/requirements.py: the floors equal requirements.txt's runtime lines; a run is checked for what it uses,
by module (its tracker, ONNX with --export or ONNX weights, matplotlib when it draws); a module another
distribution provides counts by that distribution's version and the advice names it; a package missing or too old
stops a recipe in one line, exit 2, before its run folder exists; --export on a torch too old to export is refused
before training; one environment variable skips the check."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from common import UserError, requirements
from common.requirements import Floor
from conftest import ROOT, TINY_CLASSIFIER, error_line, load_recipe

#: requirements.txt's lines that only the tests and the style checks need: no run checks them.
DEVELOPMENT = {"pytest", "pytest-xdist", "ruff"}


def requirement_lines(path) -> dict[str, tuple[str, str]]:
    """``name -> (operator, version)`` of each requirement line of a pip requirements file."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, op, version = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(>=|==)\s*([^\s;]+)", line).groups()
            found[name.lower()] = (op, version)
    return found


def test_the_floors_are_requirements_txt():
    declared = requirement_lines(ROOT / "requirements.txt")
    runtime = {name: version for name, (op, version) in declared.items() if name not in DEVELOPMENT}
    assert all(declared[name][0] == ">=" for name in runtime)
    assert runtime == requirements.declared()
    for recipe in ("classifier", "dino", "yolo", "detr", "faster_rcnn"):  # exporting never needs less than training
        assert requirements.at_least(requirements.EXPORT_TORCH[recipe], requirements.declared()["torch"])


@pytest.mark.parametrize(
    "installed, floor, ok",
    [
        ("1.0.16", "1.0.16", True),
        ("1.0.9", "1.0.16", False),
        ("2.6.0a0+ecf3bae40a", "2.6", True),  # a source build of 2.6, as GPU images ship torch
        ("2.5.1+cu124", "2.6", False),
        ("2.14.1+cu130", "2.6", True),
        ("0.4.2", "0.4.3", False),
        ("10", "10.0", True),
        ("12.1.1.post0", "10.0", True),  # Pillow-SIMD's numbering
    ],
)
def test_versions_compare_by_their_release_numbers(installed, floor, ok):
    assert requirements.at_least(installed, floor) is ok


def _modules(**cfg) -> set[str]:
    defaults = {"report_to": "none", "export": False, "weights": "", "eval_only": False, "predict": ""}
    return {floor.module for floor in requirements.needs(SimpleNamespace(**{**defaults, **cfg}))}


def test_a_run_is_checked_for_what_it_uses():
    core = {floor.module for floor in requirements.CORE}
    assert _modules() == core | {"matplotlib"}  # training draws its curves
    assert _modules(report_to="wandb") == core | {"matplotlib", "wandb"}
    assert _modules(report_to="tensorboard") == core | {"matplotlib", "tensorboard"}
    assert _modules(export=True) == core | {"matplotlib", "onnx", "onnxscript", "onnxruntime"}
    assert _modules(predict="photos", weights="run/export/model.onnx") == core | {"matplotlib", "onnx", "onnxruntime"}
    assert _modules(export=True, weights="run/best.safetensors") == core | {"onnx", "onnxscript", "onnxruntime"}
    assert _modules(eval_only=True, weights="run/best.safetensors") == core | {"matplotlib"}
    # --predict and --eval_only never export, whatever `export` says (YOLO's default is true)
    assert _modules(export=True, predict="photos", weights="w.safetensors") == core | {"matplotlib"}
    assert _modules(export=True, eval_only=True, weights="w.safetensors") == core | {"matplotlib"}


def test_the_installed_environment_passes_every_use():
    every = SimpleNamespace(report_to="wandb", export=True, weights="m.onnx", eval_only=True, predict="")
    assert requirements.problems(requirements.needs(every)) == []
    requirements.check_requirements(requirements.TRACKERS["tensorboard"])
    requirements.check_run(every, "yolo")


def _distribution(site, name: str, version: str, module: str) -> None:
    """An installed distribution ``name`` ``version`` whose files are the package ``module``, as pip lays one out
    (a .dist-info folder with METADATA and RECORD), in the folder ``site`` on sys.path."""
    (site / module).mkdir(exist_ok=True)
    (site / module / "__init__.py").write_text(f"__version__ = '{version}'\n")
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    (info / "top_level.txt").write_text(module + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("cvr_fake")]:
        del sys.modules[name]


def test_a_module_another_distribution_provides_counts_by_its_version(site):
    """As onnxruntime-gpu provides ``onnxruntime`` and Pillow-SIMD ``PIL``: the module, not the declared name,
    counts (real importlib.metadata look-ups over a distribution laid out as pip lays it out)."""
    _distribution(site, "cvr-fake-ort-gpu", "1.31.1", "cvr_fake_ort")
    floor = Floor("cvr_fake_ort", "cvr-fake-ort", "1.24.1")
    assert requirements.provider(floor) == ("cvr-fake-ort-gpu", "1.31.1")
    requirements.check_requirements([floor])


def test_advice_names_the_installed_distribution_never_a_second_wheel(site):
    _distribution(site, "cvr-fake-ort-gpu", "1.20.0", "cvr_fake_ort")
    with pytest.raises(UserError) as raised:
        requirements.check_requirements([Floor("cvr_fake_ort", "cvr-fake-ort", "1.24.1")])
    assert str(raised.value) == (
        "cvr-fake-ort-gpu 1.20.0 is installed (module cvr_fake_ort); this run needs cvr-fake-ort>=1.24.1: "
        f"pip install 'cvr-fake-ort-gpu>=1.24.1' (or set {requirements.SKIP_ENV}=1 to skip this check)"
    )


def test_the_environment_variable_skips_the_check(monkeypatch):
    missing = [Floor("cvr_fake_missing", "cvr-fake-missing", "1.0")]
    with pytest.raises(UserError, match="cvr-fake-missing is not installed"):
        requirements.check_requirements(missing)
    monkeypatch.setenv(requirements.SKIP_ENV, "1")
    requirements.check_requirements(missing)


def _faked(monkeypatch, fake: dict[str, str | None]) -> None:
    """The declared distributions of ``fake`` as installed at those versions (None: no distribution provides
    the module)."""
    real = requirements.provider
    monkeypatch.setattr(
        requirements,
        "provider",
        lambda f: (f.package, fake[f.package]) if fake.get(f.package) else None if f.package in fake else real(f),
    )


def test_an_old_or_missing_package_is_one_line_before_the_run_folder(capsys, monkeypatch, tmp_run):
    """A faked timm 1.0.9 and, for a run with --export, a missing onnxruntime: one error line naming each,
    installed and needed, and the pip command; exit 2 through the recipe's entry point, and no run folder."""
    _faked(monkeypatch, {"timm": "1.0.9", "onnxruntime": None})
    classifier = load_recipe("classifier")
    err = error_line(capsys, classifier.main, TINY_CLASSIFIER + ["--output_dir", str(tmp_run), "--export", "true"])
    assert err == (
        "error: timm 1.0.9 is installed; onnxruntime is not installed; this run needs timm>=1.0.26, "
        "onnxruntime>=1.24.1: pip install 'timm>=1.0.26' 'onnxruntime>=1.24.1' "
        f"(or set {requirements.SKIP_ENV}=1 to skip this check)"
    )
    assert not tmp_run.exists()


def test_a_run_that_does_not_export_needs_no_onnx_nor_an_unasked_tracker(monkeypatch):
    """No ONNX package and no wandb installed: a training run with report_to none passes; asking for W&B fails."""
    _faked(monkeypatch, {"onnx": None, "onnxscript": None, "onnxruntime": None, "wandb": None})
    args = SimpleNamespace(report_to="none", export=False, weights="", eval_only=False, predict="")
    requirements.check_run(args, "classifier")
    with pytest.raises(UserError, match="wandb is not installed"):
        requirements.check_run(SimpleNamespace(**{**vars(args), "report_to": "wandb"}), "classifier")


def test_export_on_a_torch_too_old_to_export_is_refused_before_training(capsys, monkeypatch, tmp_run):
    """torch at the training floor but below the recipe's export floor: --export is one line naming the export
    before anything is written; the same run without --export passes the check."""
    monkeypatch.setitem(requirements.EXPORT_TORCH, "classifier", "99.0")  # no torch exports it
    classifier = load_recipe("classifier")
    err = error_line(capsys, classifier.main, TINY_CLASSIFIER + ["--output_dir", str(tmp_run), "--export", "true"])
    assert (
        err.startswith("error: torch ")
        and "; --export of classifier.py (train without it: --export false) needs torch>=99.0: pip" in err
    )
    assert not tmp_run.exists()
    requirements.check_run(SimpleNamespace(report_to="none", export=False, weights="", eval_only=False), "classifier")
    predicting = SimpleNamespace(report_to="none", export=True, weights="w.safetensors", eval_only=False, predict="x")
    requirements.check_run(predicting, "classifier")  # a prediction never exports
    newest = max(requirements.EXPORT_TORCH.values(), key=requirements.release)
    assert requirements.export_torch("my_classifier") == newest == "99.0"  # a renamed copy: the newest floor
