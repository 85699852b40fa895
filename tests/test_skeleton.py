"""The five training loops share one skeleton (DESIGN.md, "A recipe"): a diff of two recipes shows the method,
not the plumbing. Read from each recipe's source, as Accelerate's ``compare_against_test`` reads its examples:
the plumbing calls of ``main()`` (the run, the loop, the accumulate/backward/step sequence, logging, saving) come
in the same order in every recipe, and the same variable names carry them; everything else (the model, the loss,
the method's own steps) is free."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

RECIPES = ["classifier", "dino", "yolo", "detr", "faster_rcnn"]

#: Before the epochs: the run, the budget and its schedules, the loop.
BEFORE = ["Run", "accelerator.prepare", "steps_total", "schedule", "Loop"]
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
    "loop.start_evaluation",
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
