"""Cache sizes: the bound on every user-given size (so a typo cannot allocate terabytes) and the bytes a cache
holds."""

from __future__ import annotations

from transformers import Cache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

MAX_CACHE_TOKENS = 1 << 22


def check_size(name: str, value, minimum: int) -> None:
    """Raise `TypeError`/`ValueError` naming `name` unless `minimum <= value <= MAX_CACHE_TOKENS`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if not minimum <= value <= MAX_CACHE_TOKENS:
        raise ValueError(f"{name} must be in [{minimum}, {MAX_CACHE_TOKENS}], got {value}")


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
