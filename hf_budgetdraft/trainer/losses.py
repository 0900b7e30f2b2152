"""BudgetDraft losses: pure functions of drafter logits and teacher targets, over continuation positions only.

BudgetDraft, arXiv 2606.00144, §3.2: L = L_A + λ·L_C. L_A is computed on the drafter's full-cache logits, L_C on
the logits of sparse views of the same continuation; both are the same per-token loss against the frozen target:

- `"hard"`: cross-entropy to the target's greedy (argmax) next token, which is what a greedy verifier accepts
  (the paper's loss);
- `"soft"`: a divergence to the target's next-token distribution, for a *sampling* verifier. Speculative
  sampling accepts a draft token with expected probability `sum_x min(p(x), q(x)) = 1 - TV(p, q)`
  (Leviathan et al., arXiv 2211.17192, §3.5), so `"tv"` minimises exactly one minus the acceptance; `"kl"`
  (forward KL(p || q)) is a smooth surrogate that bounds it (Pinsker: TV <= sqrt(KL / 2)); `"tv_kl"` adds both;
- `"hard+soft"`: their sum (`distillation_loss`), for one drafter that serves greedy and sampling calls: the hard
  term sharpens the argmax a greedy verifier checks, the soft one keeps the distribution a sampler checks.

Shapes: logits `(B, T, V)`; labels and masks `(B, T)`; teacher probabilities `(B, T, V)`. A position counts when
its `mask` entry is True and, for hard labels, its label is not `IGNORE_INDEX`. Every loss is the mean over the
counted positions of the whole batch (a token-level mean), computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
LOSSES = ("hard", "soft", "hard+soft")
SOFT_LOSSES = ("tv", "kl", "tv_kl")


def continuation_mask(
    sequence_length: int, prefix_length: int, device: torch.device | str | None = None
) -> torch.BoolTensor:
    """`(T,)` True at the continuation positions `[prefix_length, T)` of a `T`-token row.

    The logits at position `t` predict token `t + 1`; the continuation positions are those the drafter reads as
    its own block after the prefix, which is where a deployed draft produces its proposals.
    """
    if not 0 <= prefix_length <= sequence_length:
        raise ValueError(f"prefix_length must be in [0, {sequence_length}], got {prefix_length}")
    return torch.arange(sequence_length, device=device) >= prefix_length


def _positions(shape: torch.Size, mask: torch.Tensor | None, device: torch.device) -> torch.BoolTensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    mask = mask.to(device=device, dtype=torch.bool)
    if mask.dim() == 1:  # one mask for every row, e.g. `continuation_mask`
        mask = mask.expand(shape)
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (batch, positions)")
    return mask


def _masked_mean(values: torch.Tensor, positions: torch.BoolTensor) -> torch.Tensor:
    """Mean of `values (B, T)` over `positions`; 0 (with a gradient path) when no position counts."""
    count = positions.sum()
    return (values * positions).sum() / count.clamp(min=1)


def _check_logits(student_logits: torch.Tensor, other: torch.Tensor, what: str) -> None:
    if student_logits.dim() != 3:
        raise ValueError(
            f"student_logits must be (batch, positions, vocab), got {tuple(student_logits.shape)}"
        )
    if other.shape[:2] != student_logits.shape[:2]:
        raise ValueError(
            f"{what} covers {tuple(other.shape[:2])} (batch, positions) but student_logits covers "
            f"{tuple(student_logits.shape[:2])}; slice both to the continuation positions"
        )


def hard_distillation_loss(
    student_logits: torch.Tensor, teacher_labels: torch.LongTensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the drafter to the target's greedy tokens (BudgetDraft's L_A / L_C).

    Args:
        student_logits (`torch.Tensor` of shape `(B, T, V)`): drafter logits.
        teacher_labels (`torch.LongTensor` of shape `(B, T)`): the target's argmax next token at each position;
            `IGNORE_INDEX` (-100) skips a position.
        mask (`torch.Tensor` of shape `(B, T)` or `(T,)`, *optional*): positions that count (continuation).

    Returns:
        `torch.Tensor`: scalar, mean over the counted positions.
    """
    _check_logits(student_logits, teacher_labels, "teacher_labels")
    positions = _positions(teacher_labels.shape, mask, student_logits.device) & (
        teacher_labels != IGNORE_INDEX
    )
    safe_labels = teacher_labels.clamp(min=0)
    nll = F.cross_entropy(student_logits.float().transpose(1, 2), safe_labels, reduction="none")  # (B, T)
    return _masked_mean(nll, positions)


