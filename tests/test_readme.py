"""The README's quickstart is what CI runs, and its console example is what the command prints."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, recipe_env


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


def test_the_readme_console_example_is_what_the_command_prints(tmp_path):
    """The quick check in the README, run as written (from a fresh folder): the same lines, up to the
    speed, the wall time and the decimals (the loss moves in its third digit with the CPU's thread count)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```console\n\$ (python recipes/\S+\.py[^\n]*)\n(.*?)```", readme, re.S)
    command, shown = block[1].split(), block[2].splitlines()
    script = str(ROOT / command[1])
    out = subprocess.run(
        [sys.executable, script, *command[2:]], cwd=tmp_path, env=recipe_env(), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]  # nothing but the recipe's own lines

    def timeless(lines: list[str]) -> list[str]:
        lines = [re.sub(r"workers +\d+", "workers <n>", ln) for ln in lines]  # num_workers -1: the machine's cores
        return [re.sub(r"\d+\.\d+", "<x>", re.sub(r"\d+ img/s|done in [\d:]+", "<t>", ln)) for ln in lines]

    assert timeless(out.stdout.splitlines()) == timeless(shown)
