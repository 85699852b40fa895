"""recipes/detr.py with detr_data.py, detr_model.py and detr_pretrain.py beside it: the Hungarian matcher against
brute force, each loss term against hand-computed values, auxiliary losses, the sine position encoding
under padding, post-processing back to pixels, the box-crop pre-training data, bad input, and a
shortened default run through the entry point that learns the built-in scenes."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import safetensors.torch
import torch
import yaml

from common.config import parse_config
from common.weights import read_metadata
from conftest import (
    assert_pictures,
    assert_same_detections,
    check,
    error_line,
    export_and_predict,
    load_recipe,
    run_recipe,
    scene_files,
)
from detr_data import data_transforms, detr_collate
from detr_model import HungarianMatcher, SetCriterion, detections, postprocess, sine_position_encoding  # the recipe's
from detr_pretrain import BoxCropDataset, CropClassifier

detr = load_recipe("detr")


def _random_case(gen: torch.Generator, queries: int, counts: list[int], classes: int = 5):
    outputs = {
        "pred_logits": torch.randn(len(counts), queries, classes + 1, generator=gen),
        "pred_boxes": torch.rand(len(counts), queries, 4, generator=gen) * 0.5 + 0.25,
    }
    targets = [
        {"labels": torch.randint(classes, (n,), generator=gen), "boxes": torch.rand(n, 4, generator=gen) * 0.5 + 0.25}
        for n in counts
    ]
    return outputs, targets


def _cost_of(matcher, outputs, targets, i: int) -> torch.Tensor:
    """Image i's [Q, T_i] cost matrix, computed for that image alone."""
    one = {k: v[i : i + 1] for k, v in outputs.items()}
    return matcher.cost(one, [targets[i]])[0]


def test_matcher_equals_brute_force_over_permutations():
    """4 queries x 0..4 targets: the assignment's total cost is the minimum over every injective
    map of targets to queries (itertools.permutations), and it is that map."""
    gen = torch.Generator().manual_seed(0)
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    for trial in range(6):
        counts = [3, 0, 4, 1, 2][trial % 5 :] + [3, 0, 4, 1, 2][: trial % 5]
        outputs, targets = _random_case(gen, 4, counts)
        for i, (rows, cols) in enumerate(matcher(outputs, targets)):
            cost = _cost_of(matcher, outputs, targets, i)
            n = counts[i]
            assert len(rows) == len(cols) == n and rows.dtype == cols.dtype == torch.int64
            best = min(
                itertools.permutations(range(4), n), key=lambda qs: sum(float(cost[q, t]) for t, q in enumerate(qs))
            )
            got = dict(zip(cols.tolist(), rows.tolist()))  # target -> query
            assert tuple(got[t] for t in range(n)) == best
            assert sum(float(cost[q, t]) for t, q in got.items()) == pytest.approx(
                sum(float(cost[q, t]) for t, q in enumerate(best))
            )


def test_matcher_cost_is_minus_prob_plus_l1_minus_giou_and_batched_equals_per_image():
    from torchvision.ops import box_convert, generalized_box_iou

    gen = torch.Generator().manual_seed(1)
    matcher = HungarianMatcher(1.0, 5.0, 2.0)
    outputs, targets = _random_case(gen, 5, [2, 0, 3])
    cost = matcher.cost(outputs, targets)
    assert cost.shape == (3, 5, 5)
    prob = outputs["pred_logits"][2].softmax(-1)
    pred, tgt = outputs["pred_boxes"][2], targets[2]["boxes"]
    giou = generalized_box_iou(box_convert(pred, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy"))
    for q in range(5):
        for t in range(3):
            expected = -prob[q, targets[2]["labels"][t]] + 5 * (pred[q] - tgt[t]).abs().sum() - 2 * giou[q, t]
            assert float(cost[2, q, 2 + t]) == pytest.approx(
                float(expected), abs=1e-5
            )  # image 2's targets: columns 2..4
    batched = matcher(outputs, targets)
    for i in range(3):
        alone = matcher({k: v[i : i + 1] for k, v in outputs.items()}, [targets[i]])[0]
        assert torch.equal(batched[i][0], alone[0]) and torch.equal(batched[i][1], alone[1])
    # several layers at once (one host copy) equal one call per layer; a batch with no targets at all works
    other = {k: v.flip(1) for k, v in outputs.items()}
    layers = matcher.match_layers([outputs, other], targets)
    for got, want in zip(layers, (matcher(outputs, targets), matcher(other, targets))):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 3
    assert all(len(r) == len(c) == 0 for r, c in matcher(outputs, empty))


def _hand_case():
    """Two images, 2 queries, 2 classes (+ no-object = index 2). Image 0 has one target (class 1,
    box (0.5, 0.5, 0.4, 0.2)); query 0 sits on it with half its width, query 1 says no-object far
    away. Image 1 has no target and both its queries claim an object."""
    outputs = {
        "pred_logits": torch.tensor([[[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]),
        "pred_boxes": torch.tensor(
            [[[0.5, 0.5, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1]], [[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.2, 0.2]]]
        ),
    }
    targets = [
        {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.2]])},
        {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)},
    ]
    return outputs, targets


