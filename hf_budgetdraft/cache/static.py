"""Static sparse draft caches: preallocated slot buffers and tensor bookkeeping, so a decode step has fixed shapes.

`SinkWindowCache(..., static=True)` and `BudgetedCache(..., static=True)` (`cache_config={"static": True}`) keep
exactly the keys of their dynamic layers — sink + window (Windowed-MTP, arXiv 2607.21535, §3) or a policy-selected
prefix + window (BudgetDraft, arXiv 2606.00144, §3.1), same policy code, same rollback slack — in one
`(B, H_kv, S + W + slack, D)` buffer per layer laid out as `slot_layout.py` describes.

A **step** of `q <= slack` tokens (a one-token decode step, an MTP head absorbing a round's verified tokens) writes
each new key into its slot and returns the whole buffer in slot order — no copy of the window; the length, the ring
start and the position each ring slot holds are device tensors updated in place, so a compiled step
(`torch.compile(fullgraph=True)`, CUDA graphs) never recompiles as the context grows. The step hands its `(q,
slots)` visibility mask to the attention function through the attention kwargs (`STATIC_LAYER_KWARG`); only
`attn_implementation="budgetdraft_varlen"` reads it, so a static cache refuses any other implementation (stock
`sdpa`/`eager` would read stale slots), and model families whose attention does not pass its kwargs to
`cache.update` (GPT-NeoX) cannot run one. **Longer forwards** (the prefill, blocks of more than `slack` tokens)
return `[visible past, new]` like the dynamic layers. `crop(-n)` is exact within the slack and raises beyond it.

**No device reads on the host side.** The host keeps its own copy of the length (`known_length`) and the ring's
bookkeeping (`RingSlots`), so a crop, a block and the mask sizes never wait for the device. A compiled step cannot
update a host count (the graph replays without Python); it marks the count unknown, and whoever drove it hands the
exact count back (`note_length`, as the draft loop does before each rollback) — else the next host-side use reads
the device tensor once.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from ..attention.varlen import NAME as VARLEN_NAME
from ..attention.varlen import STATIC_LAYER_KWARG
from .policies import KeepPolicy
from .prefix_selection import PrefixSelection
from .slot_layout import RingSlots, SlotLayout


def check_static_flag(static, config: PreTrainedConfig) -> None:
    """Validate a cache's `static` switch: a bool, and (if True) a model that runs `budgetdraft_varlen` attention."""
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__} ({static!r})")
    # (a config of the wrong type is refused, with its own message, by SparseDraftCache)
    if static and isinstance(config, PreTrainedConfig):
        check_static_attention(config.get_text_config(decoder=True))


def check_static_attention(config: PreTrainedConfig) -> None:
    """Raise unless the model of `config` runs `attn_implementation="budgetdraft_varlen"` (which reads the slot mask)."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None or not str(implementation).endswith(VARLEN_NAME):
        raise ValueError(
            f"static=True returns fixed slot buffers whose stale slots only attn_implementation={VARLEN_NAME!r} hides, "
            f"but the model runs attn_implementation={implementation!r}. Load the drafter with "
            f"attn_implementation={VARLEN_NAME!r} (or call drafter.set_attn_implementation({VARLEN_NAME!r})), or use "
            "static=False"
        )


def check_skip(count: int, length: int, num_sink_tokens: int) -> None:
    """Refuse a `skip` that is not a count, or that comes before the sink is full (and before any stored token)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"skip takes a count of positions >= 0, got {count!r}")
    if length < max(num_sink_tokens, 1):
        raise ValueError(
            f"skip({count}) at length {length}: store the sink ({num_sink_tokens} tokens, and at least one token) "
            "first, since skipped positions are never stored"
        )


def check_crop_after_skip(tokens_to_remove: int, length: int, skipped_to: int) -> None:
    if length + int(tokens_to_remove) < skipped_to:
        raise ValueError(
            f"crop({tokens_to_remove}) goes back to {length + int(tokens_to_remove)}, before position {skipped_to} "
            "where positions were skipped (never stored); it cannot be rolled back"
        )


