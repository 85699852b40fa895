"""The README: its test command is what CI runs, it names every recipe and indexes docs/ within 200 lines, and its
20-step check prints what the README shows, up to the numbers a run measures (the transcript's shape)."""

from __future__ import annotations

import difflib
import math
import re
import subprocess
import sys

from conftest import ROOT, recipe_env

README = ROOT / "README.md"


def test_ci_runs_the_readme_test_command():
    ci_command = [
        ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_command) == 1
    readme = README.read_text()
    assert f"\n{ci_command[0]}\n" in readme, f"README lacks the test command: {ci_command[0]}"
    # the half-hour command sits in the Tests section, not in the way of a first run
    tests_section = readme[readme.index("\n## Tests\n") :]
    assert f"\n{ci_command[0]}\n" in tests_section, "the test command belongs in README's Tests section"


def _recipe_scripts() -> list[str]:
    """The training scripts (they declare a Config), not the sibling files beside them."""
    return sorted(p.name for p in (ROOT / "recipes").glob("*.py") if "class Config(RunConfig)" in p.read_text())


def test_every_recipe_is_in_the_readme_and_every_file_in_the_layout_doc():
    readme = README.read_text()
    scripts = _recipe_scripts()
    assert len(scripts) >= 5, scripts
    for name in scripts:
        assert f"recipes/{name}" in readme, name
    layout = (ROOT / "docs" / "layout.md").read_text()
    for script in sorted((ROOT / "recipes").glob("*.py")):
        assert f"recipes/{script.name}" in layout, f"docs/layout.md does not name recipes/{script.name}"


def test_the_readme_fits_and_links_every_doc():
    readme = README.read_text()
    assert readme.count("\n") <= 200, f"README.md has {readme.count(chr(10))} lines, at most 200"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README's docs index lacks docs/{page.name}"


def test_relative_links_in_the_readme_and_docs_lead_to_files():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


# The transcript's shape. A number is a run of digits that stands alone (not the 1 of `top1` or `fp32`, nor
# the 2 of `default-2`): an integer (`1,437`), a decimal (`2.271`, `2e-05`) or a duration (`0:00:08`).
NUMBER = re.compile(r"(?<![\w.-])-?\d+(?:[.,:]\d+)*(?:e[-+]?\d+)?(?!\w)")
TIME_UNITS = {"s", "ms", "img/s", "s/step"}  # what a number followed by one of these measures: time or speed
# Lines a slow machine adds where a minute passes without one (docs/outputs.md, "Console"): the loop's
# `epoch 0 step 13/20  5.3 s/step  eta 0:00:37` and a pass's `eval 40/72 images, 0:01:10`. Neither side keeps them.
SILENCE_LINE = re.compile(
    r"epoch \d+ step \d+/\d+  [\d.]+ s/step  eta [\d:]+|\S.* [\d,]+(/[\d,]+)? (images|batches), \d+:\d\d:\d\d"
)


def _words(line: str) -> list[str]:
    # below one image a second the interval line gives seconds per step instead: the same place, the same speed
    return ["img/s" if w == "s/step" else w for w in NUMBER.sub("<n>", line).split()]


def _key(line: str, start: int) -> str:
    """The word a number belongs to: the one before it (`loss` in `loss 2.271`, `ce` in `(ce 1.2)`)."""
    before = line[:start].split()
    return before[-1].strip("(,:=").lower() if before else ""


def _unit(line: str, end: int) -> str:
    after = line[end:].split()
    return after[0].rstrip(",;)") if after and line[end : end + 1] == " " else ""


def _value_problem(shown: str, got: str, key: str, unit: str) -> str | None:
    """Why `got` does not fit where the transcript shows `shown` (None when it does)."""
    if ":" in got:  # a duration h:mm:ss
        return None if ":" in shown else "a duration where a number is shown"
    value = float(got.replace(",", ""))
    if not math.isfinite(value):
        return "not finite"
    if unit in TIME_UNITS or key.endswith("_s") or key == "workers":  # measured, or the machine's cores
        return None if value >= 0 else "negative"
    if re.fullmatch(r"-?[\d,]+", shown):  # counts (steps, images, classes, batch) are exactly as shown
        return None if value == float(shown.replace(",", "")) else f"{shown} shown"
    if unit == "%" or any(k in key for k in ("top1", "top5", "acc")):
        return None if 0 <= value <= 100 else "a percentage outside [0, 100]"
    if "map" in key:
        return None if 0 <= value <= 1 else "an mAP outside [0, 1]"
    if "loss" in key:
        return None if value > 0 else "a loss that is not positive"
    if key == "lr":
        return None if value >= 0 else "a negative learning rate"
    return None  # any other measured value (a loss term, a gradient norm): finite


