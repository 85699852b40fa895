"""Unreadable images found before the first step (common/data/scan.py, issue 25): every kind of broken file
is found, listed in bad_images.txt and left out, and the run goes to its end; --bad_images error refuses
before anything is written; the scan's answers are cached by size and modification time; processes
split the scan; a file that breaks during the run is replaced by a sample drawn from the seed; a
detection image takes its boxes with it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from common import UserError
from common.data import scan
from common.data.scan import scan_files, scan_table, without_unreadable
from conftest import TINY_CLASSIFIER, check, load_recipe, recipe_cmd, recipe_env

BROKEN = {  # file name -> what the scan says
    "truncated_x.jpg": "truncated JPEG: no end-of-image marker",
    "empty.jpg": "empty file",
    "random_bytes.jpg": "not an image PIL can identify",
    "page.jpg": "not an image PIL can identify",  # an HTML page saved under an image's name
}


def _jpeg(path: Path, rng: np.random.Generator, size: tuple[int, int] = (40, 30)) -> None:
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)


def _break(folder: Path, rng: np.random.Generator) -> None:
    """The broken files of BROKEN (and a truncated PNG) written into ``folder``."""
    _jpeg(folder / "whole.jpg", rng)
    data = (folder / "whole.jpg").read_bytes()
    (folder / "whole.jpg").unlink()
    (folder / "truncated_x.jpg").write_bytes(data[: len(data) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "random_bytes.jpg").write_bytes(rng.bytes(2000))
    (folder / "page.jpg").write_text("<html><body>Not found</body></html>")


@pytest.fixture
def photos(tmp_path) -> Path:
    """An imagefolder of 2 classes, 12 good training JPEGs each plus the broken files in one class, and
    a validation split with one truncated PNG."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("validation", 4)):
        for name in ("cat", "dog"):
            (tmp_path / "photos" / split / name).mkdir(parents=True)
            for i in range(count):
                _jpeg(tmp_path / "photos" / split / name / f"{name}_{i}.jpg", rng)
    _break(tmp_path / "photos" / "train" / "dog", rng)
    Image.new("RGB", (20, 20), (200, 10, 10)).save(tmp_path / "broken.png")
    png = (tmp_path / "broken.png").read_bytes()
    (tmp_path / "photos" / "validation" / "cat" / "cut.png").write_bytes(png[: len(png) - 20])
    return tmp_path / "photos"


def test_every_broken_kind_is_listed_and_left_out_and_the_run_ends(photos, tmp_path, capsys):
    classifier = load_recipe("classifier")
    run = tmp_path / "run"
    args = TINY_CLASSIFIER + ["--report_to", "none", "--data", str(photos), "--batch_size", "8", "--max_steps", "3"]
    classifier.main(args + ["--output_dir", str(run)])
    out = capsys.readouterr().out
    assert "4 of 28 training images cannot be read and are skipped:" in " ".join(out.split())
    assert "1 of 9 evaluation images cannot be read and are skipped: cut.png (" in " ".join(out.split())
    rows = [line.split("\t") for line in (run / "bad_images.txt").read_text().splitlines()[1:]]
    assert {(split, Path(name).name): why for split, name, why in rows} == {
        **{("training", name): why for name, why in BROKEN.items()},
        ("evaluation", "cut.png"): rows[-1][2],
    }
    assert rows[-1][2].startswith(("OSError", "SyntaxError", "ValueError"))  # PNG verify: a broken chunk
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3  # to its end

    refused = tmp_path / "refused"
    with pytest.raises(UserError, match=r"4 of 28 training images cannot be read: .*--bad_images error"):
        classifier.main(args + ["--output_dir", str(refused), "--bad_images", "error"])
    assert not refused.exists()  # refused before anything is written
    with pytest.raises(
        UserError, match=r"24 training images are left once the unreadable ones are out \(empty.jpg \(empty file\)"
    ):
        classifier.main(args[:-4] + ["--batch_size", "26", "--max_steps", "3", "--output_dir", str(refused)])


