"""`RingSlidingLayer`: a target's sliding-window layer on the device round's static cache, which a rollback undoes.

transformers' `StaticSlidingWindowLayer` keeps the last `sliding_window` positions and shifts the oldest out as tokens
arrive: once a verification of `[newest token, γ drafts]` has shifted positions out, a rejected draft cannot be taken
back. This layer keeps `R = sliding_window - 1 + slack` positions in a ring (position `p` in slot `p mod R`): a write of
up to `slack` tokens overwrites only positions that no query from the write on reads, so a rollback of at most
`slack` tokens is exact by moving the write count back (`cumulative_length`, as for transformers' `StaticLayer`).

- A **step** (up to `slack` tokens: a verification) writes its tokens into their slots and returns the ring gathered
  in position order, `(B, H, R, D)`: positions `[o, o + R)` with `o = max(end - R, 0)`, `end` the count after the
  write. Its mask sizes are `(R, o)` with `o` a device tensor: transformers' own sliding mask then hides the positions
  outside each query's window, those at or past `end`, and a rolled-back draft a slot may still hold (always below
  the window of every query that follows it). Fixed shapes and no host read: a compiled verification is one graph.
- A **block** (a prefill chunk) returns `[the window's past, new]`, the keys transformers' dynamic layer returns, and
  reads the count from the device (the eager prefill only).

Masks come from the model's mask functions (`sdpa`, `eager`, this package's `budgetdraft_*`); kernels that take a
window instead of a mask (flash attention) would not see the ring's order and are not offered this layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer


class RingSlidingLayer(StaticLayer):
    """A sliding-window layer of `sliding_window` positions (the query's own included) for a static cache of
    `max_cache_len` positions: a ring of `sliding_window - 1 + slack` slots, exact under rollbacks of up to
    `slack` tokens."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, slack: int):
        for name, value, least in (("sliding_window", sliding_window, 2), ("slack", slack, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        super().__init__(max_cache_len=max_cache_len)
        self.sliding_window, self.slack = sliding_window, slack
        self.ring_size = sliding_window - 1 + slack

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """`StaticLayer`'s buffers, `ring_size` positions long."""
        cache_length, self.max_cache_len = self.max_cache_len, self.ring_size
        try:
            super().lazy_initialization(key_states, value_states)
        finally:
            self.max_cache_len = cache_length
        self._ring_order = torch.arange(self.ring_size, device=self.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `(B, H, n, D)` new keys/values; a step (`n <= slack`) returns the ring in position order, a block
        `[window's past, new]` (see the module docstring)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tokens = key_states.shape[-2]
        if tokens > self.slack:
            return self._block(key_states, value_states)
        positions = self.cumulative_length + self._ring_order[:tokens]  # (n,)
        self._write(positions % self.ring_size, key_states, value_states)
        self.cumulative_length.add_(tokens)
        order = (self._first_position(self.cumulative_length) + self._ring_order) % self.ring_size  # (R,)
        return self.keys.index_select(2, order), self.values.index_select(2, order)

    def _block(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, length = key_states.shape[-2], int(self.cumulative_length)
        past = torch.arange(length - min(length, self.sliding_window - 1), length, device=self.device)
        slots = past % self.ring_size
        keys = torch.cat([self.keys.index_select(2, slots), key_states], dim=-2)
        values = torch.cat([self.values.index_select(2, slots), value_states], dim=-2)
        kept = min(tokens, self.ring_size)  # the newest positions the ring can hold
        written = torch.arange(length + tokens - kept, length + tokens, device=self.device)
        self._write(written % self.ring_size, key_states[:, :, -kept:], value_states[:, :, -kept:])
        self.cumulative_length.add_(tokens)
        return keys, values

    def _write(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)

    def _first_position(self, end) -> torch.Tensor:
        """The position a step's gathered ring starts at, when `end` positions are written."""
        return torch.clamp(end - self.ring_size, min=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | torch.Tensor]:
        """`(kv_length, kv_offset)` of the keys `update` will return for `query_length` new tokens."""
        if query_length > self.slack:
            length = int(self.cumulative_length) if self.is_initialized else 0
            past = min(length, self.sliding_window - 1)
            return past + query_length, length - past
        if not self.is_initialized:  # a first forward of a few tokens: the ring from position 0
            return self.ring_size, 0
        return self.ring_size, self._first_position(self.cumulative_length + query_length)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (at most `slack`: older ones may be overwritten)."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.slack:
            raise ValueError(
                f"a ring sliding layer rolls back between 0 and its slack ({self.slack}) tokens, passed as a negative "
                f"count; got crop({tokens_to_remove})"
            )
        self.cumulative_length.sub_(-tokens_to_remove)  # in place: its address is static