def shape_mismatches(shown: list[str], got: list[str]) -> list[str]:
    """How `got` differs from the transcript `shown` in shape: its lines in order, each line's words with every
    number as a placeholder, and every number in its range. Empty when the shapes agree."""
    shown, got = ([ln for ln in lines if not SILENCE_LINE.fullmatch(ln.strip())] for lines in (shown, got))
    shapes = [[" ".join(_words(ln)) for ln in lines] for lines in (shown, got)]
    if shapes[0] != shapes[1]:  # the lines, numbers as <n>, where they differ
        return [
            "the lines differ beyond their numbers:",
            *difflib.unified_diff(*shapes, "README", "output", n=1, lineterm=""),
        ]
    problems = []
    for shown_line, got_line in zip(shown, got, strict=True):
        for s, g in zip(NUMBER.finditer(shown_line), NUMBER.finditer(got_line), strict=True):
            why = _value_problem(s[0], g[0], _key(got_line, g.start()), _unit(got_line, g.end()))
            if why:
                problems.append(f"{g[0]!r} in {got_line.strip()!r}: {why}")
    return problems


def _readme_check() -> tuple[list[str], list[str]]:
    block = re.search(r"```console\n\$ (python recipes/\S+\.py[^\n]*)\n(.*?)```", README.read_text(), re.S)
    return block[1].split(), block[2].splitlines()


def test_the_shape_check_passes_new_values_and_fails_a_changed_line():
    """The comparison below, on the README's own transcript: other measured values pass; a missing, extra,
    reordered or garbled line fails, and so do a count that is not as shown and a value out of its range."""
    _, shown = _readme_check()
    assert shape_mismatches(shown, shown) == []
    step = next(i for i, ln in enumerate(shown) if re.search(r"\bloss \d", ln))
    other = [re.sub(r"\bloss [\d.]+", "loss 0.0417", ln) for ln in shown]  # another loss, another value
    other = [re.sub(r"\d+ img/s", "12 img/s", ln) for ln in other]
    assert shape_mismatches(shown, other) == []
    changed = {
        "a line missing": shown[:step] + shown[step + 1 :],
        "a line added": [*shown[: step + 1], "epoch 0 step 20/20  loss 2.271", *shown[step + 1 :]],
        "two lines swapped": [*shown[:step], shown[step + 1], shown[step], *shown[step + 2 :]],
        "a word changed": [ln.replace("loss", "lsos", 1) if i == step else ln for i, ln in enumerate(shown)],
        "a term added": [ln.replace("  lr", "  box 0.3  lr", 1) if i == step else ln for i, ln in enumerate(shown)],
        "a step count": [re.sub(r"step (\d+)/", "step 19/", ln) if i == step else ln for i, ln in enumerate(shown)],
        "a negative loss": [re.sub(r"\bloss [\d.]+", "loss -0.5", ln) for ln in shown],
        "a top-1 above 100": [re.sub(r"top1 [\d.]+", "top1 123.45", ln) for ln in shown],
    }
    slow = [*shown[:step], "epoch 0 step 13/20  5.3 s/step  eta 0:00:37", *shown[step:]]
    assert shape_mismatches(shown, slow) == []  # a slow machine's line after a silent minute
    for what, lines in changed.items():
        assert lines != shown and shape_mismatches(shown, lines), what


def test_the_readme_console_example_is_what_the_command_prints(tmp_path):
    """The quick check in the README, run as written (from a fresh folder): the transcript's shape, not its
    digits (the loss moves with the CPU's thread count, and with any change to the loss)."""
    command, shown = _readme_check()
    script = str(ROOT / command[1])
    out = subprocess.run(
        [sys.executable, script, *command[2:]], cwd=tmp_path, env=recipe_env(), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]  # nothing but the recipe's own lines
    problems = shape_mismatches(shown, out.stdout.splitlines())
    assert not problems, "README's console example no longer matches the run:\n" + "\n".join(problems)
