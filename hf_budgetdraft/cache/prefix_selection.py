"""The BudgetDraft prefill selection, one definition for the dynamic and static budgeted cache layers.

BudgetDraft, arXiv 2606.00144, §3.1: sparsified once after the prefill — each layer keeps, per KV head, at most
`budget` prefix positions chosen by a `KeepPolicy`; query-scored policies get the prefill queries through
`attention/query_capture.py`.
"""

from __future__ import annotations

import torch

from ..attention.query_capture import cancel_request, request_queries
from .policies import KeepPolicy


class PrefixSelection:
    """The BudgetDraft prefill, shared by `BudgetedLayer` and its static twin: on the first update, keep at most
    `budget` prefix positions per KV head chosen by `policy.select` (waiting for the prefill queries when the policy
    scores with them). Hosts implement `_start_after_prefill(length)` and `_store_selection(keys, values)`."""

    def _init_selection(self, policy: KeepPolicy, budget: int, layer_idx: int) -> None:
        self.policy, self.budget, self.layer_idx = policy, budget, layer_idx
        self.prefix_length: int | None = None  # set by the prefill
        self.num_kept = 0
        self.kept_positions: torch.Tensor | None = None  # (B, H, num_kept) after the prefill
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # prefill K/V awaiting queries

    def _check_not_pending(self) -> None:
        if self._pending is not None:
            cancel_request(self)
            self._pending = None
            raise ValueError(
                f"policy={self.policy.name!r} scores the prefix with the prefill queries of layer {self.layer_idx}, "
                "but the model's attention did not hand them over. Run the model inside "
                "`hf_budgetdraft.query_capture(model)` (generate() with cache_implementation='budgeted' does this "
                "for you); it serves attention that goes through transformers' attention interface, or that calls "
                "torch SDPA / `query @ key^T` on the keys the cache returned. Otherwise use a policy without "
                "queries: policy='streaming', or policy='chunk' with query_proxy='last_key'."
            )

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        length = key_states.shape[-2]
        self.prefix_length = length
        self._start_after_prefill(length)
        if length > self.budget and self.policy.needs_queries:
            self._pending = (key_states, value_states)
            request_queries(self, self.layer_idx, key_states)  # `update` returns these keys
        else:
            self._compress(key_states, value_states, None)

    def receive_queries(self, queries: torch.Tensor) -> None:
        """Called by the capturing attention function with the prefill queries `(B, H_q, L, D)`."""
        if self._pending is None:
            return
        keys, values = self._pending
        self._pending = None
        self._compress(keys, values, queries[:, :, -self.policy.query_window :])

    def _compress(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
        positions = self.policy.select(keys, self.budget, queries)  # (B, H, n)
        self.num_kept = positions.shape[-1]
        self.kept_positions = positions
        index = positions[..., None]  # (B, H, n, 1)
        self._store_selection(
            keys.detach().gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
            values.detach().gather(2, index.expand(-1, -1, -1, values.shape[-1])),
        )

    def _length_after_crop(self, tokens_to_remove) -> int:
        new_length = self._check_crop(tokens_to_remove)
        if self.prefix_length is not None and new_length < self.prefix_length:
            raise ValueError(
                f"crop({int(tokens_to_remove)}) would cut into the compressed prefix (length {self.prefix_length}); "
                "a budgeted cache can only roll back tokens added after its prefill"
            )
        return new_length

    def _reset_selection(self) -> None:
        self.prefix_length, self.num_kept, self.kept_positions, self._pending = None, 0, None, None