class StaticDraftLayer(CacheLayerMixin):
    """One attention layer of a static draft cache: `static_capacity` static slots + a ring of `window + slack`.

    Subclasses define the static part (`_initial_ring_start`, `_static_visible`, `_num_static_visible`,
    `_steps_statically`).

    Args:
        static_capacity (`int`): static slots, S (sink tokens or the budget).
        window_length (`int`): past positions a query reads from the ring, W.
        slack (`int`): extra ring slots; the longest draft round `crop` can roll back.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, static_capacity: int, window_length: int, slack: int):
        super().__init__()
        self.static_capacity, self.window, self.slack = static_capacity, window_length, slack
        self.layout = SlotLayout(static_capacity, window_length, slack)  # device arithmetic and visibility
        self.ring = RingSlots(window_length, slack)  # host bookkeeping: ring start, oldest intact position
        self.capacity = self.layout.ring_capacity  # ring slots
        self.num_slots = self.layout.num_slots
        self.known_length: int | None = 0  # `length` on the host; None after a compiled step (read it once)
        self.length: torch.Tensor | None = None  # () long: logical length L (next position)
        self.ring_start: torch.Tensor | None = None  # () long: first position the ring holds
        self.ring_positions: torch.Tensor | None = (
            None  # (W + slack,) long: position in each ring slot, -1 = empty
        )
        self.num_static: torch.Tensor | None = None  # () long: filled static slots (budgeted)
        self._awaiting_attention = False  # a step handed over its slot mask and no attention read it yet
        self._step_tokens = 1  # tokens of the last step (its queries are the last `q` positions)

    # -- subclass hooks ------------------------------------------------------------------------------------------
    def _initial_ring_start(self) -> int:
        raise NotImplementedError

    def _steps_statically(self) -> bool:
        """Whether a one-token update is a fixed-shape step (else it goes through the block path)."""
        raise NotImplementedError

    def _static_visible(self, position: torch.Tensor) -> torch.Tensor:
        """`(q, S)` bool: static slots the queries at `position` `(q, 1)` read."""
        raise NotImplementedError

    def _num_static_visible(self, length: int) -> int:
        raise NotImplementedError

    # -- allocation ----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        batch, heads = self.batch_size, self.num_heads
        self.keys = key_states.new_zeros(batch, heads, self.num_slots, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, self.num_slots, value_states.shape[-1])
        long = dict(dtype=torch.long, device=key_states.device)
        self.length = torch.zeros((), **long)
        self.ring_start = torch.full((), self._initial_ring_start(), **long)
        self.ring_positions = torch.full((self.capacity,), -1, **long)
        self.ring.restart(self._initial_ring_start())
        self.num_static = torch.zeros((), **long)
        self._static_slots = torch.arange(self.static_capacity, **long)
        self._offsets = torch.arange(self.slack, **long)  # a step's tokens sit at length + offsets[:q]
        if (
            not torch.compiler.is_compiling()
        ):  # fixed data pointers: in-place updates never break a CUDA graph
            for tensor in (
                self.keys,
                self.values,
                self.length,
                self.ring_start,
                self.ring_positions,
                self.num_static,
            ):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    # -- the slot mask -------------------------------------------------------------------------------------------
    def key_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`(1, 1, q, S + W + slack)` bool: the slots a step's queries at consecutive `positions` `(q,)` read — the
        window before the step's first token, then the step's own tokens causally (the dynamic layers' keys)."""
        position = positions[:, None]  # (q, 1)
        ring_visible = self.layout.ring_visible(
            self.ring_positions[None], self.ring_start, position, position[:1]
        )
        return torch.cat([self._static_visible(position), ring_visible], dim=-1)[None, None]

    def consume_key_mask(self) -> torch.Tensor:
        """Called by the attention function of the step that just ran `update`: `(1, 1, q, S + W + slack)`, the mask
        of its `q` queries."""
        self._awaiting_attention = False
        return self.key_mask(self.length - self._step_tokens + self._offsets[: self._step_tokens])

    # -- updates -------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of `q <= slack` tokens: write them, return the `(B, H, S + W + slack, D)` buffers (the slot mask
        goes to the attention function). Longer: return `[visible past, new]`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._is_step(key_states.shape[-2]):
            return self._step(key_states, value_states, kwargs.get("kwargs"))
        return self._update_block(key_states, value_states)

    def _is_step(self, tokens: int) -> bool:
        return tokens <= self.slack and self._steps_statically()

    def _step(self, key_states: torch.Tensor, value_states: torch.Tensor, attention_kwargs: dict | None):
        if attention_kwargs is None:
            raise ValueError(
                "a static draft cache hands its slot mask to the attention function through the kwargs the attention "
                "module passes to cache.update(..., kwargs=kwargs); this model family calls update without them. Use "
                "static=False for this drafter"
            )
        if self._awaiting_attention:
            raise ValueError(
                "the previous step's slot mask was never read by the attention function, so that step attended to "
                f"stale slots: the drafter is not running attn_implementation={VARLEN_NAME!r}. Load it with "
                f"attn_implementation={VARLEN_NAME!r}, or use static=False"
            )
        tokens = key_states.shape[-2]
        positions = self.length + self._offsets[:tokens]  # (q,) long: the new tokens' positions
        # (q,) each; ring slots distinct (q <= slack); a sink position p < S in static slot p
        in_ring, ring_slots, slots = self.layout.placement(positions, self.ring_start)
        # stored detached: backpropagation goes through the keys `update` returns, never into the buffer
        self.keys.index_copy_(2, slots, key_states.detach())
        self.values.index_copy_(2, slots, value_states.detach())
        held = self.ring_positions.index_select(0, ring_slots)
        self.ring_positions.index_copy_(0, ring_slots, torch.where(in_ring, positions, held))
        self.length.add_(tokens)
        self._advance_known_length(tokens)
        self._step_tokens = tokens
        self._awaiting_attention = True
        attention_kwargs[STATIC_LAYER_KWARG] = self
        return self.keys, self.values

    def _advance_known_length(self, tokens: int) -> None:
        if torch.compiler.is_compiling():
            # the replayed graph cannot count on the host: `note_length` hands it back
            self.known_length = None
        elif self.known_length is not None:
            self.known_length += tokens
            self.ring.wrote_up_to(self.known_length)

    # -- the host's view ---------------------------------------------------------------------------------------------
    def note_length(self, length: int) -> None:
        """The caller's exact count of tokens this layer holds (after a compiled step, whose count stays on the
        device): host-side bookkeeping then needs no device read."""
        if self.is_initialized:
            self.known_length = length
            self.ring.wrote_up_to(length)

    def _restart_ring(self, start: int) -> None:
        """The ring holds nothing and will hold positions `[start, ...)`: its device tensors (read by a step's mask)
        and its host bookkeeping alike."""
        if self.is_initialized:
            self.ring_start.fill_(start)
            self.ring_positions.fill_(-1)
        self.ring.restart(start)

    def _length(self) -> int:
        """The logical length, from the host count (a device read only if a compiled step left it unknown)."""
        if not self.is_initialized:
            return 0
        if self.known_length is None:
            self.note_length(int(self.length))
        return self.known_length

    def _ring_index(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions `[first, last)` of the ring and their slots (ring-relative)."""
        positions = torch.arange(first, max(first, last), device=self.ring_positions.device)
        return positions, self.ring.slots(positions)

    def _window_start(self, length: int) -> int:
        return self.ring.window_start(length)

    def _visible_past(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values a block starting at `length` reads, in the dynamic layer's order: `(B, H, n, D)` each."""
        _, slots = self._ring_index(self.ring.check_window(length), length)
        index = torch.cat(
            [
                torch.arange(self._num_static_visible(length), device=slots.device),
                slots + self.static_capacity,
            ]
        )
        return self.keys.index_select(2, index), self.values.index_select(2, index)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int) -> None:
        """Store tokens at positions `[length, length + q)`: static slots below the ring start, then the ring."""
        new = key_states.shape[-2]
        into_static = min(max(self.ring.start - length, 0), new)
        if into_static:
            self.keys[:, :, length : length + into_static] = key_states[:, :, :into_static].detach()
            self.values[:, :, length : length + into_static] = value_states[:, :, :into_static].detach()
        keep = min(new - into_static, self.capacity)  # only the last `capacity` ring tokens survive
        if keep:
            positions, slots = self._ring_index(length + new - keep, length + new)
            self.keys.index_copy_(2, slots + self.static_capacity, key_states[:, :, new - keep :].detach())
            self.values.index_copy_(
                2, slots + self.static_capacity, value_states[:, :, new - keep :].detach()
            )
            self.ring_positions.index_copy_(0, slots, positions)
        self.ring.wrote_up_to(length + new)

    def _update_block(self, key_states: torch.Tensor, value_states: torch.Tensor):
        length = self._length()
        past_keys, past_values = self._visible_past(length)
        self._write(key_states, value_states, length)
        self._set_length(length + key_states.shape[-2])
        if past_keys.shape[-2] == 0:
            return key_states, value_states
        return torch.cat([past_keys, key_states], dim=-2), torch.cat([past_values, value_states], dim=-2)

    # -- sizes ---------------------------------------------------------------------------------------------------
    def num_visible_past(self, length: int | None = None) -> int:
        if length is None:
            length = self._length()
        if length == 0:
            return 0
        return self._num_static_visible(length) + max(0, length - self._window_start(length))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._is_step(query_length):
            return self.num_slots, 0
        length = self._length()
        num_past = self.num_visible_past(length)
        return num_past + query_length, length - num_past

    def get_seq_length(self) -> torch.Tensor | int:
        if not self.is_initialized:
            return 0
        if torch.compiler.is_compiling() or self.known_length is None:
            # a tensor, like transformers' StaticLayer: a compiled step reads it without a guard on its value
            return self.length.clone()
        return self.known_length

    def get_max_length(self) -> int:
        return -1

    # -- rollback ------------------------------------------------------------------------------------------------
    def _check_crop(self, tokens_to_remove) -> int:
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): sparse draft caches only take a negative count, crop(-n), "
                "to remove the last n tokens"
            )
        length = self._length()
        new_length = length + tokens_to_remove
        if new_length < 0:
            raise ValueError(f"crop({tokens_to_remove}) removes more than the {length} cached tokens")
        if self.is_initialized and not self.ring.can_roll_back_to(new_length):
            raise ValueError(
                f"crop({tokens_to_remove}) needs position {self.ring.window_start(new_length)}, already overwritten "
                f"in the ring (oldest kept: {self.ring.valid_from}); "
                f"rolling back is exact only within the slack ({self.slack} tokens). Create the cache with a "
                "larger `slack` (>= the draft length)."
            )
        return new_length

    def crop(self, tokens_to_remove) -> None:
        self._set_length(self._check_crop(tokens_to_remove))

    def _set_length(self, length: int) -> None:
        if self.is_initialized:
            # tokens past it stay in their slots, hidden by `pos <= p` until rewritten
            self.length.fill_(length)
            self.known_length = length
            self.ring.rolled_back_to(length)

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.length.zero_()
            self.num_static.zero_()
        self._restart_ring(self._initial_ring_start())
        self.known_length = 0
        self._awaiting_attention = False

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def _unsupported(self, *args, **kwargs):
        raise ValueError(
            "sparse draft caches hold one sequence per batch row; beam search/reordering is unsupported"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class StaticSinkWindowLayer(StaticDraftLayer):
    """Static `SinkWindowLayer`: `num_sink_tokens` sink slots + a ring of `window_length + slack` slots."""

    def __init__(self, num_sink_tokens: int, window_length: int, slack: int):
        super().__init__(static_capacity=num_sink_tokens, window_length=window_length, slack=slack)
        self.num_sink_tokens = num_sink_tokens
        self.skipped_to = 0  # no crop goes back before this position (positions before it were skipped)

    def _initial_ring_start(self) -> int:
        return self.num_sink_tokens

    def _steps_statically(self) -> bool:
        return True

    def _static_visible(self, position: torch.Tensor) -> torch.Tensor:
        return self._static_slots <= position  # sink slot j holds position j

    def _num_static_visible(self, length: int) -> int:
        return min(self.num_sink_tokens, length)

    def skip(self, count: int) -> None:
        """`SinkWindowLayer.skip`: advance over `count` positions never stored; the ring restarts after them."""
        length = self._length()
        check_skip(count, length, self.num_sink_tokens)
        self._set_length(length + count)
        self._restart_ring(length + count)
        self.skipped_to = length + count

    def crop(self, tokens_to_remove) -> None:
        check_crop_after_skip(tokens_to_remove, self._length(), self.skipped_to)
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.skipped_to = 0


class StaticBudgetedLayer(PrefixSelection, StaticDraftLayer):
    """Static `BudgetedLayer`: `budget` slots for the policy-selected prefix + a ring of `window_length + slack`.

    The prefill (first update) attends to the whole prompt and compresses it with `policy.select` — the same
    `PrefixSelection` as `BudgetedLayer` and the trainer's views; every later token goes to the ring.
    """

    def __init__(self, policy: KeepPolicy, budget: int, window_length: int, slack: int, layer_idx: int):
        super().__init__(static_capacity=budget, window_length=window_length, slack=slack)
        self._init_selection(policy, budget, layer_idx)
        self.prefilled = False

    def _initial_ring_start(self) -> int:
        return 0

    def _steps_statically(self) -> bool:
        return self.prefilled

    def _static_visible(self, position: torch.Tensor) -> torch.Tensor:
        # the kept prefix, always visible after the prefill
        return (self._static_slots < self.num_static).expand(position.shape[0], -1)

    def _num_static_visible(self, length: int) -> int:
        return self.num_kept

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """First call: prefill `(B, H, L, D)`, attends fully, then the prefix is compressed to the budget.
        Later calls: see `StaticDraftLayer.update`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.prefilled:
            self._prefill(key_states, value_states)
            return key_states, value_states
        self._check_not_pending()
        return super().update(key_states, value_states, *args, **kwargs)

    def _start_after_prefill(self, length: int) -> None:
        self.prefilled = True
        self._set_length(length)
        self._restart_ring(length)

    def _store_selection(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.num_static.fill_(keys.shape[-2])
        self.keys[:, :, : keys.shape[-2]] = keys
        self.values[:, :, : values.shape[-2]] = values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        self._check_not_pending()
        return super().get_mask_sizes(query_length)

    def crop(self, tokens_to_remove) -> None:
        self._set_length(self._length_after_crop(tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self.prefilled = False
        self._reset_selection()
