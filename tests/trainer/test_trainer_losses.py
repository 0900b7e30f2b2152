"""BudgetDraft losses against naive per-position references on seeded toy logits, masking included."""

import math

import pytest
import torch

from hf_budgetdraft.trainer import losses

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, V = 3, 7, 11
PREFIX = 3  # positions [PREFIX, T) are the continuation


def _toy(seed=0):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=generator) * 2
    teacher = torch.randn(B, T, V, generator=generator) * 2
    labels = teacher.argmax(-1)
    return student, teacher, labels


def _counted(mask, labels=None):
    """(b, t) pairs that count, the naive way."""
    for b in range(B):
        for t in range(T):
            if mask[b, t] and (labels is None or labels[b, t] != losses.IGNORE_INDEX):
                yield b, t


def _mean(values):
    return torch.tensor(sum(values) / len(values), dtype=torch.float32)


def _naive_ce(student, labels, mask):
    out = []
    for b, t in _counted(mask, labels):
        logits = student[b, t].tolist()
        log_z = math.log(sum(math.exp(x) for x in logits))
        out.append(log_z - logits[labels[b, t]])
    return _mean(out)


def _softmax(row, temperature=1.0):
    exps = [math.exp(x / temperature) for x in row.tolist()]
    return [e / sum(exps) for e in exps]


def _naive_tv(student, teacher_probs, mask, temperature=1.0):
    out = []
    for b, t in _counted(mask):
        q, p = _softmax(student[b, t], temperature), teacher_probs[b, t].tolist()
        out.append(0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q, strict=True)))
    return _mean(out)


def _naive_kl(student, teacher_probs, mask, temperature=1.0):
    out = []
    for b, t in _counted(mask):
        q, p = _softmax(student[b, t], temperature), teacher_probs[b, t].tolist()
        out.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0))
    return _mean(out)


def _masks():
    row_mask = losses.continuation_mask(T, PREFIX)  # (T,)
    ragged = row_mask.expand(B, T).clone()
    ragged[1, -2:] = False  # e.g. padding at the end of one row
    return {"row": row_mask, "ragged": ragged}


def test_continuation_mask():
    assert losses.continuation_mask(5, 2).tolist() == [False, False, True, True, True]
    with pytest.raises(ValueError, match="prefix_length"):
        losses.continuation_mask(5, 6)


@pytest.mark.parametrize("mask_name", ["row", "ragged"])
def test_hard_loss_matches_naive(mask_name):
    student, _, labels = _toy()
    mask = _masks()[mask_name]
    full_mask = mask.expand(B, T)
    got = losses.hard_distillation_loss(student, labels, mask)
    torch.testing.assert_close(got, _naive_ce(student, labels, full_mask), rtol=1e-5, atol=1e-5)


