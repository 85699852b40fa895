"""Properties of DINO's loss (recipes/dino.py's DINOLoss) on many seeded random cases: each test is named for the
rule it pins, so that a copier who changes a rule (KoLeo beside it, another centring) sees which one broke.
tests/test_dino.py checks one case against a hand computation.

The rule: the teacher's outputs of the 2 global crops, centred (minus an EMA of the teacher's batch means) and
sharpened (divided by the teacher temperature), softmaxed, are the targets of the student's log-softmax (at the
student temperature) of every crop of another view; the loss is the mean over those pairs of the mean over
images of the cross-entropy; no gradient reaches the teacher; then the centre moves by EMA with
``center_momentum``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import load_recipe

dino = load_recipe("dino")

CASES = 60


def _case(gen: torch.Generator) -> dict:
    """A random configuration and outputs: ncrops 2..6 crops of B images, K prototypes, crop-major rows."""
    ncrops, b, k = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((2, 7), (1, 6), (2, 33)))
    return {
        "ncrops": ncrops,
        "b": b,
        "k": k,
        "student_temp": float(torch.rand((), generator=gen)) * 0.2 + 0.05,
        "teacher_temp": float(torch.rand((), generator=gen)) * 0.06 + 0.02,
        "momentum": float(torch.rand((), generator=gen)) * 0.99,
        "center": torch.randn(1, k, generator=gen) * 0.05,
        "student": torch.randn(ncrops * b, k, generator=gen) * 0.5,  # logits of a few units at the temperatures
        "teacher": torch.randn(2 * b, k, generator=gen) * 0.05,  # centred / temperature: targets not one-hot
    }


def _loss_fn(c: dict, center: torch.Tensor | None = None, teacher_temp: float | None = None):
    temp = c["teacher_temp"] if teacher_temp is None else teacher_temp
    fn = dino.DINOLoss(c["k"], c["ncrops"], temp, temp, 0, 4, c["student_temp"], c["momentum"])
    fn.center.copy_(c["center"] if center is None else center)
    return fn


def _expected(c: dict, center: torch.Tensor) -> float:
    """The rule written out: mean over (teacher view t, student crop s != t) of the mean over images of
    -sum softmax((teacher - centre) / teacher_temp) log_softmax(student / student_temp)."""
    b = c["b"]
    q = ((c["teacher"].double() - center.double()) / c["teacher_temp"]).softmax(-1)
    logp = (c["student"].double() / c["student_temp"]).log_softmax(-1)
    terms = [
        -(q[t * b : (t + 1) * b] * logp[s * b : (s + 1) * b]).sum(-1).mean()
        for t in range(2)
        for s in range(c["ncrops"])
        if s != t
    ]
    assert len(terms) == 2 * (c["ncrops"] - 1)
    return float(sum(terms) / len(terms))


def test_dino_loss_is_the_mean_cross_entropy_over_pairs_of_different_views():
    """On random crop counts, batch sizes, widths, temperatures and centres the loss is the rule's value: every
    (teacher global view, student crop of another view) pair, 2 x (ncrops - 1) of them, weighted alike."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(CASES):
        c = _case(gen)
        got = float(_loss_fn(c)(c["student"], c["teacher"], 0))
        assert got == pytest.approx(_expected(c, c["center"]), rel=1e-4), {k: c[k] for k in ("ncrops", "b", "k")}


def test_dino_loss_never_compares_a_view_with_itself():
    """The student's global crop v learns only from the teacher's other global view: changing the teacher's view v
    changes nothing in the gradient at the student's crop v, and changes the gradient at every other crop."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(CASES):
        c = _case(gen)
        b = c["b"]
        for v in (0, 1):
            other = c["teacher"].clone()
            other[v * b : (v + 1) * b] = torch.randn(b, c["k"], generator=gen) * 0.05
            grads = []
            for teacher in (c["teacher"], other):
                student = c["student"].clone().requires_grad_()
                _loss_fn(c)(student, teacher, 0).backward()
                grads.append(student.grad.view(c["ncrops"], b, -1))
            scale = float(grads[0].abs().max())
            assert (grads[0][v] - grads[1][v]).abs().max() <= 1e-6 * scale, v
            for s in range(c["ncrops"]):
                if s != v:
                    assert (grads[0][s] - grads[1][s]).abs().max() > 1e-3 * scale, (v, s)


def test_dino_centre_is_an_ema_of_the_teacher_batch_means_with_the_configured_momentum():
    """After each call the centre is momentum x centre + (1 - momentum) x the mean of the raw teacher outputs of
    the batch, and each call's loss is centred with the centre from before that call."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(CASES // 3):
        c = _case(gen)
        fn = _loss_fn(c)
        center = c["center"].clone()
        for _ in range(4):
            c["teacher"] = (
                torch.randn(2 * c["b"], c["k"], generator=gen) * 0.05 + torch.randn(c["k"], generator=gen) * 0.1
            )
            got = float(fn(c["student"], c["teacher"], 0))
            assert got == pytest.approx(_expected(c, center), rel=1e-4)
            center = c["momentum"] * center + (1 - c["momentum"]) * c["teacher"].mean(0, keepdim=True)
            assert torch.allclose(fn.center, center, atol=1e-5)


