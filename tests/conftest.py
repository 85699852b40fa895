"""Shared fixtures: offline environment, and helpers to run a recipe as users do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never touch the network: datasets and weights come from built-in data, trackers log offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (importing a recipe has no side effects)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_cmd(recipe: str, args: list[str], nproc: int = 1) -> list[str]:
    """The command line users type: plain python for one process, torchrun (gloo) for several."""
    script = str(ROOT / "recipes" / f"{recipe}.py")
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", script, *args]


def recipe_env(nproc: int = 1, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    if nproc > 1:
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    return env


def run_recipe(recipe: str, args: list[str], nproc: int = 1, timeout: float = 600, cwd: Path | None = None,
               **extra_env: str) -> subprocess.CompletedProcess:
    """Run a recipe to completion; returns the process with text stdout/stderr."""
    return subprocess.run(recipe_cmd(recipe, args, nproc), cwd=cwd or ROOT, env=recipe_env(nproc, **extra_env),
                          capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture
def tmp_run(tmp_path: Path) -> Path:
    return tmp_path / "run"
