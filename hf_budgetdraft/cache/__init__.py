"""Sparse draft KV caches (the draft reads these) and `GrowableCache`, the full cache the target keeps."""

from .base import SparseDraftCache, SparseDraftLayer, cache_nbytes
from .budgeted import BudgetedCache, BudgetedLayer
from .growable import GrowableCache, GrowableLayer, is_full_attention_only
from .policies import POLICIES, ChunkPolicy, KeepPolicy, SnapKVPolicy, StreamingPolicy, get_policy
from .sink_window import SinkWindowCache, SinkWindowLayer

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
    "StreamingPolicy",
    "cache_nbytes",
    "get_policy",
    "is_full_attention_only",
]
