"""recipes/faster_rcnn.py with faster_rcnn_model.py and faster_rcnn_data.py beside it: the aspect-ratio batch
sampler, the weighted loss, the model's geometry (boxes back in input pixels, normalisation once), bad input, and
the default run through the entry point learning the built-in scenes."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from common.config import parse_config
from common.weights import read_metadata
from conftest import assert_pictures, check, error_line, load_recipe, run_recipe
from faster_rcnn_data import AspectRatioBatchSampler, data_transforms, has_boxes  # the files beside the recipe
from faster_rcnn_model import LOSS_NAMES, PRESETS, TwoStageDetector, create_model

frcnn = load_recipe("faster_rcnn")

# 40 landscape (w / h = 1.5: group 5 of torchvision's 8) and 24 portrait images (0.75: group 2), interleaved
RATIOS = [1.5 if i % 8 < 5 else 0.75 for i in range(64)]


def _epoch(sampler: AspectRatioBatchSampler, epoch: int) -> list[list[tuple[int, int]]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_covers_every_index_once_in_homogeneous_batches():
    sampler = AspectRatioBatchSampler(RATIOS, 8, seed=3)
    batches = _epoch(sampler, 0)
    assert len(batches) == len(sampler) == 8  # 40 / 8 + 24 / 8: every batch full, nothing dropped
    flat = [i for batch in batches for _, i in batch]
    assert sorted(flat) == list(range(64))
    assert all(e == 0 for batch in batches for e, _ in batch)
    for batch in batches:
        assert len({sampler.groups[i] for _, i in batch}) == 1  # one aspect-ratio group per batch
    # without drop_last the groups' last batches are smaller, and still every index comes once
    ragged = AspectRatioBatchSampler(RATIOS[:61], 8, seed=3, drop_last=False)
    flat = [i for batch in _epoch(ragged, 0) for _, i in batch]
    assert sorted(flat) == list(range(61)) and len(ragged) == 5 + 3
    # with drop_last they are dropped: 40 landscape -> 5 batches, 21 portrait -> 2
    assert len(AspectRatioBatchSampler(RATIOS[:61], 8, seed=3)) == 7


def test_sampler_order_is_a_function_of_seed_and_epoch():
    a, b = AspectRatioBatchSampler(RATIOS, 8, seed=3), AspectRatioBatchSampler(RATIOS, 8, seed=3)
    first = _epoch(a, 0)
    assert _epoch(b, 0) == first  # same seed and epoch, another instance
    second = _epoch(a, 1)
    assert [[i for _, i in batch] for batch in second] != [[i for _, i in batch] for batch in first]
    assert all(e == 1 for batch in second for e, _ in batch)
    assert _epoch(a, 0) == first  # back to epoch 0: the same order again
    assert _epoch(AspectRatioBatchSampler(RATIOS, 8, seed=4), 0) != first


def test_sampler_splits_across_two_processes_as_accelerate_shards_it():
    """Accelerate gives process r of W the batches r, r + W, ... of the sampler (BatchSamplerShard,
    what ``accelerator.prepare`` wraps a batch sampler in): both processes get the same number of
    full, homogeneous batches, disjoint, and together the rounds are the whole epoch's batches."""
    from accelerate.data_loader import BatchSamplerShard

    ratios = RATIOS[:60]  # 39 landscape (4 full batches), 21 portrait (2): 6 batches, 3 rounds of 2
    sampler = AspectRatioBatchSampler(ratios, 8, seed=0, num_processes=2)
    sampler.set_epoch(2)
    whole = list(sampler)
    assert len(whole) == len(sampler) == 6
    shards = [list(BatchSamplerShard(sampler, num_processes=2, process_index=r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 3
    assert [b for pair in zip(*shards) for b in pair] == whole
    seen = [i for shard in shards for batch in shard for _, i in batch]
    assert len(seen) == len(set(seen)) == 48
    for shard in shards:
        assert all(len(batch) == 8 and len({sampler.groups[i] for _, i in batch}) == 1 for batch in shard)
    # 3 processes: 6 full batches make 2 rounds; 7 would be cut to 6
    assert len(AspectRatioBatchSampler(RATIOS, 8, seed=0, num_processes=3)) == 6


def test_model_returns_the_four_terms_under_the_recipes_names():
    """Training forward: torchvision's four losses, unweighted, renamed as the recipe logs them (the
    loop sums them with loss_weights; the end-to-end test checks the logged total against the terms)."""
    model = _model()
    torch.manual_seed(0)
    images = [torch.rand(3, 96, 96), torch.rand(3, 80, 96)]
    targets = [
        {"boxes": torch.tensor([[10.0, 10.0, 30.0, 40.0]]), "labels": torch.tensor([3])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},
    ]  # a negative image
    losses = model(images, targets)
    assert list(losses) == [name for name in LOSS_NAMES.values() if name != "loss_mask"]  # the mask term: --masks
    assert all(v.ndim == 0 and torch.isfinite(v) and v >= 0 for v in losses.values())


def _model() -> TwoStageDetector:
    torch.manual_seed(0)
    return create_model(parse_config(frcnn.Config, []), num_classes=10)


def test_model_normalises_once_and_returns_boxes_in_input_pixels():
    """The data pipeline gives 0..1 images; the model's transform normalises with ImageNet mean/std
    (once) and resizes to min_size; detections come back in the pixels of the image as given."""
    from common.detection.data import IMAGENET_MEAN, IMAGENET_STD

    cfg = parse_config(frcnn.Config, ["--min_size", "128", "--max_size", "128"])
    model = create_model(cfg, num_classes=10).eval()
    image = torch.rand(3, 96, 64)
    batch, _ = model.transform([image])
    assert tuple(batch.image_sizes[0]) == (128, 85)  # shorter side 64 -> 128 would make 192 > max 128
    resized = torch.nn.functional.interpolate(image[None], size=(128, 85), mode="bilinear", align_corners=False)[0]
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    assert torch.allclose(batch.tensors[0, :, :128, :85], (resized - mean) / std, atol=1e-5)
    detections = [
        {"boxes": torch.tensor([[0.0, 0.0, 85.0, 128.0]]), "labels": torch.tensor([1]), "scores": torch.tensor([0.9])}
    ]
    back = model.transform.postprocess(detections, batch.image_sizes, [(96, 64)])
    assert back[0]["boxes"][0].tolist() == pytest.approx([0.0, 0.0, 64.0, 96.0])
    train_tf = data_transforms(True, 0.0, False)
    from PIL import Image
    from torchvision import tv_tensors

    picture = Image.fromarray((torch.rand(40, 50, 3) * 255).byte().numpy())
    boxes = tv_tensors.BoundingBoxes([[1.0, 2.0, 20.0, 30.0]], format="XYXY", canvas_size=(40, 50))
    out, target = train_tf(picture, {"boxes": boxes, "labels": torch.tensor([2])})
    assert out.shape == (3, 40, 50) and 0.0 <= float(out.min()) and float(out.max()) <= 1.0  # not normalised
    assert target["boxes"].tolist() == [[1.0, 2.0, 20.0, 30.0]]


def test_the_resized_size_is_computed_exactly_in_integers():
    """The shorter side to min_size unless the longer would pass max_size (then the longer to max_size),
    the other side rounded down exactly, on sizes where a float scale rounds a pixel apart (the graph's
    float32 gives 799 rows for 750 x 1000); training resizes the target boxes with the image."""
    cfg = parse_config(frcnn.Config, ["--min_size", "800", "--max_size", "1333"])
    transform = create_model(cfg, num_classes=2).transform.eval()
    for (h, w), expected in {(750, 1000): (800, 1066), (183, 245): (800, 1071), (1000, 100): (1333, 133)}.items():
        batch, _ = transform([torch.rand(3, h, w)])
        assert tuple(batch.image_sizes[0]) == expected, (h, w)
    transform.train()
    target = {"boxes": torch.tensor([[0.0, 0.0, 100.0, 50.0]]), "labels": torch.tensor([1])}
    batch, (resized,) = transform([torch.rand(3, 100, 200)], [target])
    assert tuple(batch.image_sizes[0]) == (666, 1333)  # 800 rows would make 1600 columns > 1333
    assert resized["boxes"][0].tolist() == pytest.approx([0.0, 0.0, 666.5, 333.0])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default config through the real entry point (the README's command, offline)."""
    run = tmp_path_factory.mktemp("faster_rcnn") / "run"
    proc = check(run_recipe("faster_rcnn", ["--output_dir", str(run), "--report_to", "none"], timeout=900))
    return run, proc


@pytest.mark.configs  # a demo trained to its threshold: the second tier (-m configs; CI runs it)
def test_default_run_learns_the_builtin_scenes(default_run):
    run, proc = default_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert train and all(
        k in train[-1]
        for k in (
            "train/loss_rpn_objectness",
            "train/loss_rpn_box",
            "train/loss_roi_classifier",
            "train/loss_roi_box",
            "train/boxes_per_image",
            "train/data_wait",
        )
    )
    for r in train:  # the logged total is the weighted (here: plain) sum of the logged terms
        terms = sum(r[f"train/loss_{k}"] for k in ("rpn_objectness", "rpn_box", "roi_classifier", "roi_box"))
        assert r["train/loss"] == pytest.approx(terms, rel=1e-4)
    final = [r for r in records if "eval/map_50" in r][-1]
    assert final["eval/map_50"] >= 0.80, final
    assert_pictures(run / "plots", ["curves", "pr_curves", "confusion_matrix", "detections"])
    assert "AP per class: " in proc.stdout and "per_class_ap.csv (" in proc.stdout
    # best.safetensors holds the best weights and rebuilds the model from its metadata
    meta = read_metadata(run / "best.safetensors")
    cfg = parse_config(frcnn.Config, [])
    assert meta["recipe"] == "faster_rcnn" and meta["config"]["model"] == cfg.model and len(meta["classes"]) == 10
    model = create_model(cfg, 10)
    model.load_state_dict(safetensors.torch.load_file(str(run / "best.safetensors")))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--loss_weights", "{rpn_box: 2, boxes: 1}"], "loss_weights names non-negative weights of rpn_objectness"),
        (["--loss_weights", "{mask: -1}"], "loss_weights names non-negative weights"),
        (["--model", "maskrcnn_resnet50_fpn", "--model_kwargs", "{}"], "maskrcnn_resnet50_fpn segments: train it"),
        (["--best_metric", "mask_map_50"], "best_metric mask_map_50 is the masks' mAP: it needs --masks true"),
        (["--min_size", "128"], "min_size must be one or more positive sizes no larger than max_size"),
        (["--anchor_sizes", "[[16], [32]]"], "anchor_sizes must give one list of sizes per FPN level"),
        (["--anchor_sizes", "[[16], [32, 48], [64]]"], "anchor_sizes must give one list of sizes per FPN level"),
        (["--model", "no_such_net"], "unknown timm model 'no_such_net'"),
        (["--model", "fasterrcnn_resnet50_fpn"], "do not fit fasterrcnn_resnet50_fpn"),  # the demo's timm kwargs
    ],
)
def test_bad_input_is_a_user_error(args, message):
    """In-process (a subprocess per case would cost seconds of imports each): what ``main`` checks
    before it makes the run folder (``check_config``, then ``create_model``) raises a UserError,
    which the entry point prints as one line with exit status 2 (tested below)."""
    from common import UserError

    cfg = parse_config(frcnn.Config, args)
    with pytest.raises(UserError, match=message):
        frcnn.check_config(cfg)
        create_model(cfg, 10)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--loss_weights", "1,1,1,1"], "config field 'loss_weights' expects a mapping"),  # the positional form
        (["--masks", "true"], "--masks true: the training split of 'digits_det' has no object masks"),
    ],
)
def test_masks_without_masks_and_positional_loss_weights_are_one_line_before_anything_is_written(
    tmp_path, capsys, args, message
):
    line = error_line(capsys, frcnn.main, ["--output_dir", str(tmp_path / "run"), "--report_to", "none", *args])
    assert message in line and not (tmp_path / "run").exists()


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    """As the entry point reports it: one ``error:`` line, exit status 2."""
    args = ["--output_dir", str(tmp_path / "run"), "--report_to", "none", "--data", "/nonexistent/folder"]
    assert "/nonexistent/folder" in error_line(capsys, frcnn.main, args)