def test_each_loss_term_against_hand_computed_values():
    outputs, targets = _hand_case()
    criterion = SetCriterion(
        2,
        HungarianMatcher(1, 5, 2),
        {"loss_ce": 1, "loss_bbox": 5, "loss_giou": 2},
        0.1,
        ["labels", "boxes", "cardinality"],
    )
    losses = criterion(outputs, targets)
    # cross-entropy: image 0 query 0 -> class 1 (weight 1), every other query -> no-object (weight 0.1),
    # the weighted mean: sum of weight x CE over sum of weights
    ce_match = math.log(2 + math.exp(2)) - 2
    ce_empty = math.log(2 + math.exp(3)) - 3  # image 0, query 1
    ce_false = math.log(2 + math.e) - 0  # image 1, both queries: no-object's logit is 0
    expected_ce = (1 * ce_match + 0.1 * ce_empty + 0.1 * 2 * ce_false) / (1 + 0.1 + 0.2)
    assert float(losses["loss_ce"]) == pytest.approx(expected_ce, rel=1e-6)
    # boxes, over num_boxes = 1: L1 |0.2 - 0.4| on the width; predicted box x 0.4..0.6 inside the target's
    # 0.3..0.7, same height: IoU 0.5, the enclosing box is the target (= the union), so GIoU 0.5
    assert float(losses["loss_bbox"]) == pytest.approx(0.2, rel=1e-6)
    assert float(losses["loss_giou"]) == pytest.approx(0.5, rel=1e-6)
    # cardinality: image 0 predicts 1 object (1 true), image 1 predicts 2 (0 true): mean |error| 1
    assert float(losses["cardinality_error"]) == pytest.approx(1.0)
    assert float(losses["class_error"]) == pytest.approx(0.0)
    # the weighted total as the loop sums it: the error metrics carry no weight
    assert set(criterion.weight_dict) == set(detr.LOSS_TERMS)
    total = sum(losses[k] * w for k, w in criterion.weight_dict.items())
    assert float(total) == pytest.approx(expected_ce + 5 * 0.2 + 2 * 0.5, rel=1e-6)
    # eos_coef 1: the plain mean over all four queries
    plain = SetCriterion(2, HungarianMatcher(), {}, 1.0, ["labels"])(outputs, targets)
    assert float(plain["loss_ce"]) == pytest.approx((ce_match + ce_empty + 2 * ce_false) / 4, rel=1e-6)


