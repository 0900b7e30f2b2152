"""Chunk retrieval, as BudgetDraft's public code (after TriForce) sparsifies the draft cache.

BudgetDraft, arXiv 2606.00144, §3.1; TriForce, arXiv 2404.11912. The prefix is split into chunks of
`chunk_size` tokens; each chunk is scored per KV head by `dot(proxy, mean key of the chunk)`, where the proxy
is the last prefix token's key (the authors' choice) or its query; chunk 0 (the sink) is always kept, and the
top-scoring chunks fill the budget. The trailing partial chunk, if the prefix length is not a multiple of
`chunk_size`, is always kept (it is the most recent context) so every head keeps the same number of tokens.

For a prefix of `L > budget` tokens the policy keeps `tail + chunk_size * ((budget - tail) // chunk_size)`
positions, `tail = L % chunk_size`: exactly `budget` only when `budget - tail` is a multiple of `chunk_size`,
otherwise up to `chunk_size - 1` fewer, because only whole chunks are retrieved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .keep_policy import KeepPolicy, group_queries


@dataclass
class ChunkPolicy(KeepPolicy):
    chunk_size: int = field(default=8, metadata={"help": "Tokens per chunk; chunk 0 is the attention sink."})
    query_proxy: str = field(
        default="last_key",
        metadata={"help": "'last_key' (BudgetDraft's code) or 'last_query' (needs query capture)."},
    )

    name = "chunk"

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.query_proxy not in ("last_key", "last_query"):
            raise ValueError(f"query_proxy must be 'last_key' or 'last_query', got {self.query_proxy!r}")

    @property
    def needs_queries(self) -> bool:
        return self.query_proxy == "last_query"

    @property
    def query_window(self) -> int:
        return 1 if self.needs_queries else 0

    def min_budget(self) -> int:
        # chunk 0 plus a trailing partial chunk of up to chunk_size - 1 tokens
        return 2 * self.chunk_size - 1

    def _select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None) -> torch.Tensor:
        """Chunk 0, the best-scoring whole chunks and the trailing partial chunk: `tail + chunk_size *
        ((budget - tail) // chunk_size)` positions per head, `tail = L % chunk_size` (at most `budget`)."""
        batch, heads, length, dim = keys.shape
        size = self.chunk_size
        num_chunks = length // size
        tail = length - num_chunks * size
        keep_chunks = (budget - tail) // size  # >= 1 by min_budget, < num_chunks since length > budget

        if self.query_proxy == "last_key":
            proxy = keys[:, :, -1]  # (B, H, D)
        else:
            proxy = group_queries(queries[:, :, -1:], heads).mean(dim=2)[:, :, 0]  # (B, H, D)
        chunk_means = keys[:, :, : num_chunks * size].reshape(batch, heads, num_chunks, size, dim).mean(dim=3)
        scores = torch.einsum("bhcd,bhd->bhc", chunk_means.float(), proxy.float())  # (B, H, num_chunks)
        scores[..., 0] = torch.inf  # the sink chunk is always kept
        chosen = scores.topk(keep_chunks, dim=-1).indices.sort(dim=-1).values  # (B, H, keep_chunks)
        return chunk_positions(chosen, size, length)


def chunk_positions(chosen: torch.Tensor, size: int, length: int) -> torch.Tensor:
    """`(..., k * size + tail)` ascending positions of the chunks `chosen` `(..., k)` (ascending; `(B, H, k)` for a
    cache) of a prefix of `length` tokens, then its trailing partial chunk (`tail = length % size`)."""
    offsets = torch.arange(size, device=chosen.device)
    positions = (chosen[..., None] * size + offsets).flatten(-2)  # (..., k * size)
    trailing = torch.arange(length - length % size, length, device=chosen.device)
    trailing = trailing.expand(*chosen.shape[:-1], -1)
    return torch.cat([positions, trailing], dim=-1)
