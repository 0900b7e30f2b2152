"""The sparse draft caches for a batch: `[static | ring]` slot buffers with one length per row.

The slot layout of the static draft layers (`slot_layout.py`) with one ring start and length per row: every
full-attention layer holds `(B, H_kv, S + W + slack, D)`. Static slots hold the sink (Windowed-MTP, arXiv
2607.21535: positions `[0, S)`) or the kept prefix (BudgetDraft, arXiv 2606.00144, §3.1: at most `budget` positions
per KV head chosen per row by a `KeepPolicy` after that row's prefill). The cache tracks the position each slot
holds (the same for every layer), so one mask serves all layers: the single-sequence layers' `[static, window,
new]` keys of each row. A forward writes at most `slack` tokens per row, so rolling a row back by what it wrote
(`crop_rows`) never needs an overwritten slot; `crop_rows` checks it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from ..attention.query_capture import cancel_request, request_queries
from .base import check_size
from .policies import KeepPolicy, get_policy
from .ragged import RaggedCache, RaggedLayer, RaggedStep
from .slot_layout import SlotLayout


class RaggedSlotLayer(RaggedLayer):
    """One full-attention layer of a batched sparse draft cache: `(B, H, S + W + slack, D)` slots."""

    def __init__(self, owner: RaggedSlotCache, layer_idx: int):
        super().__init__(owner)
        self.layer_idx = layer_idx
        self._pending: tuple | None = None  # a row prefill's keys/values awaiting its queries

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, self.owner.num_slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Row prefill `(1, H, L, D)`: store the row's sink + window or kept prefix, return the states as given (the
        prefill attends to the whole prompt). Step: write the slots, return the whole `(B, H, S + W + slack, D)`
        buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.owner.step
        if step.row is not None:
            self.owner.store_prefill(self, step.row, key_states.detach(), value_states.detach())
            return key_states, value_states
        if self._pending is not None:
            self.owner.missing_queries(self)
        index = step.slots[:, None, :, None]  # (B, 1, q, 1)
        self.keys.scatter_(2, index.expand_as(key_states), key_states.detach())
        self.values.scatter_(2, index.expand_as(value_states), value_states.detach())
        return self.keys, self.values

    def receive_queries(self, queries: torch.Tensor) -> None:
        """The row prefill's queries `(1, H_q, L, D)`, handed over by the capturing attention."""
        if self._pending is None:
            return
        row, keys, values = self._pending
        self._pending = None
        self.owner.select_prefix(self, row, keys, values, queries)


