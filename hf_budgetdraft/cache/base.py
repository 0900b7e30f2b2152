"""What the two sparse draft caches share: a layer = a fixed "static" part + a ring window of recent tokens.

Contracts:
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

import functools
from collections.abc import Callable

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    CacheLayerMixin,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)
from transformers.utils import logging

from .ring_window import RingWindow
from .static import StaticDraftLayer

logger = logging.get_logger(__name__)
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
        self.ring.rolled_back_to(length)
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


# Layer types that keep the layer transformers' `DynamicCache` gives them: bounded already (a sliding or chunked
# window, a convolution state), holding nothing (`dummy`), or attention that selects its own keys (`indexed_attention`,
# DeepSeek-V3.2's sparse attention: its indexer reads the whole cache, so it is kept whole, and this is logged).
NATIVE_LAYER_TYPES = tuple(t for t in DYNAMIC_LAYER_TYPE_MAPPING if t not in ("full_attention", "hybrid"))
_UNBOUNDED_NATIVE = ("indexed_attention",)


class SparseDraftCache(Cache):
    """A `Cache` whose attention layers are sparse draft layers; every other layer is transformers' own.

    A full-attention layer gets `make_layer(idx)`; a `"hybrid"` layer (attention and a short convolution in one
    decoder layer, e.g. Inkling) gets it plus transformers' convolution state (`with_linear_state`). Every other
    layer type keeps the layer transformers' `DynamicCache` gives it: sliding/chunked windows and convolution states
    (LFM2's `conv` layers) are bounded already; an `indexed_attention` layer (DeepSeek-V3.2) selects its own keys
    from the whole cache and is kept whole (logged). All of them roll back exactly, transformers' layers through
    their past recording (`activate_past_recording`, then `crop(-n)`).

    All-sliding drafters: a model with no full-attention layer (Mistral with `sliding_window` on every layer, the
    sliding MTP layer of Mellum) has nothing to sparsify. It runs on its own cache, exactly as stock assisted
    generation runs it, and this is logged once. The requested window is never applied to a sliding layer, smaller
    or larger than the model's own: a sliding layer reads what the model was trained to read, at a cost bounded by
    its own window.

    Refused: layer types transformers' `DynamicCache` has no layer for, and, at the first `crop` (transformers'
    assisted generation refuses stateful models too), a layer holding a recurrent state (Mamba, gated delta net),
    which cannot be rolled back.
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
        layers = [
            _make_cache_layer(idx, layer_type, kwargs, make_layer, config.model_type)
            for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        _log_what_is_not_sparsified(type(self).__name__, config.model_type, layer_types, layers)
        super().__init__(layers=layers)
        self.max_draft_tokens = slack

    def note_length(self, length: int) -> None:
        """The caller's exact count of cached tokens, for static layers whose own count is a device tensor that a
        compiled step advances: their host-side bookkeeping (crop, blocks, mask sizes) then reads no device tensor."""
        for layer in self.layers:
            if isinstance(layer, StaticDraftLayer):
                layer.note_length(length)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens from every layer (exact within the slack, else raises)."""
        for idx, layer in enumerate(self.layers):
            if any(getattr(layer, "is_recurrent_states_initialized", {}).values()):
                raise ValueError(
                    f"crop({tokens_to_remove}): layer {idx} ({type(layer).__name__}) holds a recurrent state (a "
                    "stateful model: Mamba, gated delta net, ...), which cannot be rolled back to an earlier token, "
                    "so a rejected draft cannot be undone exactly; transformers' assisted generation refuses stateful "
                    "models too. Use a drafter made of attention and convolution layers (e.g. Llama, LFM2)."
                )
        super().crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes held by this cache's buffers (keys and values of every layer, convolution states)."""
        return cache_nbytes(self)


def _log_what_is_not_sparsified(
    cache_name: str, model_type: str, layer_types: list[str], layers: list
) -> None:
    if not any(isinstance(layer, (SparseDraftLayer, StaticDraftLayer)) for layer in layers):
        logger.warning_once(
            f"{cache_name}: {model_type!r} has no full-attention layer (layer types {sorted(set(layer_types))}), so "
            "nothing is sparsified: the draft runs on the model's own cache, as stock assisted generation does"
        )
    elif unbounded := sorted(set(layer_types) & set(_UNBOUNDED_NATIVE)):
        logger.warning_once(
            f"{cache_name}: the {unbounded} layers of {model_type!r} select their own keys from the whole cache and "
            "keep it whole (not sparsified); only its full-attention layers are bounded"
        )


def _make_cache_layer(idx: int, layer_type: str, kwargs: dict, make_layer: Callable, model_type: str):
    """Layer `idx` of a sparse draft cache: `make_layer(idx)` for full attention, transformers' own otherwise."""
    if layer_type == "full_attention":
        return make_layer(idx)
    if layer_type == "hybrid":
        return with_linear_state(make_layer(idx), **kwargs)
    if layer_type in NATIVE_LAYER_TYPES:
        return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)
    raise ValueError(
        f"layer {idx} of {model_type!r} is {layer_type!r}, a layer type transformers' DynamicCache has no cache layer "
        f"for; a sparse draft cache sparsifies 'full_attention' and 'hybrid' layers and keeps transformers' own "
        f"layer for {list(NATIVE_LAYER_TYPES)}. Use a drafter whose layers are of these types."
    )


def with_linear_state(layer: SparseDraftLayer | StaticDraftLayer, number_of_states: int = 1):
    """`layer` (a sparse attention layer) that also holds transformers' convolution state, as a `"hybrid"` layer
    type needs (attention and a short convolution in one decoder layer): the attention part is sparsified, the
    convolution state is kept and rolled back by `LinearAttentionLayer`'s own code, as in transformers'
    `LinearAttentionAndFullAttentionLayer`."""
    layer.__class__ = _hybrid_class(type(layer))
    LinearAttentionLayer.__init__(layer, number_of_states=number_of_states)
    return layer


@functools.cache
def _hybrid_class(attention_class: type) -> type:
    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # `update(keys, values)` of the attention part
            attention_class.lazy_initialization(self, *args, **kwargs)
        else:  # `update_conv_state` / `update_recurrent_state`, always by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        attention_class.crop(self, tokens_to_remove)  # checks the slack first
        LinearAttentionLayer.crop(self, tokens_to_remove)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        attention_class.reset(self)

    members = {
        "is_compileable": False,
        "lazy_initialization": lazy_initialization,
        "crop": crop,
        "reset": reset,
        "__repr__": attention_class.__repr__,
        "__module__": __name__,
    }
    # the attention class first: the instance keeps its memory layout (so `__class__` can be reassigned) and its
    # attention-side behaviour; `LinearAttentionLayer` adds the convolution-state methods
    bases = (attention_class, LinearAttentionLayer)
    return type(f"{attention_class.__name__}WithLinearState", bases, members)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of keys/values (and convolution/recurrent states) stored by any transformers `Cache` (preallocated
    layers count their buffers)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):  # sparse draft and growable layers: their preallocated buffers
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size() * 2
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
            total += sum(state.numel() * state.element_size() for state in states if state is not None)
    return total
