"""A recording cache for a draft's windowed prefill: the prompt runs in chunks, each chunk attending to a sink and a
window of the tokens before it, and every layer keeps the whole prompt's keys/values for the draft cache to select
from afterwards.

Windowed-MTP (arXiv 2607.21535) bounds what the draft reads while decoding; a drafter's prefill still attends over
the whole prompt, O(L²). Prefilled in chunks of `window_length` tokens through `WindowedPrefillCache`, a query at
position `p` reads the sink `[0, S)`, the window `[max(S, c - W), c)` before its chunk (which starts at `c`) and its
own chunk causally: O(L·W). Only full-attention layers exist here; the keys of layer 0 are the same as a full
prefill's (projections of the tokens), deeper layers' differ, so a drafter meant to run this way is trained on the
same prefix (`run_shared_prefix(..., prefill_window=W)`).
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from ..compat import cache_kwargs


class WindowedPrefillLayer(CacheLayerMixin):
    """One layer's whole prompt `(B, H, L, D)`, written chunk by chunk; each chunk reads `[sink, window, chunk]`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, num_sink_tokens: int, window_length: int, prompt_length: int):
        super().__init__()
        self.num_sink_tokens, self.window_length, self.prompt_length = (
            num_sink_tokens,
            window_length,
            prompt_length,
        )
        self.length = 0  # prompt tokens written so far

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty(batch, heads, self.prompt_length, key_states.shape[-1])
        self.values = value_states.new_empty(batch, heads, self.prompt_length, value_states.shape[-1])
        self.is_initialized = True

    def _visible(self) -> tuple[range, range]:
        """Positions of the past a chunk starting at `self.length` reads: the sink, then the window."""
        sink = range(min(self.num_sink_tokens, self.length))
        return sink, range(max(len(sink), self.length - self.window_length), self.length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write a chunk `(B, H, q, D)`; return `(B, H, sink + window + q, D)` for its attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.prompt_length:
            raise ValueError(f"windowed prefill got {end} tokens for a {self.prompt_length}-token prompt")
        sink, window = self._visible()
        keys = [self.keys[:, :, : len(sink)], self.keys[:, :, window.start : window.stop], key_states]
        values = [self.values[:, :, : len(sink)], self.values[:, :, window.start : window.stop], value_states]
        self.keys[:, :, self.length : end] = key_states.detach()
        self.values[:, :, self.length : end] = value_states.detach()
        self.length = end
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # every returned past key is visible to every query of the chunk, the chunk itself causal (lower right)
        num_past = sum(len(part) for part in self._visible())
        return num_past + query_length, self.length - num_past

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


def layers_besides_full_attention(config: PreTrainedConfig) -> list[str]:
    """The layer types of a model of `config` other than full attention (a windowed prefill needs none)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return sorted(set(layer_types) - {"full_attention"})


class WindowedPrefillCache(Cache):
    """`WindowedPrefillLayer`s for every layer of a drafter of `config`, which must be full attention only.

    Args:
        config (`PreTrainedConfig`): the drafter's config.
        num_sink_tokens (`int`): sink tokens every chunk reads.
        window_length (`int`): tokens before a chunk that it reads (and the chunk length `windowed_prefill` uses).
        prompt_length (`int`): the prompt's length (the buffers are preallocated).
    """

    def __init__(
        self, config: PreTrainedConfig, num_sink_tokens: int, window_length: int, prompt_length: int
    ):
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        others = layers_besides_full_attention(config)
        if others:
            raise ValueError(
                f"a windowed draft prefill runs drafters whose layers are all full attention; {config.model_type!r} "
                f"also has {others} layers. Drop prefill_window from cache_config for this drafter"
            )
        if num_sink_tokens < 0 or window_length < 1:
            raise ValueError(
                f"need num_sink_tokens >= 0 and window_length >= 1, got {num_sink_tokens}, {window_length}"
            )
        super().__init__(
            layers=[WindowedPrefillLayer(num_sink_tokens, window_length, prompt_length) for _ in layer_types]
        )


@torch.no_grad()
def windowed_prefill(
    model, prompt_ids: torch.LongTensor, num_sink_tokens: int, window_length: int, config=None
) -> tuple[WindowedPrefillCache, torch.Tensor]:
    """Prefill `model` on `prompt_ids` `(B, L)` in chunks of `window_length` tokens through a
    `WindowedPrefillCache`; returns the cache (every layer's whole prompt K/V) and the last position's logits
    `(B, V)`. `config`: the model's config when `model` is wrapped (PEFT, DDP)."""
    cache = WindowedPrefillCache(config or model.config, num_sink_tokens, window_length, prompt_ids.shape[1])
    return cache, prefill_in_chunks(model, prompt_ids, cache, window_length, logits_to_keep=1)


@torch.no_grad()
def prefill_in_chunks(
    model,
    ids: torch.LongTensor,
    cache: Cache,
    chunk: int,
    start: int = 0,
    embeds: torch.Tensor | None = None,
    **forward_kwargs,
):
    """Feed `ids[:, start:]` (`(B, n)`) into `cache` at positions `start ...`, `chunk` tokens a forward (with
    `forward_kwargs`); the last position's logits `(B, V)`. `embeds` `(B, L, H)`: the prompt given as
    `inputs_embeds`, fed in place of the ids."""
    logits = None
    for begin in range(start, ids.shape[1], chunk):
        end = min(begin + chunk, ids.shape[1])
        piece = (
            {"input_ids": ids[:, begin:end]} if embeds is None else {"inputs_embeds": embeds[:, begin:end]}
        )
        positions = torch.arange(begin, end, device=ids.device)[None]
        out = model(**piece, position_ids=positions, **cache_kwargs(cache), use_cache=True, **forward_kwargs)
        logits = out.logits[:, -1]
    return logits


def recorded(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`(keys, values)`: per layer, the `(B, H, L, D)` a prefill wrote into `cache` (a `WindowedPrefillCache`, or a
    `DynamicCache` of full-attention layers) so far; what `fill_from_prefix` takes."""
    lengths = [layer.get_seq_length() for layer in cache.layers]
    return (
        [layer.keys[:, :, :n] for layer, n in zip(cache.layers, lengths, strict=True)],
        [layer.values[:, :, :n] for layer, n in zip(cache.layers, lengths, strict=True)],
    )


def fill_from_prefix(cache: Cache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> Cache:
    """Prefill `cache` with recorded prompt keys/values (per layer `(B, H, L, D)`) by calling each layer's own
    `update`, as a forward over the prompt would: a budgeted layer selects from them, a sink/window layer keeps its
    sink and ring. Returns `cache`."""
    for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=True):
        layer.update(layer_keys, layer_values)
    return cache