def test_auxiliary_losses_for_every_decoder_layer_matched_on_their_own():
    outputs, targets = _hand_case()
    # aux layer 0: the final layer's predictions with the queries of image 0 swapped, so that its
    # own matching (query 1) gives the same losses as the final layer's
    swapped = {k: v.clone() for k, v in outputs.items() if k.startswith("pred")}
    swapped["pred_logits"][0] = swapped["pred_logits"][0].flip(0)
    swapped["pred_boxes"][0] = swapped["pred_boxes"][0].flip(0)
    outputs["aux_outputs"] = [swapped, {k: v.clone() for k, v in outputs.items() if k.startswith("pred")}]
    cfg = parse_config(detr.Config, ["--dec_layers", "3"])
    criterion = detr.create_criterion(cfg, 2)
    losses = criterion(outputs, targets)
    for i in (0, 1):
        for k in ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error"):
            assert float(losses[f"{k}_{i}"]) == pytest.approx(float(losses[k]), rel=1e-6), (k, i)
    assert set(criterion.weight_dict) == {f"{k}{s}" for k in detr.LOSS_TERMS for s in ("", "_0", "_1")}
    # and through the real model: one aux output per decoder layer but the last, each with a loss
    torch.manual_seed(0)
    model = detr.create_model(cfg, num_classes=10)
    out = model(torch.randn(2, 3, 64, 96), torch.zeros(2, 64, 96, dtype=torch.bool))
    assert out["pred_logits"].shape == (2, cfg.num_queries, 11) and out["pred_boxes"].shape == (2, cfg.num_queries, 4)
    boxes = out["pred_boxes"].detach()
    assert len(out["aux_outputs"]) == 2 and 0 < float(boxes.min()) and float(boxes.max()) < 1
    real = detr.create_criterion(cfg, 10)(
        {**out},
        [
            {"labels": torch.tensor([3, 4]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.2, 0.3, 0.1, 0.1]])},
            {"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)},
        ],
    )
    assert {"loss_ce_1", "loss_bbox_1", "loss_giou_1"} <= set(real) and "loss_ce_2" not in real
    sum(real[k] * w for k, w in criterion.weight_dict.items()).backward()
    assert all(p.grad is not None for p in model.parameters())  # every parameter takes part


def test_position_encoding_ignores_padding():
    """The encoding of an image's pixels does not change when the batch pads it (DETR normalises
    positions by the valid extent), and it is y then x, sine and cosine interleaved."""
    small = torch.zeros(1, 4, 6, dtype=torch.bool)
    padded = torch.ones(1, 7, 9, dtype=torch.bool)
    padded[:, :4, :6] = False
    a, b = sine_position_encoding(small, 16), sine_position_encoding(padded, 16)
    assert a.shape == (1, 4, 6, 16)
    assert torch.allclose(a, b[:, :4, :6], atol=1e-5)
    # the last valid column is at 2 pi; channel 8 (x, frequency 1) is its sine
    assert float(a[0, 0, -1, 8]) == pytest.approx(math.sin(2 * math.pi), abs=1e-4)
    assert float(a[0, 0, 2, 9]) == pytest.approx(math.cos(3 / 6 * 2 * math.pi), abs=1e-4)


def test_postprocess_round_trips_boxes_to_original_pixels():
    """Original pixels -> eval transform (resize) -> collate (padded batch, normalised cxcywh) ->
    postprocess with the original sizes -> the original boxes; scores and labels from the softmax
    without the no-object class."""
    from PIL import Image
    from torchvision import tv_tensors

    cfg = parse_config(detr.Config, [])
    transform = data_transforms(cfg, train=False)
    boxes = [[[4.0, 6.0, 30.0, 40.0], [50.0, 10.0, 79.0, 59.0]], [[10.0, 20.0, 60.0, 90.0]]]
    sizes = [(60, 80), (120, 70)]  # (h, w)
    batch = []
    for (h, w), b in zip(sizes, boxes):
        image = Image.new("RGB", (w, h))
        target = {
            "boxes": tv_tensors.BoundingBoxes(b, format="XYXY", canvas_size=(h, w)),
            "labels": torch.tensor([1] * len(b)),
        }
        out, t = transform(image, target)
        assert max(out.shape[-2:]) <= cfg.max_size
        t.update(image_id=0, orig_size=(h, w), dropped=0, size=tuple(out.shape[-2:]))
        batch.append((out, t))
    images, mask, targets = detr_collate(batch)
    assert images.shape[0] == 2 and mask.shape == (2, *images.shape[-2:])
    assert int((~mask[0]).sum()) == batch[0][0].shape[-1] * batch[0][0].shape[-2]  # True on padding only
    queries = 3
    pred = torch.full((2, queries, 4), 0.5)
    logits = torch.zeros(2, queries, 4)  # 3 classes + no-object
    for i, t in enumerate(targets):
        pred[i, : len(t["boxes"])] = t["boxes"]
        logits[i, : len(t["boxes"]), 2] = 5.0
    results = postprocess({"pred_logits": logits, "pred_boxes": pred}, torch.tensor(sizes))
    for r, b in zip(results, boxes):
        assert torch.allclose(r["boxes"][: len(b)], torch.tensor(b), atol=1e-3), (r["boxes"], b)
        assert r["labels"][: len(b)].tolist() == [2] * len(b)
        assert float(r["scores"][0]) == pytest.approx(math.exp(5) / (math.exp(5) + 3), rel=1e-5)
    # a query sure of no-object scores low: its best real class has p = 1 / (3 + e^5)
    results = postprocess(
        {"pred_logits": torch.tensor([[[0.0, 0.0, 0.0, 5.0]]]), "pred_boxes": torch.rand(1, 1, 4)},
        torch.tensor([[10, 10]]),
    )
    assert float(results[0]["scores"][0]) == pytest.approx(1 / (3 + math.exp(5)), rel=1e-5)


def test_box_crop_dataset_is_the_crops_set_normalised_and_shifts_reproducibly():
    """BoxCropDataset (the backbone pre-training data, for any detection set): every box once with its
    class; unshifted, a crop is digits_det_crops' image normalised as data_transforms does; shifted,
    the window moves by a draw fixed per (epoch, index); crowd regions are left out."""
    from torchvision.transforms.v2 import functional as TF

    from common.data.builtin import digits_det_crops_dataset
    from common.detection.data import IMAGENET_MEAN, IMAGENET_STD, load_detection
    from common.loaders import train_loader_for

    train = load_detection("digits_det").train
    crops = digits_det_crops_dataset()
    plain = BoxCropDataset(train, 32, 0.15)
    assert len(plain) == len(crops["train"]) and [plain.items[i][2] for i in range(50)] == crops["train"]["label"][:50]
    image, label = plain[3]
    expected = TF.to_dtype(TF.pil_to_tensor(crops["train"][3]["image"].convert("RGB")), torch.float32, scale=True)
    assert label == crops["train"][3]["label"] and image.shape == (3, 32, 32)
    assert torch.allclose(image, TF.normalize(expected, IMAGENET_MEAN, IMAGENET_STD))
    shifted = BoxCropDataset(train, 32, 0.15, shift=0.1, seed=0)
    assert torch.equal(shifted[(2, 3)][0], shifted[(2, 3)][0]) and not torch.equal(
        shifted[(2, 3)][0], shifted[(3, 3)][0]
    )
    assert not torch.equal(shifted[(2, 3)][0], image) and shifted[(2, 3)][1] == label
    # a KeyedDataset (common.loaders' contract): the training loader hands it (epoch, index), unwrapped
    assert train_loader_for(shifted, 4, 0, 0, 1).dataset is shifted
    crowd = train.select(range(2)).map(
        lambda row: {"objects": {**row["objects"], "iscrowd": [1] + row["objects"]["iscrowd"][1:]}}
    )
    assert len(BoxCropDataset(crowd)) == sum(len(o["bbox"]) for o in crowd["objects"]) - 2


# --------------------------------------------------------------------------------------------
# Through the entry point
# --------------------------------------------------------------------------------------------
# The default config cut to its first 100 steps (the lr schedule is the default's), after one epoch of
# backbone pre-training on 16 px box crops instead of six on 32 px ones: about 75 s on one CPU core.
# DETR's classes come late (Hungarian matching first has to settle which query takes which object),
# so held-out mAP after 100 steps is still ~0 and cannot carry a threshold; what the run must show is
# that the set loss drives the boxes: the matched L1 and GIoU losses fall well below their
# first-interval values (measured: L1 0.90 -> 0.27, 1 - GIoU 1.12 -> 0.82, total 27.5 -> 16.7 from steps
# 1-20 to 81-100; the pre-training's held-out top-1 91.9 %), on top of the held-out evaluation running
# end to end.
SHORT = [
    "--max_steps",
    "100",
    "--num_workers",
    "0",
    "--log_every",
    "20",
    "--plot_images",
    "2",
    "--pretrain_crops_epochs",
    "1",
    "--pretrain_crops_size",
    "16",
]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """The default config, shortened, through the real entry point (the README's command, offline)."""
    run = tmp_path_factory.mktemp("detr") / "run"
    proc = check(run_recipe("detr", ["--output_dir", str(run), "--report_to", "none", *SHORT], timeout=900))
    return run, proc


@pytest.mark.configs  # a demo trained to its threshold: the second tier (-m configs; CI runs it)
def test_run_writes_its_outputs(short_run):
    run, proc = short_run
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["max_steps"] == 100 and saved["model"] == detr.Config.model
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert train
    for k in ("loss_ce", "loss_bbox", "loss_giou", "loss_ce_0", "loss_giou_1", "class_error", "cardinality_error"):
        assert f"train/{k}" in train[-1], k
    weights = {f"loss_{k}": w for k, w in detr.Config().loss_weights.items()}
    for r in train:  # the logged total is the weighted sum of the logged terms, auxiliary ones included
        scaled = sum(weights[k] * r[f"train/{k}{s}"] for k in detr.LOSS_TERMS for s in ("", "_0", "_1"))
        assert r["train/loss"] == pytest.approx(scaled, rel=1e-4)
    assert_pictures(run / "plots", ["curves", "pr_curves", "confusion_matrix", "detections"])
    for name in ("best.safetensors", "final.safetensors"):
        meta = read_metadata(run / name)
        assert meta["recipe"] == "detr" and len(meta["classes"]) == 10
        model = detr.create_model(parse_config(detr.Config, []), 10)
        model.load_state_dict(safetensors.torch.load_file(str(run / name)))


@pytest.mark.configs  # a demo trained to its threshold: the second tier (-m configs; CI runs it)
def test_predictions_through_onnx_are_those_of_the_weights(short_run, tmp_path):
    """--export --weights best.safetensors (no data read) writes model.onnx for any batch and image size
    (images and padding mask in, boxes in each image's pixels out); --predict through it gives the
    safetensors' detections, boxes within 0.5 px and scores within 1e-3; the model folder is a --weights."""
    run, _ = short_run
    images = scene_files(tmp_path / "images")
    args = ["--data", "no/such-dataset", "--predict_score", "0.05"]
    export, eager, onnx = export_and_predict("detr", run / "best.safetensors", images, tmp_path, *args)
    assert (export / "model.onnx").is_file() and read_metadata(export / "model.onnx")["recipe"] == "detr"
    assert assert_same_detections(eager, onnx) >= 4
    detr.main(
        ["--predict", str(images), "--weights", str(run / "model"), "--output_dir", str(tmp_path / "folder"), *args]
    )
    assert (tmp_path / "folder" / "detections.json").read_text() == (eager / "detections.json").read_text()


@pytest.mark.configs  # a demo trained to its threshold: the second tier (-m configs; CI runs it)
def test_shortened_default_run_learns_the_builtin_scenes(short_run):
    run, _ = short_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    first, last = train[0], train[-1]
    assert last["train/loss_bbox"] < 0.5 * first["train/loss_bbox"], (first, last)
    assert last["train/loss_giou"] < 0.9 * first["train/loss_giou"], (first, last)
    assert last["train/loss"] < 0.7 * first["train/loss"], (first, last)
    final = [r for r in records if "eval/map_50" in r][-1]
    assert 0.0 <= final["eval/map_50"] <= 1.0 and final["step"] == 100, final


