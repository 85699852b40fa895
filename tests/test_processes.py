"""Per-process behaviour of the shared run plumbing: random streams and the CUDA speed settings."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

from conftest import ROOT, free_port, recipe_env

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    sys.path[:0] = [sys.argv[1], sys.argv[3]]
    from conftest import load_recipe
    from common.loaders import train_loader_for
    from common.loop import Loop
    from common.run import Run

    classifier = load_recipe("classifier")
    cfg = classifier.Config(report_to="none", output_dir=sys.argv[2], num_workers=0)
    run = Run(cfg, "seeds")
    init = torch.randn(3).tolist()  # model initialisation: the shared seed
    loader = run.accelerator.prepare(train_loader_for(torch.utils.data.TensorDataset(torch.zeros(64, 1)), 4, 0, 0,
                                                      run.accelerator.num_processes))
    Loop(run, loader, 1)
    step = torch.randn(3).tolist()  # dropout, drop path, Mixup inside the loop: per process
    with open(f"{sys.argv[2]}/draws_{run.accelerator.process_index}.json", "w") as f:
        json.dump({"init": init, "step": step}, f)
    run.finish()
''')


def test_processes_share_the_initialisation_seed_then_draw_their_own(tmp_path):
    script = tmp_path / "seeds.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script), str(ROOT / "tests"), str(tmp_path / "run"), str(ROOT)]
    proc = subprocess.run(cmd, cwd=ROOT, env=recipe_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    draws = [json.loads((tmp_path / "run" / f"draws_{rank}.json").read_text()) for rank in (0, 1)]
    assert draws[0]["init"] == draws[1]["init"]
    assert draws[0]["step"] != draws[1]["step"]


def test_tf32_and_cudnn_benchmark_follow_the_field(tmp_path):
    """Run turns on TF32 matmuls/convolutions and cudnn.benchmark (CUDA's; no effect on a CPU); --tf32 false
    turns them off."""
    from common.config import parse_config
    from common.run import Run
    from conftest import load_recipe

    classifier = load_recipe("classifier")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        for value in (True, False):
            cfg = parse_config(classifier.Config, ["--tf32", str(value).lower(), "--report_to", "none",
                                                   "--output_dir", str(tmp_path / str(value))])
            run = Run(cfg, "tf32")
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                    torch.backends.cudnn.benchmark) == (value, value, value)
            run.finish()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved
