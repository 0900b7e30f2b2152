"""Dynamic chunk retrieval: the chunk policy re-run at every draft step with that step's query.

A selection made once, at the prefill, keeps what the prompt's end pointed at; a draft that copies a passage or
follows a thread far back needs different chunks at every step. Like Quest (Tang et al., arXiv 2406.10774), each
step scores the prompt's chunks with its own query and reads only the best ones; the scores are SparQ's
approximation (Ribar et al., arXiv 2312.04985): `q·k` over the `components` channels where the query (summed over
the query heads sharing a KV head) is largest, so a step reads `components / D` of the prompt's keys to score it.
A chunk scores the largest approximate `q·k` among its keys and query heads; chunk 0 (the sink) and the trailing
partial chunk are always kept, as in `ChunkPolicy`, so every step keeps as many positions as the prefill did.

The prefill's own selection is `ChunkPolicy`'s (the last key as the proxy). The cache layer keeps the whole prompt's
keys (channel-major, for the score's channel reads) and values besides its static slots: the draft's attention
reads the budget, its memory holds the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .chunk import ChunkPolicy, chunk_positions
from .keep_policy import KeepPolicy, group_queries


@dataclass
class DynamicChunkPolicy(KeepPolicy):
    chunk_size: int = field(default=8, metadata={"help": "Tokens per chunk; chunk 0 is the attention sink."})
    components: int = field(
        default=16,
        metadata={
            "help": "Query channels a step scores the prompt's keys on (0: every channel, exact scores)."
        },
    )

    name = "dynamic"
    refreshes = True

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not isinstance(self.components, int) or self.components < 0:
            raise ValueError(f"components must be an int >= 0 (0: every channel), got {self.components!r}")
        self.prefill_policy = ChunkPolicy(chunk_size=self.chunk_size)

    def min_budget(self) -> int:
        return self.prefill_policy.min_budget()

    def _select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None) -> torch.Tensor:
        return self.prefill_policy._select(keys, budget, None)

    def index(self, keys: torch.Tensor) -> torch.Tensor:
        """What a step scores: the prompt's keys `(B, H, L, D)` channel-major, `(B, H, D, L)`."""
        return keys.transpose(-1, -2).contiguous()

    def reselect(self, index: torch.Tensor, query: torch.Tensor, budget: int) -> torch.Tensor:
        """`(B, H, n)` ascending prompt positions for a step whose last query is `query` `(B, H_q, D)` (times the
        attention scaling), from `index` (`index(keys)` of a prompt longer than `budget`); `n` as `select` keeps."""
        batch, heads, dim, length = index.shape
        size = self.chunk_size
        num_chunks, tail = divmod(length, size)
        keep_chunks = (budget - tail) // size
        grouped = group_queries(query[:, :, None], heads)[:, :, :, 0].float()  # (B, H, G, D)
        keys = index[..., : num_chunks * size].float()  # (B, H, D, C * size)
        if 0 < self.components < dim:
            channels = grouped.abs().sum(2).topk(self.components, dim=-1).indices  # (B, H, r)
            grouped = grouped.gather(-1, channels[:, :, None].expand(-1, -1, grouped.shape[2], -1))
            keys = keys.gather(
                2, channels[..., None].expand(-1, -1, -1, keys.shape[-1])
            )  # (B, H, r, C * size)
        scores = grouped @ keys  # (B, H, G, C * size)
        scores = scores.view(batch, heads, -1, num_chunks, size).amax(dim=(2, 4))  # (B, H, C)
        scores[..., 0] = torch.inf  # the sink chunk is always kept
        chosen = scores.topk(keep_chunks, dim=-1).indices.sort(dim=-1).values
        return chunk_positions(chosen, size, length)

    def keys_at(self, index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys `(B, H, n, D)` at `positions` `(B, H, n)` from `index`."""
        return index.gather(-1, positions[:, :, None].expand(-1, -1, index.shape[2], -1)).transpose(-1, -2)
