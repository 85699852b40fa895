"""common/requirements.py: the floors table equals requirements.txt's runtime lines and the pins of
constraints/minimum.txt; a package missing or older than its floor stops a recipe in one line, exit 2,
before its run folder exists; the installed environment passes."""

from __future__ import annotations

import re

import pytest

from common import requirements
from conftest import ROOT, TINY_CLASSIFIER, error_line, load_recipe

#: requirements.txt's lines that only the tests and the style checks need: no run checks them.
DEVELOPMENT = {"pytest", "pytest-xdist", "ruff"}


def requirement_lines(path) -> dict[str, tuple[str, str]]:
    """``name -> (operator, version)`` of each requirement line of a pip requirements/constraints file."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, op, version = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(>=|==)\s*([^\s;]+)", line).groups()
            found[name.lower()] = (op, version)
    return found


def test_the_floors_are_requirements_txt_and_the_constraints_pins():
    declared = requirement_lines(ROOT / "requirements.txt")
    runtime = {name: version for name, (op, version) in declared.items() if name not in DEVELOPMENT}
    assert all(declared[name][0] == ">=" for name in runtime)
    assert runtime == requirements.FLOORS
    pinned = requirement_lines(ROOT / "constraints" / "minimum.txt")
    for name, floor in requirements.FLOORS.items():
        op, version = pinned[name]
        assert op == "==" and requirements.at_least(version, floor) and requirements.at_least(floor, version), name


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
    ],
)
def test_versions_compare_by_their_release_numbers(installed, floor, ok):
    assert requirements.at_least(installed, floor) is ok


def test_the_installed_environment_passes():
    assert requirements.problems() == []
    requirements.check_requirements()


def test_an_old_or_missing_package_is_one_line_before_the_run_folder(capsys, monkeypatch, tmp_run):
    """A faked timm 1.0.9 and a missing onnxruntime: one error line naming each, installed and needed, and
    the pip command; exit 2 through the recipes' entry point, and no run folder."""
    real = requirements._installed
    fake = {"timm": "1.0.9", "onnxruntime": None}
    monkeypatch.setattr(requirements, "_installed", lambda name: fake[name] if name in fake else real(name))
    classifier = load_recipe("classifier")
    err = error_line(capsys, classifier.main, TINY_CLASSIFIER + ["--output_dir", str(tmp_run)])
    assert err == (
        "error: timm 1.0.9 is installed; onnxruntime is not installed; this recipe needs timm>=1.0.26, "
        "onnxruntime>=1.24.1: pip install 'timm>=1.0.26' 'onnxruntime>=1.24.1'"
    )
    assert not tmp_run.exists()
