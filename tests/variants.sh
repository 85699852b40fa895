#!/usr/bin/env bash
# The variants tier (docs/testing.md): a Python set up as GPU machines are, with onnxruntime from
# onnxruntime-gpu and PIL from Pillow-SIMD (requirements.txt installed, then onnxruntime-gpu beside no
# onnxruntime, and pillow swapped for Pillow-SIMD, built from its source), in its own virtual environment
# outside the repository; there the classifier trains, exports and predicts through the ONNX file
# (tests/test_variants.py, -m variants). VARIANTS_VENV names the environment; an existing one is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VARIANTS_VENV:-${TMPDIR:-/tmp}/cv-recipes-variants}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip show -q pillow-simd onnxruntime-gpu 2>/dev/null; then
    rm -rf "$venv" && python -m venv "$venv"
    grep -v '^onnxruntime' requirements.txt > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" onnxruntime-gpu
    "$venv/bin/python" -m pip uninstall -q -y pillow
    "$venv/bin/python" -m pip install -q --no-binary pillow-simd pillow-simd
fi
"$venv/bin/python" -m pip install -q --no-deps -e .
HF_HUB_OFFLINE=1 WANDB_MODE=offline "$venv/bin/python" -m pytest -m variants tests/test_variants.py
