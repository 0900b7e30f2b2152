"""`DraftLayer`: one attention layer of a sparse draft cache, the dynamic storage of any `Selection`.

Windowed-MTP (arXiv 2607.21535) and BudgetDraft (arXiv 2606.00144, §3.1) drafts read a few static positions and a
window of recent ones. The layer holds `(B, H, S + W + slack, D)` slots (`slot_layout.py`): the selection fills the
static slots at the prefill (the first update, which attends to the whole prompt), the ring keeps the most recent
tokens. Contracts:
- keys are stored with their absolute RoPE rotation; `get_seq_length()` is the logical length;
- an update after the prefill returns `[static, ring window, new]` keys (views of the slots, one copy), and
  `get_mask_sizes` reports exactly that many, with an offset that makes every kept past key visible to every new
  query and keeps the new block causal;
- memory is bounded by the layout, independent of context length;
- `crop(-n)` is exact under the rollback rule of `slot_layout.py`, else it raises: never silently corrupted.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.query_capture import cancel_request, request_queries
from .selection import Selection
from .slot_layout import RingSlots, SlotLayout, rollback_length

PROMPT_FLOOR = (
    "the prompt's selected prefix (the compressed prefix) cannot be rolled back; only tokens added after it"
)
SKIP_FLOOR = "positions from there on were skipped (never stored), so they cannot be rolled back"


class DraftLayer(CacheLayerMixin):
    """A sparse draft cache layer: `selection`'s static slots + a ring of the `window_length` most recent tokens
    (+ `slack` slots, the longest round `crop` undoes). `layer_idx` names the layer to the query capture."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, selection: Selection, window_length: int, slack: int, layer_idx: int = 0):
        super().__init__()
        self.selection, self.layer_idx = selection, layer_idx
        self.layout = SlotLayout(selection.static_capacity, window_length, slack)
        self.static_capacity, self.window, self.slack = selection.static_capacity, window_length, slack
        self.num_slots = self.layout.num_slots
        self.ring = RingSlots(window_length, slack)  # host bookkeeping: ring start, oldest intact position
        self._clear_host_state()

    def _clear_host_state(self) -> None:
        self.known_length: int | None = 0  # the logical length L on the host
        self.prefix_length: int | None = None  # the prompt's length, set by the prefill
        # whether the prefill ran: what a compiled step reads (a guard on `prefix_length` would recompile the step
        # for every prompt length)
        self.prefilled = False
        self.kept_positions = None  # (B, H, n) prompt positions in the static slots
        self.num_kept = 0  # n
        self.floor, self.floor_reason = 0, ""
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # prefill K/V awaiting queries
        # a refreshing selection's index of the prompt (tensors), and the K/V a step returned, awaiting its queries
        self.prompt: tuple[torch.Tensor, ...] | None = None
        self._refresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(*key_states.shape[:2], self.num_slots, key_states.shape[-1])
        self.values = value_states.new_zeros(*value_states.shape[:2], self.num_slots, value_states.shape[-1])
        self.is_initialized = True

    # -- updates ---------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `(B, H, L, D)`: returned as given (it attends to the whole prompt) while the selection fills the
        static slots. Later: `(B, H, visible past + q, D)`, and the new tokens are stored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.prefix_length is None:
            self._prefill(key_states, value_states)
            return key_states, value_states
        self._check_refreshed()
        length = self._length()
        keys, values = self._with_past(key_states, value_states, length)
        self._write(key_states, value_states, length)
        self._set_length(length + key_states.shape[-2])
        self._ask_for_queries(keys, values)
        return keys, values

    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        length, ring_start = key_states.shape[-2], self.selection.ring_start(key_states.shape[-2])
        self.prefix_length, self.prefilled = length, True
        self.floor, self.floor_reason = self.selection.floor(length), PROMPT_FLOOR
        self._restart_ring(ring_start)
        self._set_length(length)
        first = min(ring_start, length)  # the prompt's tail the ring keeps (none for a budget)
        self._write(key_states[:, :, first:], value_states[:, :, first:], first)
        if self.selection.needs_queries(length):
            self._pending = (key_states, value_states)
            request_queries(self, self.layer_idx, key_states)  # `update` returns these keys
        else:
            self._keep(key_states, value_states, None)

    def receive_queries(self, queries: torch.Tensor) -> None:
        """Called by the capturing attention function, before it attends, with the queries `(B, H_q, q, D)` of the
        prefill (a query-scored selection) or of a step (a refreshing one)."""
        cancel_request(self)  # served: a request left behind would keep this layer and its keys alive
        if self._pending is not None:
            keys, values = self._pending
            self._pending = None
            self._keep(keys, values, queries)
        elif self._refresh is not None:
            self._reselect(*self._refresh, queries[:, :, -1])

    def _ask_for_queries(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After a step's update: a refreshing selection asks for the step's queries, to re-select the static part
        of the keys and values `(B, H, S + ..., D)` the step returned before its attention reads them."""
        if self.prompt is not None:
            self._refresh = (keys, values)
            request_queries(self, self.layer_idx, keys)

    def _reselect(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        """Fill the static part of the `keys`/`values` a step returned (the static layer's slots themselves, the
        dynamic layer's `[static, window, new]` copy, which every step rebuilds from its slots before re-selecting)
        with the prompt positions the step's last query `(B, H_q, D)` (times the scaling) selects. Every kept position
        is a prompt position, which every later query reads: the slots' visibility needs no update."""
        self._refresh = None
        choice, kept_keys, kept_values = self.selection.reselect(self.prompt, query)
        if not torch.compiler.is_compiling():  # bookkeeping a replayed graph could not keep
            self._choice = choice  # turned into positions only if read
        keys[:, :, : self.num_kept].copy_(kept_keys)
        values[:, :, : self.num_kept].copy_(kept_values)

    @property
    def kept_positions(self) -> torch.Tensor | None:
        """`(B, H, n)` the prompt positions in the static slots (a refreshing selection's: those the latest step
        read)."""
        if self._choice is not None:
            self._kept_positions, self._choice = self.selection.positions(self._choice, self.prompt), None
        return self._kept_positions

    @kept_positions.setter
    def kept_positions(self, positions: torch.Tensor | None) -> None:
        self._kept_positions, self._choice = positions, None

    def _check_refreshed(self) -> None:
        if self._refresh is not None:
            cancel_request(self)
            self._refresh = None
            raise ValueError(
                f"policy={self.selection.policy.name!r} selects again at every step with the step's queries, but the "
                f"attention of layer {self.layer_idx} did not hand them over, so the last step read a stale selection. "
                "Run the drafter inside `hf_budgetdraft.query_capture(drafter)` (generate() with "
                "cache_implementation='budgeted' does this for you), or use policy='chunk'."
            )

    def _check_not_pending(self) -> None:
        if self._pending is not None:
            cancel_request(self)
            self._pending = None
            raise ValueError(
                f"policy={self.selection.policy.name!r} scores the prefix with the prefill queries of layer "
                f"{self.layer_idx}, but the model's attention did not hand them over. Run the model inside "
                "`hf_budgetdraft.query_capture(model)` (generate() with cache_implementation='budgeted' does this "
                "for you); it serves attention that goes through transformers' attention interface, or that calls "
                "torch SDPA / `query @ key^T` on the keys the cache returned. Otherwise use a policy without "
                "queries: policy='streaming', or policy='chunk' with query_proxy='last_key'."
            )

    def _keep(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Store the selection's prompt positions `(B, H, n)` in static slots `[0, n)`."""
        positions, kept_keys, kept_values = self.selection.keep(keys.detach(), values.detach(), queries)
        self.kept_positions, self.num_kept = positions, positions.shape[-1]
        self._store_static(kept_keys, kept_values, positions)
        self.prompt = self.selection.index(keys.detach(), values.detach())

    def _store_static(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys[:, :, : keys.shape[-2]] = keys
        self.values[:, :, : values.shape[-2]] = values

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int) -> None:
        """Store tokens at positions `[first, first + q)`: below the ring start in static slot p (a sink), the rest
        in the ring, of which only the last `W + slack` survive."""
        new = key_states.shape[-2]
        for slot, position, count in self._runs(first, new):
            source = slice(position - first, position - first + count)
            # stored detached: backpropagation goes through the keys `update` returns, never into the buffer
            self.keys[:, :, slot : slot + count] = key_states[:, :, source].detach()
            self.values[:, :, slot : slot + count] = value_states[:, :, source].detach()
            self._wrote(slot, position, count)
        self.ring.wrote_up_to(first + new)

    def _runs(self, first: int, new: int) -> list[tuple[int, int, int]]:
        """`(slot, position, count)` runs of contiguous slots where positions `[first, first + new)` go."""
        into_static = min(max(self.ring.start - first, 0), new)
        runs = [(first, first, into_static)] if into_static else []
        kept = min(new - into_static, self.ring.capacity)
        position = first + new - kept
        while kept:
            slot = self.static_capacity + (position - self.ring.start) % self.ring.capacity
            count = min(kept, self.num_slots - slot)
            runs.append((slot, position, count))
            position, kept = position + count, kept - count
        return runs

    def _wrote(self, slot: int, position: int, count: int) -> None:
        """Hook: slots `[slot, slot + count)` now hold positions `[position, position + count)`."""

    # -- reads ---------------------------------------------------------------------------------------------------
    def visible_past(self, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Past keys/values a query at `length` reads, in order: `(B, H, n_i, D)` views (static slots, then the
        ring's one or two contiguous pieces) whose lengths sum to `num_visible_past(length)`; nothing is copied."""
        length = self._length() if length is None else length
        n_static = self._num_static_at(length)
        pieces = [(self.keys[:, :, :n_static], self.values[:, :, :n_static])] if n_static else []
        first = self.ring.check_window(length)
        if length <= first:
            return pieces
        head = self.static_capacity + (first - self.ring.start) % self.ring.capacity
        tail = head + (length - first)
        if tail <= self.num_slots:
            return [*pieces, (self.keys[:, :, head:tail], self.values[:, :, head:tail])]
        wrapped = self.static_capacity + tail - self.num_slots
        ring_head = slice(head, None)
        ring_tail = slice(self.static_capacity, wrapped)
        return [
            *pieces,
            (self.keys[:, :, ring_head], self.values[:, :, ring_head]),
            (self.keys[:, :, ring_tail], self.values[:, :, ring_tail]),
        ]

    def _with_past(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int):
        """`[visible past, new]` keys and values, `(B, H, num_visible_past() + q, D)`, one copy each."""
        pieces = self.visible_past(length)
        if not pieces:
            return key_states, value_states
        pieces.append((key_states, value_states))
        return torch.cat([k for k, _ in pieces], dim=-2), torch.cat([v for _, v in pieces], dim=-2)

    def _num_static_at(self, length: int) -> int:
        """Static slots a query at `length` reads: the prompt positions the selection kept, then any position written
        below the ring start since (a sink filled after a short prompt), each in its own slot."""
        if length == 0 or self.prefix_length is None:
            return 0
        self._check_not_pending()
        written_since = max(0, min(self.ring.start, length) - self.prefix_length)
        return min(length, self.static_capacity, self.num_kept + written_since)

    def num_visible_past(self, length: int | None = None) -> int:
        length = self._length() if length is None else length
        return self._num_static_at(length) + self.ring.num_visible(length) if length else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self._length()
        num_past = self.num_visible_past(length)
        return num_past + query_length, length - num_past

    def get_seq_length(self) -> int:
        return self._length()

    def get_max_length(self) -> int:
        return -1

    def _length(self) -> int:
        return self.known_length

    # -- rollback ------------------------------------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (`slot_layout.py`'s rollback rule; raises beyond it)."""
        length = rollback_length(tokens_to_remove, self._length(), self.ring, self.floor, self.floor_reason)
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self.known_length = length
        self.ring.rolled_back_to(length)

    def _restart_ring(self, start: int) -> None:
        """The ring holds nothing and will hold positions `[start, ...)`."""
        self.ring.restart(start)

    def skip(self, count: int) -> None:
        """Advance over `count` positions that are never stored: they would leave the window before any query reads
        them. Needs a selection that allows it (a sink) and a full sink; no crop goes back before the new length."""
        length = self._length()
        if not self.selection.can_skip:
            raise ValueError(
                f"skip() needs a sink selection, this layer keeps a {type(self.selection).__name__}"
            )
        check_skip(count, length, self.static_capacity)
        self._set_length(length + count)
        self._restart_ring(length + count)
        self.floor, self.floor_reason = length + count, SKIP_FLOOR

    def reset(self) -> None:
        if self._pending is not None or self._refresh is not None:
            cancel_request(self)
        self._clear_host_state()
        self._restart_ring(0)
        self._set_length(0)

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        tensors = (self.keys, self.values, *(self.prompt or ()))
        return sum(t.numel() * t.element_size() for t in tensors)

    def _unsupported(self, *args, **kwargs):
        raise ValueError(
            "sparse draft caches hold one sequence per batch row; beam search/reordering is unsupported"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


def check_skip(count: int, length: int, num_sink_tokens: int) -> None:
    """Refuse a `skip` that is not a count, or that comes before the sink is full (and before any stored token)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"skip takes a count of positions >= 0, got {count!r}")
    if length < max(num_sink_tokens, 1):
        raise ValueError(
            f"skip({count}) at length {length}: store the sink ({num_sink_tokens} tokens, and at least one token) "
            "first, since skipped positions are never stored"
        )