@pytest.mark.configs  # a demo trained to its threshold: the second tier (-m configs; CI runs it)
def test_backbone_pretraining_learns_the_box_classes_and_is_skipped_on_resume(short_run, tmp_path):
    """The pre-training stage ran before DETR and its held-out crop accuracy is far above chance (10 %
    for ten digits; one epoch on 16 px crops); resuming the finished run does not pre-train again
    (the checkpoint holds the weights) and ends with the same weights."""
    import shutil

    run, proc = short_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    pretrain = [r for r in records if "pretrain/top1" in r]
    assert len(pretrain) == 1 and pretrain[0]["step"] == 0 and records[0] == pretrain[0], records[:2]
    assert pretrain[0]["pretrain/top1"] > 40, pretrain
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    resumed = check(
        run_recipe("detr", ["--output_dir", str(copy), "--report_to", "none", *SHORT, "--resume", "auto"], timeout=600)
    )
    assert "backbone pre-training on box crops skipped: resuming" in resumed.stdout, resumed.stdout[-2000:]
    again = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in again if "pretrain/top1" in r] == pretrain
    before, after = (safetensors.torch.load_file(str(d / "final.safetensors")) for d in (run, copy))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_init_backbone_loads_a_classifiers_weights_and_refuses_a_mismatch(tmp_path):
    """A timm classifier's state dict (head and stage 4 included, as classifier.py saves it) fills
    DETR's features_only backbone exactly; a file of another width is one clear error."""
    import timm

    from common import UserError

    cfg = detr.Config()
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k != "output_stride"}
    classifier = timm.create_model(cfg.model, num_classes=10, **kwargs)
    path = tmp_path / "cls.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, str(path))
    model = detr.create_model(parse_config(detr.Config, ["--init_backbone", str(path)]), 10)
    own = model.backbone.state_dict()
    assert own and all(torch.equal(v, classifier.state_dict()[k]) for k, v in own.items())
    other = timm.create_model(cfg.model, num_classes=10)  # full width: every shape differs
    safetensors.torch.save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(path))
    with pytest.raises(UserError, match="does not fit the backbone"):
        detr.create_model(parse_config(detr.Config, ["--init_backbone", str(path)]), 10)
    with pytest.raises(UserError, match="does not exist"):
        detr.create_model(parse_config(detr.Config, ["--init_backbone", str(tmp_path / "none")]), 10)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--loss_weights", "{ce: 1, l1: 5}"], "loss_weights names non-negative weights of ce, bbox, giou"),
        (["--matcher_costs", "1,-1,1"], "matcher_costs must be 3 non-negative numbers"),
        (["--d_model", "100"], "must be a multiple of 4 and of nheads"),
        (["--crop_size", "96,64"], "crop_size must be"),
        (["--model", "no_such_net"], "unknown timm model 'no_such_net'"),
    ],
)
def test_bad_input_is_a_user_error(args, message):
    from common import UserError

    cfg = parse_config(detr.Config, args)
    with pytest.raises(UserError, match=message):
        detr.check_config(cfg)
        detr.create_model(cfg, 10)


def test_unknown_key_is_one_clear_line(tmp_path, capsys):
    line = error_line(
        capsys, detr.main, ["--output_dir", str(tmp_path / "run"), "--report_to", "none", "--num_querys", "8"]
    )
    assert "num_querys" in line and "num_queries" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.full
def test_default_config_reaches_map50_055_and_evaluates_alike_under_bf16(tmp_path):
    """The issue's target on the complete default run (6 epochs of backbone pre-training on the box
    crops, then 12 of DETR; about 9 minutes on 2 cores, so not in the default suite: ``python -m
    pytest -m full``): held-out mAP@0.5 of at least 0.55 (docs/detr.md lists the seeds measured).
    Then the trained weights through ``--eval_only``: in fp32 the run's own last numbers, and under
    bf16 autocast (boxes stay fp32) the same mAP within 0.01."""
    run = tmp_path / "run"
    check(run_recipe("detr", ["--output_dir", str(run), "--report_to", "none"], timeout=3600))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "pretrain/top1" in r][-1]["pretrain/top1"] > 95
    final = [r for r in records if "eval/map_50" in r][-1]
    assert final["eval/map_50"] >= 0.55, final
    evaluated = {}
    for precision in ("no", "bf16"):
        out = tmp_path / precision
        check(
            run_recipe(
                "detr",
                [
                    "--eval_only",
                    "--weights",
                    str(run / "final.safetensors"),
                    "--output_dir",
                    str(out),
                    "--mixed_precision",
                    precision,
                    "--report_to",
                    "none",
                ],
            )
        )
        lines = (out / "metrics.jsonl").read_text().splitlines()
        evaluated[precision] = [r for r in map(json.loads, lines) if "eval/map_50" in r][-1]
    for name in ("map", "map_50", "map_75"):
        assert evaluated["no"][f"eval/{name}"] == pytest.approx(final[f"eval/{name}"], abs=1e-9), name
        assert abs(evaluated["bf16"][f"eval/{name}"] - evaluated["no"][f"eval/{name}"]) <= 0.01, (name, evaluated)


