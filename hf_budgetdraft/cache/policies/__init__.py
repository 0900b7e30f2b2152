"""KV-selection policies for `BudgetedCache` and the BudgetDraft trainer's sparse views."""

from __future__ import annotations

from .chunk import ChunkPolicy
from .dynamic import DynamicChunkPolicy
from .keep_policy import KeepPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy

POLICIES: dict[str, type[KeepPolicy]] = {
    ChunkPolicy.name: ChunkPolicy,
    StreamingPolicy.name: StreamingPolicy,
    SnapKVPolicy.name: SnapKVPolicy,
    DynamicChunkPolicy.name: DynamicChunkPolicy,
}


def get_policy(policy: str | KeepPolicy, **policy_kwargs) -> KeepPolicy:
    """Resolve a policy name (with its hyper-parameters) or pass a `KeepPolicy` instance through."""
    if isinstance(policy, KeepPolicy):
        if policy_kwargs:
            raise ValueError(
                f"policy_kwargs {sorted(policy_kwargs)} given with a policy instance; set them on it"
            )
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy={policy!r}; choose one of {sorted(POLICIES)} or pass a KeepPolicy")
    try:
        return POLICIES[policy](**policy_kwargs)
    except TypeError as error:
        raise ValueError(f"bad policy_kwargs for policy={policy!r}: {error}") from None


__all__ = [
    "POLICIES",
    "ChunkPolicy",
    "DynamicChunkPolicy",
    "KeepPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "get_policy",
]