def teacher_probs_from_logits(teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`(B, T, V)` target probabilities at sampling `temperature`."""
    return (teacher_logits.float() / temperature).softmax(dim=-1)


def teacher_probs_from_topk(
    topk_ids: torch.LongTensor, topk_logprobs: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Dense `(B, T, V)` probabilities from precomputed top-k `(B, T, k)` ids/log-probs, renormalised over the k.

    The precomputed-teacher path stores only the top k tokens per position (the teacher is the expensive part and a
    full distribution per position does not fit on disk); the soft loss then targets the truncated distribution.
    """
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"top-k ids {tuple(topk_ids.shape)} and log-probs {tuple(topk_logprobs.shape)} differ"
        )
    probs = topk_logprobs.float().softmax(dim=-1)  # renormalise the kept mass to 1
    dense = probs.new_zeros(*topk_ids.shape[:2], vocab_size)
    return dense.scatter_(-1, topk_ids, probs)


def _student_log_probs(student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a soft loss, got {temperature}")
    return F.log_softmax(student_logits.float() / temperature, dim=-1)


def total_variation_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean total-variation distance `0.5 * sum_x |p(x) - q(x)|` = one minus the expected sampling acceptance.

    Args:
        student_logits (`torch.Tensor` of shape `(B, T, V)`): drafter logits (divided by `temperature`).
        teacher_probs (`torch.Tensor` of shape `(B, T, V)`): target probabilities at the same temperature.
        mask (`torch.Tensor` of shape `(B, T)` or `(T,)`, *optional*): positions that count.
        temperature (`float`, defaults to 1.0): the sampling temperature the drafter will be used at.
    """
    _check_logits(student_logits, teacher_probs, "teacher_probs")
    q = _student_log_probs(student_logits, temperature).exp()
    tv = 0.5 * (q - teacher_probs.float()).abs().sum(dim=-1)  # (B, T)
    return _masked_mean(tv, _positions(tv.shape, mask, tv.device))


def kl_distillation_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean forward KL(p_target || q_drafter) = `sum_x p(x) (log p(x) - log q(x))`, with `0 log 0 = 0`.

    Args: as `total_variation_loss`.
    """
    _check_logits(student_logits, teacher_probs, "teacher_probs")
    log_q = _student_log_probs(student_logits, temperature)
    p = teacher_probs.float()
    log_p = torch.where(p > 0, p.clamp(min=torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p))
    kl = (p * (log_p - log_q)).sum(dim=-1)  # (B, T)
    return _masked_mean(kl, _positions(kl.shape, mask, kl.device))


def soft_distillation_loss(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    kind: str = "tv",
    temperature: float = 1.0,
) -> torch.Tensor:
    """The soft (sampling-acceptance) loss named by `kind`: `"tv"`, `"kl"` or `"tv_kl"` (their sum)."""
    if kind == "tv":
        return total_variation_loss(student_logits, teacher_probs, mask, temperature)
    if kind == "kl":
        return kl_distillation_loss(student_logits, teacher_probs, mask, temperature)
    if kind == "tv_kl":
        return total_variation_loss(student_logits, teacher_probs, mask, temperature) + kl_distillation_loss(
            student_logits, teacher_probs, mask, temperature
        )
    raise ValueError(f"soft loss kind must be one of {SOFT_LOSSES}, got {kind!r}")


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_labels: torch.LongTensor,
    teacher_probs: torch.Tensor | None,
    loss: str = "hard",
    soft_kind: str = "tv",
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-branch loss named by `loss` (one of `LOSSES`): hard, soft (`soft_kind`), or their sum."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    terms = []
    if loss in ("hard", "hard+soft"):
        terms.append(hard_distillation_loss(student_logits, teacher_labels, mask))
    if loss in ("soft", "hard+soft"):
        if teacher_probs is None:
            raise ValueError(f"loss={loss!r} needs the teacher's probabilities, got None")
        terms.append(soft_distillation_loss(student_logits, teacher_probs, mask, soft_kind, temperature))
    return sum(terms[1:], terms[0])


@torch.no_grad()
def greedy_agreement(
    student_logits: torch.Tensor, teacher_labels: torch.LongTensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Fraction of counted positions where the drafter's argmax equals the target's greedy token (a greedy
    verifier's per-token acceptance when the drafter's previous tokens were accepted)."""
    _check_logits(student_logits, teacher_labels, "teacher_labels")
    positions = _positions(teacher_labels.shape, mask, student_logits.device) & (
        teacher_labels != IGNORE_INDEX
    )
    hits = (student_logits.argmax(dim=-1) == teacher_labels).float()
    return _masked_mean(hits, positions)


@torch.no_grad()
def expected_acceptance(
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean `sum_x min(p(x), q(x))`: a sampling verifier's per-token acceptance probability."""
    return 1.0 - total_variation_loss(student_logits, teacher_probs, mask, temperature)


def budgetdraft_loss(
    full_cache_loss: torch.Tensor, view_losses: list[torch.Tensor], sparse_loss_weight: float
) -> torch.Tensor:
    """L = L_A + λ·L_C, with L_C the mean of the sparse views' losses (0 views: L = L_A)."""
    if not view_losses:
        return full_cache_loss
    return full_cache_loss + sparse_loss_weight * torch.stack(view_losses).mean()
