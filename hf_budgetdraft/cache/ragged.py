"""Ragged batch caches: the rows of one batch, each at its own length (batched speculative decoding).

After a verification round each row keeps its own number of accepted tokens, so the rows drift apart. A
`RaggedCache` keeps one length per row. A forward of `q` new tokens writes row b's tokens at its own positions
`[L_b, L_b + q)`; the caller then rolls each row back by what it rejected with `crop_rows` (exact). The cache, not
its layers, keeps the bookkeeping and builds the mask each forward needs: a `(B, 1, q, K)` custom 4D mask per layer
type, which transformers' models use as given.

Layer layouts:
- `RaggedFullLayer`: a position-indexed buffer `(B, H, capacity, D)` (slot p holds position p), for full attention
  and native sliding windows (the window is in the mask): the target's layers and a drafter's sliding ones.
- `RaggedSlotLayer` (`ragged_draft.py`): the sparse draft's `[static | ring]` slot buffer with one length per row
  — sink + window (Windowed-MTP, arXiv 2607.21535) or a policy-selected prefix + window (BudgetDraft,
  arXiv 2606.00144).

Each row is prefilled on its own (`prefill_row`: a `(1, L_b)` forward of the row's prompt without its padding, a
plain causal mask), so a row's positions in the cache are its logical positions and no prefill computes padding.
"""

from __future__ import annotations

import math

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    get_layer_types_and_kwargs,
)

from ..attention.function_parts import as_additive
from .growable import GrowableLayer
from .sizes import MAX_CACHE_TOKENS

# the one-row transformers cache layers a ragged row can start from: full ones hold positions [0, L) from their
# start, the dynamic sliding one its last tokens
SEEDABLE_LAYERS = (DynamicLayer, GrowableLayer, StaticLayer, DynamicSlidingWindowLayer)

MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")


