"""KV caches. The draft reads a sparse one: a selection (`SinkSelection`, `BudgetSelection`) on a storage (dynamic
`DraftLayer`, fixed-shape `StaticDraftLayer`, or the batched `RaggedDraftCache`), named `SinkWindowCache` /
`BudgetedCache`, with MTP / DFlash forms (`WindowedMtpCache`, `WindowedDFlashCache`). The target keeps
`GrowableCache`, a full cache."""

from .draft_cache import BudgetedCache, SinkWindowCache, SparseDraftCache, has_fixed_shape_steps
from .draft_head_caches import WindowedDFlashCache, WindowedMtpCache
from .draft_layer import DraftLayer
from .growable import GrowableCache, GrowableLayer, is_full_attention_only
from .policies import (
    POLICIES,
    ChunkPolicy,
    DynamicChunkPolicy,
    KeepPolicy,
    SnapKVPolicy,
    StreamingPolicy,
    get_policy,
)
from .selection import BudgetSelection, Selection, SinkSelection
from .sizes import cache_nbytes
from .static_draft_layer import StaticDraftLayer
from .static_sliding_layer import StaticSlidingLayer

__all__ = [
    "POLICIES",
    "BudgetSelection",
    "BudgetedCache",
    "ChunkPolicy",
    "DraftLayer",
    "DynamicChunkPolicy",
    "GrowableCache",
    "GrowableLayer",
    "KeepPolicy",
    "Selection",
    "SinkSelection",
    "SinkWindowCache",
    "SnapKVPolicy",
    "SparseDraftCache",
    "StaticDraftLayer",
    "StaticSlidingLayer",
    "StreamingPolicy",
    "WindowedDFlashCache",
    "WindowedMtpCache",
    "cache_nbytes",
    "get_policy",
    "has_fixed_shape_steps",
    "is_full_attention_only",
]
