"""Sink + window caches for transformers' own draft heads, whose queries sit ahead of their keys.

- `WindowedMtpCache` (Windowed-MTP, arXiv 2607.21535): `generate(use_mtp=True)` drafts with `MtpModel` on an
  `MtpCache`, whose depth-k layer runs k+1 tokens ahead of the main model; this cache keeps those offsets on
  sink + window draft layers.
- `WindowedDFlashCache`: transformers' DFlash block drafter (`speculation_type="dflash"`) appends the keys/values of
  the newly accepted context (projected target hidden states) and of the noise block each round, while only the
  `block_size` noise tokens are queries; this cache keeps `DFlashCache`'s bookkeeping (keys run `accepted` tokens
  ahead of the queries) on sink + window ring layers.

Either way the draft's attention cost and memory stop growing with context, and the target still verifies every
token with full attention (lossless by construction); a window covering the whole context reproduces the native
head exactly. Sliding-window layers (Mellum's `mtp_layer_types=["sliding_attention"]`, DFlash's sliding layers)
keep transformers' own layer, as every dynamic `SparseDraftCache` does: they are bounded already. `generate()`'s
`cache_config` becomes one of these in `generation.windowed_mtp.windowed_mtp_cache` / `generation.dflash.windowed_dflash_cache`.
"""

from __future__ import annotations

from .draft_cache import SinkWindowCache


class WindowedMtpCache(SinkWindowCache):
    """`MtpCache` semantics (depth-k queries and keys sit k+1 positions ahead) on sink + window ring layers.

    An MTP layer that is natively sliding (Mellum's `mtp_layer_types=["sliding_attention"]`) keeps its own
    sliding-window layer, as every dynamic `SparseDraftCache` keeps sliding layers: it is already bounded, so the
    requested window is not applied to it (a Mellum head drafts exactly as native MTP does, and this is logged).
    """

    def get_query_offset(self, layer_idx: int = 0):
        return super().get_query_offset(layer_idx) + layer_idx + 1

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        return kv_length, kv_offset + layer_idx + 1


class WindowedDFlashCache(SinkWindowCache):
    """`DFlashCache` semantics on sink + window ring layers: a forward appends `accepted + block_size` keys while
    only the `block_size` noise tokens are queries, so the queries' offset and the key count grow by `accepted`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._previous_number_of_accepted_tokens = 0

    def set_previous_accepted_tokens(self, number_of_accepted_tokens: int) -> None:
        """Called by transformers' DFlash generator before each draft forward: the tokens accepted last round."""
        self._previous_number_of_accepted_tokens = number_of_accepted_tokens

    def get_query_offset(self, layer_idx: int = 0):
        return super().get_query_offset(layer_idx) + self._previous_number_of_accepted_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        return kv_length + self._previous_number_of_accepted_tokens, kv_offset
