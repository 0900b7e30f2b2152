"""A speculative call that continues a target cache passed to `generate()` (a document prefilled once, many turns).

transformers' own way to reuse a prefix is `generate(full_ids, cache=cache)` where `cache` already holds the first
k tokens of `full_ids`: its prefill feeds only the rest. Its assisted loop does not: the first verification feeds
the whole prompt again, onto a cache that already holds k of its tokens, so the target reads its prefix twice and
its output is no longer its own. Inside `continuing(cache)`, the first verification of a call feeds only the
tokens the cache does not hold (`first_round_inputs`, called from `GenerationMixin.prepare_inputs_for_generation`);
the drafter reads the whole prompt on its own sparse cache, as in any call. The scope is a `ContextVar` holding
that one cache: other calls, other threads and the drafter's own forwards are untouched.

The same scope gives speculative calls transformers' `prefill_chunk_size`, which its assisted loop ignores (its
first verification feeds the whole prompt in one forward): the prompt is fed in chunks first, and the first
verification continues from there.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from transformers import Cache

from ..cache import SparseDraftCache
from ..cache.windowed_prefill import prefill_in_chunks
from ..compat import CACHE_KWARG

# (the target cache a call continues, the tokens it holds when transformers' loop starts)
_continued: ContextVar[tuple[Cache, int] | None] = ContextVar("budgetdraft_continued_cache", default=None)


def is_given(cache) -> bool:
    """Whether `cache` was passed to `generate()` by its caller (transformers marks such caches), as opposed to the
    one the call built for itself."""
    return bool(getattr(cache, "_is_user_defined", False))


def check_target_cache(cache, rows: int, runs_batched: bool) -> None:
    """Refuse a cache a speculative call on a sparse draft cache cannot continue, before anything is written to it."""
    if not isinstance(cache, Cache):
        raise TypeError(
            f"the target's cache must be a transformers Cache (e.g. DynamicCache, or the past_key_values of an "
            f"earlier call's output), got {type(cache).__name__}"
        )
    if isinstance(cache, SparseDraftCache):
        raise ValueError(
            f"the cache passed to generate() is a {type(cache).__name__}, a sparse draft cache; with a draft the "
            "target verifies on a full cache: pass the target's own cache (a DynamicCache, or an earlier "
            "speculative call's past_key_values), or none"
        )
    if runs_batched:
        raise ValueError(
            f"a target cache passed to generate() is continued one sequence at a time; this call runs the batched "
            f"loop ({rows} rows, or cache_config full_draft_cache=True), which builds its own: drop cache=, or "
            "generate the rows one by one"
        )


def check_prompt_extends(cached: int, input_ids: torch.LongTensor) -> None:
    """The prompt is the whole sequence (the `cached` tokens the cache holds, then at least one new token)."""
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"the target's cache holds {cached} tokens but the prompt has {input_ids.shape[1]}; pass the whole "
            "sequence as input_ids (the tokens the cache holds, then the new ones: at least one)"
        )


@contextlib.contextmanager
def continuing(target, cache: Cache, input_ids: torch.LongTensor, chunk: int | None = None) -> Iterator[None]:
    """Run the call's first verification on the tokens past `cache`'s length only. With `chunk` (transformers'
    `prefill_chunk_size`), first feed the prompt's uncached tokens but the last into `cache` in chunks of at most
    `chunk` (the first verification then feeds the last token and the round's drafts), as transformers' own prefill
    does: a long prompt's activations stay bounded. A target whose `prepare_inputs_for_generation` never reaches
    transformers' own is refused before the cache is written (it would feed the whole prompt again)."""
    cached = cache.get_seq_length()
    check_prompt_extends(cached, input_ids)
    chunked = chunk is not None and input_ids.shape[1] - cached > chunk
    held = input_ids.shape[1] - 1 if chunked else cached  # what the cache holds when the loop starts
    if held == 0:
        yield
        return
    token = _continued.set((cache, held))
    try:
        _check_inputs_are_sliced(target, cache, input_ids, held)
        if chunked:
            keep = (
                {"logits_to_keep": 1}
                if "logits_to_keep" in inspect.signature(target.forward).parameters
                else {}
            )
            prefill_in_chunks(target, input_ids[:, :held], cache, chunk, cached, **keep)
        yield
    finally:
        _continued.reset(token)


def _check_inputs_are_sliced(target, cache: Cache, input_ids: torch.LongTensor, held: int) -> None:
    probe = target.prepare_inputs_for_generation(
        input_ids, next_sequence_length=None, is_first_iteration=True, **{CACHE_KWARG: cache}
    )
    fed = probe.get("input_ids")
    if fed is None or fed.shape[-1] != input_ids.shape[-1] - held:
        raise ValueError(
            f"{type(target).__name__}.prepare_inputs_for_generation does not reach transformers' own, so a "
            "speculative call cannot start from a prefilled cache on it; pass the whole prompt, without cache= "
            "or prefill_chunk_size="
        )


def first_round_inputs(input_ids: torch.LongTensor, kwargs: dict) -> None:
    """In `kwargs` of `prepare_inputs_for_generation(input_ids, **kwargs)`: on the first verification of a call
    continuing its target cache, slice `input_ids (B, L)` to the `L - cached` tokens the cache does not hold."""
    continued = _continued.get()
    if (
        continued is None
        or not kwargs.get("is_first_iteration")
        or kwargs.get("next_sequence_length") is not None
    ):
        return
    cache, cached = continued
    if kwargs.get("cache", kwargs.get("past_key_values")) is cache and kwargs.get("inputs_embeds") is None:
        kwargs["next_sequence_length"] = input_ids.shape[-1] - cached
