"""Sparse draft KV caches (the draft reads these; `static=True`: their compile-friendly slot-buffer layers), their
MTP / DFlash forms (`WindowedMtpCache`, `WindowedDFlashCache`) and `GrowableCache`, the full cache the target keeps."""

from .base import SparseDraftCache, SparseDraftLayer, cache_nbytes
from .budgeted import BudgetedCache, BudgetedLayer
from .growable import GrowableCache, GrowableLayer, is_full_attention_only
from .policies import POLICIES, ChunkPolicy, KeepPolicy, SnapKVPolicy, StreamingPolicy, get_policy
from .sink_window import SinkWindowCache, SinkWindowLayer
from .static import StaticBudgetedLayer, StaticDraftLayer, StaticSinkWindowLayer
from .windowed import WindowedDFlashCache, WindowedMtpCache

__all__ = [
    "POLICIES",
    "BudgetedCache",
    "BudgetedLayer",
    "ChunkPolicy",
    "GrowableCache",
    "GrowableLayer",
    "KeepPolicy",
    "SinkWindowCache",
    "SinkWindowLayer",
    "SnapKVPolicy",
    "SparseDraftCache",
    "SparseDraftLayer",
    "StaticBudgetedLayer",
    "StaticDraftLayer",
    "StaticSinkWindowLayer",
    "StreamingPolicy",
    "WindowedDFlashCache",
    "WindowedMtpCache",
    "cache_nbytes",
    "get_policy",
    "is_full_attention_only",
]
