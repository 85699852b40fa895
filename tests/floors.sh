#!/usr/bin/env bash
# The floors tier (docs/testing.md): what a user's resolver picks at requirements.txt's floors, in an environment of
# its own outside the repository, and each recipe's short check there (tests/test_floors.py, -m floors).
# uv (installed from PyPI into the calling Python when it lacks it) resolves requirements.txt with
# --resolution lowest-direct (every declared package at its floor, the others at their newest that fit) for the
# running Python's version, and the environment is synced to exactly that resolution, which is printed. There every
# recipe trains two steps, evaluates and predicts from its weights, and --export is refused where the recipe's
# export floor (common/requirements.py) is newer than the training floor. Then torch is raised to each export floor
# in turn (the same resolution with torch pinned there: torchvision follows) and those recipes export the weights
# to ONNX and predict through the file. FLOORS_VENV names the environment (an existing one is reused and synced);
# the runs are left in FLOORS_RUNS (default: beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FLOORS_VENV:-${TMPDIR:-/tmp}/cv-recipes-floors}"
runs="${FLOORS_RUNS:-$venv-runs}"
python="$(python -c 'import sys; print(sys.executable)')"
version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$python" -m uv --version >/dev/null 2>&1 || "$python" -m pip install -q uv
uv() { "$python" -m uv "$@"; }

same_python="import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))"
[ ! -x "$venv/bin/python" ] || "$venv/bin/python" -c "$same_python" || rm -rf "$venv"
[ -x "$venv/bin/python" ] || uv venv -q --python "$python" "$venv"

pins() {
  tr '\n' ' ' <"$1" | fold -s -w 116 | sed 's/^/  /'
  echo
}

# resolve LOCK [uv pip compile options]: requirements.txt's lowest-direct resolution into LOCK, and the environment
# made to hold exactly it.
resolve() {
  local lock="$1"
  shift
  uv pip compile -q requirements.txt --resolution lowest-direct --python-version "$version" --no-header --no-annotate \
    "$@" -o "$lock"
  uv pip sync -q --python "$venv/bin/python" "$lock"
}

run_tests() {
  HF_HUB_OFFLINE=1 WANDB_MODE=offline FLOORS_RUNS="$runs" "$venv/bin/python" -m pytest -m floors tests/test_floors.py
}

rm -rf "$runs"
resolve "$venv/floors.txt"
echo "floors: uv pip compile requirements.txt --resolution lowest-direct --python-version $version picked"
pins "$venv/floors.txt"
run_tests

# The export floors newer than the training floor's torch, oldest first.
newer="$("$venv/bin/python" -c '
from importlib.metadata import version
from common.requirements import EXPORT_TORCH, at_least, release
print(*sorted({v for v in EXPORT_TORCH.values() if not at_least(version("torch"), v)}, key=release))')"
for torch in $newer; do
  echo "torch==$torch" >"$venv/export-torch.txt"
  resolve "$venv/floors-torch-$torch.txt" --constraint "$venv/export-torch.txt"
  echo "floors: torch raised to an export floor; what changed:"
  pins <(diff "$venv/floors.txt" "$venv/floors-torch-$torch.txt" | sed -n 's/^> //p')
  run_tests
done
echo "floors: done in $SECONDS s"
