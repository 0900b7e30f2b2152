"""The draft-length policy interface, a fixed length, and transformers' heuristic schedule."""

from __future__ import annotations

from dataclasses import dataclass


class DraftLength:
    """Base class: `next_length()` before a round, `update(...)` after it."""

    name = "fixed"

    def next_length(self) -> int:
        raise NotImplementedError

    def update(self, drafted: int, accepted, draft_seconds: float, verify_seconds: float) -> None:
        """Record a finished round: `drafted` tokens proposed, `accepted` of them kept (an int, or one per row of a
        batched round), its two phase times."""


def per_row(accepted) -> list[int]:
    return [int(accepted)] if isinstance(accepted, int) else [int(a) for a in accepted]


@dataclass
class FixedDraftLength(DraftLength):
    """γ tokens every round (`num_assistant_tokens` with the constant schedule)."""

    length: int
    name = "fixed"

    def next_length(self) -> int:
        return self.length


@dataclass
class HeuristicDraftLength(DraftLength):
    """transformers' `"heuristic"` schedule: +2 after a fully accepted round, -1 otherwise, in [1, maximum]."""

    length: int
    maximum: int
    name = "heuristic"

    def next_length(self) -> int:
        return self.length

    def update(self, drafted: int, accepted, draft_seconds: float, verify_seconds: float) -> None:
        if drafted == 0:
            return
        step = 2 if min(per_row(accepted)) == drafted else -1
        self.length = max(1, min(self.maximum, self.length + step))
