"""The README's quickstart is what CI runs."""

from __future__ import annotations

from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    ci_command = [
        ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_command) == 1
    readme = (ROOT / "README.md").read_text()
    assert f"\n{ci_command[0]}\n" in readme, f"README quickstart lacks: {ci_command[0]}"


def test_every_recipe_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for script in sorted((ROOT / "recipes").glob("*.py")):
        assert f"recipes/{script.name}" in readme, script.name
