"""Windowed DFlash: transformers' DFlash block drafter reads only an attention sink + a recent window of its cache.

DFlash (`generate(assistant_model=drafter, speculation_type="dflash")`, transformers' `DFlashTokenCandidateGenerator`)
drafts a block of `block_size` tokens in one forward: every drafter layer appends the keys/values of the newly
accepted context (projected target hidden states) and of the noise block to its `DFlashCache`, the block's queries
attend bidirectionally over all of them, and the block is cropped away next round. Its full-attention layers read
the whole context every round, the same draft-KV tax Windowed-MTP (arXiv 2607.21535) removes for MTP heads.
`WindowedDFlashCache` keeps `DFlashCache`'s bookkeeping (keys run `accepted` tokens ahead of the queries) on sink +
window ring layers, so the draft's per-round cost and memory stop growing with context; sliding-window layers keep
transformers' own layer. The target still verifies every token with full attention (lossless by construction).
"""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache.sink_window import SinkWindowCache

OPTIONS = ("num_sink_tokens", "window_length", "slack")


class WindowedDFlashCache(SinkWindowCache):
    """`DFlashCache` semantics on sink + window ring layers: a forward appends `accepted + block_size` keys while
    only the `block_size` noise tokens are queries, so the queries' offset and the key count grow by `accepted`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._previous_number_of_accepted_tokens = 0

    def set_previous_accepted_tokens(self, number_of_accepted_tokens: int) -> None:
        self._previous_number_of_accepted_tokens = number_of_accepted_tokens

    def get_query_offset(self, layer_idx: int = 0):
        return super().get_query_offset(layer_idx) + self._previous_number_of_accepted_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        return kv_length + self._previous_number_of_accepted_tokens, kv_offset


def windowed_dflash_cache(drafter: PreTrainedModel, cache_config: dict | None) -> WindowedDFlashCache:
    """The windowed cache for a DFlash `drafter`, from `generate()`'s `cache_config` (past recording on, as the
    stock generator does for its sliding layers)."""
    options = dict(cache_config or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"cache_config keys {unknown} are not options of windowed DFlash; accepted: {', '.join(OPTIONS)}"
        )
    block_size = drafter.config.block_size
    # every round crops the previous noise block away: the ring must roll back `block_size` tokens exactly
    options.setdefault("slack", max(32, block_size))
    if options["slack"] < block_size:
        raise ValueError(
            f"slack={options['slack']} is smaller than the drafter's block_size={block_size}; each round rolls the "
            f"noise block back, so pass slack >= {block_size}"
        )
    cache = WindowedDFlashCache(config=drafter.config, **options)
    cache.activate_past_recording()
    return cache
