"""FSDP2 on 2 gloo CPU processes, switched on as configs/accelerate/fsdp.yaml does (accelerate's environment
variables): every recipe that allows it shards below the root and trains 3 steps to the losses DDP gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from conftest import ROOT, check, free_port, recipe_env, run_recipe

# Per recipe: the demo shortened to 3 logged steps, no export or pictures (they test nothing here).
SHORT = ["--max_steps", "3", "--log_every", "1", "--num_workers", "0", "--report_to", "none", "--export", "false"]
RECIPES = {
    "classifier": ["--model", "test_vit", "--img_size", "32", "--batch_size", "8", "--opt", "sgd", "--ema_decay", "0"],
    "yolo": ["--batch_size", "4", "--ema_decay", "0", "--plot_images", "0"],
    "detr": ["--batch_size", "4", "--pretrain_crops_epochs", "0", "--plot_images", "0"],
    "faster_rcnn": ["--batch_size", "4", "--plot_images", "0"],
}


def fsdp_env() -> dict[str, str]:
    """What `accelerate launch --config_file configs/accelerate/fsdp.yaml` exports."""
    fsdp = yaml.safe_load((ROOT / "configs/accelerate/fsdp.yaml").read_text())["fsdp_config"]
    return {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": str(fsdp["fsdp_version"]),
        "FSDP_AUTO_WRAP_POLICY": fsdp["fsdp_auto_wrap_policy"],
        "FSDP_RESHARD_AFTER_FORWARD": str(fsdp["fsdp_reshard_after_forward"]).lower(),
        "FSDP_STATE_DICT_TYPE": fsdp["fsdp_state_dict_type"],  # checkpoints; the weights files are whole
    }


def run_fsdp(recipe: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``run_recipe(recipe, args, nproc=2)`` under FSDP, through tests/fsdp_cpu.py (FSDP on gloo)."""
    script = ROOT / "recipes" / f"{recipe}.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd = [*launch, str(ROOT / "tests" / "fsdp_cpu.py"), str(script), *args]
    env = recipe_env(2, **fsdp_env())
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["train/loss"] for row in rows if "train/loss" in row]


def weights_layout(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's shape and dtype in a weights file, read back as --weights reads it."""
    tensors = safetensors.torch.load_file(str(path))
    assert all(type(t) is torch.Tensor and t.isfinite().all() for t in tensors.values()), path  # whole, no DTensor
    return {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}


@pytest.mark.configs  # the second tier (-m configs), which CI runs after the default suite
@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fsdp_shards_per_block_and_trains_like_ddp(tmp_path, recipe):
    args = SHORT + RECIPES[recipe]
    # each run takes well under a minute: a run that waits at a collective fails the test in minutes
    ddp = check(run_recipe(recipe, args + ["--output_dir", str(tmp_path / "ddp")], nproc=2, timeout=300))
    fsdp = check(run_fsdp(recipe, args + ["--output_dir", str(tmp_path / "fsdp")], timeout=300))
    assert "fsdp:" not in ddp.stdout
    units = [line for line in fsdp.stdout.splitlines() if line.startswith("fsdp:")]
    assert len(units) == 1 and int(units[0].split()[1]) > 1, fsdp.stdout[-2000:]  # the root and blocks below it
    assert len(losses(tmp_path / "fsdp")) == 3
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-4, abs=1e-5)
    # every process gathered the full weights for the main process to write: the files hold DDP's tensors
    for name in ("best.safetensors", "final.safetensors"):
        assert weights_layout(tmp_path / "fsdp" / name) == weights_layout(tmp_path / "ddp" / name), name


def test_yolo_ema_under_fsdp_is_one_line_before_the_run(tmp_path):
    """YOLO's EMA (on by default) keeps a full replica: refused with the flag that turns it off."""
    args = SHORT + RECIPES["yolo"][:2] + ["--output_dir", str(tmp_path / "run")]
    proc = run_fsdp("yolo", args, timeout=300)
    assert proc.returncode != 0
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error:")}
    assert len(errors) == 1 and "--ema_decay 0" in errors.pop(), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "best.safetensors").exists()


def test_marked_blocks_are_the_repeated_blocks_not_layers_or_containers():
    import timm
    from torch import nn

    from common.models import mark_fsdp_blocks

    assert mark_fsdp_blocks(timm.create_model("test_vit")) == ["Block"]
    assert mark_fsdp_blocks(timm.create_model("resnet10t")) == ["BasicBlock"]
    layers = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.ReLU()]))
    assert mark_fsdp_blocks(layers) == ["Sequential"]  # the inner one; single layers and the ModuleList are not
