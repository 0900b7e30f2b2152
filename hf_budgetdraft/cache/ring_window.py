"""A preallocated ring buffer that holds the most recent tokens of a draft KV cache.

Windowed-MTP (arXiv 2607.21535, §3): the draft reads a sliding window of the most recent `window` tokens;
the ring has `window + slack` slots so that a draft round of up to `slack` tokens can be written and rolled
back without ever overwriting a token the window still needs. Position `p >= start` lives in slot
`(p - start) mod (window + slack)`; keys carry their RoPE rotation, so a reused slot needs no re-rotation.
"""

from __future__ import annotations

import torch


class RingSlots:
    """Host bookkeeping of a ring of `window + slack` slots holding the positions `[start, ...)` of one cache layer:
    which slot a position lives in, which positions a query reads, and which are still intact for a rollback. The
    dynamic ring (`RingWindow`) and the static draft layers (`static.py`) share it; neither reads a device tensor.

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

    def restart(self, start: int) -> None:
        """Forget every stored token; the ring will hold positions `[start, ...)`."""
        self.start = self.valid_from = start

    def slots(self, first: int, last: int, device: torch.device) -> torch.Tensor:
        """`(last - first,)` long: the ring slots of positions `[first, last)`."""
        return (torch.arange(first, last, device=device) - self.start) % self.capacity

    def wrote_up_to(self, end: int) -> None:
        """Every position before `end` has been written: the ones `capacity` or more back were overwritten."""
        self.valid_from = max(self.valid_from, end - self.capacity)

    def window_start(self, length: int) -> int:
        """First position a query at logical length `length` reads from the ring."""
        return max(self.start, length - self.window)

    def num_visible(self, length: int) -> int:
        return max(0, length - self.window_start(length))

    def check_window(self, length: int) -> int:
        """The window's first position at `length`; raises if a position of it was overwritten (a bookkeeping bug:
        `crop` refuses to roll back that far)."""
        first = self.window_start(length)
        if first < self.valid_from:
            raise RuntimeError(
                f"ring window needs position {first} but the oldest kept position is {self.valid_from}; "
                "this is a bug in the cache bookkeeping (crop/update out of order)"
            )
        return first

    def can_roll_back_to(self, length: int) -> bool:
        """Whether every position the window needs at logical length `length` is still stored."""
        return self.window_start(length) >= self.valid_from or length <= self.start


class RingWindow(RingSlots):
    """`RingSlots` with its `(B, H, window + slack, D)` key/value buffers."""

    def __init__(self, window: int, slack: int):
        super().__init__(window, slack)
        self.keys: torch.Tensor | None = None  # (B, H, capacity, D)
        self.values: torch.Tensor | None = None

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Preallocate `(B, H, capacity, D)` buffers shaped like `key_states`/`value_states`."""
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self.restart(start)

    def read(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The window `[max(start, length - window), length)` in position order, as at most two `(B, H, n, D)`
        key/value views of the ring (two when the window wraps around its end); nothing is copied."""
        first = self.check_window(length)
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
        slots = self.slots(end - keep, end, self.keys.device)
        # stored detached: a training step backpropagates through the keys `update` returns, not through the buffer
        self.keys.index_copy_(2, slots, key_states[:, :, q - keep :].detach())
        self.values.index_copy_(2, slots, value_states[:, :, q - keep :].detach())
        self.wrote_up_to(end)

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
