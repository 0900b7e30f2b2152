"""A speculative call that continues a target cache passed to `generate()` (`generation/prefilled.py`): a prefix
prefilled once, then several calls, or one call's returned cache continued by the next turn. Its output is the
target's own on the whole sequence, its first verification feeds only the tokens the cache does not hold, and what it
cannot continue is refused before the cache is written. The same scope runs `prefill_chunk_size`'s chunked prefill,
which transformers' assisted loop ignores."""

import copy
import inspect

import pytest
import torch
from test_stops import StopOn
from tiny_models import FAMILIES, model_pair, random_prompt, supports
from transformers import DynamicCache, LlamaForCausalLM, StaticCache, StoppingCriteriaList
from transformers.generation import utils as generation_utils

from hf_budgetdraft import GrowableCache, record_speculation
from hf_budgetdraft.cache import SinkWindowCache
from hf_budgetdraft.compat import CACHE_KWARG, cache_kwargs, output_cache
from hf_budgetdraft.generation import prefilled

SIZES = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 40},
}
NEW_TOKENS = 30


def speculate(target, drafter, ids, cache, name="budgeted", cache_config=None, **kwargs):
    return target.generate(
        ids,
        assistant_model=drafter,
        cache_implementation=name,
        cache_config={**SIZES[name], **(cache_config or {})},
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        **cache_kwargs(cache),
        **kwargs,
    )


def prefilled_cache(target, prefix: torch.LongTensor) -> DynamicCache:
    """transformers' prefix caching: the prefix run once through the target."""
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prefix, **cache_kwargs(cache))
    return cache


class FedLengths:
    """The input lengths of the target's forwards (a hook on the test's own copy of the model)."""

    def __init__(self, model):
        self.lengths = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(ids.shape[-1])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(SIZES))
def test_a_prefix_prefilled_once_is_continued_as_the_targets_own_call(family, name):
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, draft_layers=1)
    ids = random_prompt(150, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    cache = prefilled_cache(target, ids[:, :120])
    fed = FedLengths(target)
    out = speculate(target, drafter, ids, cache, name)
    assert torch.equal(out, expected)
    assert 30 <= fed.lengths[0] <= 30 + 3  # the 30 tokens the cache lacks, then the round's drafts
    # the caller's cache, continued, holds the whole sequence
    assert cache.get_seq_length() == out.shape[1] - 1


def test_the_next_turn_continues_the_cache_a_call_returned():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(140, seed=5)
    first = speculate(target, drafter, ids, None, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, random_prompt(12, seed=6)], dim=1)
    expected = target.generate(turn, do_sample=False, max_new_tokens=NEW_TOKENS)
    fed = FedLengths(target)
    second = speculate(target, drafter, turn, output_cache(first), return_dict_in_generate=True)
    assert torch.equal(second.sequences, expected)
    assert fed.lengths[0] <= 13 + 3  # the new turn (and the token the cache lacked), then drafts
    assert output_cache(second) is output_cache(first)


def test_an_empty_cache_passed_in_is_filled_and_returned():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(100, seed=7)
    cache = DynamicCache(config=target.config)
    out = speculate(target, drafter, ids, cache, "sink_window")
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))
    assert cache.get_seq_length() == out.shape[1] - 1


