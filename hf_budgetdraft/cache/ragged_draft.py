"""The ragged storage of the sparse draft caches: `[static | ring]` slot buffers for a batch, one length per row.

The slot layout of the single-sequence draft layers (`slot_layout.py`) with one ring start and length per row: every
full-attention layer holds `(B, H_kv, S + W + slack, D)`. The selection (`selection.py`) fills each row's static
slots at that row's prefill: the sink (Windowed-MTP, arXiv 2607.21535: positions `[0, S)`) or the kept prefix
(BudgetDraft, arXiv 2606.00144, §3.1: at most `budget` positions per KV head chosen per row by a `KeepPolicy`). The
cache tracks the position each slot holds (the same for every layer: a kept slot is marked with the first layer's
earliest kept position there), so one mask serves all layers: the single-sequence layers' `[static, window, new]`
keys of each row. A forward writes at most `slack` tokens per row, so rolling a row back by what it wrote
(`crop_rows`) never needs an overwritten slot; `crop_rows` checks it with `slot_layout.py`'s rule on the device.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from ..attention.query_capture import cancel_request, request_queries
from .draft_cache import check_scores_read_a_subset
from .policies import KeepPolicy
from .ragged import RaggedCache, RaggedLayer, RaggedStep
from .selection import BudgetSelection, Selection, SinkSelection
from .sizes import check_size
from .slot_layout import SlotLayout, static_marks


class RaggedSlotLayer(RaggedLayer):
    """One full-attention layer of a batched sparse draft cache: `(B, H, S + W + slack, D)` slots."""

    def __init__(self, owner: RaggedDraftCache, layer_idx: int):
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
        cancel_request(self)  # served: a request left behind would keep this layer and its keys alive
        if self._pending is None:
            return
        row, keys, values = self._pending
        self._pending = None
        self.owner.keep_prefix(self, row, keys, values, queries)


class RaggedDraftCache(RaggedCache):
    """A batched sparse draft cache: `selection`'s static slots + the last `window_length` tokens, per row.

    Args:
        config (`PreTrainedConfig`): the drafter's config.
        batch_size (`int`): rows.
        selection (`Selection`): which past tokens each row keeps besides its window.
        window_length (`int`): most recent past tokens kept, W.
        slack (`int`): extra ring slots; the most tokens a forward writes per row.
        capacity (`int`): initial positions of the layers transformers keeps whole (sliding ones).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        batch_size: int,
        selection: Selection,
        window_length: int,
        slack: int,
        capacity: int = 1024,
    ):
        check_scores_read_a_subset(config)
        check_size("window_length", window_length, 1)
        check_size("slack", slack, 1)
        if selection.refreshes:
            raise ValueError(
                f"policy={selection.policy.name!r} selects again at every step of one sequence; a batch drafts on "
                "ragged per-row caches, which keep each row's prefill selection. Use policy='chunk' for batched calls"
            )
        self.selection = selection
        self.layout = SlotLayout(selection.static_capacity, window_length, slack)
        self.static_capacity, self.window, self.slack = selection.static_capacity, window_length, slack
        self.num_slots = self.layout.num_slots
        # (B, S + W + slack) long: the position each slot holds, -1 = empty; (B,) long: each row's ring start
        self.slot_positions = torch.full((batch_size, self.num_slots), -1, dtype=torch.long)
        self.ring_start = torch.zeros(batch_size, dtype=torch.long)
        # (B,) long each: the static slots each row's prefill filled; the shortest length a row may go back to
        self.num_kept = torch.zeros(batch_size, dtype=torch.long)
        self.floor = torch.zeros(batch_size, dtype=torch.long)
        super().__init__(config, batch_size, capacity, make_full_layer=RaggedSlotLayer)
        if not any(isinstance(layer, RaggedSlotLayer) for layer in self.layers):
            raise ValueError(
                f"{config.model_type!r} has no full-attention layer, so a batched sparse draft cache has nothing to "
                "sparsify; run this drafter without cache_implementation (its own cache is already bounded)"
            )

    @property
    def ring_capacity(self) -> int:
        return self.layout.ring_capacity

    def _ring_slots(self, positions: torch.Tensor, row: int) -> torch.Tensor:
        """Buffer slots `(1, n)` of row `row`'s positions `(1, n)` at or past its ring start."""
        return self.static_capacity + self.layout.ring_offsets(positions, self.ring_start[row])

    # -- one forward ---------------------------------------------------------------------------------------------
    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.step is not None and self.step.row is not None:
            return query_length, 0
        return self.num_slots, 0

    def _before_forward(self, step: RaggedStep) -> None:
        device = self.lengths.device
        self.slot_positions, self.ring_start = self.slot_positions.to(device), self.ring_start.to(device)
        if step.row is not None:
            self.ring_start[step.row] = self.selection.ring_start(step.end)
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
        """`(B, q, S + W + slack)` bool for queries at `positions` `(B, q)` (see `SlotLayout.visible`)."""
        query = positions[:, :, None]  # (B, q, 1)
        return self.layout.visible(
            self.slot_positions[:, None, :], self.ring_start[:, None, None], query, query[:, :1]
        )

    def _prefill_ring_positions(self, row: int, length: int) -> torch.Tensor:
        """The prompt positions the ring keeps: the last `W + slack` from the ring start (none for a budget)."""
        first = max(int(self.ring_start[row]), length - self.ring_capacity)
        return torch.arange(first, max(first, length), device=self.lengths.device)

    def _place_prefill(self, row: int, length: int) -> None:
        """Mark the ring slots a row's prefill fills; the static ones are marked by the first layer's selection."""
        held = self.slot_positions[row]
        held.fill_(-1)
        ring = self._prefill_ring_positions(row, length)
        held[self._ring_slots(ring[None], row)[0]] = ring
        self.num_kept, self.floor = self.num_kept.to(self.lengths.device), self.floor.to(self.lengths.device)
        self.num_kept[row] = -1
        self.floor[row] = self.selection.floor(length)

    def store_prefill(
        self, layer: RaggedSlotLayer, row: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store a row prefill's `(1, H, L, D)` keys/values into the layer's slots of that row."""
        length = keys.shape[-2]
        ring = self._prefill_ring_positions(row, length)
        slots = self._ring_slots(ring[None], row)[0]
        for buffer, states in ((layer.keys, keys), (layer.values, values)):
            buffer[row, :, slots] = states[0, :, ring]
        if self.selection.needs_queries(length):
            layer._pending = (row, keys, values)
            request_queries(layer, layer.layer_idx)
            return
        self.keep_prefix(layer, row, keys, values, None)

    def keep_prefix(self, layer, row: int, keys: torch.Tensor, values: torch.Tensor, queries) -> None:
        """Keep the selection's positions `(1, H, n)` of the row's prompt in the layer's static slots; every layer
        keeps the same count."""
        kept, kept_keys, kept_values = self.selection.keep(
            keys, values, queries
        )  # (1, H, n), (1, H, n, D) x 2
        count = kept.shape[-1]
        layer.keys[row, :, :count], layer.values[row, :, :count] = kept_keys[0], kept_values[0]
        if int(self.num_kept[row]) < 0:
            self.num_kept[row] = count
            self.slot_positions[row, :count] = static_marks(kept)
        elif int(self.num_kept[row]) != count:
            raise RuntimeError(f"layers of one row kept {int(self.num_kept[row])} and {count} prefix tokens")

    def missing_queries(self, layer: RaggedSlotLayer) -> None:
        cancel_request(layer)
        raise ValueError(
            "a query-scored policy needs the prefill queries, but the drafter's attention did not hand them over. "
            "Run the drafter's prefill inside `hf_budgetdraft.query_capture(drafter)`, or use policy='chunk'/'streaming'"
        )

    # -- rollback and rows ---------------------------------------------------------------------------------------
    def crop_rows(self, remove: torch.Tensor) -> None:
        """`RaggedCache.crop_rows` under `slot_layout.py`'s rollback rule: refused, with the cache unchanged, when a
        row would go back before its floor or need a ring position already overwritten."""
        lengths = self._lengths_after(remove)
        held = self.slot_positions.masked_fill(self.slot_positions >= lengths[:, None], -1)
        intact = self.layout.window_intact(held[:, self.static_capacity :], self.ring_start, lengths)
        if not bool((intact & (lengths >= self.floor.to(lengths.device))).all()):
            if bool((lengths < self.floor.to(lengths.device)).any()):
                raise ValueError(
                    f"crop_rows({remove.tolist()}) goes back to {lengths.tolist()}, before the rows' floors "
                    f"{self.floor.tolist()}: a budgeted prompt's selected prefix cannot be rolled back"
                )
            raise ValueError(
                f"crop_rows({remove.tolist()}) needs ring positions already overwritten; a row can roll back only "
                f"what it wrote since its last kept token, within the slack ({self.slack})"
            )
        self.lengths = lengths
        self.slot_positions = held

    def copy_row(self, source: int, target: int) -> None:
        super().copy_row(source, target)
        for state in (self.slot_positions, self.ring_start, self.num_kept, self.floor):
            state[target] = state[source]

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        self.slot_positions, self.ring_start = self.slot_positions[rows], self.ring_start[rows]
        self.num_kept, self.floor = self.num_kept[rows], self.floor[rows]


class RaggedSinkWindowCache(RaggedDraftCache):
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
        self.num_sink_tokens = num_sink_tokens
        super().__init__(config, batch_size, SinkSelection(num_sink_tokens), window_length, slack, capacity)


class RaggedBudgetedCache(RaggedDraftCache):
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
        selection = BudgetSelection(budget, policy, policy_kwargs)
        self.budget, self.policy = budget, selection.policy
        super().__init__(config, batch_size, selection, window_length, slack, capacity)
