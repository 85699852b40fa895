"""The five training loops share one skeleton (DESIGN.md, "A recipe"): a diff of two recipes shows the method,
not the plumbing. Read from each recipe's source, as Accelerate's ``compare_against_test`` reads its examples:
the plumbing calls of ``main()`` (the run, the loop, the accumulate/backward/step sequence, logging, saving) come
in the same order in every recipe, and the same variable names carry them; everything else (the model, the loss,
the method's own steps) is free. Its comments stay short: every comment block in recipes/ is at most two
lines (the reason and the hazard, as nanoGPT's); the detail lives in the recipe's docs page."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from conftest import ROOT

RECIPES = ["classifier", "dino", "yolo", "detr", "faster_rcnn"]

#: Before the epochs: the run, the budget and its schedules, the loop, the per-process seeds and the resume.
BEFORE = ["Run", "accelerator.prepare", "schedule", "Loop", "set_seed", "loop.resume"]
#: Inside ``for epoch in loop.epochs()``, in this order (each call's first appearance counts).
EPOCH = [
    "loop.batches",
    "set_group_values",
    "accelerator.accumulate",
    "accelerator.backward",
    "optimizer.step",
    "optimizer.zero_grad",
    "loop.record",
    "loop.end_step",
    "loop.log_due",
    "loop.log_train",
    "loop.stop_requested",
    "loop.save_checkpoint",
    "loop.stop",
    "loop.checkpoint_due",
    "loop.eval_due",
    "loop.evaluation",
]
#: After the epochs: the final weights, then the summary (what ships them is the recipe's inference file).
AFTER = ["save_weights", "loop.finish"]
#: The names the plumbing runs on, bound in every main().
NAMES = {"run", "cfg", "accelerator", "train_loader", "optimizer", "loop", "meters", "results"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _calls(nodes: list[ast.stmt], names: list[str]) -> list[str]:
    """The first appearance of each of ``names`` called in ``nodes``, in source order."""
    found = sorted(
        (n.lineno, n.col_offset, _dotted(n.func))
        for stmt in nodes
        for n in ast.walk(stmt)
        if isinstance(n, ast.Call) and _dotted(n.func) in names
    )
    seen: list[str] = []
    for *_, name in found:
        if name not in seen:
            seen.append(name)
    return seen


def skeleton(source: str) -> tuple[list[str], list[str], list[str], set[str]]:
    """(calls before the epoch loop, in it, after it, names bound) of ``main()`` in a recipe's source."""
    tree = ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    epochs = [
        n
        for n in ast.walk(main)
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Call) and _dotted(n.iter.func) == "loop.epochs"
    ]
    assert len(epochs) == 1, "main() has one `for epoch in loop.epochs()`"
    loop = epochs[0]
    before = [s for s in ast.walk(main) if isinstance(s, ast.stmt) and s.end_lineno < loop.lineno]
    after = [s for s in ast.walk(main) if isinstance(s, ast.stmt) and s.lineno > loop.end_lineno]
    bound = {
        t.id for n in ast.walk(main) for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)
    }
    return _calls(before, BEFORE), _calls(loop.body, EPOCH), _calls(after, AFTER), bound


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_runs_the_shared_skeleton_in_order(recipe):
    before, epoch, after, bound = skeleton((ROOT / "recipes" / f"{recipe}.py").read_text())
    assert before == BEFORE
    assert epoch == EPOCH
    assert after == AFTER
    assert NAMES <= bound, sorted(NAMES - bound)


def test_the_check_sees_a_reordered_loop():
    """The check fails on a recipe whose optimizer steps before its backward pass."""
    source = (ROOT / "recipes" / "classifier.py").read_text()
    swapped = source.replace(
        "accelerator.backward(loss)", "optimizer.step()\n                accelerator.backward(loss)", 1
    )
    assert swapped != source
    assert skeleton(swapped)[1] != EPOCH


def test_every_recipe_is_checked():
    mains = sorted(p.stem for p in Path(ROOT / "recipes").glob("*.py") if "def main(" in p.read_text())
    assert mains == sorted(RECIPES)


#: A section banner line: ``# ====...`` (a title line between two of them is the banner's) or ``# ---- title ----``.
BANNER = re.compile(r"#\s*[=-]{4,}")


def comment_blocks(source: str) -> list[list[int]]:
    """The line numbers of each comment block in ``source``: a run of consecutive comment lines, a full-line
    comment or a trailing comment followed by full-line comments continuing it; banners end a block."""
    lines = source.splitlines()
    comments = {
        t.start[0]: (t.string, lines[t.start[0] - 1].lstrip().startswith("#"))
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    }

    def banner(n: int) -> bool:
        return n in comments and BANNER.match(comments[n][0]) is not None

    blocks: list[list[int]] = []
    for n in sorted(comments):
        full = comments[n][1]
        if banner(n) or (full and banner(n - 1) and banner(n + 1)):
            blocks.append([])  # a banner ends the block before it
        elif blocks and blocks[-1] and blocks[-1][-1] == n - 1 and full:
            blocks[-1].append(n)
        else:
            blocks.append([n])
    return [b for b in blocks if b]


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "recipes").glob("*.py")))
def test_recipe_comments_are_at_most_two_lines(path):
    blocks = comment_blocks((ROOT / "recipes" / path).read_text())
    long = [f"line {b[0]}: {len(b)} lines" for b in blocks if len(b) > 2]
    assert not long, f"recipes/{path}: comments longer than two lines (move the detail to docs/): {long}"


def test_the_comment_check_sees_a_long_block_and_spares_banners():
    source = """# =====
# Data
# =====
x = 1  # a trailing comment
# continued once
# and twice
# ---- title ----
# one
# two
y = 2
"""
    assert [len(b) for b in comment_blocks(source)] == [3, 2]
