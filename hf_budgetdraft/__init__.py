"""hf-budgetdraft: long-context speculative decoding whose draft reads a sparse KV cache.

`import hf_budgetdraft` registers `cache_implementation="sink_window"` and `"budgeted"` with transformers'
`generate()`. With `assistant_model=`, they name the draft's cache; the target keeps its full cache (a
`GrowableCache`), so the output is exactly the target's. It also registers `attn_implementation="budgetdraft_sdpa"`,
SDPA without the KV copies that make verifying several tokens at long context slow on CPU.
"""

from . import integration
from .attention.query_capture import query_capture
from .cache import (
    BudgetedCache,
    BudgetSelection,
    ChunkPolicy,
    DynamicChunkPolicy,
    GrowableCache,
    KeepPolicy,
    Selection,
    SinkSelection,
    SinkWindowCache,
    SnapKVPolicy,
    SparseDraftCache,
    StreamingPolicy,
    cache_nbytes,
)
from .generation.compiled_step import draft_step_compile_config
from .generation.draft_prefix import KeptPrompts, set_kept_prompts
from .generation.plan import DraftPlan
from .generation.spec import DraftSpec
from .generation.stats import SpeculationStats, record_speculation

integration.install()
uninstall = (
    integration.uninstall
)  # undoes every patch install() made (import runs install(); call it to re-install)
install = integration.install

__version__ = "0.1.0"

__all__ = [
    "BudgetSelection",
    "BudgetedCache",
    "ChunkPolicy",
    "DynamicChunkPolicy",
    "DraftPlan",
    "DraftSpec",
    "GrowableCache",
    "KeepPolicy",
    "KeptPrompts",
    "Selection",
    "SinkSelection",
    "SinkWindowCache",
    "SnapKVPolicy",
    "SparseDraftCache",
    "SpeculationStats",
    "StreamingPolicy",
    "cache_nbytes",
    "draft_step_compile_config",
    "install",
    "query_capture",
    "record_speculation",
    "set_kept_prompts",
    "uninstall",
]
