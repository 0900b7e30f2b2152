"""`StaticSlidingLayer`: a drafter's own sliding-window layer on the static storage, so its step has fixed shapes.

A drafter with sliding layers (Gemma 2/3, Cohere 2, gpt-oss, OLMo 3, ...) keeps them as the model was trained: a
query at position `p` reads positions `(p - sliding_window, p]`. transformers' `DynamicSlidingWindowLayer` holds
them in a tensor that grows a token a step between rollbacks (its past recording), which a whole-graph compile
would recompile for at every step. On a static draft cache such a layer is a `StaticDraftLayer` that keeps no
static slots and a ring of `sliding_window - 1` past positions (+ the slack a rollback undoes): the same keys, read
through the same masked step, exact per query (each query's window ends at the query, not at its step's first
token as a sparse layer's does). Longer forwards (the prefill) return the contiguous window and report its true
offset, so transformers' own sliding mask stays exact.

A ring is allocated whole, so only windows up to `LARGEST_RING` positions become rings (Gemma's 512-4,096, Mistral's
and Cohere 2's 4,096, gpt-oss's 128); a window of hundreds of thousands (Phi-3's 128K models declare 262,144) keeps
transformers' layer, which grows with the context, and its step stays eager.
"""

from __future__ import annotations

import torch

from .selection import SinkSelection
from .static_draft_layer import StaticDraftLayer

LARGEST_RING = 16384  # positions; a larger sliding window keeps transformers' growing layer


def fits_a_ring(sliding_window) -> bool:
    """Whether a sliding layer of `sliding_window` positions becomes a `StaticSlidingLayer` on a static cache."""
    return isinstance(sliding_window, int) and 2 <= sliding_window <= LARGEST_RING


class StaticSlidingLayer(StaticDraftLayer):
    """A model's own sliding-window layer (`sliding_window` positions, the query's own included) as a fixed-shape
    ring: no static slots, `sliding_window - 1` past positions, `slack` slots for rollback."""

    is_sliding = True

    def __init__(self, sliding_window: int, slack: int, layer_idx: int = 0):
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 2:
            raise ValueError(
                f"a sliding layer needs the model's sliding_window, an int >= 2, got {sliding_window!r}; check the "
                "drafter's config"
            )
        super().__init__(SinkSelection(0), sliding_window - 1, slack, layer_idx=layer_idx)
        self.sliding_window = sliding_window

    def key_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`(1, 1, q, W + slack)` bool: query `p` of a step reads the ring positions `[p - W, p]`."""
        position = positions[:, None]  # (q, 1)
        return self.layout.visible(self.slot_positions, self.ring_start, position, position)[None, None]