class RaggedSlotCache(RaggedCache):
    """Shared bookkeeping of the batched sparse draft caches (see the module docstring); subclasses fill the static
    slots at the prefill (`store_prefill`)."""

    def __init__(
        self,
        config: PreTrainedConfig,
        batch_size: int,
        static_capacity: int,
        window_length: int,
        slack: int,
        capacity: int,
    ):
        check_size("window_length", window_length, 1)
        check_size("slack", slack, 1)
        self.layout = SlotLayout(static_capacity, window_length, slack)
        self.static_capacity, self.window, self.slack = static_capacity, window_length, slack
        self.num_slots = self.layout.num_slots
        # (B, S + W + slack) long: the position each slot holds, -1 = empty; (B,) long: each row's ring start
        self.slot_positions = torch.full((batch_size, self.num_slots), -1, dtype=torch.long)
        self.ring_start = torch.zeros(batch_size, dtype=torch.long)
        super().__init__(config, batch_size, capacity, make_full_layer=RaggedSlotLayer)
        if not any(isinstance(layer, RaggedSlotLayer) for layer in self.layers):
            raise ValueError(
                f"{config.model_type!r} has no full-attention layer, so a batched sparse draft cache has nothing to "
                "sparsify; run this drafter without cache_implementation (its own cache is already bounded)"
            )

    @property
    def ring_capacity(self) -> int:
        return self.layout.ring_capacity

    def _ring_slots(self, positions: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """Ring slots `(B, n)` (buffer indices) of positions `(B, n)` at or past each row's ring start (`row`: the
        positions `(1, n)` of that row only)."""
        start = self.ring_start[:, None] if row is None else self.ring_start[row]
        return self.static_capacity + self.layout.ring_offsets(positions, start)

    # -- one forward ---------------------------------------------------------------------------------------------
    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.step is not None and self.step.row is not None:
            return query_length, 0
        return self.num_slots, 0

    def _before_forward(self, step: RaggedStep) -> None:
        device = self.lengths.device
        self.slot_positions, self.ring_start = self.slot_positions.to(device), self.ring_start.to(device)
        if step.row is not None:
            self.ring_start[step.row] = self._initial_ring_start(step.end)
            self._place_prefill(step.row, step.end)
            return
        if step.positions.shape[1] > self.slack:
            raise ValueError(
                f"a forward of {step.positions.shape[1]} tokens per row exceeds the draft cache's slack "
                f"({self.slack}); feed at most `slack` tokens at a time"
            )
        step.slots = self.layout.slots(step.positions, self.ring_start[:, None])
        self.slot_positions.scatter_(1, step.slots, step.positions)

    def _slot_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`(B, q, S + W + slack)` bool for queries at `positions` `(B, q)` (see the module docstring)."""
        held = self.slot_positions[:, None, :]  # (B, 1, K)
        query = positions[:, :, None]  # (B, q, 1)
        ring = self.layout.ring_visible(held, self.ring_start[:, None, None], query, query[:, :1])
        static = torch.arange(self.num_slots, device=held.device) < self.static_capacity
        return torch.where(static, (held >= 0) & (held <= query), ring)

    def _initial_ring_start(self, length: int) -> int:
        raise NotImplementedError

    def _place_prefill(self, row: int, length: int) -> None:
        """Mark the slots a row's prefill fills (the position each holds), before the layers store them."""

    def store_prefill(
        self, layer: RaggedSlotLayer, row: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store a row prefill's `(1, H, L, D)` keys/values into the layer's slots of that row."""
        raise NotImplementedError

    def missing_queries(self, layer: RaggedSlotLayer) -> None:
        cancel_request(layer)
        raise ValueError(
            "a query-scored policy needs the prefill queries, but the drafter's attention did not hand them over. "
            "Run the drafter's prefill inside `hf_budgetdraft.query_capture(drafter)`, or use policy='chunk'/'streaming'"
        )

    # -- rollback and rows ---------------------------------------------------------------------------------------
    def crop_rows(self, remove: torch.Tensor) -> None:
        super().crop_rows(remove)
        held = self.slot_positions
        held.masked_fill_(held >= self.lengths[:, None], -1)
        intact = self.layout.window_intact(held[:, self.static_capacity :], self.ring_start, self.lengths)
        if not bool(intact.all()):
            raise ValueError(
                f"crop_rows({remove.tolist()}) needs ring positions already overwritten; a row can roll back only "
                f"what it wrote since its last kept token, within the slack ({self.slack})"
            )

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        self.slot_positions, self.ring_start = self.slot_positions[rows], self.ring_start[rows]


class RaggedSinkWindowCache(RaggedSlotCache):
    """Batched `SinkWindowCache`: `num_sink_tokens` sink slots + the last `window_length` tokens, per row."""

    def __init__(
        self,
        config: PreTrainedConfig,
        batch_size: int,
        num_sink_tokens: int = 64,
        window_length: int = 1024,
        slack: int = 32,
        capacity: int = 1024,
    ):
        check_size("num_sink_tokens", num_sink_tokens, 0)
        self.num_sink_tokens = num_sink_tokens
        super().__init__(config, batch_size, num_sink_tokens, window_length, slack, capacity)

    def _initial_ring_start(self, length: int) -> int:
        return self.num_sink_tokens

    def _prefill_ring_positions(self, length: int) -> torch.Tensor:
        """The prompt positions the ring keeps: the last `W + slack` past the sink (fewer for a short prompt)."""
        first = max(self.num_sink_tokens, length - self.ring_capacity)
        return torch.arange(first, max(first, length), device=self.lengths.device)

    def _place_prefill(self, row: int, length: int) -> None:
        held = self.slot_positions[row]
        held.fill_(-1)
        sink = min(self.num_sink_tokens, length)
        held[:sink] = torch.arange(sink, device=held.device)
        ring = self._prefill_ring_positions(length)
        held[self._ring_slots(ring[None], row)[0]] = ring

    def store_prefill(
        self, layer: RaggedSlotLayer, row: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        length = keys.shape[-2]
        sink = min(self.num_sink_tokens, length)
        ring = self._prefill_ring_positions(length)
        slots = self._ring_slots(ring[None], row)[0]
        for buffer, states in ((layer.keys, keys), (layer.values, values)):
            buffer[row, :, :sink] = states[0, :, :sink]
            buffer[row, :, slots] = states[0, :, ring]


class RaggedBudgetedCache(RaggedSlotCache):
    """Batched `BudgetedCache`: per row, at most `budget` prefix positions per layer and KV head (chosen by
    `policy` on that row's own prompt) + the last `window_length` tokens after the prefill."""

    def __init__(
        self,
        config: PreTrainedConfig,
        batch_size: int,
        budget: int = 512,
        policy: str | KeepPolicy = "chunk",
        window_length: int = 256,
        slack: int = 32,
        policy_kwargs: dict | None = None,
        capacity: int = 1024,
    ):
        check_size("budget", budget, 1)
        self.policy = get_policy(policy, **(policy_kwargs or {}))
        self.policy.validate_budget(budget)
        self.budget = budget
        self.num_kept = torch.zeros(batch_size, dtype=torch.long)  # (B,): prefix tokens each row keeps
        super().__init__(config, batch_size, budget, window_length, slack, capacity)

    def _initial_ring_start(self, length: int) -> int:
        return length  # every token after the prefill goes to the ring

    def _place_prefill(self, row: int, length: int) -> None:
        self.slot_positions[row].fill_(-1)
        self.num_kept = self.num_kept.to(self.lengths.device)
        self.num_kept[row] = -1  # set by the first layer's selection

    def store_prefill(
        self, layer: RaggedSlotLayer, row: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        if self.policy.needs_queries and keys.shape[-2] > self.budget:
            layer._pending = (row, keys, values)
            request_queries(layer, layer.layer_idx)
            return
        self.select_prefix(layer, row, keys, values, None)

    def select_prefix(self, layer, row: int, keys: torch.Tensor, values: torch.Tensor, queries) -> None:
        """Keep the row's selection `(1, H, n)` in the layer's static slots; every layer keeps the same count."""
        if queries is not None:
            queries = queries[:, :, -self.policy.query_window :]
        kept = self.policy.select(keys, self.budget, queries)[0]  # (H, n)
        count = kept.shape[-1]
        for buffer, states in ((layer.keys, keys), (layer.values, values)):
            buffer[row, :, :count] = states[0].gather(1, kept[..., None].expand(-1, -1, states.shape[-1]))
        if int(self.num_kept[row]) < 0:
            self.num_kept[row] = count
            self.slot_positions[row, :count] = 0  # always visible: every kept position precedes every query
        elif int(self.num_kept[row]) != count:
            raise RuntimeError(f"layers of one row kept {int(self.num_kept[row])} and {count} prefix tokens")

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        self.num_kept = self.num_kept[rows]
