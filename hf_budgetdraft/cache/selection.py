"""Selections: which past tokens a sparse draft keeps besides its recent window.

A draft cache layer is `[S static slots | W + slack ring slots]` (`slot_layout.py`). The ring always holds the most
recent tokens; a *selection* decides, at the prefill (a layer's first update), which prompt positions fill the static
slots and where the ring starts. Every storage (`draft_layer.py`, `static_draft_layer.py`, `ragged_draft.py`) runs any
selection, so a new selection is one class here.

- `SinkSelection` (Windowed-MTP, arXiv 2607.21535): the first `S` positions (an attention sink); the ring starts
  at `S`, so positions written later below `S` fill the rest of the sink.
- `BudgetSelection` (BudgetDraft, arXiv 2606.00144, §3.1): per KV head, at most `budget` prompt positions chosen
  by a `KeepPolicy`; the ring starts after the prompt, and no rollback goes back into it. A policy that `refreshes`
  (dynamic) also chooses at every later step, with the step's query, from the prompt `index` keeps.
"""

from __future__ import annotations

import torch

from .policies import KeepPolicy, get_policy
from .sizes import check_size


class Selection:
    """What a storage asks of a selection; subclasses set `static_capacity` and implement `select`."""

    static_capacity: int = 0
    uses_queries = False  # whether `select` may need the prefill queries
    refreshes = False  # whether every step after the prefill selects again, with its own query (`reselect`)
    can_skip = False  # whether positions past the static ones may be skipped (never stored)

    def ring_start(self, prompt_length: int) -> int:
        """First position the ring holds after a prefill of `prompt_length` tokens."""
        raise NotImplementedError

    def floor(self, prompt_length: int) -> int:
        """The shortest length a rollback may return to after that prefill."""
        return 0

    def needs_queries(self, prompt_length: int) -> bool:
        """Whether `select` needs the prefill queries for a prompt of this length."""
        return False

    def select(self, keys: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        """`(B, H, n)` long, ascending: the positions of the prefill keys `(B, H, L, D)` the static slots keep,
        `n <= static_capacity` (queries `(B, H_q, L, D)` when `needs_queries`)."""
        raise NotImplementedError

    def index(self, keys: torch.Tensor, values: torch.Tensor):
        """What a refreshing selection re-selects from after a prefill of these keys and values `(B, H, L, D)`
        (`None`: nothing, it never selects again)."""
        return None

    def keep(
        self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`select`'s positions `(B, H, n)` and the keys and values at them, `(B, H, n, D)` each."""
        positions = self.select(keys, queries)
        index = positions[..., None]  # (B, H, n, 1)
        return (
            positions,
            keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
            values.gather(2, index.expand(-1, -1, -1, values.shape[-1])),
        )


class SinkSelection(Selection):
    """The first `num_sink_tokens` positions, whatever the prompt (Windowed-MTP's attention sink)."""

    can_skip = True

    def __init__(self, num_sink_tokens: int):
        check_size("num_sink_tokens", num_sink_tokens, 0)
        self.num_sink_tokens = self.static_capacity = num_sink_tokens

    def ring_start(self, prompt_length: int) -> int:
        return self.num_sink_tokens

    def select(self, keys: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        kept = torch.arange(min(self.num_sink_tokens, keys.shape[-2]), device=keys.device)
        return kept.expand(*keys.shape[:2], -1)


class BudgetSelection(Selection):
    """At most `budget` prompt positions per KV head, chosen by `policy` (`"chunk"`, `"streaming"`, `"snapkv"` or a
    `KeepPolicy`); a prompt no longer than the budget is kept whole."""

    def __init__(self, budget: int, policy: str | KeepPolicy = "chunk", policy_kwargs: dict | None = None):
        check_size("budget", budget, 1)
        self.policy = get_policy(policy, **(policy_kwargs or {}))
        self.policy.validate_budget(budget)
        self.budget = self.static_capacity = budget
        self.uses_queries = self.policy.needs_queries
        self.refreshes = self.policy.refreshes

    def ring_start(self, prompt_length: int) -> int:
        return prompt_length

    def floor(self, prompt_length: int) -> int:
        return prompt_length

    def needs_queries(self, prompt_length: int) -> bool:
        return self.uses_queries and prompt_length > self.budget

    def select(self, keys: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        if queries is not None:
            queries = queries[:, :, -self.policy.query_window :]
        return self.policy.select(keys, self.budget, queries)

    def index(self, keys: torch.Tensor, values: torch.Tensor):
        """A refreshing policy's index of the prompt's keys and values (`None`: the prompt fits the budget, or the
        policy does not refresh)."""
        if not self.refreshes or keys.shape[-2] <= self.budget:
            return None
        return self.policy.index(keys, values)

    def reselect(self, prompt, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's choice and the keys and values it keeps `(B, H, n, D)`, chosen with its last query `(B, H_q, D)`
        from `prompt` (what `index` returned); `positions(choice, prompt)`: the positions `(B, H, n)`."""
        return self.policy.reselect(prompt, query, self.budget)

    def positions(self, choice: torch.Tensor, prompt) -> torch.Tensor:
        return self.policy.positions(choice, prompt)