def test_all_unreadable_is_one_line_naming_them(tmp_path):
    folder = tmp_path / "train" / "x"
    folder.mkdir(parents=True)
    _break(folder, np.random.default_rng(1))
    with pytest.raises(UserError, match=r"none of the 4 training images can be read: empty.jpg \(empty file\)"):
        load_recipe("dino").main(["--data", str(tmp_path), "--report_to", "none", "--output_dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


def test_the_scan_is_cached_by_size_and_time_and_sees_a_changed_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(2)
    paths = []
    for i in range(300):  # more than one chunk: two pool processes share them
        _jpeg(tmp_path / f"{i:03d}.jpg", rng, (8, 8))
        paths.append(str(tmp_path / f"{i:03d}.jpg"))
    (tmp_path / "007.jpg").write_bytes(b"")
    first, cached = scan_files(paths, workers=2)
    assert first == {paths[7]: "empty file"} and not cached
    assert scan_files(paths, workers=2) == (first, True)  # every answer from the cache
    _jpeg(tmp_path / "007.jpg", rng, (8, 8))  # repaired: another size and time
    data = (tmp_path / "100.jpg").read_bytes()
    (tmp_path / "100.jpg").write_bytes(data[:-30])  # broken after the first scan
    os.utime(tmp_path / "100.jpg", ns=(1, 1))
    assert scan_files(paths) == ({paths[100]: "truncated JPEG: no end-of-image marker"}, False)
    # replaced by a same-size file with its modification time kept (`cp -p`, `rsync -a`): checked again
    stat = os.stat(tmp_path / "200.jpg")
    broken = tmp_path / "200.jpg.new"
    broken.write_bytes(b"\0" * stat.st_size)
    os.utime(broken, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    broken.replace(tmp_path / "200.jpg")
    assert os.stat(tmp_path / "200.jpg").st_size == stat.st_size and os.stat(tmp_path / "200.jpg").st_mtime_ns == (
        stat.st_mtime_ns
    )
    found, cached = scan_files(paths)
    assert set(found) == {paths[100], paths[200]} and not cached


def _accelerator(index: int, processes: int) -> SimpleNamespace:
    """What without_unreadable uses of an Accelerator."""
    return SimpleNamespace(process_index=index, num_processes=processes)


def _detection_folder(root: Path) -> Path:
    """A COCO-json folder with category ids 4 and 9, 10 training images (2 broken, with 3 boxes) and 4 val."""
    rng = np.random.default_rng(3)
    for split, count in (("train", 10), ("val", 4)):
        (root / split).mkdir(parents=True)
        images, annotations = [], []
        for i in range(count):
            _jpeg(root / split / f"{i}.jpg", rng, (48, 32))
            images.append({"id": 100 + i, "file_name": f"{i}.jpg", "width": 48, "height": 32})
            for k in range(1 + i % 2):
                box = [4 + k * 16, 4, 6 + i % 5, 5 + (i + k) % 4]  # sizes that vary: YOLO's k-means anchors
                annotations.append({"id": len(annotations) + 1, "image_id": 100 + i, "category_id": [4, 9][k],
                                    "bbox": box, "area": 64, "iscrowd": 0})  # fmt: skip
        categories = [{"id": 4, "name": "four"}, {"id": 9, "name": "nine"}]
        (root / "annotations").mkdir(exist_ok=True)
        coco = {"images": images, "annotations": annotations, "categories": categories}
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    (root / "train" / "2.jpg").write_bytes(b"")  # 1 box
    (root / "train" / "5.jpg").write_text("<html>")  # 2 boxes
    return root


def test_a_detection_image_takes_its_boxes_and_processes_share_the_scan(tmp_path):
    from common.detection.data import load_detection

    data = load_detection(str(_detection_folder(tmp_path / "coco")), seed=0)
    shares = [scan_table(data.train, "image", share=(i, 2))[0] for i in range(2)]
    assert {i for i, _, _ in shares[0]} == {2} and {i for i, _, _ in shares[1]} == {5}  # rows i % 2 == process
    scan = without_unreadable(data, "image", _accelerator(0, 1), "skip", 0, 2, tmp_path / "run")
    kept = scan.data
    assert len(kept.train) == 8 and len(kept.eval) == 4 and 102 not in kept.train["image_id"]
    assert "2 of 10 training images (with 3 boxes) cannot be read and are skipped:" in " ".join(scan.notes)
    assert str(tmp_path / "run" / "bad_images.txt") in " ".join(scan.notes).replace("\n    ", "")
    assert list(scan.files) == ["bad_images.txt"] and scan.files["bad_images.txt"].count("\n") == 3


def test_an_image_broken_during_the_run_is_replaced_from_the_seed(photos, tmp_path, capsys):
    from common.data.classification import ClassificationDataset, load_classification

    data = load_classification(str(photos), seed=0)
    rows = [i for i in range(len(data.train)) if Path(data.train[i]["image"]["path"]).name == "dog_3.jpg"]
    dataset = ClassificationDataset(data.train, data.image_column, data.label_column, lambda image: image.size)
    before = [dataset[(1, i)] for i in range(len(dataset))]
    os.remove(data.train[rows[0]]["image"]["path"])  # deleted in the middle of a long run
    got = dataset[(1, rows[0])]
    again = dataset[(1, rows[0])]  # the same draw: a resumed run sees the same sample
    assert got == again and got in before
    err = capsys.readouterr().err
    told = [line for line in err.splitlines() if "dog_3.jpg" in line]  # once, though drawn twice
    assert len(told) == 1 and told[0].endswith("another image, drawn from the seed, takes its place")
    assert dataset.replaced.value >= 2  # counted each time (and the broken files of the fixture too)


def test_a_run_whose_file_breaks_after_the_scan_goes_on_and_logs_the_count(photos, tmp_path, monkeypatch):
    """The file is deleted once the scan has passed it: the run ends, and train/replaced_images says so."""
    classifier = load_recipe("classifier")
    victim = photos / "train" / "cat" / "cat_5.jpg"
    scanned = classifier.without_unreadable

    def scan_then_delete(*args, **kwargs):
        kept = scanned(*args, **kwargs)
        victim.unlink(missing_ok=True)
        return kept

    monkeypatch.setattr(classifier, "without_unreadable", scan_then_delete)
    run = tmp_path / "run"
    args = ["--report_to", "none", "--data", str(photos), "--batch_size", "8", "--max_steps", "6", "--log_every", "3"]
    classifier.main(TINY_CLASSIFIER + args + ["--output_dir", str(run)])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counts = [r["train/replaced_images"] for r in logged if "train/replaced_images" in r]
    assert counts and counts[-1] >= 1 and logged[-1]["step"] == 6


@pytest.mark.slow
def test_two_processes_scan_their_shares_and_agree(photos, tmp_path):
    """Two gloo processes: each checks half of the files, both leave the same ones out and train on."""
    run = tmp_path / "run"
    args = TINY_CLASSIFIER + ["--report_to", "none", "--data", str(photos), "--batch_size", "4", "--max_steps", "2"]
    proc = check(
        __import__("subprocess").run(
            recipe_cmd("classifier", args + ["--output_dir", str(run)], nproc=2),
            env=recipe_env(2),
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    assert "4 of 28 training images cannot be read and are skipped" in " ".join(proc.stdout.split())
    assert (run / "bad_images.txt").read_text().count("\n") == 6


@pytest.mark.parametrize("recipe", ["yolo", "detr", "faster_rcnn", "dino"])
def test_every_recipe_runs_to_its_end_past_broken_files(recipe, photos, tmp_path, capsys):
    """Each recipe on a folder holding broken files: they are listed and left out, and the run ends."""
    data = _detection_folder(tmp_path / "coco") if recipe != "dino" else photos
    run = tmp_path / "run"
    args = ["--data", str(data), "--report_to", "none", "--num_workers", "0", "--batch_size", "4", "--max_steps", "2"]
    extra = {"yolo": ["--export", "false"], "detr": ["--pretrain_crops_epochs", "0"], "dino": ["--knn_k", "3"]}
    load_recipe(recipe).main(args + extra.get(recipe, []) + ["--output_dir", str(run)])
    out = " ".join(capsys.readouterr().out.split())
    assert ("2 of 10 training images (with 3 boxes)" if recipe != "dino" else "4 of 28 training images") in out
    assert out.endswith(f"output: {run}") and (run / "bad_images.txt").is_file()


def test_train_fraction_gives_the_stated_seeded_stratified_counts(tmp_path, capsys):
    """--train_fraction (the semi-supervised protocol): per class round(f x n_c) images, at least one; the
    same seed the same images, another seed others; a detection split by images; the banner says how many
    train, and a resumed run may not change it."""
    import datasets

    from common.data.classification import ClassificationData, label_fraction, with_label_fraction

    labels = [0] * 50 + [1] * 30 + [2] * 3
    table = datasets.Dataset.from_dict({"label": labels, "x": list(range(len(labels)))})
    part = label_fraction(table, 0.1, seed=0, label_column="label")
    assert np.bincount(part["label"]).tolist() == [5, 3, 1]  # the rarest class keeps one
    assert part["x"] == label_fraction(table, 0.1, 0, "label")["x"] != label_fraction(table, 0.1, 1, "label")["x"]
    assert len(label_fraction(table, 0.25, seed=0)) == 21 and label_fraction(table, 1.0, 0) is table
    # the helper takes the fraction and the seed, and gives back the cut data and its banner line ('' uncut)
    data = ClassificationData(table, table, "x", "label", ["a", "b", "c"])
    cut, line = with_label_fraction(data, 0.1, 0, "label")
    assert cut.train["x"] == part["x"] and cut.eval is table
    assert (
        line
        == "  labels    train_fraction 0.1: 9 of 83 training images (stratified by class from seed 0; the rest unused)"
    )
    assert with_label_fraction(data, 1.0, 0, "label") == (data, "")

    classifier = load_recipe("classifier")
    run = tmp_path / "run"
    args = TINY_CLASSIFIER + ["--report_to", "none", "--train_fraction", "0.1", "--max_steps", "2"]
    classifier.main(args + ["--output_dir", str(run)])
    out = capsys.readouterr().out
    assert "train_fraction 0.1: 142 of 1,437 training images (stratified by class from seed 0" in out
    assert "data      142 training images" in out  # per class round(0.1 x n_c)
    with pytest.raises(UserError, match=r"other values of train_fraction 0.1 -> 0.2"):
        classifier.main(args + ["--output_dir", str(run), "--resume", "auto", "--train_fraction", "0.2"])


def test_dino_trains_on_a_coco_folders_images(tmp_path, capsys):
    """DINO on a detection dataset: its training images, boxes unused (broken ones left out); the kNN
    evaluation then needs --knn_data, and says so."""
    coco = _detection_folder(tmp_path / "coco")
    run = tmp_path / "run"
    args = ["--data", str(coco), "--report_to", "none", "--num_workers", "0", "--batch_size", "4", "--max_steps", "2"]
    load_recipe("dino").main(args + ["--output_dir", str(run)])
    out = " ".join(capsys.readouterr().out.split())
    assert "data 8 training images" in out and "2 of 10 training images cannot be read and are skipped" in out
    assert "no kNN evaluation:" in out and (run / "teacher_backbone.safetensors").is_file()


class _Run(SimpleNamespace):
    """What Scanned.into and a background check use of a Run: notes, files, the folder once begun, print."""

    def __init__(self, folder: Path) -> None:
        super().__init__(notes=[], files={}, printed=[], begun=True, dir=folder)

    def note(self, *lines: str) -> None:
        self.notes += lines

    def print(self, line: str) -> None:
        self.printed.append(line)


def test_a_large_split_is_checked_in_the_background_and_lists_the_same_files(photos, tmp_path, monkeypatch):
    """Above BACKGROUND_ROWS (lowered here) the training split keeps every row while a child process checks it;
    when it ends, bad_images.txt lists the very files the check before the start lists (a truncated JPEG among good
    ones, an empty file, ...) and one warning line says they are replaced. The evaluation split, whatever its size,
    is checked before the start and its unreadable images left out: none is scored under another's id."""
    from common.data.classification import load_classification

    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))  # no cached answer: the child reads them all
    data = load_classification(str(photos), seed=0)
    before = without_unreadable(data, data.image_column, _accelerator(0, 1), "skip", 0, 2, tmp_path / "a")
    assert len(before.data.train) == 24 and before.background is None

    monkeypatch.setattr(scan, "BACKGROUND_ROWS", 5)
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache2"))
    scanned = without_unreadable(data, data.image_column, _accelerator(0, 1), "skip", 0, 2, tmp_path / "b")
    assert len(scanned.data.train) == 28 and len(scanned.data.eval) == 8  # every training row stays
    assert "28 training images being checked while the run starts" in " ".join(scanned.notes)
    run = _Run(tmp_path / "b")
    scanned.into(run)
    found = scanned.wait(60)
    assert {Path(name).name for _, name, _ in found["training"]} == set(BROKEN)
    assert {Path(name).name for _, name, _ in found["evaluation"]} == {"cut.png"}
    assert (tmp_path / "b" / "bad_images.txt").read_text() == before.files["bad_images.txt"]
    assert run.files["bad_images.txt"] == before.files["bad_images.txt"]
    line = " ".join(" ".join(run.printed).split())
    assert "4 of 28 training images cannot be read and are replaced by others drawn from the seed:" in line
    assert "evaluation images cannot be read and are replaced" not in line
    # with --bad_images error the check comes before the start whatever the size: refused before anything is made
    with pytest.raises(UserError, match=r"--bad_images error"):
        without_unreadable(data, data.image_column, _accelerator(0, 1), "error", 0, 2, tmp_path / "c")


def test_a_background_check_that_ends_before_the_run_is_made_is_reported_to_it(photos, tmp_path, monkeypatch):
    from common.data.classification import load_classification

    monkeypatch.setattr(scan, "BACKGROUND_ROWS", 5)
    data = load_classification(str(photos), seed=0)
    scanned = without_unreadable(data, data.image_column, _accelerator(0, 1), "skip", 0, 2, tmp_path / "run")
    scanned.wait(60)  # ended before into(): the line and the file wait for the run
    run = _Run(tmp_path / "run")
    run.begun = False
    scanned.into(run)
    assert run.files["bad_images.txt"].count("\n") == 6 and len(run.printed) == 1


def test_files_shared_by_checking_processes_get_the_answers_of_one(tmp_path, monkeypatch):
    """More files than CHUNK and 2 workers: two child processes check a half each, in order."""
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(1)
    _jpeg(tmp_path / "good.jpg", rng)
    good = (tmp_path / "good.jpg").read_bytes()
    paths = []
    for i in range(300):
        path = tmp_path / f"{i:03d}.jpg"
        path.write_bytes(good[: len(good) // 2] if i in (7, 250) else good)
        paths.append(str(path))
    found, cached = scan_files(paths, workers=2)
    assert found == {paths[7]: BROKEN["truncated_x.jpg"], paths[250]: BROKEN["truncated_x.jpg"]} and not cached


def test_a_run_that_exits_during_a_background_check_ends_silently(tmp_path):
    """The checking process is killed at exit and nothing is printed after the program's last line."""
    rng = np.random.default_rng(2)
    _jpeg(tmp_path / "good.jpg", rng)
    good = (tmp_path / "good.jpg").read_bytes()
    for i in range(3000):
        (tmp_path / f"{i:04d}.jpg").write_bytes(good)
    program = f"""
import datasets
from types import SimpleNamespace
from common.data.scan import without_unreadable
paths = sorted(str(p) for p in __import__("pathlib").Path({str(tmp_path)!r}).glob("*.jpg"))
table = datasets.Dataset.from_dict({{"image": paths}}).cast_column("image", datasets.Image(decode=False))
data = SimpleNamespace(train=table, eval=None)
accelerator = SimpleNamespace(process_index=0, num_processes=1)
scanned = without_unreadable(data, "image", accelerator, "skip", 0, 2, {str(tmp_path / "run")!r})
assert scanned.background is not None
print("last line")
"""
    env = {**os.environ, "CV_RECIPES_CACHE": str(tmp_path / "cache")}
    done = __import__("subprocess").run(
        [__import__("sys").executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout == "last line\n" and done.stderr == "", done.stderr


def test_the_training_batches_do_not_depend_on_when_the_background_check_ends(photos, tmp_path, monkeypatch):
    """The classifier on a folder with broken files, its training split checked in the background: once with the check
    held back until after the run, once with every answer cached (it ends at once). Both runs train on the same
    batches (the same losses: broken images replaced from the seed, not left out), and list the same files."""
    classifier = load_recipe("classifier")
    monkeypatch.setattr(scan, "BACKGROUND_ROWS", 5)
    monkeypatch.setenv("CV_RECIPES_CACHE", str(tmp_path / "cache"))
    held = __import__("threading").Event()
    checked = scan.scan_table

    def late(*args, **kwargs):
        if kwargs.get("nice"):  # the background check
            held.wait(120)
        return checked(*args, **kwargs)

    args = TINY_CLASSIFIER + ["--report_to", "none", "--data", str(photos), "--batch_size", "4", "--max_steps", "6"]
    args += ["--log_every", "1", "--num_workers", "0"]
    monkeypatch.setattr(scan, "scan_table", late)
    classifier.main(args + ["--output_dir", str(tmp_path / "late")])
    early = (tmp_path / "late" / "bad_images.txt").read_text().splitlines()[1:]  # the training's check had not ended
    assert {Path(line.split("\t")[1]).name for line in early} == {"cut.png"}  # the evaluation's, before the start
    held.set()
    scan_files([str(p) for p in sorted(photos.rglob("*.*"))])  # every answer cached
    monkeypatch.setattr(scan, "scan_table", checked)
    classifier.main(args + ["--output_dir", str(tmp_path / "cached")])

    def losses(run: str) -> list[float]:
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in records if "train/loss" in r]

    assert len(losses("late")) == 6 and losses("late") == losses("cached")
    listed = (tmp_path / "cached" / "bad_images.txt").read_text()
    assert {Path(line.split("\t")[1]).name for line in listed.splitlines()[1:]} == {*BROKEN, "cut.png"}
