"""common/meters.py: on-device sums, one reduction across processes when logged."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from common.meters import Meters, format_seconds
from conftest import free_port


def test_running_means_and_reset():
    meters = Meters("cpu")
    meters.update(n=2, loss=torch.tensor(1.0), acc=0.5)
    meters.update(n=6, loss=torch.tensor(3.0))
    meters.images(8)
    meters.step()
    out = meters.summary(steps_left=10)
    assert out["loss"] == pytest.approx((2 * 1 + 6 * 3) / 8)
    assert out["acc"] == pytest.approx(0.5)
    assert out["images_per_s"] > 0 and 0 <= out["data_wait"] <= 1
    assert out["eta_s"] == pytest.approx(10 * out["s_per_step"])
    meters.update(n=1, loss=torch.tensor(7.0))
    assert meters.summary()["loss"] == pytest.approx(7.0)  # the previous interval is gone


def test_update_keeps_sums_on_device_without_reading_them():
    meters = Meters("meta")  # a device whose values cannot be read: any .item() would fail
    meters.update(n=4, loss=torch.ones((), device="meta"))
    assert meters._sums["loss"].device.type == "meta"


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        ACCELERATE_USE_CPU="1",
    )
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    meters = Meters(acc.device)
    # rank 0 sees 3 samples of loss 1.0, rank 1 sees 1 sample of loss 5.0: global mean (3 + 5) / 4 = 2
    meters.update(n=3 if rank == 0 else 1, loss=torch.tensor(1.0 if rank == 0 else 5.0))
    if rank == 1:
        meters.update(n=2, only_rank1=torch.tensor(4.0))
    meters.images(3 if rank == 0 else 1)
    out = meters.summary(acc)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    acc.wait_for_everyone()
    acc.end_training()


def test_reduction_across_two_processes(tmp_path):
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo backend not available")
    # a value that only one process logged must not break the single stacked reduction
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for out in results:
        assert out["loss"] == pytest.approx(2.0)
        assert out["only_rank1"] == pytest.approx(4.0)
        assert out["images_per_s"] > 0


def test_format_seconds():
    assert format_seconds(3725) == "1:02:05" and format_seconds(-3) == "0:00:00"
