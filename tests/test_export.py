"""common/artifacts/export.py and the hub upload of common/artifacts/model_folder.py: an export keeps its dynamic batch
from an example of one, carries the weights' metadata, and is refused (no file left) when it does not
reproduce the eager model; --push_to_hub is refused up front without network or token, and uploads the
model folder to the repository named."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from common import UserError
from common.artifacts.export import OnnxModel, export_model
from common.config import RunConfig
from common.trackers import check_hub_push, push_folder
from common.weights import read_metadata, weights_metadata


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    )


def test_an_export_from_one_example_keeps_a_dynamic_batch_and_the_metadata(tmp_path):
    model = _net().eval()
    cfg = RunConfig(data="tiny")
    meta = weights_metadata(cfg, ["a", "b", "c", "d"], "classifier", normalization=([0.5] * 3, [0.25] * 3))
    diffs = export_model(model, {"images": torch.rand(1, 3, 32, 32)}, ["logits"], tmp_path, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.pt2"]  # no temporary file left
    assert set(diffs) == {"export/inputs", "export/onnx_logits_rel", "export/pt2_logits_rel"}
    assert (
        diffs["export/inputs"] == 1 and diffs["export/onnx_logits_rel"] < 1e-5 and diffs["export/pt2_logits_rel"] < 1e-5
    )
    images = torch.rand(5, 3, 32, 32)  # another batch size than the example's
    with torch.no_grad():
        expected = model(images)
    (logits,) = OnnxModel(tmp_path / "model.onnx")(images)
    assert torch.allclose(logits, expected, atol=1e-5)
    got = torch.export.load(str(tmp_path / "model.pt2")).module()(images)
    assert torch.allclose(got, expected, atol=1e-5)
    saved = read_metadata(tmp_path / "model.onnx")  # the weights' schema, read from the ONNX file
    assert saved["recipe"] == "classifier" and saved["classes"] == ["a", "b", "c", "d"]
    assert saved["config"]["data"] == "tiny" and saved["mean"] == [0.5] * 3 and saved["std"] == [0.25] * 3


class _Drifting(nn.Module):
    """A model whose traced graph cannot follow it: a host-side random factor is frozen at export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + random.random())


def test_an_export_that_does_not_reproduce_the_model_is_refused_and_leaves_nothing(tmp_path):
    random.seed(0)
    with pytest.raises(UserError, match=r"export refused: model\.(pt2|onnx) on x \[2, 3\]: y differ by 0\.\d+ of its"):
        export_model(_Drifting(), {"x": torch.ones(2, 3)}, ["y"], tmp_path, {})
    assert list(tmp_path.iterdir()) == []


def test_push_to_hub_is_refused_before_anything_is_written(monkeypatch):
    with pytest.raises(UserError, match="push_to_hub needs ORG/NAME"):
        check_hub_push("just-a-name")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        check_hub_push("me/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(UserError, match="no Hugging Face token"):
        check_hub_push("me/model")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_xxx")
    check_hub_push("me/model")  # a name, network and a token: nothing to refuse
    check_hub_push("")  # not asked for


class _FakeHub:
    """HfApi's two calls that push_folder makes, recorded instead of sent."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def create_repo(self, repo_id, repo_type, exist_ok):
        self.calls.append(("create_repo", repo_id, repo_type, exist_ok))

    def upload_folder(self, folder_path, repo_id, repo_type, commit_message):
        if self.fail:
            raise ConnectionError("no route to host")
        self.calls.append(("upload_folder", sorted(p.name for p in Path(folder_path).iterdir()), repo_id))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()


def test_push_uploads_the_model_folder_and_a_failure_raises_for_the_run_to_tell(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("README.md", "config.json", "model.safetensors"):
        (folder / name).write_text("x")
    hub = _FakeHub()
    line = push_folder(folder, "me/digits", hub)
    assert hub.calls == [
        ("create_repo", "me/digits", "model", True),
        ("upload_folder", ["README.md", "config.json", "model.safetensors"], "me/digits"),
    ]
    assert line == f"push_to_hub: {folder} uploaded to https://huggingface.co/me/digits/commit/1"
    with pytest.raises(ConnectionError, match="no route to host"):  # Run.finish tells it with the retry command
        push_folder(folder, "me/digits", _FakeHub(fail=True))
    assert "nothing to upload" in push_folder(tmp_path / "absent", "me/digits", hub)


def test_an_onnx_file_is_refused_where_tensors_are_needed(tmp_path):
    from common.weights import load_weights

    (tmp_path / "model.onnx").write_bytes(b"\x08\x07")
    with pytest.raises(UserError, match=r"are an ONNX export: --predict runs them; this needs the safetensors file"):
        load_weights(tmp_path / "model.onnx")


def test_detections_agree_up_to_a_tie_at_the_score_floor_and_no_further():
    """The detector check's rule (common/artifacts/export.py): paired boxes within 0.5 px and scores within 1e-3; a
    detection scoring within 1e-3 of the floor (or of the last score kept at the detection limit) may be
    on one side only; any other detection without its pair refuses the file."""
    from common.artifacts.export_check import Detections, detections_agree

    boxes = torch.tensor([[10.0, 10, 50, 60], [100, 20, 140, 90], [30, 30, 80, 70]])
    eager = (boxes, torch.tensor([0.9, 0.6, 0.3005]), torch.tensor([1, 2, 1]))
    spec = Detections(lambda out: out, floor=0.3)
    moved = (boxes[:2] + 0.2, torch.tensor([0.9004, 0.6]), torch.tensor([1, 2]))  # the last fell below 0.3
    box_diff, score_diff, wrong = detections_agree(moved, eager, spec, "model.onnx")
    assert wrong is None and box_diff == pytest.approx(0.2, abs=1e-5) and score_diff == pytest.approx(4e-4, abs=1e-6)
    far = (boxes[:2] + torch.tensor([0.0, 0, 0.7, 0]), eager[1][:2], eager[2][:2])
    assert detections_agree(far, eager, spec, "model.onnx")[2] == "boxes differ by 0.7 px (tolerance 0.5 px)"
    lost = (boxes[1:], eager[1][1:], eager[2][1:])
    assert detections_agree(lost, eager, spec, "model.onnx")[2] == (
        "eager's detection of class 1 scoring 0.900 has none in model.onnx"
    )
    relabelled = (boxes, eager[1], torch.tensor([1, 3, 1]))
    assert (
        detections_agree(relabelled, eager, spec, "f")[2] == "eager's detection of class 2 scoring 0.600 has none in f"
    )
    extra = (
        torch.cat([boxes, boxes[:1] + 200]),
        torch.cat([eager[1], torch.tensor([0.5])]),
        torch.tensor([1, 2, 1, 4]),
    )
    assert (
        detections_agree(extra, eager, spec, "f")[2] == "f has a detection of class 4 scoring 0.500 that eager has not"
    )
    capped = Detections(lambda out: out, floor=0.0, limit=2)  # at the limit the last score kept is a floor
    two = (boxes[:2], torch.tensor([0.9, 0.6]), torch.tensor([1, 2]))
    other = (boxes[[0, 2]], torch.tensor([0.9, 0.6005]), torch.tensor([1, 1]))
    assert detections_agree(other, two, capped, "model.onnx")[2] is None