def test_the_device_round_continues_a_cache_through_its_static_one():
    """The device round (the default on CUDA) loads the caller's cache into its static cache and gives it back
    what the call added."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=3)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    cache = prefilled_cache(target, ids[:, :100])
    fed = FedLengths(target)
    with record_speculation() as stats:
        out = speculate(
            target, drafter, ids, cache, cache_config={"device_round": True}, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, expected) and stats.runtime["loop"] == "device_round"
    assert fed.lengths[0] == 50 and output_cache(out) is cache
    reference = prefilled_cache(target, expected[:, :-1])
    assert cache.get_seq_length() == expected.shape[1] - 1
    for layer, same in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys, same.keys, rtol=1e-4, atol=1e-5)


class FailingStreamer:
    """Raises at its third `put` (the prompt, then two rounds)."""

    def __init__(self):
        self.puts = 0

    def put(self, value):
        self.puts += 1
        if self.puts == 3:
            raise RuntimeError("the caller stopped")

    def end(self):
        pass


def test_a_failed_device_round_leaves_the_given_cache_as_it_was():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=3)
    cache = prefilled_cache(target, ids[:, :100])
    keys = cache.layers[0].keys.clone()
    with pytest.raises(RuntimeError, match="the caller stopped"):
        speculate(
            target, drafter, ids, cache, cache_config={"device_round": True}, streamer=FailingStreamer()
        )
    assert cache.get_seq_length() == 100 and torch.equal(cache.layers[0].keys, keys)


def test_a_cache_holding_the_whole_prompt_is_refused_untouched():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(80, seed=1)
    cache = prefilled_cache(target, ids)
    keys = cache.layers[0].keys.clone()
    with pytest.raises(ValueError, match="holds 80 tokens but the prompt has 80"):
        speculate(target, drafter, ids, cache)
    assert cache.get_seq_length() == 80 and torch.equal(cache.layers[0].keys, keys)


@pytest.mark.parametrize(
    ("rows", "cache_config", "message"),
    [(2, None, "2 rows"), (1, {"full_draft_cache": True}, "full_draft_cache")],
)
def test_the_batched_loop_refuses_a_cache_passed_in(rows, cache_config, message):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(60, seed=2).repeat(rows, 1)
    cache = prefilled_cache(target, ids[:, :40])
    with pytest.raises(ValueError, match=message):
        speculate(target, drafter, ids, cache, cache_config=cache_config)
    assert cache.get_seq_length() == 40


def test_a_sparse_draft_cache_or_a_legacy_tuple_is_refused():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(60, seed=2)
    with pytest.raises(ValueError, match="sparse draft cache"):
        speculate(
            target, drafter, ids, SinkWindowCache(config=target.config, num_sink_tokens=4, window_length=16)
        )
    with pytest.raises(TypeError, match="must be a transformers Cache"):
        speculate(target, drafter, ids, ((torch.zeros(1), torch.zeros(1)),))


class WholeInputs(LlamaForCausalLM):
    """A model whose `prepare_inputs_for_generation` always feeds the whole sequence (as a few old families do)."""

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        inputs["input_ids"] = input_ids
        return inputs


def test_a_target_that_would_read_its_prefix_twice_is_refused_untouched():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    target.__class__ = WholeInputs
    ids = random_prompt(60, seed=2)
    cache = prefilled_cache(target, ids[:, :40])
    with pytest.raises(ValueError, match="does not reach transformers' own"):
        speculate(target, drafter, ids, cache)
    assert cache.get_seq_length() == 40


def test_other_calls_are_untouched():
    """Outside a continuing call, transformers' own inputs: the first iteration feeds the whole sequence."""
    target, _ = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(60, seed=2)
    cache = prefilled_cache(target, ids[:, :40])
    inputs = target.prepare_inputs_for_generation(ids, is_first_iteration=True, **cache_kwargs(cache))
    assert inputs["input_ids"].shape[-1] == 60 and prefilled._first_round.get() is None
    with prefilled.continuing(target, cache, ids):
        inputs = target.prepare_inputs_for_generation(ids, is_first_iteration=True, **cache_kwargs(cache))
        assert inputs["input_ids"].shape[-1] == 20
        other = DynamicCache(config=target.config)
        inputs = target.prepare_inputs_for_generation(ids, is_first_iteration=True, **{CACHE_KWARG: other})
        assert inputs["input_ids"].shape[-1] == 60  # another cache (the drafter's, another call's): untouched
    assert prefilled._first_round.get() is None


