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
verification continues from there. And it gives them `inputs_embeds`: transformers' assisted loop feeds the first
verification the prompt's embeddings alone, without the round's drafts, and reads the drafts' logits off prompt
positions; here the drafts' embeddings (the target's own embedding of their ids) follow the prompt's. The drafter
reads the prompt's ids, with its own embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import Cache

from ..cache import SparseDraftCache
from ..cache.windowed_prefill import prefill_in_chunks
from ..compat import CACHE_KWARG


@dataclass(frozen=True)
class _FirstRound:
    """What a call's first verification needs: the target `cache` it continues, the tokens it `held` when
    transformers' loop started, and the target's input embedding (`embed`, for the drafts of a prompt given as
    embeddings)."""

    cache: Cache
    held: int
    embed: torch.nn.Module


_first_round: ContextVar[_FirstRound | None] = ContextVar("budgetdraft_first_round", default=None)


def is_given(cache) -> bool:
    """Whether `cache` was passed to `generate()` by its caller (transformers marks such caches), as opposed to the
    one the call built for itself."""
    return bool(getattr(cache, "_is_user_defined", False))


def continues_a_prefix(cache) -> bool:
    """Whether a call continues a target cache its caller passed, holding a prefix of the prompt."""
    return cache is not None and is_given(cache) and int(cache.get_seq_length()) > 0


@contextlib.contextmanager
def kept_on_failure(cache) -> Iterator[None]:
    """A call that fails (an exception, a stopped streamer, Ctrl-C) leaves a cache its caller passed holding what it
    held: its full-attention layers cropped back (exact: only their length moves), its bounded layers (sliding
    windows, convolution states, which cannot roll back past their window) put back as copied at the start."""
    if cache is None or not is_given(cache):
        yield
        return
    held = int(cache.get_seq_length())
    copies = {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers) if _bounded(layer)}
    try:
        yield
    except BaseException:
        for i, layer in enumerate(cache.layers):
            if i in copies:
                _put_back(layer, copies[i])
            elif int(layer.get_seq_length()) > held:
                layer.crop(held - int(layer.get_seq_length()))
        raise


def _bounded(layer) -> bool:
    """A layer holding a bounded state (a sliding window, a convolution state) rather than every past token."""
    return getattr(layer, "is_sliding", None) is not False


def _put_back(layer, saved) -> None:
    """Restore `layer`'s state from `saved`, its copy; tensors of the same shape in place (a static layer's buffers
    keep their addresses)."""
    for name, value in vars(saved).items():
        current = getattr(layer, name, None)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(current, torch.Tensor)
            and current.shape == value.shape
        ):
            current.copy_(value)
        else:
            setattr(layer, name, value)


def check_target_cache(cache, rows: int, runs_batched: bool, copies: int = 1) -> None:
    """Refuse a cache a speculative call on a sparse draft cache cannot continue, before anything is written to it
    (`rows`: the call's rows, `copies` of each prompt: `num_return_sequences`)."""
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
    if runs_batched and not (copies > 1 and rows == copies):
        raise ValueError(
            f"a target cache passed to generate() is continued one sequence at a time, or by the samples of one "
            f"prompt (num_return_sequences); this call runs the batched loop ({rows} rows, or cache_config "
            "full_draft_cache=True), which builds its own: drop cache=, or generate the rows one by one"
        )


def check_prompt_extends(cached: int, input_ids: torch.LongTensor) -> None:
    """The prompt is the whole sequence (the `cached` tokens the cache holds, then at least one new token)."""
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"the target's cache holds {cached} tokens but the prompt has {input_ids.shape[1]}; pass the whole "
            "sequence as input_ids (the tokens the cache holds, then the new ones: at least one)"
        )


@contextlib.contextmanager
def continuing(
    target,
    cache: Cache,
    input_ids: torch.LongTensor,
    chunk: int | None = None,
    embeds: torch.Tensor | None = None,
) -> Iterator[None]:
    """Run the call's first verification on the tokens past `cache`'s length only. With `chunk` (transformers'
    `prefill_chunk_size`), first feed the prompt's uncached tokens but the last into `cache` in chunks of at most
    `chunk` (the first verification then feeds the last token and the round's drafts), as transformers' own prefill
    does: a long prompt's activations stay bounded. `embeds` `(1, L, H)`: the prompt as `inputs_embeds`, fed to the
    target in place of `input_ids (1, L)`'s embeddings. A target whose `prepare_inputs_for_generation` never reaches
    transformers' own is refused before the cache is written (it would feed the whole prompt again)."""
    cached = cache.get_seq_length()
    check_prompt_extends(cached, input_ids)
    check_embeds(embeds, input_ids)
    chunked = chunk is not None and input_ids.shape[1] - cached > chunk
    held = input_ids.shape[1] - 1 if chunked else cached  # what the cache holds when the loop starts
    if held == 0 and embeds is None:
        yield
        return
    token = _first_round.set(_FirstRound(cache, held, target.get_input_embeddings()))
    try:
        _check_inputs_are_sliced(target, cache, input_ids, held, embeds)
        if chunked:
            keep = (
                {"logits_to_keep": 1}
                if "logits_to_keep" in inspect.signature(target.forward).parameters
                else {}
            )
            prefill_in_chunks(target, input_ids[:, :held], cache, chunk, cached, embeds=embeds, **keep)
        yield
    finally:
        _first_round.reset(token)


def check_embeds(embeds: torch.Tensor | None, input_ids: torch.LongTensor) -> None:
    """`inputs_embeds (B, L, H)` must give the embeddings of the prompt `input_ids (B, L)`, position for position."""
    if embeds is not None and tuple(embeds.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"inputs_embeds has shape {tuple(embeds.shape)} but input_ids {tuple(input_ids.shape)}; pass both for "
            "the same prompt (the target reads the embeddings, a drafter the ids): inputs_embeds of shape (batch, "
            "prompt length, hidden size)"
        )


def _check_inputs_are_sliced(
    target, cache: Cache, input_ids: torch.LongTensor, held: int, embeds: torch.Tensor | None
) -> None:
    probe = target.prepare_inputs_for_generation(
        input_ids,
        next_sequence_length=None,
        is_first_iteration=True,
        inputs_embeds=embeds,
        **{CACHE_KWARG: cache},
    )
    fed = probe.get("input_ids" if embeds is None else "inputs_embeds")
    if fed is None or fed.shape[1] != input_ids.shape[-1] - held:
        raise ValueError(
            f"{type(target).__name__}.prepare_inputs_for_generation does not reach transformers' own, so a "
            "speculative call cannot start from a prefilled cache on it; pass the whole prompt, without cache=, "
            "prefill_chunk_size= or inputs_embeds="
        )


def first_round_inputs(input_ids: torch.LongTensor, kwargs: dict) -> None:
    """In `kwargs` of `prepare_inputs_for_generation(input_ids, **kwargs)`, on the first verification of a call in
    `continuing`: slice `input_ids (B, L + n)` (the prompt, then the round's n drafts) to the tokens the cache does
    not hold, and append the drafts' embeddings to a prompt given as `inputs_embeds (B, L, H)`."""
    scope = _first_round.get()
    if (
        scope is None
        or not kwargs.get("is_first_iteration")
        or kwargs.get("next_sequence_length") is not None
        or kwargs.get("cache", kwargs.get("past_key_values")) is not scope.cache
    ):
        return
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        drafts = input_ids[:, embeds.shape[1] :]
        kwargs["inputs_embeds"] = torch.cat([embeds, scope.embed(drafts).to(embeds.dtype)], dim=1)
    kwargs["next_sequence_length"] = input_ids.shape[-1] - scope.held
