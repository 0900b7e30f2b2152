"""The contract every KV-selection policy follows, shared by the inference cache and the trainer's views."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KeepPolicy(ABC):
    """Chooses which prefix positions a budgeted draft cache keeps, per layer and per KV head.

    One definition serves both `BudgetedCache` (at inference, once after prefill) and the BudgetDraft
    trainer's sparse views, so the drafter is trained on exactly the keys it will read when deployed.
    """

    name: str = ""
    # whether each draft step selects again with its own query (`DynamicChunkPolicy`): the cache layer then keeps the
    # prompt's `index(keys, values)` and calls `reselect` at every step
    refreshes: bool = False

    @property
    def needs_queries(self) -> bool:
        """Whether `select` needs the prefill's last queries (see `query_window`)."""
        return False

    @property
    def reads_queries(self) -> bool:
        """Whether a model on this policy's cache must hand queries to it (the query capture): the prefill's
        (`needs_queries`) or every step's (`refreshes`)."""
        return self.needs_queries or self.refreshes

    @property
    def query_window(self) -> int:
        """How many of the last prefill queries `select` reads (0 when it needs none)."""
        return 0

    @abstractmethod
    def min_budget(self) -> int:
        """The smallest budget this policy can honour."""

    def validate_budget(self, budget: int) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise TypeError(f"budget must be an int, got {type(budget).__name__} ({budget!r})")
        if budget < self.min_budget():
            raise ValueError(
                f"budget={budget} is too small for policy={self.name!r} ({self!r}); it needs at least "
                f"{self.min_budget()}. Raise `budget` or shrink the policy's sink/chunk/window parameters."
            )

    def select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None = None) -> torch.Tensor:
        """Indices of the kept prefix positions.

        Args:
            keys (`torch.Tensor` of shape `(B, H_kv, L, D)`): the prefix keys, RoPE already applied.
            budget (`int`): at most this many positions are kept per head.
            queries (`torch.Tensor` of shape `(B, H_q, w, D)`, *optional*): the last `w >= query_window`
                prefix queries, already multiplied by the attention scaling. Only for `needs_queries` policies.

        Returns:
            `torch.LongTensor` of shape `(B, H_kv, n)`: ascending positions, the same count `n` per head. `n` is
            `L` when `L <= budget`; otherwise `n <= budget` and each policy's `_select` says exactly how many it
            keeps (StreamingLLM and SnapKV fill the budget; chunk retrieval keeps whole chunks plus the trailing
            partial one, so it can keep fewer). Callers size their buffers from `n`, not from `budget`.
        """
        self.validate_budget(budget)
        length = keys.shape[-2]
        if length <= budget:
            return _all_positions(keys)
        if self.needs_queries:
            if queries is None:
                raise ValueError(f"policy={self.name!r} needs the prefill queries, got queries=None")
            if queries.shape[-2] < self.query_window:
                raise ValueError(
                    f"policy={self.name!r} needs the last {self.query_window} queries, got {queries.shape[-2]}"
                )
        return self._select(keys, budget, queries)

    @abstractmethod
    def _select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None) -> torch.Tensor:
        """`select` for a prefix longer than the budget; returns at most `budget` positions per head."""


def _all_positions(keys: torch.Tensor) -> torch.Tensor:
    batch, heads, length = keys.shape[:3]
    return torch.arange(length, device=keys.device).expand(batch, heads, length)


def group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`(B, H_q, w, D)` -> `(B, H_kv, H_q // H_kv, w, D)`: the query heads that share each KV head (GQA)."""
    batch, num_q_heads, window, dim = queries.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    return queries.view(batch, num_kv_heads, num_q_heads // num_kv_heads, window, dim)