class RaggedLayer(CacheLayerMixin):
    """What the ragged layers share: buffers `(B, H, slots, D)` owned by a `RaggedCache`, which keeps the lengths."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: RaggedCache):
        super().__init__()
        self.owner = owner

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        batch, heads = self.owner.num_rows, key_states.shape[1]
        self.keys = key_states.new_zeros(batch, heads, slots, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, slots, value_states.shape[-1])
        self.is_initialized = True

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def copy_row(self, source: int, target: int) -> None:
        if self.is_initialized:
            self.keys[target], self.values[target] = self.keys[source], self.values[source]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size() if self.is_initialized else 0


class RaggedFullLayer(RaggedLayer):
    """Full KV of one layer for B rows of different lengths: `(B, H, capacity, D)`, position p in slot p.

    `update` writes the forward's tokens at the positions the owning `RaggedCache` computed and returns the first
    `max_b(L_b) + q` slots; the cache's mask hides what a row must not read (its own stale tail, other rows' extra
    length, the sliding window's past).
    """

    def __init__(self, owner: RaggedCache, sliding_window: int | None = None):
        super().__init__(owner)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, max(self.owner.capacity, key_states.shape[-2]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Row prefill of positions `[start, end)`, `(1, H, end - start, D)`: store in the row, return the row's
        `(1, H, end, D)` (as given for a whole prompt). Step `(B, H, q, D)`: write each row at its positions, return
        `(B, H, max_b L_b + q, D)`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.owner.step
        if step.row is not None:
            if step.end > self.keys.shape[-2]:
                self._grow(step.end)
            self.keys[step.row, :, step.start : step.end] = key_states[0].detach()
            self.values[step.row, :, step.start : step.end] = value_states[0].detach()
            if step.start == 0:
                return key_states, value_states
            return self.keys[step.row : step.row + 1, :, : step.end], self.values[
                step.row : step.row + 1, :, : step.end
            ]
        if step.end > self.keys.shape[-2]:
            self._grow(step.end)
        index = step.positions[:, None, :, None]  # (B, 1, q, 1)
        self.keys.scatter_(2, index.expand_as(key_states), key_states.detach())
        self.values.scatter_(2, index.expand_as(value_states), value_states.detach())
        return self.keys[:, :, : step.end], self.values[:, :, : step.end]

    def _grow(self, needed: int) -> None:
        capacity = min(max(needed, math.ceil(self.keys.shape[-2] * 1.5)), MAX_CACHE_TOKENS)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : old.shape[-2]] = old
            setattr(self, name, new)


class RaggedEmptyLayer(RaggedLayer):
    """A layer that stores nothing: transformers' "dummy" cache layer, for one that reads an earlier layer's
    keys/values (KV sharing: the model hands it that layer's states) or has no attention. Its queries are masked as
    its attention type's (the model picks the mask by that type)."""

    def __init__(self, owner: RaggedCache, layer_idx: int):
        super().__init__(owner)
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.update(key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"layer {self.layer_idx} stores no keys/values: it reads another layer's")


class RaggedStep:
    """What one forward writes: a row's prefill (`row`, positions `[start, end)` of its prompt), or a step of every
    row at positions `(B, q)` (`end` = the keys the full layers return; `slots` `(B, q)` for slot layers; `spans`:
    each row's `(L_b, n_b)`, its first position and the queries it needs, `n_b <= q`)."""

    def __init__(
        self,
        end: int,
        row: int | None = None,
        positions: torch.Tensor | None = None,
        spans: list[tuple[int, int]] | None = None,
        start: int = 0,
    ):
        self.end, self.row, self.positions, self.spans, self.start = end, row, positions, spans, start
        self.slots: torch.Tensor | None = None


class RaggedCache(Cache):
    """A `Cache` of B rows at independent lengths, for a model of `config`.

    Every attention layer is a `RaggedFullLayer` (sliding layers keep their window, as a mask), unless
    `make_full_layer` builds another layer for full-attention layers (the sparse draft caches do); a layer that
    reads another's keys/values (transformers' "dummy") is a `RaggedEmptyLayer`. Other layer types (linear
    attention, convolutions, chunked attention) are refused.

    Use: `prefill_row(b, L_b)` before the `(1, L_b)` forward of row b's prompt (no mask: causal); then, before each
    batched forward, `step_mask(q)` (it also fixes where the forward writes) and the model's forward with that
    mask; `crop_rows(n)` drops each row's last `n[b]` tokens, `keep_rows(rows)` drops finished rows.

    Args:
        config (`PreTrainedConfig`): the model's config.
        batch_size (`int`): rows.
        capacity (`int`): positions preallocated per row (grows if a row gets longer).
        make_full_layer (`Callable`, *optional*): `(owner, layer_idx) -> layer` for full-attention layers.
    """

    def __init__(self, config: PreTrainedConfig, batch_size: int, capacity: int, make_full_layer=None):
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        self.capacity = min(max(1, capacity), MAX_CACHE_TOKENS)
        self.num_rows = batch_size
        layers = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if layer_type not in (*MASKED_LAYER_TYPES, "dummy"):
                raise ValueError(
                    f"layer {idx} of {config.model_type!r} is {layer_type!r}; batched speculative decoding runs "
                    f"models whose layers are {MASKED_LAYER_TYPES}. Generate one sequence at a time with this model"
                )
            if layer_type == "dummy":
                layers.append(RaggedEmptyLayer(self, idx))
            elif layer_type == "full_attention" and make_full_layer is not None:
                layers.append(make_full_layer(self, idx))
            else:
                layers.append(RaggedFullLayer(self, kwargs.get("sliding_window")))
        super().__init__(layers=layers)
        self.layer_types = tuple(layer_types)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # (B,): tokens held per row
        self.step: RaggedStep | None = None

    # -- sizes ---------------------------------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # what a row prefill's positions and mask are sized from: its own past (none, or its earlier chunks)
        return self.step.start if self.step is not None and self.step.row is not None else self.max_length

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    # -- one forward ---------------------------------------------------------------------------------------------
    def prefill_row(self, row: int, length: int, device: torch.device, start: int = 0) -> None:
        """Set up the prefill of row `row`: the next forward is `(1, length - start)`, its prompt's positions
        `[start, length)` (`start > 0`: a later chunk, after the row's first `start` tokens; full layers only), with
        a causal mask."""
        if not 0 <= row < self.num_rows or int(self.lengths[row]) != start:
            raise ValueError(
                f"row {row} of this {self.num_rows}-row RaggedCache does not hold exactly {start} tokens to prefill on from"
            )
        if start and not all(type(layer) in (RaggedFullLayer, RaggedEmptyLayer) for layer in self.layers):
            raise ValueError(
                "a row's prefill in chunks needs full KV layers (a sparse draft cache selects from the whole prompt)"
            )
        self.lengths = self.lengths.to(device)
        self.step = RaggedStep(length, row=row, start=start)
        self._before_forward(self.step)
        self.lengths[row] = length

    def step_mask(
        self, query_length: int, dtype: torch.dtype, needed: torch.Tensor | None = None
    ) -> torch.Tensor | dict:
        """Mask of a forward of `query_length` new tokens per row, at each row's own positions; the forward's
        writes go to positions `[L_b, L_b + q)`. `needed` `(B,)`: the queries each row needs (all `q` if `None`);
        the row-by-row attention (`ragged_rows`) computes only those, the rest are filler the caller crops."""
        offsets = torch.arange(query_length, device=self.lengths.device)
        positions = self.lengths[:, None] + offsets  # (B, q)
        end = self.max_length + query_length
        counts = (
            [query_length] * len(self.lengths) if needed is None else needed.clamp(max=query_length).tolist()
        )
        spans = list(zip(self.lengths.tolist(), counts, strict=True))
        self.step = RaggedStep(end, positions=positions, spans=spans)
        self._before_forward(self.step)
        self.lengths = self.lengths + query_length
        return self._by_layer_type(positions, dtype)

    def _before_forward(self, step: RaggedStep) -> None:
        """Hook for slot layouts (the sparse draft caches)."""

    def row_spans(self, layer_idx: int) -> list[tuple[int, int]] | None:
        """`[(L_b, n_b)] * B` when layer `layer_idx` may attend row by row this forward: a batched step, and a
        full-attention layer whose keys are position-indexed (`RaggedFullLayer` without a window). `None`: use
        the mask."""
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        plain = type(layer) is RaggedFullLayer and layer.sliding_window is None
        return self.step.spans if plain and self.step is not None and self.step.row is None else None

    def _by_layer_type(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | dict:
        """One `(B, 1, q, K)` additive mask per layer type (a dict when the model has several)."""
        query_pos = positions[:, :, None]  # (B, q, 1)
        key_pos = torch.arange(self.step.end, device=positions.device)[None, None, :]  # (1, 1, K)
        masks = {}
        for layer_type in dict.fromkeys(t for t in self.layer_types if t != "dummy"):
            layer = self.layers[self.layer_types.index(layer_type)]
            if isinstance(layer, RaggedFullLayer):
                mask = key_pos <= query_pos
                if layer.sliding_window is not None:
                    mask = mask & (key_pos > query_pos - layer.sliding_window)
            else:
                mask = self._slot_mask(positions)
            masks[layer_type] = as_additive(mask[:, None], dtype)  # sdpa and eager both read it
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _slot_mask(self, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- rollback and rows ---------------------------------------------------------------------------------------
    def crop_rows(self, remove: torch.Tensor) -> None:
        """Drop the last `remove[b]` tokens of each row `b` (`(B,)` long, >= 0)."""
        self.lengths = self._lengths_after(remove)

    def _lengths_after(self, remove: torch.Tensor) -> torch.Tensor:
        """`(B,)` lengths after removing `remove`, or `ValueError` unless `0 <= remove <= lengths`."""
        remove = remove.to(self.lengths.device)
        if bool((remove < 0).any()) or bool((remove > self.lengths).any()):
            raise ValueError(
                f"crop_rows got {remove.tolist()} for rows of lengths {self.lengths.tolist()}; expected counts in "
                "[0, length]"
            )
        return self.lengths - remove

    def copy_row(self, source: int, target: int) -> None:
        """Make row `target` (empty) hold what row `source` holds: a row whose prompt equals a prefilled one's."""
        rows = self.lengths.shape[0]
        if not (0 <= source < rows and 0 <= target < rows) or int(self.lengths[target]):
            raise ValueError(
                f"copy_row({source}, {target}) on a {rows}-row RaggedCache with lengths "
                f"{self.lengths.tolist()}; expected two rows of it, the second empty"
            )
        self.lengths[target] = self.lengths[source]
        for layer in self.layers:
            layer.copy_row(source, target)

    def seed_row(self, row: int, source: Cache, device: torch.device) -> int:
        """Fill empty row `row` with what `source`, a one-row transformers cache of the same model (dynamic,
        growable or static; offloaded layers too), holds, on `device`; returns its length L. The row's prefill then
        continues at position L."""
        held = int(source.get_seq_length())
        if len(source.layers) != len(self.layers) or int(self.lengths[row]):
            raise ValueError(
                f"seed_row({row}) from a {len(source.layers)}-layer cache into row {row} of a {len(self.layers)}-layer "
                f"RaggedCache with lengths {self.lengths.tolist()}; expected the same model's cache and an empty row"
            )
        for idx, (layer, given) in enumerate(zip(self.layers, source.layers, strict=True)):
            if held == 0:
                break
            if type(layer) is RaggedEmptyLayer:
                continue
            keys, values = (states.to(device) for states in self._held_states(idx, layer, given, held))
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys[row, :, held - keys.shape[-2] : held] = keys[0]
            layer.values[row, :, held - keys.shape[-2] : held] = values[0]
        self.lengths[row] = held
        return held

    @staticmethod
    def _held_states(idx: int, layer, given, held: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(1, H, n, D)` keys/values of the last `n` positions before `held` that `given` keeps (n = held for a
        full layer)."""
        sliding = bool(getattr(given, "is_sliding", False))
        usable = type(given) in SEEDABLE_LAYERS and not (sliding and isinstance(given, StaticLayer))
        if not usable or type(layer) is not RaggedFullLayer or sliding != layer.is_sliding:
            raise ValueError(
                f"layer {idx} of the cache passed is a {type(given).__name__}; a batched call starts its rows from "
                "a one-row DynamicCache, GrowableCache or StaticCache of the target (a static cache's layers full "
                "attention)"
            )
        if given.keys.shape[0] != 1:
            raise ValueError(
                f"the cache passed holds {given.keys.shape[0]} rows; a batched call starts its rows from a one-row "
                "cache (the prompt's prefix, prefilled once)"
            )
        if sliding:
            return given.keys, given.values
        if given.keys.shape[-2] < held:
            raise ValueError(
                f"layer {idx} of the cache passed keeps {given.keys.shape[-2]} of its {held} tokens"
            )
        return given.keys[:, :, :held], given.values[:, :, :held]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows `rows` (`(B',)` long indices), in that order (finished rows leave the batch)."""
        self.lengths = self.lengths[rows]
        for layer in self.layers:
            layer.keep_rows(rows)

    def _unsupported(self, *args, **kwargs):
        raise ValueError(
            "a RaggedCache is for batched speculative decoding; beam search/reordering is unsupported"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported
