"""Sparse draft KV caches: the draft reads these, the target keeps its full cache."""

from .base import SparseDraftCache, SparseDraftLayer, cache_nbytes
from .budgeted import BudgetedCache, BudgetedLayer
from .policies import POLICIES, ChunkPolicy, KeepPolicy, SnapKVPolicy, StreamingPolicy, get_policy
from .sink_window import SinkWindowCache, SinkWindowLayer

__all__ = [
    "POLICIES",
    "BudgetedCache",
    "BudgetedLayer",
    "ChunkPolicy",
    "KeepPolicy",
    "SinkWindowCache",
    "SinkWindowLayer",
    "SnapKVPolicy",
    "SparseDraftCache",
    "SparseDraftLayer",
    "StreamingPolicy",
    "cache_nbytes",
    "get_policy",
]
