"""SnapKV: keep the prefix tokens the last observation window of queries attends to most.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
Scores are the softmax attention of the last `window_size` prefill queries (causal inside the window),
summed over the window, averaged over the query heads sharing a KV head (GQA), and max-pooled over
`kernel_size` neighbours; the window itself is always kept. A prefix longer than the budget keeps exactly
`budget` positions per head: the window plus the `budget - window_size` best-scoring earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .keep_policy import KeepPolicy, group_queries


@dataclass
class SnapKVPolicy(KeepPolicy):
    window_size: int = field(
        default=32, metadata={"help": "Observation window: last prefill queries used to score."}
    )
    kernel_size: int = field(
        default=7, metadata={"help": "Max-pooling width over neighbouring positions (odd)."}
    )

    name = "snapkv"

    def __post_init__(self):
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {self.kernel_size}")

    @property
    def needs_queries(self) -> bool:
        return True

    @property
    def query_window(self) -> int:
        return self.window_size

    def min_budget(self) -> int:
        return self.window_size + 1

    def _select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None) -> torch.Tensor:
        """The `budget - window_size` best-scoring positions before the window, then the window: `budget`."""
        batch, heads, length, _ = keys.shape
        window = self.window_size
        grouped = group_queries(queries[:, :, -window:], heads).float()  # (B, H, g, w, D)
        logits = torch.einsum("bhgwd,bhld->bhgwl", grouped, keys.float())  # (B, H, g, w, L)
        # causal inside the observation window: query i (position L - w + i) sees keys <= its position
        key_pos = torch.arange(length, device=keys.device)
        query_pos = torch.arange(length - window, length, device=keys.device)
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        scores = logits.softmax(dim=-1)[..., : length - window].sum(dim=3).mean(dim=2)  # (B, H, L - w)
        scores = F.max_pool1d(scores, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        chosen = scores.topk(budget - window, dim=-1).indices.sort(dim=-1).values
        recent = torch.arange(length - window, length, device=keys.device).expand(batch, heads, window)
        return torch.cat([chosen, recent], dim=-1)
