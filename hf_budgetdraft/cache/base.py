"""What the two sparse draft caches share: a layer = a fixed "static" part + a ring window of recent tokens.

Contracts (DESIGN.md §3):
- keys are stored with their absolute RoPE rotation; `get_seq_length()` is the logical length;
- `update` returns `[static part, ring window, new tokens]` in that order and `get_mask_sizes` reports exactly
  that many keys, with an offset that makes every kept past key visible to every new query and keeps the new
  block causal (kept past keys are mapped to the positions just before the new block);
- per-layer memory is bounded by the policy, independent of context length;
- `crop(-n)` is exact while the new length is at most `slack` below the furthest length reached (so always
  for a draft round of <= slack tokens rolled back), else it
  raises: a draft cache is never silently corrupted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from .ring_window import RingWindow
from .static import StaticDraftLayer

MAX_CACHE_TOKENS = 1 << 22  # bound on any user-given size, so a typo cannot allocate terabytes


def check_size(name: str, value, minimum: int) -> None:
    """Raise `TypeError`/`ValueError` naming `name` unless `minimum <= value <= MAX_CACHE_TOKENS`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if not minimum <= value <= MAX_CACHE_TOKENS:
        raise ValueError(f"{name} must be in [{minimum}, {MAX_CACHE_TOKENS}], got {value}")


class SparseDraftLayer(CacheLayerMixin):
    """One attention layer of a sparse draft cache: `static` keys (sink or budgeted selection) + `ring`.

    Subclasses decide what goes into the static part (`_num_static`, `_store`).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, window_length: int, slack: int, static_capacity: int):
        super().__init__()
        self.ring = RingWindow(window_length, slack)
        self.static_capacity = static_capacity
        self.static_keys: torch.Tensor | None = None  # (B, H, static_capacity, D)
        self.static_values: torch.Tensor | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.static_keys = key_states.new_zeros(
            *key_states.shape[:2], self.static_capacity, key_states.shape[-1]
        )
        self.static_values = value_states.new_zeros(
            *value_states.shape[:2], self.static_capacity, value_states.shape[-1]
        )
        self.ring.allocate(key_states, value_states, start=self._ring_start())
        self.is_initialized = True

    def _ring_start(self) -> int:
        return 0

    def _num_static(self, length: int) -> int:
        """How many static entries a query at logical length `length` reads."""
        raise NotImplementedError

    def num_visible_past(self, length: int | None = None) -> int:
        length = self.cumulative_length if length is None else length
        if length == 0:
            return 0
        return self._num_static(length) + self.ring.num_visible(length)

    def visible_past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Past keys/values a new query reads, in order: `(B, H, n_i, D)` views (static part, then the ring's one or
        two contiguous pieces) whose lengths sum to `num_visible_past()`; nothing is copied."""
        length = self.cumulative_length
        n_static = self._num_static(length) if length else 0
        static = (
            [(self.static_keys[:, :, :n_static], self.static_values[:, :, :n_static])] if n_static else []
        )
        return static + self.ring.read(length)

    def _with_past(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`[visible past, new]` keys and values, `(B, H, num_visible_past() + q, D)`, built with one copy each."""
        pieces = self.visible_past()
        if not pieces:
            return key_states, value_states
        pieces.append((key_states, value_states))
        return torch.cat([k for k, _ in pieces], dim=-2), torch.cat([v for _, v in pieces], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        num_past = self.num_visible_past()
        return num_past + query_length, self.cumulative_length - num_past

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def _check_crop(self, tokens_to_remove: int) -> int:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): sparse draft caches only take a negative count, crop(-n), "
                "to remove the last n tokens"
            )
        new_length = self.cumulative_length + tokens_to_remove
        if new_length < 0:
            raise ValueError(
                f"crop({tokens_to_remove}) removes more than the {self.cumulative_length} cached tokens"
            )
        if not self.ring.can_roll_back_to(new_length):
            raise ValueError(
                f"crop({tokens_to_remove}) needs position {self.ring.window_start(new_length)}, already evicted "
                f"(oldest kept: {self.ring.valid_from}); rolling back is exact only within the slack "
                f"({self.ring.slack} tokens). Create the cache with a larger `slack` (>= the draft length)."
            )
        return new_length

    def crop(self, tokens_to_remove: int) -> None:
        self._set_length(self._check_crop(tokens_to_remove))

    def _set_length(self, length: int) -> None:
        if length <= self.ring.start:  # everything in the ring is now in the future: forget it
            self.ring.restart(self.ring.start)
        self.cumulative_length = length

    def reset(self) -> None:
        if self.is_initialized:
            self.static_keys.zero_()
            self.static_values.zero_()
            self.ring.restart(self._ring_start())
        self.cumulative_length = 0

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        static = self.static_keys.numel() * self.static_keys.element_size()
        return 2 * static + self.ring.nbytes()

    def _unsupported(self, *args, **kwargs):
        raise ValueError(
            "sparse draft caches hold one sequence per batch row; beam search/reordering is unsupported"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


class SparseDraftCache(Cache):
    """A `Cache` whose full-attention layers are sparse draft layers.

    Sliding-window and chunked layers already have a bounded cost; they keep transformers' own
    `DynamicSlidingWindowLayer`. A model with no full-attention layer has nothing to sparsify.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        make_layer: Callable[[int], SparseDraftLayer | StaticDraftLayer],
        slack: int,
    ):
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"config must be the model's PreTrainedConfig (e.g. `config=model.config`), got {type(config).__name__}"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if layer_type == "full_attention":
                layers.append(make_layer(idx))
            elif layer_type in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(**kwargs))
            elif layer_type == "dummy":
                layers.append(DummyLayer())
            else:
                raise ValueError(
                    f"layer {idx} of {config.model_type!r} is {layer_type!r}; a sparse draft cache can only replace "
                    "attention KV caches (full, sliding, chunked). Use a drafter with standard attention layers."
                )
        if not any(isinstance(layer, (SparseDraftLayer, StaticDraftLayer)) for layer in layers):
            raise ValueError(
                f"{config.model_type!r} with layer types {sorted(set(layer_types))} has no full-attention layer: its "
                "cache is already bounded by its sliding window, there is nothing for a sparse draft cache to do"
            )
        super().__init__(layers=layers)
        self.max_draft_tokens = slack

    def nbytes(self) -> int:
        """Bytes held by this cache's buffers (keys and values of every layer)."""
        return cache_nbytes(self)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of keys/values stored by any transformers `Cache` (preallocated layers count their buffers)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):  # sparse draft and growable layers: their preallocated buffers
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size() * 2
    return total
