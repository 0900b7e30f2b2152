"""Times each speculative round for its draft-length policy, without adding a device synchronisation on CUDA."""

from __future__ import annotations

import time

import torch

from .policy import DraftLength


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); a no-op where work is synchronous. Timing code outside a round's
    own acceptance uses this, never a bare `torch.cuda.synchronize`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RoundClock:
    """Times each round of a candidate generator for its `DraftLength` policy: the draft from `start()` to
    `drafted(n)` (inside `get_candidates`), the verification from then to `finish(accepted)` (in
    `update_candidate_strategy`), which feeds the policy.

    On CUDA no mark synchronises: `finish` comes after the acceptance, which already waited for the device (it
    read the accepted count), so the round's host time is its wall time, and the draft's share is read from two
    CUDA events recorded around it (complete by then). Elsewhere each mark reads the host clock.
    """

    def __init__(self, policy: DraftLength, device: torch.device):
        self.policy, self.device = policy, torch.device(device)
        self.events = self.device.type == "cuda"
        self.drafted_tokens, self.draft_seconds, self.verify_seconds = 0, 0.0, 0.0
        self._start = self._end = time.perf_counter()
        self._marks: tuple | None = None

    def start(self) -> None:
        self._start = time.perf_counter()
        if self.events:
            self._marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._marks[0].record()

    def drafted(self, tokens: int) -> None:
        self.drafted_tokens = tokens
        if self.events:
            self._marks[1].record()
        else:
            self._end = time.perf_counter()
            self.draft_seconds = self._end - self._start

    def finish(self, accepted) -> None:
        """The round was verified: `accepted` draft tokens kept (an int, or one per row)."""
        now = time.perf_counter()
        if self.events:
            begin, end = self._marks
            if not end.query():  # only if the caller had not waited for the acceptance
                end.synchronize()
            self.draft_seconds = begin.elapsed_time(end) / 1e3
            self.verify_seconds = max(0.0, now - self._start - self.draft_seconds)
        else:
            self.verify_seconds = now - self._end
        self.policy.update(self.drafted_tokens, accepted, self.draft_seconds, self.verify_seconds)
