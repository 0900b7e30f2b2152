"""Dynamic chunk retrieval: the chunk policy re-run at every draft step with that step's query.

A selection made once, at the prefill, keeps what the prompt's end pointed at; a draft that copies a passage or
follows a thread far back needs different chunks at every step. Like Quest (Tang et al., arXiv 2406.10774), each
step scores the prompt's chunks with its own query and reads only the best ones; the scores are SparQ's
approximation (Ribar et al., arXiv 2312.04985): `q·k` over the `components` channels where the query (summed over
the query heads sharing a KV head) is largest, so a step reads `components / D` of the prompt's keys to score it.
Copying those channels out and multiplying over them passes over `components` rows three times: where that is not
less than the `D` rows of an exact score (`3 · components >= D`), the score is exact.
A chunk scores the largest approximate `q·k` among its keys and query heads; chunk 0 (the sink) and the trailing
partial chunk are always kept, as in `ChunkPolicy`, so every step keeps as many positions as the prefill did.

The prefill's own selection is `ChunkPolicy`'s (the last key as the proxy). The cache layer keeps a `PromptIndex`
besides its static slots: the prompt's keys channel-major (a score reads whole channels) and its keys and values in
chunks (a selection copies whole chunks). The draft's attention reads the budget; its memory holds the prompt, its
keys twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .chunk import ChunkPolicy, chunk_positions
from .keep_policy import KeepPolicy, group_queries


class PromptIndex(NamedTuple):
    """What a step selects from: the prompt's keys channel-major `(B, H, D, C * size)`, its keys and values in
    chunks `(B, H, C, size, D)`, its trailing partial chunk's keys and values `(B, H, tail, D)`, and the batch and
    head indices `(B, 1, 1)`, `(1, H, 1)` that pick a chunk or channel per row and head."""

    channels: torch.Tensor
    key_chunks: torch.Tensor
    value_chunks: torch.Tensor
    tail_keys: torch.Tensor
    tail_values: torch.Tensor
    rows: torch.Tensor
    heads: torch.Tensor


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
        return self.prefill_policy.select(keys, budget)

    def index(self, keys: torch.Tensor, values: torch.Tensor) -> PromptIndex:
        """The `PromptIndex` of a prompt's keys and values `(B, H, L, D)`."""
        batch, heads, length, dim = keys.shape
        whole = length - length % self.chunk_size
        chunked = (batch, heads, whole // self.chunk_size, self.chunk_size, dim)
        return PromptIndex(
            channels=keys[:, :, :whole].transpose(-1, -2).contiguous(),
            key_chunks=keys[:, :, :whole].reshape(chunked),
            value_chunks=values[:, :, :whole].reshape(chunked),
            tail_keys=keys[:, :, whole:].contiguous(),
            tail_values=values[:, :, whole:].contiguous(),
            rows=torch.arange(batch, device=keys.device)[:, None, None],
            heads=torch.arange(heads, device=keys.device)[None, :, None],
        )

    def approximates(self, head_dim: int) -> bool:
        """Whether a query scores on `components` of its `head_dim` channels (else exactly, on all of them)."""
        return self.components > 0 and 3 * self.components < head_dim

    def choose(self, index: PromptIndex, queries: torch.Tensor, budget: int) -> torch.Tensor:
        """`(B, H, T, k)` ascending: for each of `T` queries `(B, H_q, T, D)` (times the attention scaling), the
        chunks of `index` (a prompt longer than `budget`) it keeps, the sink chunk among them. Each query scores
        on its own channels, as if it came alone."""
        batch, heads, num_chunks, size, dim = index.key_chunks.shape
        grouped = group_queries(queries, heads).transpose(2, 3)  # (B, H, T, G, D)
        if self.approximates(dim):
            channels = grouped.abs().sum(3).topk(self.components, dim=-1).indices  # (B, H, T, r)
            grouped = grouped.gather(-1, channels[:, :, :, None].expand(-1, -1, -1, grouped.shape[3], -1))
            rows, cols = index.rows[..., None], index.heads[..., None]  # (B, 1, 1, 1), (1, H, 1, 1)
            keys = index.channels[rows, cols, channels]  # (B, H, T, r, C * size): whole channels
            scores = grouped.to(keys.dtype) @ keys  # (B, H, T, G, C * size)
        else:  # every query reads the same keys: one product, (B, H, T * G, D) @ (B, H, D, C * size)
            scores = grouped.flatten(2, 3).to(index.channels.dtype) @ index.channels
        scores = scores.float().view(*grouped.shape[:4], num_chunks, size).amax(dim=(3, 5))  # (B, H, T, C)
        scores[..., 0] = torch.inf  # the sink chunk is always kept
        tail = index.tail_keys.shape[-2]
        return scores.topk((budget - tail) // size, dim=-1).indices.sort(dim=-1).values

    def reselect(
        self, index: PromptIndex, query: torch.Tensor, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's `(chunks (B, H, k), keys, values (B, H, n, D))`: the chunks `choose` keeps for its last query
        `(B, H_q, D)` and the keys and values of their positions (`positions(chunks, index)`, `n` as `select`
        keeps)."""
        chosen = self.choose(index, query[:, :, None], budget)[:, :, 0]
        rows, cols, tail = index.rows, index.heads, index.tail_keys.shape[-2]

        def gather(chunks: torch.Tensor, trailing: torch.Tensor) -> torch.Tensor:
            kept = chunks[rows, cols, chosen].flatten(2, 3)  # (B, H, k * size, D): whole chunks
            return torch.cat([kept, trailing], dim=2) if tail else kept

        return (
            chosen,
            gather(index.key_chunks, index.tail_keys),
            gather(index.value_chunks, index.tail_values),
        )

    @staticmethod
    def positions(chunks: torch.Tensor, index: PromptIndex) -> torch.Tensor:
        """`(..., n)` ascending prompt positions of the chunks `(..., k)` `choose` chose, then the trailing partial
        chunk."""
        num_chunks, size = index.key_chunks.shape[2:4]
        return chunk_positions(chunks, size, num_chunks * size + index.tail_keys.shape[-2])
