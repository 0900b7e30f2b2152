"""A preallocated ring buffer that holds the most recent tokens of a draft KV cache.

Windowed-MTP (arXiv 2607.21535, §3): the draft reads a sliding window of the most recent `window` tokens;
the ring has `window + slack` slots so that a draft round of up to `slack` tokens can be written and rolled
back without ever overwriting a token the window still needs. Position `p >= start` lives in slot
`(p - start) mod (window + slack)`; keys carry their RoPE rotation, so a reused slot needs no re-rotation.
"""

from __future__ import annotations

import torch


class RingWindow:
    """Ring buffer of the positions `[start, ...)` of one cache layer.

    Args:
        window (`int`): how many of the most recent past positions a query reads.
        slack (`int`): extra slots; a `crop` of up to `slack` tokens after a write is always exact.
    """

    def __init__(self, window: int, slack: int):
        self.window = window
        self.slack = slack
        self.capacity = window + slack
        self.start = 0  # first position stored in the ring (positions before it live elsewhere)
        self.valid_from = 0  # oldest position whose slot still holds its own key/value
        self.keys: torch.Tensor | None = None  # (B, H, capacity, D)
        self.values: torch.Tensor | None = None

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Preallocate `(B, H, capacity, D)` buffers shaped like `key_states`/`value_states`."""
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self.restart(start)

    def restart(self, start: int) -> None:
        """Forget every stored token; the ring will hold positions `[start, ...)`."""
        self.start = self.valid_from = start

    def _slots(self, first: int, last: int, device: torch.device) -> torch.Tensor:
        return (torch.arange(first, last, device=device) - self.start) % self.capacity

    def window_start(self, length: int) -> int:
        """First position a query at logical length `length` reads from the ring."""
        return max(self.start, length - self.window)

    def num_visible(self, length: int) -> int:
        return max(0, length - self.window_start(length))

    def read(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The window `[max(start, length - window), length)` in position order, as at most two `(B, H, n, D)`
        key/value views of the ring (two when the window wraps around its end); nothing is copied."""
        first = self.window_start(length)
        if first < self.valid_from:
            raise RuntimeError(
                f"ring window needs position {first} but the oldest kept position is {self.valid_from}; "
                "this is a bug in the cache bookkeeping (crop/update out of order)"
            )
        if length <= first:
            return []
        head = (first - self.start) % self.capacity
        tail = head + (length - first)
        if tail <= self.capacity:
            return [(self.keys[:, :, head:tail], self.values[:, :, head:tail])]
        wrapped = tail - self.capacity
        return [
            (self.keys[:, :, head:], self.values[:, :, head:]),
            (self.keys[:, :, :wrapped], self.values[:, :, :wrapped]),
        ]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, first_position: int) -> None:
        """Store tokens at positions `[first_position, first_position + q)`; only the last `capacity` are kept."""
        q = key_states.shape[-2]
        end = first_position + q
        keep = min(q, self.capacity)
        slots = self._slots(end - keep, end, self.keys.device)
        # stored detached: a training step backpropagates through the keys `update` returns, not through the buffer
        self.keys.index_copy_(2, slots, key_states[:, :, q - keep :].detach())
        self.values.index_copy_(2, slots, value_states[:, :, q - keep :].detach())
        self.valid_from = max(self.valid_from, end - self.capacity)

    def can_roll_back_to(self, length: int) -> bool:
        """Whether every position the window needs at logical length `length` is still stored."""
        return self.window_start(length) >= self.valid_from or length <= self.start

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
