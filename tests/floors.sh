#!/usr/bin/env bash
# The floors tier (docs/testing.md): install the lowest versions requirements.txt allows
# (constraints/minimum.txt) into their own virtual environment, outside the repository, and run each
# recipe's short check in it: two training steps, the ONNX export, --predict through the exported file
# (tests/test_floors.py, -m floors). FLOORS_VENV names the environment; an existing one is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FLOORS_VENV:-${TMPDIR:-/tmp}/cv-recipes-floors}"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/python" -m pip install -q -c constraints/minimum.txt -r requirements.txt
HF_HUB_OFFLINE=1 WANDB_MODE=offline "$venv/bin/python" -m pytest -m floors tests/test_floors.py
