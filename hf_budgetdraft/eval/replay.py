"""Replayed acceptance: a benchmark tool that gives random-weight models a chosen acceptance, at their real costs.

Random weights accept nothing, so on a GPU where real checkpoints cannot be had, a speculative row would measure
only rounds that fail. Inside `ReplayedAcceptance(...).installed()`, every round still runs the drafter's forwards
for real (their cost is real) and the target verifies every token as usual; only the proposals are rewritten, on
the device, after the draft: a round of n drafts keeps the target's own next tokens (`reference`, the target's
greedy continuation) for its first m, and proposes a wrong token at position m, where m is drawn so that
`P(m > k) = survival[k]` (one uniform draw per round against the trace: `survival[k]` is the share of rounds whose
first k + 1 drafts were all accepted, as `benchmarks/results/ceiling.json` records it; 0 past the trace).

Never for real decoding: its output is the target's as long as the target follows `reference`. A target that
diverges from it (bf16 rounding at a near-tie) makes the replay propose against a stale reference; `divergence`
finds the first such position so a benchmark can re-anchor the reference there (untimed) and repeat the run.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from transformers.generation.utils import GenerationMixin

from ..generation.device_loop import DeviceRound


def paper_survival(alpha: float, depth: int) -> list[float]:
    """The survival trace of a constant per-token acceptance `alpha`: `alpha ** (k + 1)`."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return [alpha ** (k + 1) for k in range(depth)]


class ReplayedAcceptance:
    """Rewrites each round's proposals to follow a survival trace (see the module docstring).

    Args:
        reference (`torch.LongTensor` of shape `(1, T)`): the prompt and the target's greedy continuation, on the
            models' device, long enough for the call (prompt + new tokens + the longest round).
        survival (`list[float]`): `survival[k]` = P(the first k + 1 drafts of a round are accepted), non-increasing.
        vocab_size (`int`): the wrong token at the first rejected position is the reference's next one modulo this.
        seed (`int`): seeds the draws, so paired runs replay the same rounds.
    """

    def __init__(self, reference: torch.LongTensor, survival: list[float], vocab_size: int, seed: int = 0):
        if any(b > a + 1e-12 for a, b in zip(survival, survival[1:], strict=False)) or not all(
            0.0 <= s <= 1.0 for s in survival
        ):
            raise ValueError(f"survival must be non-increasing probabilities, got {survival!r}")
        self.reference, self.survival, self.vocab_size = reference, list(survival), vocab_size
        self.random = random.Random(seed)
        self.rounds: list[tuple[int, int]] = []  # (drafted, survivors drawn) per rewritten round

    def reseed(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.rounds = []

    def survivors(self, drafted: int) -> int:
        """How many of a round's `drafted` proposals follow the reference (one uniform draw)."""
        draw = self.random.random()
        return sum(1 for k in range(drafted) if k < len(self.survival) and self.survival[k] > draw)

    def rewrite(self, drafts: torch.Tensor, start: int) -> torch.Tensor:
        """`drafts (1, n)` proposed for positions `start ...` -> the replayed proposals `(1, n)` (device ops only)."""
        n = drafts.shape[1]
        if n == 0:
            return drafts
        kept = self.survivors(n)
        self.rounds.append((n, kept))
        available = max(0, min(n, self.reference.shape[1] - start))
        out = drafts.clone()
        if available == 0:
            return out
        truth = self.reference[:, start : start + available].to(drafts.device)
        out[:, : min(kept, available)] = truth[:, : min(kept, available)]
        if kept < available:
            out[:, kept] = (truth[:, kept] + 1) % self.vocab_size
        return out

    def replayed_survival(self) -> list[float]:
        """The survival the draws gave: per position k, the share of rounds reaching it that kept it."""
        depth = max((n for n, _ in self.rounds), default=0)
        out = []
        for k in range(depth):
            reached = [m for n, m in self.rounds if n > k]
            out.append(sum(1 for m in reached if m > k) / len(reached) if reached else float("nan"))
        return out

    @contextlib.contextmanager
    def installed(self) -> Iterator[ReplayedAcceptance]:
        """Replay inside the block, for every speculative call (transformers' candidate generators, the device
        round); the patched methods are restored on exit."""
        stock_generator = GenerationMixin._get_candidate_generator
        stock_draft = DeviceRound._draft
        replay = self

        def candidate_generator(model, *args, **kwargs):
            generator = stock_generator(model, *args, **kwargs)
            propose = generator.get_candidates

            def get_candidates(input_ids, **more):
                candidates, logits = propose(input_ids, **more)
                start = input_ids.shape[-1]
                drafts = replay.rewrite(candidates[:, start:], start)
                return torch.cat([candidates[:, :start], drafts], dim=-1), logits

            generator.get_candidates = get_candidates
            return generator

        def draft(round_, tokens, length, gamma):
            drafts, logits = stock_draft(round_, tokens, length, gamma)  # γ tokens (1, 1)
            return list(replay.rewrite(torch.cat(drafts, 1), length).split(1, dim=1)), logits

        GenerationMixin._get_candidate_generator = candidate_generator
        DeviceRound._draft = draft
        try:
            yield self
        finally:
            GenerationMixin._get_candidate_generator = stock_generator
            DeviceRound._draft = stock_draft


def divergence(output: torch.Tensor, reference: torch.Tensor, prompt: int) -> int | None:
    """The first position after `prompt` where `output (1, L)` leaves `reference (1, T)`; `None` if it never does."""
    length = min(output.shape[1], reference.shape[1])
    differ = (output[0, prompt:length] != reference[0, prompt:length].to(output.device)).nonzero()
    return None if differ.numel() == 0 else prompt + int(differ[0, 0])
