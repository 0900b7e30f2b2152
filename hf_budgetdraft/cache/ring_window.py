"""The dynamic draft layers' ring: `RingSlots` bookkeeping (`slot_layout.py`) with its own key/value buffers, read
as at most two views of the window (no copy)."""

from __future__ import annotations

import torch

from .slot_layout import RingSlots


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
        slots = self.slots(torch.arange(end - keep, end, device=self.keys.device))
        # stored detached: a training step backpropagates through the keys `update` returns, not through the buffer
        self.keys.index_copy_(2, slots, key_states[:, :, q - keep :].detach())
        self.values.index_copy_(2, slots, value_states[:, :, q - keep :].detach())
        self.wrote_up_to(end)

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