def test_a_stop_inside_a_round_trims_the_continued_cache():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=3)
    free = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, 150:].tolist()
    stop = next(token for at, token in enumerate(free) if at > 4 and token not in free[:at])
    criteria = StoppingCriteriaList([StopOn(stop)])
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, stopping_criteria=criteria)
    cache = prefilled_cache(target, ids[:, :120])
    out = speculate(target, drafter, ids, cache, stopping_criteria=criteria)
    assert torch.equal(out, expected) and cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("name", sorted(SIZES))
def test_prefill_chunk_size_bounds_every_prefill_forward(family, name):
    """transformers' assisted loop feeds the whole prompt in its first verification whatever `prefill_chunk_size`
    says; a speculative call feeds it in chunks, as the target's own call does."""
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, draft_layers=1)
    ids = random_prompt(150, seed=4)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    fed = FedLengths(target)
    out = speculate(target, drafter, ids, None, name, prefill_chunk_size=40)
    assert torch.equal(out, expected)
    assert fed.lengths[:4] == [40, 40, 40, 29] and fed.lengths[4] <= 1 + 3  # then the last token and drafts


def test_prefill_chunk_size_continues_from_a_given_cache():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=4)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    cache = prefilled_cache(target, ids[:, :60])
    fed = FedLengths(target)
    assert torch.equal(speculate(target, drafter, ids, cache, prefill_chunk_size=40), expected)
    assert fed.lengths[:3] == [40, 40, 9]


def test_the_device_round_prefills_in_the_calls_chunks():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=4)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    fed = FedLengths(target)
    out = speculate(target, drafter, ids, None, cache_config={"device_round": True}, prefill_chunk_size=64)
    assert torch.equal(out, expected) and fed.lengths[:3] == [64, 64, 22]


def test_a_padded_row_keeps_the_one_forward_prefill():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=4)
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    out = speculate(target, drafter, ids, None, attention_mask=mask, prefill_chunk_size=40)
    assert torch.equal(out, expected)


CACHE_CLASSES = {
    "dynamic": lambda config: DynamicCache(config=config),
    "growable": lambda config: GrowableCache(config=config, initial_capacity=128),
    "static": lambda config: StaticCache(config=config, max_cache_len=256),
}


# transformers' assisted loop refuses a static cache with sliding layers (they cannot be cropped), and before 5.24
# any static cache
STOCK_REFUSES_STATIC = "not supported with Static cache" in inspect.getsource(generation_utils)


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        pytest.param(
            f, k, marks=pytest.mark.skipif(k == "static" and STOCK_REFUSES_STATIC, reason="old release")
        )
        for f in ("llama", "gemma2")
        for k in CACHE_CLASSES
        if (f, k) != ("gemma2", "static")
    ],
)
def test_a_failed_call_leaves_the_given_cache_as_it_was(family, kind):
    """transformers' loop writes the caller's cache as it goes: a failure crops its full layers back and puts its
    sliding layers (gemma2's window of 24, long passed here) back as they were."""
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, draft_layers=1)
    ids = random_prompt(150, seed=3)
    cache = CACHE_CLASSES[kind](target.config)
    with torch.no_grad():
        target(ids[:, :100], **cache_kwargs(cache))
    before = copy.deepcopy(cache)
    with pytest.raises(RuntimeError, match="the caller stopped"):
        speculate(target, drafter, ids, cache, streamer=FailingStreamer())
    assert int(cache.get_seq_length()) == 100
    for layer, saved in zip(cache.layers, before.layers, strict=True):
        length = int(saved.get_seq_length()) if kind == "static" else None  # past it: stale, never read
        assert torch.equal(layer.keys[:, :, :length], saved.keys[:, :, :length])
        assert torch.equal(layer.values[:, :, :length], saved.values[:, :, :length])
    # and it is continued as if nothing had happened
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(speculate(target, drafter, ids, cache), expected)