def test_boxes_stay_fp32_under_bf16_autocast():
    """Evaluation and training run under autocast; the box head must not: a bf16 box coordinate is
    a multiple of 1/256 of the image (2-4 px on a COCO image), which costs mAP. The boxes under bf16
    autocast are those of the fp32 box head on the (bf16-computed) decoder output."""
    cfg = parse_config(detr.Config, [])
    torch.manual_seed(0)
    model = detr.create_model(cfg, num_classes=10).eval()
    hidden = []
    model.decoder_norm.register_forward_hook(lambda m, i, o: hidden.append(o))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(1, 3, 64, 96), torch.zeros(1, 64, 96, dtype=torch.bool))
    assert out["pred_logits"].dtype == torch.bfloat16  # the rest of the model does run in bf16
    assert out["pred_boxes"].dtype == torch.float32
    assert all(a["pred_boxes"].dtype == torch.float32 for a in out["aux_outputs"])
    with torch.no_grad():
        expected = model.bbox_embed(hidden[-1].float()).sigmoid()
    assert torch.equal(out["pred_boxes"], expected)  # [1, Q, 4]: the last decoder layer's boxes


def test_max_steps_caps_the_backbone_pretraining_and_its_errors_name_its_flag(tmp_path, monkeypatch, capsys):
    """--max_steps 3 is a smoke test: the crop pre-training takes 3 steps as well (it took minutes), and
    a crop batch larger than the boxes names --pretrain_crops_batch_size, not --batch_size."""
    steps = []
    forward = CropClassifier.forward

    def counted(self, images):
        if self.training:
            steps.append(len(images))
        return forward(self, images)

    monkeypatch.setattr(CropClassifier, "forward", counted)
    args = ["--report_to", "none", "--num_workers", "0", "--plot_images", "0"]
    detr.main(args + ["--max_steps", "3", "--best_metric", "map", "--output_dir", str(tmp_path / "run")])
    assert len(steps) == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["pretrain/epoch"] for r in records if "pretrain/loss" in r] == [0]
    assert max(r["step"] for r in records) == 3
    # --best_metric map: best.safetensors follows mAP@[.5:.95]
    final = [r for r in records if "eval/map" in r][-1]
    assert final["best/map"] == final["eval/map"] and "best/map_50" not in final
    assert (tmp_path / "run" / "best.safetensors").is_file()
    line = error_line(
        capsys, detr.main, args + ["--pretrain_crops_batch_size", "100000", "--output_dir", str(tmp_path / "big")]
    )
    assert "boxes to pre-train the backbone on" in line and "lower --pretrain_crops_batch_size" in line
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_positions_costs_and_detections_are_fp32_under_autocast(dtype):
    """Inside autocast, with the model's outputs in bf16 or fp16 as autocast hands them over: the sine
    position encoding of an 800x1216 image's stride-32 map (padded at the right and bottom), the Hungarian
    matcher's costs (and so its pairs) and the detections in pixels equal their fp32 values on the same
    outputs (a bf16 box corner near 1216 px is a multiple of 8 px; a bf16 cost is rounded at 1/128 of it)."""
    mask = torch.zeros(2, 25, 38, dtype=torch.bool)
    mask[1, 20:], mask[1, :, 30:] = True, True
    g = torch.Generator().manual_seed(0)
    outputs = {"pred_logits": torch.randn(2, 100, 6, generator=g), "pred_boxes": torch.rand(2, 100, 4, generator=g)}
    outputs["pred_boxes"] = outputs["pred_boxes"] * 0.5 + 0.25  # cx, cy, w, h: inside the image
    low = {k: v.to(dtype) for k, v in outputs.items()}
    wide = {k: v.float() for k, v in low.items()}  # the same values in fp32
    targets = [
        {"labels": torch.randint(0, 5, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25}
        for n in (7, 3)
    ]
    matcher, sizes = HungarianMatcher(1.0, 5.0, 2.0), torch.tensor([[800, 1216], [640, 960]])
    want = (sine_position_encoding(mask, 256), matcher.cost(wide, targets), *detections(wide, sizes))
    want_pairs = matcher(wide, targets)
    with torch.autocast("cpu", dtype=dtype):
        got = (sine_position_encoding(mask, 256), matcher.cost(low, targets), *detections(low, sizes))
        pairs = matcher(low, targets)
    for name, a, b in zip(["positions", "costs", "boxes", "scores", "labels"], got, want):
        assert a.dtype == b.dtype and a.dtype in (torch.float32, torch.int64), name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=name)
    assert float(want[2].max()) > 1000  # boxes in the pixels of the 1216 px wide image
    assert all(torch.equal(a, b) for p, q in zip(pairs, want_pairs) for a, b in zip(p, q))


