"""Per-round speculation statistics, recorded from any candidate generator while `record_speculation()` is open."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from ..compat import CACHE_KWARG
from .draft_length.clock import synchronize


@dataclass
class SpeculationStats:
    """What happened in each draft/verify round of one or more `generate()` calls.

    `mean_accepted_length` = tokens emitted per verification round and sequence (accepted draft tokens + the
    target's own token), as EAGLE/SGLang report "accept length"; `acceptance_rate` = accepted / proposed draft
    tokens, as BudgetDraft reports it. A batched call records one round per batch round (`rows_per_round` rows in
    it, counts summed over them) and one `SpeculationStats` per input row in `rows` (its rounds, with the batch
    round's timings, and `latency_seconds`: from the call's start to the row's last token).
    """

    proposed_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    draft_seconds_per_round: list[float] = field(default_factory=list)
    verify_seconds_per_round: list[float] = field(default_factory=list)
    # the `DraftPlan` of the most recent sparse-draft call: the resolved spec, the draft-length policy and its source
    plan: object | None = field(default=None, compare=False)
    # per call: the drafter's own prefill forward (sparse drafts only; 0 where the generator does not report it)
    draft_prefill_seconds: float = 0.0
    # the candidate generator of the most recent recorded call (only the latest is kept, so a long recording
    # session does not hold every call's draft cache alive); read its cache with `draft_cache`
    candidate_generator: object | None = field(default=None, repr=False, compare=False)
    rows_per_round: list[int] = field(default_factory=list)
    rows: list[SpeculationStats] = field(default_factory=list, repr=False)
    latency_seconds: float | None = None

    def add_round(
        self, proposed: int, accepted: int, draft_seconds: float, verify_seconds: float, rows: int = 1
    ) -> None:
        self.proposed_per_round.append(proposed)
        self.accepted_per_round.append(accepted)
        self.draft_seconds_per_round.append(draft_seconds)
        self.verify_seconds_per_round.append(verify_seconds)
        self.rows_per_round.append(rows)

    def begin_batch(self, batch_size: int, target_prefill: float, draft_prefill: float) -> None:
        """A batched call starts: its prefill round (every row's first token) and one `SpeculationStats` per row."""
        self._batch_start = time.perf_counter() - target_prefill - draft_prefill
        self._batch_rows = [SpeculationStats() for _ in range(batch_size)]
        self.rows.extend(self._batch_rows)
        self.draft_prefill_seconds += draft_prefill
        self.add_round(0, 0, draft_prefill, target_prefill, rows=batch_size)
        for row in self._batch_rows:
            row.add_round(0, 0, draft_prefill, target_prefill)

    def add_batch_round(
        self, rows: list[int], drafted: list[int], accepted: list[int], draft: float, verify: float
    ) -> None:
        """A batch round over the input rows `rows`, row `rows[i]` drafting `drafted[i]` and keeping `accepted[i]`."""
        self.add_round(sum(drafted), sum(accepted), draft, verify, rows=len(rows))
        for row, length, kept in zip(rows, drafted, accepted, strict=True):
            self._batch_rows[row].add_round(length, kept, draft, verify)

    def finish_rows(self, rows: list[int]) -> None:
        """The input rows `rows` emitted their last token now."""
        for row in rows:
            self._batch_rows[row].latency_seconds = time.perf_counter() - self._batch_start

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def mean_accepted_length(self) -> float:
        sequences = sum(self.rows_per_round)
        return (sum(self.accepted_per_round) + sequences) / sequences if sequences else 0.0

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(self.proposed_per_round)
        return sum(self.accepted_per_round) / proposed if proposed else 0.0

    @property
    def draft_seconds(self) -> float:
        return sum(self.draft_seconds_per_round)

    @property
    def verify_seconds(self) -> float:
        return sum(self.verify_seconds_per_round)

    @property
    def runtime(self) -> dict | None:
        """What ran in the latest sparse-draft call, not what was planned: the loop (`"device_round"` or
        `"transformers"`), the verification (compiled calls, buckets, graphs compiled, recompilations, a compile
        failure) and the one-token draft step (compiled calls, eager calls after a failure); `None` for other
        generators."""
        runtime = getattr(self.candidate_generator, "runtime", None)
        return runtime() if callable(runtime) else None

    @property
    def draft_length_policy(self) -> str | None:
        """Which draft-length policy ran in the latest sparse-draft call (`"adaptive"`, `"heuristic"`, `"fixed"`)."""
        generator = self.candidate_generator
        policy = getattr(generator, "draft_length", None)
        return getattr(policy, "name", None)

    @property
    def target_prefill_seconds(self) -> float:
        """The first round's verification: the target's prefill of the prompt (plus that round's drafts)."""
        return self.verify_seconds_per_round[0] if self.rounds else 0.0

    @property
    def decode_draft_seconds(self) -> float:
        """Draft time of every round but the first (which holds the drafter's prefill)."""
        return sum(self.draft_seconds_per_round[1:])

    @property
    def decode_verify_seconds(self) -> float:
        """Verification time of every round but the first (which holds the target's prefill)."""
        return sum(self.verify_seconds_per_round[1:])

    @property
    def ar_rounds(self) -> int:
        """Rounds that drafted nothing: the target took a plain AR step."""
        return sum(1 for p in self.proposed_per_round if p == 0)

    @property
    def draft_cache(self):
        """The draft side's KV cache of the most recent recorded call, for memory accounting: the
        `SparseDraftCache` of a sparse draft, the stock assistant's own cache (a full `DynamicCache`), or the MTP
        head's cache (`MtpCache` / `WindowedMtpCache`), the DFlash drafter's (`DFlashCache` / `WindowedDFlashCache`); `None` for prompt lookup (no draft model) or no call."""
        generator = self.candidate_generator
        if generator is None:
            return None
        # SparseDraftCandidateGenerator, MTPCandidateGenerator, DFlashTokenCandidateGenerator
        for attribute in ("draft_cache", "mtp_cache", "cache"):
            if getattr(generator, attribute, None) is not None:
                return getattr(generator, attribute)
        return (getattr(generator, "assistant_kwargs", None) or {}).get(CACHE_KWARG)

    def acceptance_per_position(self) -> list[tuple[int, int]]:
        """`(accepted, reached)` per draft position k: of the rounds whose draft reached position k (all
        earlier drafts accepted), how many accepted draft token k too (a batched round: per row). Conditional
        acceptance = ratio."""
        if self.rows:
            per_row = [row.acceptance_per_position() for row in self.rows]
            depth = max((len(c) for c in per_row), default=0)
            return [
                (
                    sum(c[k][0] for c in per_row if len(c) > k),
                    sum(c[k][1] for c in per_row if len(c) > k),
                )
                for k in range(depth)
            ]
        rounds = list(zip(self.proposed_per_round, self.accepted_per_round, strict=True))
        depth = max(self.proposed_per_round, default=0)
        return [
            (sum(1 for p, a in rounds if p > k and a > k), sum(1 for p, a in rounds if p > k and a >= k))
            for k in range(depth)
        ]


_active: ContextVar[SpeculationStats | None] = ContextVar("budgetdraft_speculation_stats", default=None)


@contextlib.contextmanager
def record_speculation() -> Iterator[SpeculationStats]:
    """Record every speculative `generate()` round run inside the block.

    Example:
        >>> with record_speculation() as stats:
        ...     target.generate(ids, assistant_model=drafter, cache_implementation="sink_window")
        >>> stats.mean_accepted_length, stats.acceptance_rate
    """
    stats = SpeculationStats()
    token = _active.set(stats)
    try:
        yield stats
    finally:
        _active.reset(token)


def active_recorder() -> SpeculationStats | None:
    return _active.get()


def instrument(generator, stats: SpeculationStats) -> None:
    """Wrap a candidate generator's `get_candidates`/`update_candidate_strategy` to time and count rounds.

    Draft time = inside `get_candidates`; verify time = from its return to `update_candidate_strategy`, i.e. the
    target's forward plus the acceptance step. A generator with its own `RoundClock` (`clock`) is read from it,
    adding no device synchronisation; others are timed here, synchronising CUDA at each mark. The first round holds
    both prefills: `decode_draft_seconds` / `decode_verify_seconds` leave it out, `target_prefill_seconds` /
    `draft_prefill_seconds` report them.
    """
    stats.candidate_generator = generator
    get_candidates, update_strategy = generator.get_candidates, generator.update_candidate_strategy
    clock = getattr(generator, "clock", None)
    round_state: dict = {}

    def timed_get_candidates(input_ids, **kwargs):
        if clock is None:
            synchronize(input_ids.device)
        start = time.perf_counter()
        candidate_ids, candidate_logits = get_candidates(input_ids, **kwargs)
        if clock is None:
            synchronize(candidate_ids.device)
        round_state.update(
            draft=time.perf_counter() - start,
            end=time.perf_counter(),
            proposed=candidate_ids.shape[-1] - input_ids.shape[-1],
        )
        return candidate_ids, candidate_logits

    def timed_update_candidate_strategy(input_ids, scores, num_matches):
        if clock is None:
            synchronize(input_ids.device)
            draft, verify = round_state["draft"], time.perf_counter() - round_state["end"]
        result = update_strategy(input_ids, scores, num_matches)
        if clock is not None:
            draft, verify = clock.draft_seconds, clock.verify_seconds
        prefill = getattr(generator, "draft_prefill_seconds", 0.0)
        stats.draft_prefill_seconds += prefill - round_state.get("prefill_seen", 0.0)
        round_state["prefill_seen"] = prefill
        stats.add_round(round_state["proposed"], int(num_matches), draft, verify)
        return result

    generator.get_candidates = timed_get_candidates
    generator.update_candidate_strategy = timed_update_candidate_strategy
