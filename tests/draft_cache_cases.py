"""What the draft-cache layer tests share: the tensor sizes, random keys/values, the budget policies they run."""

import torch

HEADS, DIM, SLACK = 2, 4, 6
# (policy name, its arguments, budget): each selection policy at a budget small enough to evict
BUDGET_POLICIES = [
    ("chunk", {"chunk_size": 4}, 12),
    ("streaming", {"num_sink_tokens": 2}, 9),
    ("snapkv", {"window_size": 3}, 10),
]


def random_kv(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`(keys, values)`, each `(1, HEADS, n, DIM)`."""
    return (
        torch.randn(1, HEADS, n, DIM, generator=generator),
        torch.randn(1, HEADS, n, DIM, generator=generator),
    )
