"""A copy that owns its code: ``python -m common.vendor RECIPE DEST`` writes a recipe, its sibling files and the
modules of ``common/`` it imports into a folder outside the repository, which then trains with nothing of the
checkout importable; the copy records the commit it came from and each run's ``config.yaml`` names the
``common/`` it ran with."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common import UserError
from common.config import RunConfig, parse_config, save_config
from common.origin import RECORD, common_origin, content_hash, git_state, origin_comment
from common.run_folder import check_resume
from common.vendor import common_modules, data_files, plan, siblings
from common.vendor import main as vendor_main
from conftest import ROOT, TINY_CLASSIFIER, TINY_RUNS

DETECTORS = ["yolo", "detr", "faster_rcnn"]
RECIPES = ["classifier", "dino", *DETECTORS]
# the tiny model and sizes of each recipe's short test runs, less the flags the smoke command already gives
TINY = {
    "classifier": [a for a in TINY_CLASSIFIER if a not in ("--max_steps", "4")],
    **TINY_RUNS,
    "dino": [*TINY_RUNS["dino"], "--knn_pixel_limit", "0"],  # no raw-pixel kNN baseline
}

# Run in the child instead of `python SCRIPT`: the checkout made unreachable first. `pip install -e .` put a
# finder on sys.meta_path (and a path hook) that maps `common` to the checkout from anywhere; they go, with
# every sys.path entry inside the checkout. At exit the child writes the file of every module it loaded.
CHILD = """
import atexit, json, os, runpy, sys
checkout, script, report = os.path.realpath(sys.argv[1]), *sys.argv[2:4]
inside = lambda p: (os.path.realpath(p) + os.sep).startswith(checkout + os.sep)
editable = lambda f: (getattr(f, "__module__", "") or "").startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path[:] = [os.path.dirname(script)] + [p for p in sys.path if p and not inside(p)]
sys.path_importer_cache.clear()
def reachable():
    # where `common` would come from if the copy beside the script were not there: nowhere in the checkout
    from importlib.machinery import PathFinder
    elsewhere = [p for p in sys.path if os.path.realpath(p) != os.path.realpath(os.path.dirname(script))]
    finders = [f for f in sys.meta_path if f is not PathFinder and hasattr(f, "find_spec")]
    specs = [PathFinder.find_spec("common", elsewhere), *(f.find_spec("common", None) for f in finders)]
    return [s.origin for s in specs if s is not None and s.origin and inside(s.origin)]
def record():
    files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
    files = {n: f for n, f in files.items() if isinstance(f, str) and os.path.isabs(f)}
    with open(report, "w") as out:
        json.dump({"modules": files, "checkout_reachable": reachable()}, out)
atexit.register(record)
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="session")
def few_scenes(tmp_path_factory) -> Path:
    """The first 16 training and 8 evaluation scenes of the built-in digits_det as a COCO-json folder: the
    detectors' demo data, small enough that loading, checking and evaluating it take no time."""
    from common.data.builtin import DETECTION

    source, root = DETECTION["digits_det"](), tmp_path_factory.mktemp("scenes")
    (root / "annotations").mkdir()
    for split, count in (("train", 16), ("val", 8)):
        coco = json.loads((source / "annotations" / f"instances_{split}.json").read_text())
        images = sorted(coco["images"], key=lambda image: image["id"])[:count]
        kept = {image["id"] for image in images}
        (root / split).mkdir()
        for image in images:
            shutil.copy(source / split / image["file_name"], root / split / image["file_name"])
        boxes = [a for a in coco["annotations"] if a["image_id"] in kept]
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps(dict(coco, images=images, annotations=boxes))
        )
    return root


@pytest.fixture(scope="session")
def few_digits(tmp_path_factory) -> Path:
    """128 training and 64 evaluation images of the built-in digits, saved as a dataset: DINO's kNN evaluation
    (at step 0 and at the end) over them takes no time."""
    from common.data.builtin import CLASSIFICATION

    digits, root = CLASSIFICATION["digits"](), tmp_path_factory.mktemp("digits") / "few"
    type(digits)(train=digits["train"].select(range(128)), test=digits["test"].select(range(64))).save_to_disk(root)
    return root


def vendored(recipe: str, dest: Path, capsys: pytest.CaptureFixture) -> list[str]:
    """Vendor ``recipe`` into ``dest`` as the command line does; returns the lines it printed."""
    vendor_main([recipe, str(dest)])
    return capsys.readouterr().out.splitlines()


