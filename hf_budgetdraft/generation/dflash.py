"""Windowed DFlash glue: transformers' DFlash block drafter reads only an attention sink + a recent window.

DFlash (`generate(assistant_model=drafter, speculation_type="dflash")`, transformers' `DFlashTokenCandidateGenerator`)
drafts a block of `block_size` tokens in one forward: every drafter layer appends the keys/values of the newly
accepted context and of the noise block to its `DFlashCache`, the block's queries attend bidirectionally over all of
them, and the block is cropped away next round. Its full-attention layers read the whole context every round, the
same draft-KV tax Windowed-MTP (arXiv 2607.21535) removes for MTP heads. `windowed_dflash_cache` builds the
`WindowedDFlashCache` (`hf_budgetdraft.cache.draft_head_caches`) that replaces it from `generate()`'s `cache_config`.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache.draft_head_caches import WindowedDFlashCache
from ..compat import activate_past_recording
from .cache_config import WindowedSpec


def windowed_dflash_cache(drafter: PreTrainedModel, spec: WindowedSpec | dict | None) -> WindowedDFlashCache:
    """The windowed cache for a DFlash `drafter`, from a call's `cache_config` (parsed, or a dict parsed here; past
    recording on, as the stock generator does for its sliding layers)."""
    if not isinstance(spec, WindowedSpec):
        spec = WindowedSpec.from_cache_config("dflash", spec)
    options = dict(spec.cache_options)
    block_size = drafter.config.block_size
    # every round crops the previous noise block away: the ring must roll back `block_size` tokens exactly
    options.setdefault("slack", max(32, block_size))
    if options["slack"] < block_size:
        raise ValueError(
            f"slack={options['slack']} is smaller than the drafter's block_size={block_size}; each round rolls the "
            f"noise block back, so pass slack >= {block_size}"
        )
    cache = WindowedDFlashCache(config=drafter.config, **options)
    activate_past_recording(cache)
    return cache
