"""`StaticDraftLayer`: the static storage of a sparse draft cache, so a decode step has fixed shapes.

`SinkWindowCache(..., static=True)` and `BudgetedCache(..., static=True)` (`cache_config={"static": True}`) keep
exactly the keys of the dynamic `DraftLayer` — same selection, same slots, same rollback rule — and add device-side
bookkeeping: the length, the ring start and the position each slot holds are device tensors updated in place.

A **step** of `q <= slack` tokens after the prefill (a one-token decode step, an MTP head absorbing a round's
verified tokens) writes each new key into its slot and returns the whole `(B, H_kv, S + W + slack, D)` buffers — no
copy of the window — so a compiled step (`torch.compile(fullgraph=True)`, CUDA graphs) never recompiles as the
context grows. The step hands its `(q, slots)` visibility mask to the attention function through the attention
kwargs (`STATIC_LAYER_KWARG`); where the attention passes no kwargs to `cache.update` (GPT-NeoX, every family before
transformers 5.24), or reuses these keys past Gemma 3n / Gemma 4's KV-sharing point, the attention function finds
the layer through its key buffer (`KEYS_OWNER`). Only `attn_implementation="budgetdraft_varlen"` reads it, so a static
cache refuses any other implementation (stock `sdpa`/`eager` would read stale slots); families whose attention
transforms the keys between the cache and the attention function without passing its kwargs (DeepSeek-V3's latents
before 5.24) or that add a position bias over the keys (Inkling: built on contiguous key positions, which the slots
are not; the step refuses it) cannot run one. **Longer forwards**
(the prefill, blocks of more than `slack` tokens) go through `DraftLayer`'s path and return `[visible past, new]`.

**No device reads on the host side.** The host keeps its own copy of the length and the ring's bookkeeping, so a
crop, a block and the mask sizes never wait for the device. A compiled step cannot update a host count (the graph
replays without Python); it marks the count unknown, and whoever drove it hands the exact count back
(`note_length`, as the draft loop does before each rollback) — else the next host-side use reads the device tensor
once.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from ..attention.varlen import KEYS_OWNER, STATIC_LAYER_KWARG
from ..attention.varlen import NAME as VARLEN_NAME
from .draft_layer import DraftLayer
from .selection import Selection
from .slot_layout import static_marks


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


class StaticDraftLayer(DraftLayer):
    """`DraftLayer` with device bookkeeping and a fixed-shape step (see the module docstring)."""

    is_compileable = True

    def __init__(self, selection: Selection, window_length: int, slack: int, layer_idx: int = 0):
        super().__init__(selection, window_length, slack, layer_idx)
        self.length: torch.Tensor | None = None  # () long: logical length L (next position)
        self.ring_start: torch.Tensor | None = None  # () long: first position the ring holds
        self.slot_positions: torch.Tensor | None = (
            None  # (S + W + slack,) long: position in each slot, -1 = empty
        )
        self._awaiting_attention = False  # a step handed over its slot mask and no attention read it yet
        self._step_tokens = 1  # tokens of the last step (its queries are the last `q` positions)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        long = dict(dtype=torch.long, device=key_states.device)
        self.length = torch.full((), self._length(), **long)
        self.ring_start = torch.full((), self.ring.start, **long)
        self.slot_positions = torch.full((self.num_slots,), -1, **long)
        self._offsets = torch.arange(self.slack, **long)  # a step's tokens sit at length + offsets[:q]
        setattr(self.keys, KEYS_OWNER, self)  # a layer reusing these keys finds their slot mask through them
        if (
            not torch.compiler.is_compiling()
        ):  # fixed data pointers: in-place updates never break a CUDA graph
            for tensor in (self.keys, self.values, self.length, self.ring_start, self.slot_positions):
                torch._dynamo.mark_static_address(tensor)

    # -- the step ------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of `q <= slack` tokens: write them, return the `(B, H, S + W + slack, D)` buffers (the slot mask
        goes to the attention function). Otherwise `DraftLayer.update`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._is_step(key_states.shape[-2]):
            return self._step(key_states, value_states, kwargs.get("kwargs"))
        return super().update(key_states, value_states, *args, **kwargs)

    def _is_step(self, tokens: int) -> bool:
        return tokens <= self.slack and self.prefilled

    def _step(self, key_states: torch.Tensor, value_states: torch.Tensor, attention_kwargs: dict | None):
        if self._awaiting_attention:
            raise ValueError(
                "the previous step's slot mask was never read by the attention function, so that step attended to "
                f"stale slots: the drafter is not running attn_implementation={VARLEN_NAME!r}. Load it with "
                f"attn_implementation={VARLEN_NAME!r}, or use static=False"
            )
        self._check_not_pending()
        self._check_refreshed()
        tokens = key_states.shape[-2]
        positions = self.length + self._offsets[:tokens]  # (q,) long: the new tokens' positions
        # ring slots distinct (q <= slack); a position below the ring start (a sink) in static slot p
        slots = self.layout.slots(positions, self.ring_start)
        # stored detached: backpropagation goes through the keys `update` returns, never into the buffer
        self.keys.index_copy_(2, slots, key_states.detach())
        self.values.index_copy_(2, slots, value_states.detach())
        self.slot_positions.index_copy_(0, slots, positions)
        self.length.add_(tokens)
        self._advance_known_length(tokens)
        self._step_tokens = tokens
        self._awaiting_attention = True
        if attention_kwargs is not None:  # (else the attention function finds this layer through `self.keys`)
            attention_kwargs[STATIC_LAYER_KWARG] = self
        return self.keys, self.values

    def before_attention(self, query: torch.Tensor, scaling: float) -> None:
        """Called by the attention function of the step that just ran `update`, before it reads the buffers, with its
        queries `(B, H_q, q, D)` and scaling: a refreshing selection re-selects the static slots with the last query
        (fixed shapes, in place: a compiled step holds it too)."""
        if self.prompt is not None:
            self._reselect(self.keys, self.values, query[:, :, -1] * scaling)

    def _advance_known_length(self, tokens: int) -> None:
        if torch.compiler.is_compiling():
            # the replayed graph cannot count on the host: `note_length` hands it back
            self.known_length = None
        elif self.known_length is not None:
            self.known_length += tokens
            self.ring.wrote_up_to(self.known_length)

    def key_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`(1, 1, q, S + W + slack)` bool: the slots a step's queries at consecutive `positions` `(q,)` read — the
        static slots, the window before the step's first token, then the step's own tokens causally (the keys
        `DraftLayer` returns)."""
        position = positions[:, None]  # (q, 1)
        return self.layout.visible(self.slot_positions, self.ring_start, position, position[:1])[None, None]

    def consume_key_mask(self) -> torch.Tensor:
        """Called by the attention function of the step that just ran `update`: `(1, 1, q, S + W + slack)`, the mask
        of its `q` queries."""
        self._awaiting_attention = False
        return self.step_key_mask()

    def step_key_mask(self) -> torch.Tensor:
        """`(1, 1, q, S + W + slack)`: the mask of the last step's `q` queries (also read by layers that reuse this
        layer's keys: Gemma 3n / Gemma 4 past their KV-sharing point)."""
        return self.key_mask(self.length - self._step_tokens + self._offsets[: self._step_tokens])

    # -- device bookkeeping beside the host's ------------------------------------------------------------------------
    def _store_static(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        super()._store_static(keys, values, positions)
        # a kept slot is marked with the earliest position any head keeps there: every later query reads it
        self.slot_positions[: positions.shape[-1]] = static_marks(positions)

    def _wrote(self, slot: int, position: int, count: int) -> None:
        self.slot_positions[slot : slot + count] = torch.arange(
            position, position + count, device=self.keys.device
        )

    def _set_length(self, length: int) -> None:
        # tokens past it stay in their slots, hidden by `held <= query` until rewritten
        super()._set_length(length)
        if self.is_initialized:
            self.length.fill_(length)

    def _restart_ring(self, start: int) -> None:
        super()._restart_ring(start)
        if self.is_initialized:
            self.ring_start.fill_(start)
            self.slot_positions[self.static_capacity :] = -1

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self.slot_positions.fill_(-1)
        self._awaiting_attention = False

    # -- the host's view -----------------------------------------------------------------------------------------
    def note_length(self, length: int) -> None:
        """The caller's exact count of tokens this layer holds (after a compiled step, whose count stays on the
        device): host-side bookkeeping then needs no device read."""
        if self.is_initialized:
            self.known_length = length
            self.ring.wrote_up_to(length)

    def _length(self) -> int:
        """The logical length, from the host count (a device read only if a compiled step left it unknown)."""
        if self.known_length is None:
            self.note_length(int(self.length))
        return self.known_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        self._check_not_pending()
        if self._is_step(query_length):
            return self.num_slots, 0
        return super().get_mask_sizes(query_length)

    def get_seq_length(self) -> torch.Tensor | int:
        if self.is_initialized and (torch.compiler.is_compiling() or self.known_length is None):
            # a tensor, like transformers' StaticLayer: a compiled step reads it without a guard on its value
            return self.length.clone()
        return self._length()