def test_proposals_and_boxes_stay_fp32_under_bf16_autocast():
    """torchvision's BoxCoder decodes in the regression's dtype, casting the anchors and proposals to
    it: under bf16 autocast every box would be rounded to 2-8 px on COCO-sized images. The recipe's
    heads hand their regressions over in fp32, so proposals and detections stay fp32."""
    model = create_model(
        parse_config(frcnn.Config, ["--min_size", "800", "--max_size", "1333", "--box_score_thresh", "0"]),
        num_classes=10,
    ).eval()
    proposals = []
    model.rpn.register_forward_hook(lambda m, i, o: proposals.append(o[0]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        (detections,) = model([torch.rand(3, 600, 900)])
    assert all(p.dtype == torch.float32 for p in proposals[0]) and len(proposals[0][0]) > 0
    assert detections["boxes"].dtype == torch.float32 and len(detections["boxes"]) > 0
    # not on the bf16 grid: above 512 px a bf16 coordinate is a multiple of 4
    large = detections["boxes"][detections["boxes"] > 512]
    assert len(large) == 0 or bool((large % 4 != 0).any())


@pytest.mark.parametrize("model", ["default", "fasterrcnn_resnet50_fpn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_anchors_are_fp32_under_autocast(model, dtype):
    """The RPN's anchors at 800x1216 (every level of the model: strides 4, 8, ...) are their fp32 values
    when the FPN features come in bf16 or fp16 from an autocast forward: torchvision builds them in the
    features' dtype: in bf16 a coordinate near 1216 px is a multiple of 8 px; fp16 holds these integral
    anchors (up to 2048 px) but hands them on in fp16, in which the decoded boxes would be rounded."""
    from torchvision.models.detection.image_list import ImageList

    args = [] if model == "default" else ["--model", model, "--model_kwargs", "{}", "--anchor_sizes", "[]"]
    generator = create_model(parse_config(frcnn.Config, args), num_classes=10).rpn.anchor_generator
    batch = ImageList(torch.zeros(2, 3, 800, 1216), [(800, 1216), (780, 1200)])
    shapes = [(2, 8, 800 // 2**i, 1216 // 2**i) for i in range(2, 2 + len(generator.sizes))]
    reference = generator(batch, [torch.zeros(s) for s in shapes])
    with torch.autocast("cpu", dtype=dtype):
        anchors = generator(batch, [torch.zeros(s, dtype=dtype) for s in shapes])
    assert len(anchors) == 2 and anchors[0].shape == reference[0].shape and anchors[0].shape[0] > 100_000
    for got, want in zip(anchors, reference):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# ---- torchvision's reference: aspect-ratio groups, images without boxes, budgets, backbone weights ----------
def test_sampler_groups_ratios_into_torchvisions_bins():
    """torchvision's create_aspect_ratio_groups(k=3): edges 2 ** linspace(-1, 1, 7), 8 groups, quantised by
    bisect_right. It cuts height / width, so its group of an image off the edges is 7 - ours (width / height)."""
    import bisect

    import numpy as np

    sampler = AspectRatioBatchSampler([1.0] * 8, 4)
    assert sampler.edges == pytest.approx((2 ** np.linspace(-1, 1, 7)).tolist())
    ratios = [0.3, 0.55, 0.7, 0.9, 1.1, 1.4, 1.8, 2.5]  # one in each group, 0..7
    assert AspectRatioBatchSampler(ratios, 1).groups == list(range(8))
    assert [7 - bisect.bisect_right(sampler.edges, 1 / r) for r in ratios] == list(range(8))
    # on an edge: the upper group (a square image goes with the slightly wide ones)
    assert AspectRatioBatchSampler([0.5, 1.0, 2.0], 1).groups == [1, 4, 7]
    # 0: landscape (w >= h) or portrait; -1: one group
    assert AspectRatioBatchSampler([0.3, 0.9, 1.0, 2.5], 1, group_factor=0).groups == [0, 0, 1, 1]
    assert set(AspectRatioBatchSampler(ratios, 1, group_factor=-1).groups) == {0}

    # 5 groups of 9, 6, 4, 8 and 3 images, interleaved; batches of 4
    spread = [r for k in range(9) for r, n in zip((0.55, 0.9, 1.0, 1.4, 2.5), (9, 6, 4, 8, 3)) if k < n]
    sampler = AspectRatioBatchSampler(spread, 4, seed=1)
    batches = _epoch(sampler, 0)
    assert len(batches) == len(sampler) == 2 + 1 + 1 + 2 + 0  # full batches only
    assert all(len(b) == 4 and len({sampler.groups[i] for _, i in b}) == 1 for b in batches)
    assert len({sampler.groups[b[0][1]] for b in batches}) == 4  # the groups with a full batch all appear
    ragged = AspectRatioBatchSampler(spread, 4, seed=1, drop_last=False)
    flat = [i for b in _epoch(ragged, 0) for _, i in b]
    assert sorted(flat) == list(range(len(spread))) and len(ragged) == 3 + 2 + 1 + 2 + 1
    assert all(len({ragged.groups[i] for _, i in b}) == 1 for b in _epoch(ragged, 0))
    assert len(AspectRatioBatchSampler(spread, 4, seed=1, num_processes=4)) == 4  # 6 batches: 1 round of 4
    assert len(AspectRatioBatchSampler(spread, 4, seed=1, group_factor=-1)) == len(spread) // 4  # no grouping
    assert _epoch(AspectRatioBatchSampler(spread, 4, seed=1), 0) == batches  # a function of (seed, epoch)
    from common import UserError

    with pytest.raises(UserError, match="no aspect-ratio group of the training split fills"):
        AspectRatioBatchSampler([0.5, 1.5, 0.5, 1.5], 3)


def test_images_without_a_box_to_learn_are_told_apart():
    """torchvision's rule (no box, or only boxes at most 1 px wide or high), and crowd-only images count as empty."""

    def objects(boxes, crowd=None):
        return {"bbox": boxes, "iscrowd": crowd or [0] * len(boxes)}

    assert has_boxes(objects([[0, 0, 5, 5]]))
    assert has_boxes(objects([[0, 0, 1, 9], [3, 3, 2, 2]]))  # one good box is enough
    assert not has_boxes(objects([]))
    assert not has_boxes(objects([[0, 0, 1, 9], [4, 4, 9, 0.5]]))  # every box at most 1 px on a side
    assert not has_boxes(objects([[0, 0, 20, 20]], [1]))  # crowd regions are never targets
    assert has_boxes(objects([[0, 0, 20, 20], [30, 30, 8, 8]], [1, 0]))


def _saved_detection(folder, train_boxes, train_crowd=None):
    """A save_to_disk dataset: a train split of 32 x 32 images with the given boxes, a validation split of 2."""
    import datasets

    from conftest import bright_rectangle, detection_table

    train = detection_table(
        [bright_rectangle(32, 32, (4, 4, 12, 12)) for _ in train_boxes], train_boxes, crowd=train_crowd
    )
    validation = detection_table([bright_rectangle(32, 32, (4, 4, 12, 12))] * 2, [[[4, 4, 12, 12]]] * 2)
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(str(folder))
    return str(folder)


def test_training_drops_images_without_a_box_to_learn(tmp_path, capsys):
    """Through the entry point: the left-out images are counted in one line; none left is one clear error."""
    good = [[4, 4, 12, 12]]
    data = _saved_detection(
        tmp_path / "data", [good, [], good, [[0, 0, 1, 5]], good, good], [[0], [], [0], [0], [0], [1]]
    )  # left out: no box, a 1 px wide one, a crowd region
    args = [
        "--data",
        data,
        "--output_dir",
        str(tmp_path / "run"),
        "--report_to",
        "none",
        "--num_workers",
        "0",
        "--batch_size",
        "1",
        "--max_steps",
        "1",
        "--min_size",
        "32",
        "--max_size",
        "32",
        "--plot_images",
        "0",
    ]
    proc = check(run_recipe("faster_rcnn", args, timeout=300))
    assert "training on 3 of 6 images: 3 without a box to learn left out (--keep_empty true keeps them)" in proc.stdout
    empty = _saved_detection(tmp_path / "empty", [[], [[2, 2, 1, 6]], good], [[], [0], [1]])
    line = error_line(
        capsys,
        frcnn.main,
        ["--data", empty, "--output_dir", str(tmp_path / "run_empty"), "--report_to", "none", "--num_workers", "0"],
    )
    assert "no training image of" in line and "--keep_empty true" in line


def _sampled(model) -> tuple:
    """(pre-NMS top n [train, eval], post-NMS top n [train, eval], RPN anchors and RoI proposals sampled per image)."""
    rpn = model.rpn
    return (
        [rpn._pre_nms_top_n["training"], rpn._pre_nms_top_n["testing"]],
        [rpn._post_nms_top_n["training"], rpn._post_nms_top_n["testing"]],
        rpn.fg_bg_sampler.batch_size_per_image,
        model.roi_heads.fg_bg_sampler.batch_size_per_image,
    )


def test_budgets_left_empty_are_the_models_own_and_a_set_value_wins():
    preset = ["--model", "fasterrcnn_resnet50_fpn", "--model_kwargs", "{}", "--anchor_sizes", "[]"]
    assert _sampled(create_model(parse_config(frcnn.Config, preset), 10)) == (
        [2000, 1000],
        [2000, 1000],
        256,
        512,
    )
    mobile = ["--model", "fasterrcnn_mobilenet_v3_large_320_fpn", "--model_kwargs", "{}", "--anchor_sizes", "[]"]
    assert _sampled(create_model(parse_config(frcnn.Config, mobile), 10)) == ([2000, 150], [2000, 150], 256, 512)
    demo = create_model(parse_config(frcnn.Config, []), 10)
    assert _sampled(demo) == ([200, 200], [100, 100], 128, 32)  # the demo's, as before these fields could be empty
    explicit = [
        "--rpn_pre_nms_top_n",
        "300,250",
        "--rpn_post_nms_top_n",
        "60,50",
        "--rpn_batch_size_per_image",
        "64",
        "--box_batch_size_per_image",
        "16",
    ]
    for base in (preset, []):
        cfg = parse_config(frcnn.Config, base + explicit)
        assert _sampled(create_model(cfg, 10)) == ([300, 250], [60, 50], 64, 16)
    from common import UserError

    with pytest.raises(UserError, match=r"rpn_pre_nms_top_n takes two positive numbers \[train, eval\], or \[\]"):
        frcnn.check_config(parse_config(frcnn.Config, ["--rpn_pre_nms_top_n", "[300]"]))


def test_presets_take_the_imagenet_v1_backbone_of_torchvisions_reference(monkeypatch):
    """--pretrained_backbone asks the preset builder for the V1 ImageNet weights the reference trained from, not
    "DEFAULT" (V2); --pretrained asks for the COCO weights ("DEFAULT", fasterrcnn_resnet50_fpn's COCO_V1, 37.0
    box AP). The builder is replaced, so nothing is downloaded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the weights are never fetched: the builder is replaced
    monkeypatch.setattr("faster_rcnn_model.reachable", lambda url: True)  # as if the network were there
    import torchvision
    from torchvision.models import MobileNet_V3_Large_Weights, ResNet50_Weights
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

    class Built(Exception):
        pass

    calls = []

    def builder(**kwargs):
        calls.append(kwargs)
        raise Built

    for name in PRESETS:
        monkeypatch.setattr(torchvision.models.detection, name, builder)
    for name, weights in [
        ("fasterrcnn_resnet50_fpn", ResNet50_Weights.IMAGENET1K_V1),
        ("fasterrcnn_resnet50_fpn_v2", ResNet50_Weights.IMAGENET1K_V1),
        ("fasterrcnn_mobilenet_v3_large_fpn", MobileNet_V3_Large_Weights.IMAGENET1K_V1),
        ("fasterrcnn_mobilenet_v3_large_320_fpn", MobileNet_V3_Large_Weights.IMAGENET1K_V1),
    ]:
        for flags, expected in (
            (["--pretrained_backbone", "true"], (None, weights)),
            (["--pretrained", "true"], ("DEFAULT", None)),
            ([], (None, None)),
        ):
            cfg = parse_config(frcnn.Config, ["--model", name, "--model_kwargs", "{}", *flags])
            with pytest.raises(Built):
                create_model(cfg, 10)
            assert (calls[-1]["weights"], calls[-1]["weights_backbone"]) == expected, (name, flags)
    assert ResNet50_Weights.DEFAULT != ResNet50_Weights.IMAGENET1K_V1  # why "DEFAULT" would not be the reference's
    assert FasterRCNN_ResNet50_FPN_Weights.DEFAULT == FasterRCNN_ResNet50_FPN_Weights.COCO_V1
    assert FasterRCNN_ResNet50_FPN_Weights.COCO_V1.meta["_metrics"]["COCO-val2017"]["box_map"] == 37.0


def test_freeze_at_counts_a_presets_stages_as_torchvision_does(monkeypatch):
    """freeze_at (the stem counted as 1) becomes the preset's trainable_backbone_layers: of 5 stages for a resnet,
    of 6 for a MobileNetV3 (its first convolution with the block after it, four stride-2 stages, its last
    convolution), so freeze_at 1 freezes exactly the stem of either and 0 nothing. Checked on
    torchvision's own extractors with the numbers passed."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the weights are never fetched: the builder is replaced
    monkeypatch.setattr("faster_rcnn_model.reachable", lambda url: True)  # as if the network were there
    import torchvision
    from torchvision.models.detection.backbone_utils import _mobilenet_extractor, _resnet_fpn_extractor

    calls = []

    class Built(Exception):
        pass

    def builder(**kwargs):
        calls.append(kwargs)
        raise Built

    for name in PRESETS:
        monkeypatch.setattr(torchvision.models.detection, name, builder)
    trainable = {}
    for name in ("fasterrcnn_resnet50_fpn", "fasterrcnn_mobilenet_v3_large_fpn"):
        for freeze_at in (0, 1, 2):
            cfg = parse_config(
                frcnn.Config,
                [
                    "--model",
                    name,
                    "--model_kwargs",
                    "{}",
                    "--pretrained_backbone",
                    "true",
                    "--freeze_at",
                    str(freeze_at),
                ],
            )
            frcnn.check_config(cfg)
            with pytest.raises(Built):
                create_model(cfg, 10)
            trainable[name, freeze_at] = calls[-1]["trainable_backbone_layers"]

    def frozen(module):
        return sorted({n.split(".")[0] for n, p in module.named_parameters() if not p.requires_grad})

    mobile = _mobilenet_extractor(
        torchvision.models.mobilenet_v3_large(), True, trainable["fasterrcnn_mobilenet_v3_large_fpn", 1]
    )
    assert frozen(mobile.body) == ["0", "1"]  # the stem: features[0] and the block before the first stride-2 one
    assert not frozen(
        _mobilenet_extractor(
            torchvision.models.mobilenet_v3_large(), True, trainable["fasterrcnn_mobilenet_v3_large_fpn", 0]
        ).body
    )
    resnet = _resnet_fpn_extractor(torchvision.models.resnet50(), trainable["fasterrcnn_resnet50_fpn", 2])
    assert frozen(resnet.body) == ["bn1", "conv1", "layer1"]
    assert not frozen(
        _resnet_fpn_extractor(torchvision.models.resnet50(), trainable["fasterrcnn_resnet50_fpn", 0]).body
    )
    from common import UserError

    with pytest.raises(UserError, match=r"freeze_at must be 0..6 for fasterrcnn_mobilenet_v3_large_fpn, got 7"):
        frcnn.check_config(
            parse_config(frcnn.Config, ["--model", "fasterrcnn_mobilenet_v3_large_fpn", "--freeze_at", "7"])
        )


def test_empty_anchor_sizes_follow_the_backbone_and_the_image_size():
    """A timm backbone's anchors are 8 x each FPN level's stride whatever its out_indices; a preset's are its own,
    scaled by the last min_size over the side they are sized for, with a note naming them."""
    for levels, strides in (([1, 2, 3], [4, 8, 16]), ([2, 3, 4], [8, 16, 32]), ([1, 2, 3, 4], [4, 8, 16, 32])):
        notes: list[str] = []
        cfg = parse_config(frcnn.Config, ["--anchor_sizes", "[]", "--out_indices", str(levels), "--model_kwargs", "{}"])
        sizes = create_model(cfg, 3, notes).rpn.anchor_generator.sizes
        assert sizes == tuple((8 * s,) for s in strides) and any(str(8 * strides[-1]) in n for n in notes)
    args = [
        "--model",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "--model_kwargs",
        "{}",
        "--anchor_sizes",
        "[]",
        "--aspect_ratios",
        "[0.5, 1, 2]",
    ]
    own = create_model(parse_config(frcnn.Config, [*args, "--min_size", "[320]", "--max_size", "640"]), 3)
    assert own.rpn.anchor_generator.sizes == ((32, 64, 128, 256, 512),) * 3  # its own side: unchanged
    notes = []
    half = create_model(parse_config(frcnn.Config, [*args, "--min_size", "[160]", "--max_size", "320"]), 3, notes)
    assert half.rpn.anchor_generator.sizes == ((16, 32, 64, 128, 256),) * 3
    assert any("x 0.5 for a shorter side of 160 px" in n for n in notes)
    # written-out anchor_sizes stay as written
    cfg = parse_config(frcnn.Config, ["--anchor_sizes", "[[20], [40], [80]]"])
    assert create_model(cfg, 3).rpn.anchor_generator.sizes == ((20,), (40,), (80,))
