"""Without network, ``pretrained: true`` is known at once (issue 43, item 4): weights not in the local cache are
one line within seconds, not a minute of the hub client's retries; weights in the cache load from it. The probe
(common.models.reachable, a HEAD request through huggingface_hub's client) answers yes for an HTTP server, and no
within its timeout for a closed port, a host that does not resolve, a peer that breaks the TLS handshake or stays
silent, and a proxy that does (issue 49: behind a proxy that failed TLS, the TCP-only probe said yes). Only
loopback addresses are ever connected to."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator

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


@contextlib.contextmanager
def peer(behaviour: str) -> Iterator[tuple[int, list[bytes]]]:
    """A TCP server on a loopback port, and the first bytes each connection sent it. ``behaviour``: ``garbage``
    answers every connection with bytes that are neither TLS nor HTTP and closes it; ``close`` closes it at once;
    ``silent`` reads and answers nothing; ``proxy-tls`` answers a proxy's CONNECT with 200 and then garbage (a
    tunnel whose TLS fails); ``proxy-407`` answers CONNECT with 407 Proxy Authentication Required."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    received: list[bytes] = []
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # the server closed: the test is over
                return
            held.append(conn)
            if behaviour == "close":
                conn.close()
                continue
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                received.append(conn.recv(4096))
                if behaviour == "garbage":
                    conn.sendall(b"no TLS here, no HTTP either\r\n\r\n")
                elif behaviour == "proxy-tls":
                    conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    conn.recv(4096)  # the client's TLS hello
                    conn.sendall(b"\x00garbage in place of a server hello" * 4)
                elif behaviour == "proxy-407":
                    conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
            if behaviour != "silent":
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], received
    finally:
        server.close()
        for conn in held:
            conn.close()


@pytest.fixture
def probe_online(monkeypatch):
    """Hub offline mode off for the probe (the suite sets it, and huggingface_hub's client then refuses every
    request), no proxy from the machine's environment, and huggingface_hub's shared client made anew before and
    after (it reads the proxy variables when it is made)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    huggingface_hub.close_session()
    yield monkeypatch
    huggingface_hub.close_session()


class Answer(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # noqa: N802 (the http.server API)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # quiet
        pass


def test_the_probe_says_yes_for_an_http_server_and_no_for_a_closed_port_or_an_unknown_host(probe_online):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert reachable(f"http://127.0.0.1:{server.server_address[1]}/timm/resnet10t", timeout=3.0)
    finally:
        server.shutdown()
        server.server_close()
    assert not reachable(f"http://127.0.0.1:{free_port()}/x", timeout=3.0)
    started = time.perf_counter()
    assert not reachable("https://no-such-host.invalid/weights.bin", timeout=3.0)
    assert time.perf_counter() - started < 4.0


@pytest.mark.parametrize("behaviour", ["garbage", "close", "silent"])
def test_a_peer_that_breaks_the_tls_handshake_or_stays_silent_is_no(probe_online, behaviour):
    """A TCP connection opens (what the probe asked before), then no TLS server answers: no, within the timeout
    (at once where the peer speaks or closes)."""
    with peer(behaviour) as (port, received):
        started = time.perf_counter()
        assert not reachable(f"https://127.0.0.1:{port}/timm/resnet10t", timeout=2.0)
        took = time.perf_counter() - started
    assert took < (2.5 if behaviour == "silent" else 1.0), took
    assert received or behaviour == "close"  # the connection did open: the TLS hello reached the peer


@pytest.mark.parametrize("behaviour", ["garbage", "proxy-tls", "proxy-407", "close"])
def test_behind_a_proxy_that_fails_the_probe_is_no_at_once(probe_online, behaviour):
    """HTTPS_PROXY names a loopback proxy that breaks the tunnel (garbage, a failed TLS handshake through it, 407,
    a closed connection): the probe goes through it, as huggingface_hub's downloads would, and says no within a
    second; the host named in the URL (under .invalid, which never resolves) is never connected to."""
    with peer(behaviour) as (port, received):
        probe_online.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
        huggingface_hub.close_session()  # the client reads the proxy when it is made
        started = time.perf_counter()
        assert not reachable("https://huggingface.invalid/timm/resnet10t", timeout=3.0)
        took = time.perf_counter() - started
    assert took < 1.0, took
    if behaviour != "close":
        assert received and received[0].startswith(b"CONNECT huggingface.invalid:443"), received


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
