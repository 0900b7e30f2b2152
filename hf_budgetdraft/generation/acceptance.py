"""Which drafted tokens a verification keeps, for every row of a batch at once.

Greedy: a row keeps its drafts up to the first one the target's argmax disagrees with, then the target's own token.
Sampling: speculative sampling (Leviathan et al., arXiv 2211.17192, Algorithm 1) per row: draft token k is kept with
probability `min(1, p_k(x) / q_k(x))`; the first rejected position is resampled from `norm(max(0, p - q))`, and a
row whose drafts were all kept draws its next token from `p`. Either way each row's output follows the target
exactly (greedy: its argmax; sampling: its distribution).
"""

from __future__ import annotations

import torch


def greedy_kept(drafts: torch.Tensor, choice: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """`(B,)` drafts kept per row: `drafts (B, γ)` up to the first that differs from the target's argmax `choice
    (B, γ + 1)`, at most `limits (B,)`."""
    agree = drafts == choice[:, : drafts.shape[1]]
    return torch.minimum(agree.long().cumprod(-1).sum(-1), limits)


def greedy_accept(
    drafts: torch.Tensor, target_logits: torch.Tensor, limits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`drafts (B, γ)`, processed target logits `(B, γ + 1, V)`, `limits (B,)` (drafts a row may keep) ->
    `(kept (B,), next_token (B,))`: kept drafts per row and the target's token after them."""
    choice = target_logits.argmax(-1)  # (B, γ + 1)
    kept = greedy_kept(drafts, choice, limits)
    return kept, choice.gather(1, kept[:, None])[:, 0]


def sample_on_device(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs (..., V)` without a host synchronisation: `argmax(p / E)` with `E ~ Exp(1)` picks
    index i with probability `p_i` (the exponential-race form of the Gumbel-max trick, as gpt-fast samples);
    `torch.multinomial` may wait for the device to check its input. Returns `(...)` indices."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)


def speculative_accept(
    drafts: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    limits: torch.Tensor,
    generator: torch.Generator | None = None,
    on_device: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling per row.

    Args:
        drafts (`torch.LongTensor` of shape `(B, γ)`): the drafted tokens.
        draft_logits (`torch.Tensor` of shape `(B, γ, V)`): the processed logits the drafts were sampled from.
        target_logits (`torch.Tensor` of shape `(B, γ + 1, V)`): the target's processed logits.
        limits (`torch.LongTensor` of shape `(B,)`): drafts each row may keep (a row's draft ended early).
        on_device (`bool`): read nothing on the host (the residual always computed, `sample_on_device` draws).

    Returns:
        `(kept (B,), next_token (B,))`.
    """
    gamma = drafts.shape[1]
    p = target_logits.float().softmax(-1)  # (B, γ + 1, V)
    q = draft_logits.float().softmax(-1)  # (B, γ, V)
    p_draft = p[:, :gamma].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    uniform = torch.rand(p_draft.shape, device=p.device, generator=generator)
    accepted = uniform <= p_draft / q_draft
    positions = torch.arange(gamma, device=p.device)[None]
    accepted &= positions < limits[:, None]
    kept = accepted.long().cumprod(-1).sum(-1)  # (B,)
    rows = torch.arange(drafts.shape[0], device=p.device)
    target_next = p[rows, kept]  # (B, V): the target's distribution after the kept drafts
    rejected = kept < limits
    residual = torch.zeros_like(target_next)
    if on_device or bool(rejected.any()):
        at = kept.clamp(max=gamma - 1)
        residual = (target_next - q[rows, at]).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q at a rejected position has probability 0; fall back to p so the draw stays defined
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_next)
    distribution = torch.where(rejected[:, None], residual, target_next)
    if on_device:
        return kept, sample_on_device(distribution, generator)
    return kept, torch.multinomial(distribution, 1, generator=generator)[:, 0]


def accept_round(
    drafts: torch.Tensor,
    draft_logits: torch.Tensor | None,
    target_logits: torch.Tensor,
    limits: torch.Tensor,
    sample: bool,
    on_device: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verified round's outcome for every row: `(kept (B,), new (B, γ + 1))`, row b's tokens `new[b, : kept[b] + 1]`
    (its kept drafts, then the target's token; what follows is unspecified). Greedy: the target's argmax at every
    position, which the kept drafts equal and which holds the token after them (`greedy_kept`); sampling:
    `speculative_accept`, or with no drafts a draw from the target's distribution. `on_device`: nothing read on the
    host (`sample_on_device`)."""
    if not sample:
        choice = target_logits.argmax(-1)  # (B, γ + 1)
        return greedy_kept(drafts, choice, limits), choice
    if drafts.shape[1]:
        kept, bonus = speculative_accept(drafts, draft_logits, target_logits, limits, on_device=on_device)
    else:
        probs = target_logits[:, 0].softmax(-1)  # (B, V)
        kept = limits
        bonus = sample_on_device(probs) if on_device else torch.multinomial(probs, 1)[:, 0]
    new = torch.cat([drafts, bonus[:, None]], 1)
    new.scatter_(1, kept[:, None], bonus[:, None])
    return kept, new