def test_dino_teacher_is_centred_then_sharpened_by_the_teacher_temperature():
    """The teacher's targets depend on (teacher - centre) / teacher_temp only: a centre c equals raw outputs
    shifted by -c with no centre, and halving the temperature equals doubling the centred outputs."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(CASES):
        c = _case(gen)
        zero = torch.zeros(1, c["k"])
        centred = float(_loss_fn(c)(c["student"], c["teacher"], 0))
        shifted = float(_loss_fn(c, center=zero)(c["student"], c["teacher"] - c["center"], 0))
        assert centred == pytest.approx(shifted, rel=1e-4)
        sharper = float(_loss_fn(c, center=zero, teacher_temp=c["teacher_temp"] / 2)(c["student"], c["teacher"], 0))
        scaled = float(_loss_fn(c, center=zero)(c["student"], 2 * c["teacher"], 0))
        assert sharper == pytest.approx(scaled, rel=1e-4)


def test_dino_loss_is_minimal_when_every_student_crop_predicts_the_teachers_target():
    """With both teacher views of an image alike, a student whose every crop's softmax (at the student
    temperature) is the teacher's target q has loss = mean entropy of q, zero gradient, and any change raises it."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(CASES):
        c = _case(gen)
        b, k = c["b"], c["k"]
        per_image = torch.randn(b, k, generator=gen) * 0.05
        c["teacher"] = per_image.repeat(2, 1)
        q = ((per_image - c["center"]) / c["teacher_temp"]).softmax(-1).double()
        logits = q.clamp(min=1e-30).log().float() * c["student_temp"] + torch.randn(
            b, 1, generator=gen
        )  # any per-row shift
        student = logits.repeat(c["ncrops"], 1).requires_grad_()
        loss = _loss_fn(c)(student, c["teacher"], 0)
        entropy = float(-(q * q.clamp(min=1e-300).log()).sum(-1).mean())
        assert float(loss.detach()) == pytest.approx(entropy, rel=1e-3, abs=1e-4)
        loss.backward()
        assert student.grad.abs().max() < 1e-4
        moved = student.detach() + torch.randn(student.shape, generator=gen) * 0.05
        assert float(_loss_fn(c)(moved, c["teacher"], 0)) > float(loss.detach())


def test_dino_loss_does_not_depend_on_the_order_of_images():
    """The same permutation of the images in every crop leaves the loss and the centre unchanged."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(CASES):
        c = _case(gen)
        b = c["b"]
        perm = torch.randperm(b, generator=gen)
        rows_s = torch.cat([perm + v * b for v in range(c["ncrops"])])
        rows_t = torch.cat([perm, perm + b])
        a, p = _loss_fn(c), _loss_fn(c)
        la, lp = float(a(c["student"], c["teacher"], 0)), float(p(c["student"][rows_s], c["teacher"][rows_t], 0))
        assert la == pytest.approx(lp, rel=1e-5)
        assert torch.allclose(a.center, p.center, atol=1e-6)


def test_dino_loss_sends_no_gradient_to_the_teacher():
    """The teacher's outputs are targets only: backward reaches the student's outputs and never the teacher's."""
    gen = torch.Generator().manual_seed(6)
    for _ in range(CASES // 3):
        c = _case(gen)
        student, teacher = c["student"].clone().requires_grad_(), c["teacher"].clone().requires_grad_()
        _loss_fn(c)(student, teacher, 0).backward()
        assert teacher.grad is None or not teacher.grad.any()
        assert student.grad is not None and student.grad.abs().sum() > 0


def test_dino_epoch_picks_its_teacher_temperature_from_the_warmup_schedule():
    """At epoch e the teacher temperature is the schedule's e-th (linear warmup, then constant), and epochs past
    the schedule keep its last value."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(CASES // 3):
        c = _case(gen)
        warm, epochs = int(torch.randint(1, 5, (1,), generator=gen)), 6
        start, end = 0.02, c["teacher_temp"] + 0.02
        fn = dino.DINOLoss(c["k"], c["ncrops"], start, end, warm, epochs, c["student_temp"], c["momentum"])
        warmup = [start + (end - start) * e / (warm - 1) if warm > 1 else start for e in range(warm)]  # np.linspace
        temps = warmup + [end] * (epochs - warm)
        for epoch in (0, warm - 1, warm, epochs - 1, epochs + 3):
            fn.center.copy_(c["center"])
            expected = _expected({**c, "teacher_temp": temps[min(epoch, epochs - 1)]}, c["center"])
            assert float(fn(c["student"], c["teacher"], epoch)) == pytest.approx(expected, rel=1e-4), epoch
