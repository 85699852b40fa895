"""Without network, ``pretrained: true`` is known at once (issue 43, item 4): weights not in the local cache are
one line within seconds, not a minute of the hub client's retries; weights in the cache load from it; the probe
(common.models.reachable) answers for a listening port, a closed one and a host that does not resolve."""

from __future__ import annotations

import socket
import time

import huggingface_hub
import pytest
import safetensors.torch
import timm
import torch

from common import UserError
from common.models import create_timm_model, reachable
from conftest import free_port


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE unset, the hub at a local port nothing listens on, an empty hub cache: a machine whose
    network is down, as the client sees it."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_the_probe_answers_for_open_closed_and_unknown_hosts():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert reachable(f"http://127.0.0.1:{server.getsockname()[1]}/x")
    assert not reachable(f"http://127.0.0.1:{free_port()}/x")
    started = time.perf_counter()
    assert not reachable("https://no-such-host.invalid/weights.bin", timeout=3.0)
    assert time.perf_counter() - started < 4.0


def test_weights_not_cached_without_network_are_one_line_within_seconds(no_network):
    started = time.perf_counter()
    with pytest.raises(UserError) as raised:
        create_timm_model("resnet10t", pretrained=True, num_classes=3)
    assert time.perf_counter() - started < 10
    assert "(timm/resnet10t.c3_in1k) are not in the local cache and cannot be downloaded (no network)" in str(
        raised.value
    )


def test_weights_in_the_cache_load_without_network(no_network):
    """The cache laid out as huggingface_hub writes it (refs/main -> a snapshot): the model gets those tensors."""
    hub_id = timm.models.get_pretrained_cfg("resnet10t").hf_hub_id
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = no_network / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    torch.manual_seed(1)
    state = timm.create_model("resnet10t").state_dict()
    safetensors.torch.save_file(state, str(repo / "snapshots" / revision / "model.safetensors"))
    started = time.perf_counter()
    model = create_timm_model("resnet10t", pretrained=True)
    assert time.perf_counter() - started < 10
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_torchvision_weights_not_cached_without_network_are_one_line(monkeypatch, tmp_path):
    """Faster R-CNN's torchvision presets download from their own host: the same one line when it does not answer
    (the probe's answer stood in for; the probe itself is tested above)."""
    from common.config import parse_config
    from conftest import load_recipe
    from faster_rcnn_model import create_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty torch.hub cache
    monkeypatch.setattr("faster_rcnn_model.reachable", lambda url: False)
    cfg = parse_config(
        load_recipe("faster_rcnn").Config,
        ["--model", "fasterrcnn_mobilenet_v3_large_fpn", "--model_kwargs", "{}", "--pretrained", "true"],
    )
    with pytest.raises(UserError) as raised:
        create_model(cfg, 3)
    assert str(raised.value).startswith("--pretrained: torchvision's weights https://download.pytorch.org/")
    assert "are not in " in str(raised.value) and " and download.pytorch.org is not reachable: " in str(raised.value)