def test_hard_loss_ignores_ignore_index_and_masked_logits():
    student, _, labels = _toy(1)
    labels[0, 4] = losses.IGNORE_INDEX
    mask = losses.continuation_mask(T, PREFIX)
    expected = _naive_ce(student, labels, mask.expand(B, T))
    student = student.clone().requires_grad_(True)
    got = losses.hard_distillation_loss(student, labels, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.backward()
    assert student.grad[:, :PREFIX].abs().sum() == 0, "prefix positions must not receive gradient"
    assert student.grad[0, 4].abs().sum() == 0, "an IGNORE_INDEX position must not receive gradient"
    assert student.grad[:, PREFIX:].abs().sum() > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mask_name", ["row", "ragged"])
def test_soft_losses_match_naive(mask_name, temperature):
    student, teacher, _ = _toy(2)
    mask = _masks()[mask_name]
    full_mask = mask.expand(B, T)
    probs = losses.teacher_probs_from_logits(teacher, temperature)
    torch.testing.assert_close(probs, teacher.div(temperature).softmax(-1))
    tv = _naive_tv(student, probs, full_mask, temperature)
    kl = _naive_kl(student, probs, full_mask, temperature)
    kw = dict(mask=mask, temperature=temperature)
    torch.testing.assert_close(losses.total_variation_loss(student, probs, **kw), tv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.kl_distillation_loss(student, probs, **kw), kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        losses.soft_distillation_loss(student, probs, kind="tv", **kw), tv, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        losses.soft_distillation_loss(student, probs, kind="kl", **kw), kl, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        losses.soft_distillation_loss(student, probs, kind="tv_kl", **kw), tv + kl, rtol=1e-5, atol=1e-6
    )


def test_acceptance_is_sum_of_min_and_one_minus_tv():
    student, teacher, labels = _toy(3)
    probs = losses.teacher_probs_from_logits(teacher)
    mask = losses.continuation_mask(T, PREFIX)
    naive = _mean(
        [
            sum(min(p, q) for p, q in zip(probs[b, t].tolist(), _softmax(student[b, t]), strict=True))
            for b, t in _counted(mask.expand(B, T))
        ]
    )
    torch.testing.assert_close(losses.expected_acceptance(student, probs, mask), naive, rtol=1e-5, atol=1e-6)
    # identical distributions: TV 0, acceptance 1, KL 0
    same = losses.teacher_probs_from_logits(student)
    assert losses.total_variation_loss(student, same).item() == pytest.approx(0, abs=1e-6)
    assert losses.kl_distillation_loss(student, same).item() == pytest.approx(0, abs=1e-5)


def test_kl_handles_zero_teacher_mass_and_topk_reconstruction():
    student, teacher, _ = _toy(4)
    logprobs, ids = teacher.log_softmax(-1).topk(3, dim=-1)  # (B, T, 3)
    probs = losses.teacher_probs_from_topk(ids, logprobs, V)
    assert probs.shape == (B, T, V)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, T))
    assert (probs > 0).sum(-1).eq(3).all()
    naive = teacher.gather(-1, ids).softmax(-1)  # renormalised over the kept 3
    torch.testing.assert_close(probs.gather(-1, ids), naive)
    mask = losses.continuation_mask(T, PREFIX)
    got = losses.kl_distillation_loss(student, probs, mask)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, _naive_kl(student, probs, mask.expand(B, T)), rtol=1e-5, atol=1e-6)


def test_agreement_matches_naive():
    student, _, labels = _toy(5)
    labels[:, -1] = student[:, -1].argmax(-1)  # some guaranteed hits
    mask = _masks()["ragged"]
    naive = _mean([float(student[b, t].argmax() == labels[b, t]) for b, t in _counted(mask)])
    torch.testing.assert_close(losses.greedy_agreement(student, labels, mask), naive)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_hard_plus_soft_is_the_sum_of_both_naive_losses(temperature):
    student, teacher, labels = _toy(4)
    mask = _masks()["ragged"]
    full_mask = mask.expand(B, T)
    probs = losses.teacher_probs_from_logits(teacher, temperature)
    ce, tv = _naive_ce(student, labels, full_mask), _naive_tv(student, probs, full_mask, temperature)
    both = losses.distillation_loss(student, labels, probs, "hard+soft", "tv", temperature, mask)
    torch.testing.assert_close(both, ce + tv, rtol=1e-5, atol=1e-6)
    hard = losses.distillation_loss(student, labels, None, "hard", mask=mask)
    torch.testing.assert_close(hard, ce, rtol=1e-5, atol=1e-6)
    soft = losses.distillation_loss(student, labels, probs, "soft", "tv", temperature, mask)
    torch.testing.assert_close(soft, tv, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs the teacher's probabilities"):
        losses.distillation_loss(student, labels, None, "hard+soft")
    with pytest.raises(ValueError, match="loss must be one of"):
        losses.distillation_loss(student, labels, probs, "both")


def test_total_loss_combines_full_and_mean_of_views():
    full = torch.tensor(2.0)
    views = [torch.tensor(1.0), torch.tensor(3.0)]
    assert losses.budgetdraft_loss(full, views, 0.5).item() == pytest.approx(2.0 + 0.5 * 2.0)
    assert losses.budgetdraft_loss(full, [], 0.5).item() == 2.0


def test_loss_errors():
    student, teacher, labels = _toy()
    with pytest.raises(ValueError, match="slice both to the continuation"):
        losses.hard_distillation_loss(student, labels[:, 1:])
    with pytest.raises(ValueError, match="mask has shape"):
        losses.hard_distillation_loss(student, labels, torch.ones(B, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="soft loss kind"):
        losses.soft_distillation_loss(student, teacher.softmax(-1), kind="js")
    with pytest.raises(ValueError, match="temperature"):
        losses.total_variation_loss(student, teacher.softmax(-1), temperature=0)
