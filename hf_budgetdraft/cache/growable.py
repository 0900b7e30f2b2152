"""`GrowableCache`: a full KV cache whose append does not copy the whole cache.

transformers' `DynamicLayer.update` is `torch.cat([keys, new])`: every step copies the whole cache, a cost that
grows with context (`benchmarks/verify_cost.py --setups sdpa+growable` isolates it). A `GrowableLayer` keeps keys/values in a preallocated
`(B, H, capacity, D)` buffer, writes the new tokens in place and returns a view of the first `length` positions;
when the buffer is full it grows geometrically (x`growth_factor`), so appends cost O(new tokens) amortised.
`crop(-n)` only moves the length back: exact, free, and what assisted generation does after every verification.

It is what the target runs on when speculating with this package's draft caches, and a plain AR cache:

    >>> cache = GrowableCache(config=model.config)
    >>> out = model.generate(input_ids, cache=cache, max_new_tokens=64)
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, get_layer_types_and_kwargs

from .sizes import cache_nbytes, check_size

_MAX_GROWTH_FACTOR = 16.0


def _check_growth_factor(growth_factor) -> None:
    if (
        not isinstance(growth_factor, (int, float))
        or isinstance(growth_factor, bool)
        or not 1.0 < growth_factor <= _MAX_GROWTH_FACTOR
    ):
        raise ValueError(
            f"growth_factor must be a number in (1, {_MAX_GROWTH_FACTOR:g}], got {growth_factor!r}; 2.0 doubles "
            "the buffer when it is full (amortised O(1) appends)"
        )


class GrowableLayer(CacheLayerMixin):
    """Full-attention cache layer in a preallocated buffer with amortised geometric growth.

    `update` returns views `(B, H, length, D)` of the buffer; they stay valid until the next `update`/`crop` of
    this layer (a later update may overwrite cropped positions in place). Stored detached: with gradients on, the
    returned keys are `cat([past, new])` so a training step backpropagates through the new keys.

    Args:
        initial_capacity (`int`, defaults to 1024): tokens preallocated at the first update (more if the first
            update is longer).
        growth_factor (`float`, defaults to 2.0): capacity multiplier when the buffer is full.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, initial_capacity: int = 1024, growth_factor: float = 2.0):
        check_size("initial_capacity", initial_capacity, 1)
        _check_growth_factor(growth_factor)
        super().__init__()
        self.initial_capacity = initial_capacity
        self.growth_factor = float(growth_factor)
        self.key_buffer: torch.Tensor | None = None  # (B, H, capacity, D_k)
        self.value_buffer: torch.Tensor | None = None  # (B, H, capacity, D_v)
        self.cumulative_length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.key_buffer is None else self.key_buffer.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        capacity = max(self.initial_capacity, key_states.shape[-2])
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[-1])
        self.is_initialized = True
        self._sync_views()

    def _sync_views(self) -> None:
        # `keys`/`values` are what transformers (and users) read: the first `length` positions of the buffers
        self.keys = self.key_buffer[:, :, : self.cumulative_length]
        self.values = self.value_buffer[:, :, : self.cumulative_length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, math.ceil(self.capacity * self.growth_factor))
        length = self.cumulative_length
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, :length] = old[:, :, :length]
            setattr(self, name, new)

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        expected = (self.key_buffer.shape[:2], self.key_buffer.shape[-1], self.value_buffer.shape[-1])
        got = (key_states.shape[:2], key_states.shape[-1], value_states.shape[-1])
        if got != expected or key_states.dtype != self.key_buffer.dtype:
            raise ValueError(
                f"GrowableLayer holds (batch, heads)={tuple(expected[0])}, key/value dims {expected[1:]} in "
                f"{self.key_buffer.dtype}, got {tuple(got[0])}, {got[1:]} in {key_states.dtype}; create a new "
                "GrowableCache for another model, batch size or dtype"
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `(B, H, q, D)` keys/values; return all `(B, H, length + q, D)` cached keys/values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        start = self.cumulative_length
        end = start + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        elif self.key_buffer.is_inference() and not torch.is_inference_mode_enabled():
            # filled under torch.inference_mode() (a prefix prefilled there, continued by generate()): torch
            # refuses in-place writes to its tensors outside that mode, so the buffers become ordinary, once
            self._map_buffers(torch.clone)
        self.key_buffer[:, :, start:end] = key_states.detach()
        self.value_buffer[:, :, start:end] = value_states.detach()
        self.cumulative_length = end
        self._sync_views()
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            past_keys, past_values = self.key_buffer[:, :, :start], self.value_buffer[:, :, :start]
            return torch.cat([past_keys, key_states], dim=-2), torch.cat([past_values, value_states], dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1  # grows without bound, like `DynamicLayer`

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (`crop(-n)`); exact and O(1): only the length moves back."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative count, crop(-n), to remove the last n tokens"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if -tokens_to_remove > self.cumulative_length:
            raise ValueError(
                f"crop({tokens_to_remove}) removes more than the {self.cumulative_length} cached tokens; "
                f"the most is crop(-{self.cumulative_length})"
            )
        self.cumulative_length += tokens_to_remove
        self._sync_views()

    def reset(self) -> None:
        """Forget every token; the buffers are kept (and reused by the next sequence)."""
        self.cumulative_length = 0
        if self.is_initialized:
            self._sync_views()

    def _map_buffers(self, function) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = function(self.key_buffer), function(self.value_buffer)
            self.batch_size = self.key_buffer.shape[0]
            self._sync_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_buffers(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_buffers(lambda t: t[indices, ...])

    def offload(self) -> None:
        self._map_buffers(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.key_buffer.device != self.device:
            self._map_buffers(lambda t: t.to(self.device, non_blocking=True))

    def nbytes(self) -> int:
        """Bytes held by the buffers (the whole capacity, not only the used length)."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer))


class GrowableCache(Cache):
    """A full KV cache for any decoder whose full-attention layers append in place (`GrowableLayer`).

    Sliding-window, chunked and linear-attention layers keep transformers' own dynamic layers (their cost is
    already bounded). Without `config`, layers are created lazily, one `GrowableLayer` per attention layer.

    Args:
        config (`PreTrainedConfig`, *optional*): the config of the model that runs on this cache.
        initial_capacity (`int`, defaults to 1024): tokens preallocated per layer at the first update; pass the
            prompt length + `max_new_tokens` to never grow.
        growth_factor (`float`, defaults to 2.0): capacity multiplier when a buffer is full.

    Example:
        >>> cache = GrowableCache(config=model.config)
        >>> model(input_ids, cache=cache)                           # prefill
        >>> model(next_ids, cache=cache)                            # appends in place, no copy of the past
        >>> cache.crop(-2)                                          # roll back 2 tokens, exactly
    """

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        initial_capacity: int = 1024,
        growth_factor: float = 2.0,
    ):
        check_size("initial_capacity", initial_capacity, 1)
        _check_growth_factor(growth_factor)
        make_layer = functools.partial(
            GrowableLayer, initial_capacity=initial_capacity, growth_factor=growth_factor
        )
        if config is None:
            super().__init__(layer_class_to_replicate=make_layer)
            return
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"config must be the model's PreTrainedConfig (e.g. `config=model.config`), got {type(config).__name__}"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        layers = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if layer_type == "full_attention":
                layers.append(make_layer())
            elif layer_type in DYNAMIC_LAYER_TYPE_MAPPING:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
            else:
                raise ValueError(
                    f"layer {idx} of {config.model_type!r} is {layer_type!r}, which transformers' dynamic caches do "
                    "not know either; use the model's own cache class instead of GrowableCache"
                )
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes held by this cache's buffers (allocated capacity of every layer)."""
        return cache_nbytes(self)


def is_full_attention_only(config: PreTrainedConfig) -> bool:
    """Whether every layer of `config`'s decoder is a full-attention layer (what `GrowableCache` speeds up)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return all(layer_type == "full_attention" for layer_type in layer_types)
