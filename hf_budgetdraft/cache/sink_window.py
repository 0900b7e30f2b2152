"""`SinkWindowCache`: the Windowed-MTP draft cache — an attention sink plus a sliding window.

Windowed-MTP, arXiv 2607.21535 (sink S = 64, window W = 4032 in the paper). A query at logical length `L`
reads positions `[0, min(S, L))` and `[max(S, L - W), L)`, plus the tokens of its own forward (a draft round
is never windowed away). The window lives in a ring of `W + slack` slots, slot(p) = S + (p - S) mod (W + slack),
so memory and per-step cost are constant in context length and a draft round of up to `slack` tokens rolls
back exactly.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig

from .base import SparseDraftCache, SparseDraftLayer, check_size
from .static import StaticSinkWindowLayer, check_crop_after_skip, check_skip, check_static_flag


class SinkWindowLayer(SparseDraftLayer):
    """Cache layer keeping `num_sink_tokens` sink tokens + the last `window_length` tokens."""

    def __init__(self, num_sink_tokens: int, window_length: int, slack: int):
        super().__init__(window_length=window_length, slack=slack, static_capacity=num_sink_tokens)
        self.num_sink_tokens = num_sink_tokens
        self.skipped_to = 0  # no crop goes back before this position (positions before it were skipped)

    def _ring_start(self) -> int:
        return self.num_sink_tokens

    def _num_static(self, length: int) -> int:
        return min(self.num_sink_tokens, length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `(B, H, q, D)` new keys/values; return `(B, H, sink + window + q, D)` for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._with_past(key_states, value_states)

        length, new = self.cumulative_length, key_states.shape[-2]
        into_sink = min(max(self.num_sink_tokens - length, 0), new)
        if into_sink:
            self.static_keys[:, :, length : length + into_sink] = key_states[:, :, :into_sink].detach()
            self.static_values[:, :, length : length + into_sink] = value_states[:, :, :into_sink].detach()
        if new > into_sink:
            self.ring.write(key_states[:, :, into_sink:], value_states[:, :, into_sink:], length + into_sink)
        self.cumulative_length = length + new
        return keys, values

    def skip(self, count: int) -> None:
        """Advance the logical length over `count` positions that are never stored: they would have left the window
        before any query reads them. Needs a full sink; the ring restarts at the new length, and no crop goes back
        before it."""
        check_skip(count, self.cumulative_length, self.num_sink_tokens)
        self.cumulative_length += count
        self.ring.restart(self.cumulative_length)
        self.skipped_to = self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        check_crop_after_skip(tokens_to_remove, self.cumulative_length, self.skipped_to)
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.skipped_to = 0


class SinkWindowCache(SparseDraftCache):
    """Draft cache with an attention sink and a sliding window in a preallocated ring buffer.

    Args:
        config (`PreTrainedConfig`): the config of the model that will run on this cache.
        num_sink_tokens (`int`, defaults to 64): first tokens always kept (attention sink), S.
        window_length (`int`, defaults to 1024): most recent past tokens kept, W.
        slack (`int`, defaults to 32): extra ring slots; the longest draft round that can be rolled back.
        static (`bool`, defaults to `False`): preallocated `[sink | ring]` slot buffers with tensor bookkeeping, so a
            one-token step has fixed shapes (`torch.compile` / CUDA graphs); needs the model to run
            `attn_implementation="budgetdraft_varlen"`. Same keys, same outputs as the dynamic layers.

    Example:
        >>> cache = SinkWindowCache(config=drafter.config, num_sink_tokens=4, window_length=48)
        >>> drafter(input_ids, cache=cache)
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        num_sink_tokens: int = 64,
        window_length: int = 1024,
        slack: int = 32,
        static: bool = False,
    ):
        check_size("num_sink_tokens", num_sink_tokens, 0)
        check_size("window_length", window_length, 1)
        check_size("slack", slack, 1)
        check_static_flag(static, config)
        self.num_sink_tokens, self.window_length, self.static = num_sink_tokens, window_length, static
        layer_class = StaticSinkWindowLayer if static else SinkWindowLayer
        super().__init__(config, lambda idx: layer_class(num_sink_tokens, window_length, slack), slack)

    def can_skip(self) -> bool:
        """Whether `skip` applies: every layer is a sink + window layer (a model's own sliding layers keep theirs)."""
        return all(isinstance(layer, (SinkWindowLayer, StaticSinkWindowLayer)) for layer in self.layers)

    def skip(self, count: int) -> None:
        """Advance every layer over `count` positions nothing will read: a draft head catching up on a long block
        only needs the sink and the last `window_length` positions' keys (a position's keys depend only on its own
        inputs), so it feeds those and skips the rest."""
        if not self.can_skip():
            raise ValueError(
                "skip() needs every cache layer to be a sink + window layer; this model keeps its own sliding layers"
            )
        for layer in self.layers:
            layer.skip(count)