# the processes each shipped config's header writes it for (its batch_size and grad_accum_steps are in the file)
PROCESSES = {
    "coco_r50": 16,
    "cppe5": 8,
    "digits_det": 1,
    "digits_det_dino": 1,
    "digits_det_pretrained": 1,
    "own_photos": 1,
}


def test_each_config_peaks_at_its_lr_on_the_machine_it_is_written_for():
    """lr (and lr_backbone, by the same factor) is the peak for lr_batch images: on the machine a config's
    header names, the run peaks at lr as written; another global batch by the square root of the ratio."""
    from conftest import ROOT

    folder = ROOT / "configs" / "detr"
    assert set(PROCESSES) == {p.stem for p in folder.glob("*.yaml")}
    for name, processes in PROCESSES.items():
        cfg = parse_config(detr.Config, ["--config", str(folder / f"{name}.yaml")])
        assert cfg.peak_lr(processes) == cfg.lr and cfg.lr_scale == "sqrt", name
    cfg = parse_config(detr.Config, ["--batch_size", "4"])  # a quarter of the demo's batch: half its peak
    assert cfg.peak_lr(1) == pytest.approx(cfg.lr / 2)


def test_the_sine_positions_reach_the_encoder_and_decoder_in_fp32_under_bf16():
    """Geometry stays fp32 under autocast: the positions each encoder and decoder layer gets are the fp32 sine
    encoding itself, not a bf16 rounding of it, and the model still runs (its logits in bf16)."""
    cfg = parse_config(detr.Config, [])
    torch.manual_seed(0)
    model = detr.create_model(cfg, num_classes=10).eval()
    seen = []
    for layer in [*model.encoder, *model.decoder]:
        position = 1 if layer in list(model.encoder) else 2  # encoder (src, pos, ...), decoder (tgt, memory, pos, ...)
        layer.register_forward_pre_hook(lambda m, args, i=position: seen.append(args[i]))
    mask = torch.zeros(1, 64, 96, dtype=torch.bool)
    mask[:, :, 80:] = True  # a padded image: positions count valid pixels only
    images = torch.randn(1, 3, 64, 96)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images, mask)
        side = model.backbone(images)[-1].shape[-2:]
    assert out["pred_logits"].dtype == torch.bfloat16
    feature_mask = torch.nn.functional.interpolate(mask[:, None].float(), size=side).bool()[:, 0]
    expected = sine_position_encoding(feature_mask, cfg.d_model).flatten(1, 2)
    assert len(seen) == len(model.encoder) + len(model.decoder)
    assert all(p.dtype == torch.float32 and torch.equal(p, expected) for p in seen)
