"""hf-budgetdraft: long-context speculative decoding whose draft reads a sparse KV cache.

`import hf_budgetdraft` registers `cache_implementation="sink_window"` and `"budgeted"` with transformers'
`generate()`. With `assistant_model=`, they name the draft's cache; the target keeps its full cache, so the
output is exactly the target's.
"""

from . import integration
from .attention.query_capture import query_capture
from .cache import (
    BudgetedCache,
    ChunkPolicy,
    KeepPolicy,
    SinkWindowCache,
    SnapKVPolicy,
    StreamingPolicy,
    cache_nbytes,
)
from .generation.stats import SpeculationStats, record_speculation

integration.install()

__version__ = "0.1.0"

__all__ = [
    "BudgetedCache",
    "ChunkPolicy",
    "KeepPolicy",
    "SinkWindowCache",
    "SnapKVPolicy",
    "SpeculationStats",
    "StreamingPolicy",
    "cache_nbytes",
    "query_capture",
    "record_speculation",
]
