"""The slot layout of the sparse draft caches: `[S static slots | W + slack ring slots]`, in one place.

Windowed-MTP (arXiv 2607.21535, §3) and BudgetDraft (arXiv 2606.00144, §3.1) drafts read a few static positions
(the attention sink `[0, S)`, or a policy-selected prefix of at most S positions) plus a sliding window of the W
most recent tokens. Every draft cache lays one layer out as

    [S static slots | W + slack ring slots]

Position `p >= ring_start` lives in ring slot `S + (p - ring_start) mod (W + slack)` (a sink position `p <
ring_start` in static slot `p`); keys carry their RoPE rotation, so a reused slot needs no re-rotation. The `slack`
extra ring slots let a draft round of up to `slack` tokens be written and rolled back without overwriting a token
the window still needs. A query at position `p` of a step whose first query is at `p0` reads

    static slot:  filled and visible (a sink position <= p; a kept prefix position always)
    ring slot:    max(ring_start, p0 - W) <= pos <= p          (pos = the position the slot holds, -1 = empty)

**The rollback rule**, the same for every storage: a rollback to length L is exact while every position of its
window `[max(ring_start, L - W), L)` still holds its own key (while `L - W >= high-water mark - (W + slack)`), and
L is not below the selection's floor (a budgeted prompt, skipped positions). Static slots never need restoring: a
sink slot holds its own position (hidden from queries before it), a kept prefix lies below the floor.

- `RingSlots` + `rollback_length`: the host's bookkeeping of one sequence and the rule on it, used by the
  single-sequence layers (`draft_layer.py`, `static_draft_layer.py`); they never read a device tensor.
- `SlotLayout`: the same arithmetic, visibility and rule on device tensors, for a step's slots and its mask, shared
  by the static layers (one sequence) and the batched caches (`ragged_draft.py`, one ring start per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RingSlots:
    """Host bookkeeping of a ring of `window + slack` slots holding the positions `[start, ...)` of one cache layer:
    which slot a position lives in, which positions a query reads, and which are still intact for a rollback. The
    single-sequence draft layers share it; it never reads a device tensor.

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

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """The ring slots of `positions` (at or past the ring start), same shape."""
        return (positions - self.start) % self.capacity

    def rolled_back_to(self, length: int) -> None:
        """The sequence was cut to `length`: at or before the ring start, every ring slot is in the future (free)."""
        if length <= self.start:
            self.restart(self.start)

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


def static_marks(positions: torch.Tensor) -> torch.Tensor:
    """`(n,)`: the position a static slot is marked with, from the kept positions `(..., n)` of every head: the
    earliest any head keeps there (a sink slot's own position; a kept prefix slot, before every later query)."""
    return positions.flatten(0, -2).amin(0)


def rollback_length(tokens_to_remove, length: int, ring: RingSlots, floor: int, floor_reason: str) -> int:
    """The length after `crop(tokens_to_remove)` of a layer at `length`, or `ValueError` if the rollback is not exact
    (see the module docstring). `floor_reason` says why the layer cannot go back before `floor`."""
    tokens_to_remove = int(tokens_to_remove)
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): sparse draft caches only take a negative count, crop(-n), to remove the last "
            "n tokens"
        )
    new_length = length + tokens_to_remove
    if new_length < 0:
        raise ValueError(f"crop({tokens_to_remove}) removes more than the {length} cached tokens")
    if new_length < floor:
        raise ValueError(
            f"crop({tokens_to_remove}) goes back to {new_length}, before position {floor}: {floor_reason}"
        )
    if not ring.can_roll_back_to(new_length):
        raise ValueError(
            f"crop({tokens_to_remove}) needs position {ring.window_start(new_length)}, already overwritten in the ring "
            f"(oldest kept: {ring.valid_from}); rolling back is exact only within the slack ({ring.slack} tokens). "
            "Create the cache with a larger `slack` (>= the draft length)."
        )
    return new_length


@dataclass(frozen=True)
class SlotLayout:
    """`[static_capacity | window + slack]` slots on device tensors; positions may carry any leading batch shape.

    Args:
        static_capacity (`int`): static slots, S (sink tokens or the budget).
        window (`int`): past positions a query reads from the ring, W.
        slack (`int`): extra ring slots; the longest round a rollback undoes.
    """

    static_capacity: int
    window: int
    slack: int

    @property
    def ring_capacity(self) -> int:
        return self.window + self.slack

    @property
    def num_slots(self) -> int:
        return self.static_capacity + self.ring_capacity

    def ring_offsets(self, positions: torch.Tensor, ring_start: torch.Tensor) -> torch.Tensor:
        """Ring-relative slots `(p - ring_start) mod (W + slack)` of positions at or past the ring start."""
        return (positions - ring_start).remainder(self.ring_capacity)

    def placement(
        self, positions: torch.Tensor, ring_start: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(in_ring, ring offset, buffer slot)` of `positions`, each their shape: a position before the ring start
        (a sink) lives in static slot `p`, the others in ring slot `S + offset`."""
        in_ring = positions >= ring_start
        offsets = self.ring_offsets(positions, ring_start)
        return in_ring, offsets, torch.where(in_ring, self.static_capacity + offsets, positions)

    def slots(self, positions: torch.Tensor, ring_start: torch.Tensor) -> torch.Tensor:
        """Buffer slots of `positions` (see `placement`)."""
        return self.placement(positions, ring_start)[2]

    def ring_visible(
        self, held: torch.Tensor, ring_start: torch.Tensor, queries: torch.Tensor, first: torch.Tensor
    ) -> torch.Tensor:
        """Whether a ring slot holding position `held` is read by a query at `queries` of a step whose first query
        is at `first` (shapes broadcast): within the window, not past the query, not empty or stale."""
        return (held >= torch.maximum(ring_start, first - self.window)) & (held <= queries)

    def visible(
        self, held: torch.Tensor, ring_start: torch.Tensor, queries: torch.Tensor, first: torch.Tensor
    ) -> torch.Tensor:
        """Whether each slot, holding position `held` (`(..., S + W + slack)`, -1 = empty), is read by a query at
        `queries` of a step whose first query is at `first` (shapes broadcast): a static slot when filled and not
        past the query, a ring slot as `ring_visible` says."""
        static, ring = held[..., : self.static_capacity], held[..., self.static_capacity :]
        static_visible = (static >= 0) & (static <= queries)
        return torch.cat([static_visible, self.ring_visible(ring, ring_start, queries, first)], dim=-1)

    def window_intact(
        self, held_ring: torch.Tensor, ring_start: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """`(B,)` bool: whether ring slots `(B, W + slack)` still hold every position of each row's window at
        `lengths` `(B,)` (a rollback to `lengths` is exact)."""
        oldest = torch.maximum(ring_start, lengths - self.window)
        held = ((held_ring >= oldest[:, None]) & (held_ring < lengths[:, None])).sum(-1)
        return held == (lengths - oldest).clamp(min=0)