# the classifier in the default suite; the other four in the second tier (-m configs), which CI runs too
@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n if n == "classifier" else pytest.param(n, marks=pytest.mark.configs) for n in RECIPES]
)
def test_a_vendored_recipe_trains_with_no_checkout_importable(name, tmp_path, capsys, request):
    dest = tmp_path / f"my_{name}"
    printed = vendored(name, dest, capsys)
    # the one command that smoke-tests the copy, run here with the tests' tiny model and sizes added
    smoke = printed[-1].removeprefix("smoke test: ")
    assert smoke == f"cd {dest} && python {name}.py --max_steps 2 --report_to none", printed
    args = shlex.split(smoke.partition(" && ")[2])[2:] + ["--epochs", "1", "--num_workers", "0", *TINY[name]]
    if name in ("dino", *DETECTORS):  # their demo data made small (the classifier's is small already)
        args += ["--data", str(request.getfixturevalue("few_digits" if name == "dino" else "few_scenes"))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    report = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(dest / f"{name}.py"), str(report), *args],
        cwd=dest,
        env=dict(env, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reported = json.loads(report.read_text())
    assert reported["checkout_reachable"] == []
    modules = reported["modules"]
    from_checkout = sorted(n for n, f in modules.items() if Path(f).resolve().is_relative_to(ROOT))
    assert not from_checkout, f"loaded from the checkout: {from_checkout}"
    ours = {n: f for n, f in modules.items() if n == "common" or n.startswith(("common.", f"{name}_"))}
    assert modules["common"] == str(dest / "common" / "__init__.py")
    assert all(Path(f).is_relative_to(dest) for f in ours.values()), ours
    # the run says which common/ it ran with: the vendored one, from the commit its record names
    record = json.loads((dest / "common" / RECORD).read_text())
    config = dest / "runs" / name / "default" / "config.yaml"
    header = config.read_text().splitlines()[0]
    assert header.startswith(f"# common/: vendored from git {record['short']}"), header
    assert f"(sha256 {content_hash(dest / 'common')})" in header and "edited since" not in header
    assert yaml.safe_load(config.read_text())["max_steps"] == 2  # the comment changes nothing loaded


def test_the_copy_holds_the_imported_files_and_records_them(tmp_path, capsys):
    dest = tmp_path / "copy"
    printed = vendored("classifier", dest, capsys)
    written = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    record = json.loads((dest / "common" / RECORD).read_text())
    # every file but the record itself, each with its sha256
    assert sorted(record["files"]) == [f for f in written if f != f"common/{RECORD}"]
    assert record["files"]["classifier.py"] == hashlib.sha256((ROOT / "recipes/classifier.py").read_bytes()).hexdigest()
    # the recipe, its siblings (classifier_inference imports classifier_model), configs, requirements
    assert {"classifier.py", "classifier_inference.py", "classifier_model.py", "requirements.txt"} <= set(written)
    assert not any(f.startswith(("dino", "yolo", "detr", "faster_rcnn")) for f in written)  # no other recipe's
    configs = sorted(p.name for p in (ROOT / "configs" / "classifier").glob("*.yaml"))
    assert sorted(f.removeprefix("configs/") for f in written if f.startswith("configs/")) == configs
    # common/: what is imported, with each package's __init__.py; the vendor itself is not
    assert {"common/__init__.py", "common/data/__init__.py", "common/data/builtin/__init__.py"} <= set(written)
    assert "common/vendor.py" not in written and "common/origin.py" in written
    assert printed[0].startswith(f"wrote {dest}: classifier.py and 2 files beside it, ")
    commit, _ = git_state(ROOT)
    assert record["commit"] == commit and record["short"] == commit[:12] and record["recipe"] == "classifier"
    if commit != "unknown":  # a checkout: the commit is the one checked out, 40 hex digits
        assert len(commit) == 40 and int(commit, 16) >= 0


def test_siblings_and_common_modules_are_followed_through_imports(tmp_path):
    """In a small fake tree: siblings reached only through another sibling, a module imported inside a function,
    ``from package import submodule``, a relative import, each package's __init__.py and a data file beside a
    module come; files nobody imports do not."""
    files = {
        "recipes/my.py": "import os\nfrom my_model import Net\n\ndef main():\n    from common.loop import run\n",
        "recipes/my_model.py": "from my_parts import head\nfrom common import UserError\n",
        "recipes/my_parts.py": "from common.data import builtin\n",
        "recipes/other_model.py": "from common.unused import x\n",
        "common/__init__.py": "class UserError(Exception): ...\n",
        "common/loop.py": "def run():\n    from .schedules import cosine\n",
        "common/schedules.py": "",
        "common/unused.py": "",
        "common/data/__init__.py": "",
        "common/data/builtin/__init__.py": "from common.data.builtin.digits import load\n",
        "common/data/builtin/digits.py": "",
        "common/data/builtin/digits.csv": "0,1\n",
        "common/data/builtin/unused.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    script = tmp_path / "recipes" / "my.py"
    assert [p.name for p in siblings(script)] == ["my_model.py", "my_parts.py"]
    modules = common_modules([script, *siblings(script)], tmp_path / "common")
    names = [p.relative_to(tmp_path).as_posix() for p in modules]
    assert names == [
        "common/__init__.py",
        "common/data/__init__.py",
        "common/data/builtin/__init__.py",
        "common/data/builtin/digits.py",
        "common/loop.py",
        "common/schedules.py",
    ]
    assert [p.name for p in data_files(modules, tmp_path / "common")] == ["digits.csv"]


def test_a_recipe_given_as_a_path_takes_its_configs_and_dino_its_figures():
    """The real DINO: dino_knn imports dino_figures, which dino.py never names."""
    files = plan(str(ROOT / "recipes" / "dino.py")).files
    assert {"dino.py", "dino_knn.py", "dino_figures.py", "dino_inference.py", "dino_model.py"} <= set(files)
    assert sorted(n for n in files if n.startswith("configs/")) == sorted(
        f"configs/{p.name}" for p in (ROOT / "configs" / "dino").glob("*.yaml")
    )


def test_refusals_write_nothing(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    cases = {
        ("dino", str(full)): f"error: '{full}' exists and is not empty: name a new or empty folder",
        ("nope", str(tmp_path / "new")): "error: unknown recipe 'nope': the recipes are classifier, detr, dino, "
        "faster_rcnn, yolo (or give a script's path)",
        (str(ROOT / "recipes" / "dino_model.py"), str(tmp_path / "new")): (
            f"error: '{ROOT / 'recipes' / 'dino_model.py'}' is not a recipe script: it declares no "
            "class Config(RunConfig)"
        ),
    }
    for args, line in cases.items():
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            vendor_main(list(args))
        assert stopped.value.code == 2 and capsys.readouterr().err.splitlines() == [line]
    assert [p.name for p in tmp_path.iterdir()] == ["full"] and [p.name for p in full.iterdir()] == ["notes.txt"]


def test_the_command_line_refuses_an_unknown_recipe_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "common.vendor", "dinov2", str(tmp_path / "x")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.splitlines()[0].startswith("error: unknown recipe 'dinov2'")
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "x").exists()


def test_a_checkouts_origin_names_its_commit_and_a_vendored_copy_edited_since(tmp_path, capsys):
    commit, changed = git_state(ROOT / "common")  # the commit, and local changes under common/ only
    here = common_origin()
    assert origin_comment() == f"# common/: {here}\n"
    assert here.endswith(f"(sha256 {content_hash(ROOT / 'common')})")
    if commit != "unknown":
        assert here.startswith(f"{ROOT / 'common'} at git {commit[:12]}") and ("+ local changes" in here) == changed
    # a vendored copy: its record, then "edited since" once a module changes, with another hash
    dest = tmp_path / "copy"
    vendored("yolo", dest, capsys)
    before = common_origin(dest / "common")
    assert before.startswith("vendored from git ") and "edited since" not in before
    with (dest / "common" / "ema.py").open("a") as f:
        f.write("# my change\n")
    common_origin.cache_clear()
    after = common_origin(dest / "common")
    assert "edited since" in after and after.rpartition("sha256 ")[2] != before.rpartition("sha256 ")[2]
    # outside any git checkout: no commit, still the hash
    bare = tmp_path / "bare" / "common"
    shutil.copytree(dest / "common", bare)
    (bare / RECORD).unlink()
    assert common_origin(bare) == f"{bare}, no git commit (sha256 {content_hash(bare)})"


def test_the_header_leaves_config_loading_and_the_resume_check_unchanged(tmp_path):
    cfg = parse_config(RunConfig, ["--lr", "0.25", "--max_steps", "3"])
    save_config(cfg, tmp_path / "config.yaml", origin_comment())
    text = (tmp_path / "config.yaml").read_text()
    assert text.startswith("# common/: ") and text.count("\n# common/") == 0
    again = parse_config(RunConfig, ["--config", str(tmp_path / "config.yaml")])
    assert (again.lr, again.max_steps) == (0.25, 3)
    assert check_resume(cfg, tmp_path) == {}  # nothing changed: the comment is not a field
    assert check_resume(parse_config(RunConfig, ["--lr", "0.25", "--max_steps", "5"]), tmp_path) == {
        "max_steps": (3, 5)
    }
    with pytest.raises(UserError, match="other values of lr 0.25 -> 0.5"):
        check_resume(parse_config(RunConfig, ["--lr", "0.5", "--max_steps", "3"]), tmp_path)
