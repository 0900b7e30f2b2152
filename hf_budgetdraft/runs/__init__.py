"""What a run of the product needs (`hf-budgetdraft generate`, the demo app, the benchmarks alike): a timed
`generate()` call with its phases and memory (`timed_call`), a timed batched call (`batch_call`), the output compared
token for token with the target's own (`token_diff`), and the acceptance's intervals (`intervals`)."""

from .intervals import acceptance_intervals, wilson_interval
from .timed_call import RunResult, timed_generate
from .token_diff import TokenDiff, divergence_margin, noise_envelope, token_diff

__all__ = [
    "RunResult",
    "TokenDiff",
    "acceptance_intervals",
    "divergence_margin",
    "noise_envelope",
    "timed_generate",
    "token_diff",
    "wilson_interval",
]
