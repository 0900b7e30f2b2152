"""StreamingLLM: keep an attention sink plus the most recent prefix tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
A prefix longer than the budget keeps exactly `budget` positions: the sink and the `budget - num_sink_tokens`
most recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .keep_policy import KeepPolicy


@dataclass
class StreamingPolicy(KeepPolicy):
    num_sink_tokens: int = field(
        default=8, metadata={"help": "First prefix tokens always kept (attention sink)."}
    )

    name = "streaming"

    def __post_init__(self):
        if self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")

    def min_budget(self) -> int:
        return self.num_sink_tokens + 1

    def _select(self, keys: torch.Tensor, budget: int, queries: torch.Tensor | None) -> torch.Tensor:
        """The first `num_sink_tokens` positions and the most recent ones, `budget` in all."""
        batch, heads, length = keys.shape[:3]
        recent = budget - self.num_sink_tokens
        positions = torch.cat([torch.arange(self.num_sink_tokens), torch.arange(length - recent, length)]).to(
            keys.device
        )
        return positions.expand(batch, heads, budget)
