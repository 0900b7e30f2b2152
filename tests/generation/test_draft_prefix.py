"""A call continuing a prefilled target cache: the drafter's prefill continues the prompt it read in the previous such
call from where the two stop sharing (`generation/draft_prefix.py`): a windowed prefill from the first chunk they do
not share, and then everything it drafts is what a full re-read would have drafted; a full prefill from the first
token."""

import copy
import gc

import pytest
import torch
from test_prefilled import FedLengths, prefilled_cache
from tiny_models import model_pair, random_prompt, skip_unless_static

from hf_budgetdraft import KeptPrompts, record_speculation, set_kept_prompts
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation import draft_prefix

WINDOW = 32
SIZES = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 40},
}
NEW_TOKENS = 24


class PrefillFeeds(FedLengths):
    """Tokens fed by each forward of the drafter that feeds more than one round's tokens (its prefill)."""

    @property
    def fed(self) -> list[int]:
        return [n for n in self.lengths if n > 3]  # a draft step feeds at most the round's 3 tokens


def speculate(target, drafter, ids, cache=None, name="budgeted", **config):
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation=name,
            cache_config={**SIZES[name], "prefill_window": WINDOW, "draft_length": 3, **config},
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            **({} if cache is None else cache_kwargs(copy.deepcopy(cache))),
        )
    return out, stats


def questions(document: torch.LongTensor, count: int = 2) -> list[torch.LongTensor]:
    return [torch.cat([document, random_prompt(20, seed=40 + q)], dim=1) for q in range(count)]


@pytest.mark.parametrize("name", ["budgeted", "sink_window"])
def test_the_next_question_reads_only_the_chunks_it_does_not_share(name):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=3)
    cache = prefilled_cache(target, document)
    first, second = questions(document)
    speculate(target, drafter, first, cache, name)
    feeds = PrefillFeeds(drafter)
    out, stats = speculate(target, drafter, second, cache, name)
    assert sum(feeds.fed) == second.shape[1] - 192  # the document's first 6 chunks are the last prompt's
    draft_prefix._prompts.pop(drafter)
    fresh_out, fresh = speculate(target, drafter, second, cache, name)
    assert sum(feeds.fed[1:]) == second.shape[1]  # without it: the whole sequence again
    expected = target.generate(second, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected) and torch.equal(fresh_out, expected)
    # the same drafts, round for round, and the same draft cache at the end
    assert (
        stats.proposed_per_round == fresh.proposed_per_round
        and stats.accepted_per_round == fresh.accepted_per_round
    )
    for layer, fresh_layer in zip(stats.draft_cache.layers, fresh.draft_cache.layers, strict=True):
        assert torch.equal(layer.keys, fresh_layer.keys) and torch.equal(layer.values, fresh_layer.values)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["budgeted", "sink_window"])
def test_a_full_prefill_reads_only_the_tokens_it_does_not_share(name, static):
    """`prefill_window=None` (CUDA's default): every query reads every earlier token, so every shared token is."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    if static:
        skip_unless_static(drafter)
    document = random_prompt(200, seed=11)
    cache = prefilled_cache(target, document)
    first, second = questions(document)
    speculate(target, drafter, first, cache, name, prefill_window=None, static=static)
    feeds = PrefillFeeds(drafter)
    out, stats = speculate(target, drafter, second, cache, name, prefill_window=None, static=static)
    assert feeds.fed == [20] and stats.plan.spec.prefill_window is None and stats.plan.spec.static == static
    assert torch.equal(out, target.generate(second, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_a_prefill_scored_by_its_queries_reads_the_whole_prompt():
    """A policy that scores the prompt with the prefill's queries (SnapKV) needs them all from one forward."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=12)
    cache = prefilled_cache(target, document)
    first, second = questions(document)
    snapkv = {"prefill_window": None, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}
    speculate(target, drafter, first, cache, **snapkv)
    feeds = PrefillFeeds(drafter)
    out, _ = speculate(target, drafter, second, cache, **snapkv)
    assert feeds.fed == [second.shape[1]] and drafter not in draft_prefix._prompts
    assert torch.equal(out, target.generate(second, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_the_next_turn_continues_the_prompt_of_the_last():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=5)
    first, _ = speculate(target, drafter, ids, prefilled_cache(target, ids[:, :100]))
    turn = torch.cat([first, random_prompt(12, seed=6)], dim=1)
    feeds = PrefillFeeds(drafter)
    out, _ = speculate(target, drafter, turn, prefilled_cache(target, turn[:, :-12]))
    assert sum(feeds.fed) == turn.shape[1] - 128  # the last prompt's 150 tokens: 4 whole chunks
    assert torch.equal(out, target.generate(turn, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_calls_without_a_passed_cache_neither_reuse_nor_keep_a_prompt():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(200, seed=7)
    feeds = PrefillFeeds(drafter)
    for _ in range(2):
        speculate(target, drafter, ids)
    assert sum(feeds.fed) == 2 * ids.shape[1] and drafter not in draft_prefix._prompts


def test_new_weights_or_another_window_read_the_whole_prompt_again():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=8)
    cache = prefilled_cache(target, document)
    first, second = questions(document)
    speculate(target, drafter, first, cache)
    feeds = PrefillFeeds(drafter)
    speculate(target, drafter, second, cache, prefill_window=40)
    assert sum(feeds.fed) == second.shape[1]
    with torch.no_grad():
        drafter.lm_head.weight.mul_(1.01)  # written in place: its version moves
    feeds.lengths.clear()
    speculate(target, drafter, first, cache, prefill_window=40)
    assert sum(feeds.fed) == first.shape[1]


def test_the_device_round_continues_the_prompt_too():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=9)
    cache = prefilled_cache(target, document)
    first, second = questions(document)
    speculate(target, drafter, first, cache, device_round=True)
    feeds = PrefillFeeds(drafter)
    out, stats = speculate(target, drafter, second, cache, device_round=True)
    # the device round's drafter reads the prompt and the target's first token
    assert stats.runtime["loop"] == "device_round" and sum(feeds.fed) == second.shape[1] + 1 - 192
    assert torch.equal(out, target.generate(second, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_the_kept_prompt_goes_with_the_drafter():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=10)
    gc.collect()  # the prompts of earlier tests' drafters, gone with them
    before = len(draft_prefix._prompts)
    speculate(target, drafter, questions(document)[0], prefilled_cache(target, document))
    assert len(draft_prefix._prompts) == before + 1
    del drafter
    gc.collect()
    assert len(draft_prefix._prompts) == before


@pytest.mark.parametrize("window", [WINDOW, None])
def test_the_samples_of_the_next_question_continue_the_prompt_of_the_last(window):
    """`num_return_sequences` continuing the document's cache (the batched loop): the drafter reads only what the
    question does not share with the last prompt it read (whole chunks, windowed; every token, full), once for all
    the copies; at top_k=1 every copy is the target's own output, and the rounds are those of a whole re-read."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    document = random_prompt(200, seed=5)
    cache = prefilled_cache(target, document)
    first, second = questions(document)

    def samples(ids):
        with record_speculation() as stats:
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=drafter,
                cache_implementation="budgeted",
                cache_config={**SIZES["budgeted"], "prefill_window": window, "draft_length": 3},
                do_sample=True,
                top_k=1,
                num_return_sequences=3,
                max_new_tokens=NEW_TOKENS,
                **cache_kwargs(cache),
            )
        return out, stats

    samples(first)
    feeds = PrefillFeeds(drafter)
    out, stats = samples(second)
    assert feeds.fed == ([second.shape[1] - 192] if window else [20])
    draft_prefix._prompts.pop(drafter)
    fresh_out, fresh = samples(second)
    assert sum(feeds.fed[1:]) == second.shape[1]  # without it: the whole sequence again
    expected = target.generate(second, do_sample=False, max_new_tokens=NEW_TOKENS).repeat(3, 1)
    assert torch.equal(out, expected) and torch.equal(fresh_out, expected)
    if window:  # bit-identical draft caches: the same rounds
        assert stats.accepted_per_round == fresh.accepted_per_round


@pytest.fixture
def kept_limits():
    """Restores the process-wide limits a test changes."""
    before = set_kept_prompts()
    yield
    set_kept_prompts(before.max_prompts, before.max_bytes)


def test_documents_taken_in_turn_each_continue_their_own_prompt():
    """A question on one document, then on another, then the first again: each continues its own document's prompt
    (read once), and a second question on a document stands for its first."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    documents = [random_prompt(200, seed=30), random_prompt(200, seed=31)]
    caches = [prefilled_cache(target, document) for document in documents]
    asked = [questions(document) for document in documents]
    for d in (0, 1):
        speculate(target, drafter, asked[d][0], caches[d])
    feeds = PrefillFeeds(drafter)
    for d in (0, 1):
        out, _ = speculate(target, drafter, asked[d][1], caches[d])
        assert torch.equal(out, target.generate(asked[d][1], do_sample=False, max_new_tokens=NEW_TOKENS))
    assert feeds.fed == [asked[0][1].shape[1] - 192, asked[1][1].shape[1] - 192]
    assert [read.ids.shape[1] for read in draft_prefix._prompts[drafter]] == [220, 220]


def test_prompts_sharing_a_short_start_are_both_kept():
    """Two conversations opening with the same 64-token system prompt: the second does not replace the first."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    system = random_prompt(64, seed=32)
    conversations = [torch.cat([system, random_prompt(150, seed=33 + c)], dim=1) for c in (0, 1)]
    for conversation in conversations:
        speculate(target, drafter, conversation, prefilled_cache(target, conversation[:, :-10]))
    feeds = PrefillFeeds(drafter)
    turn = torch.cat([conversations[0], random_prompt(20, seed=35)], dim=1)
    speculate(target, drafter, turn, prefilled_cache(target, conversations[0]))
    assert sum(feeds.fed) == turn.shape[1] - 192  # the first conversation's 214 tokens: 6 whole chunks
    assert len(draft_prefix._prompts[drafter]) == 2


def kept_now(drafter) -> list[int]:
    return [id(read) for read in draft_prefix._prompts[drafter]]


def test_the_limits_bound_what_is_kept(kept_limits):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    documents = [random_prompt(200, seed=36 + d) for d in range(3)]
    for document in documents:
        speculate(target, drafter, questions(document)[0], prefilled_cache(target, document))
    kept = draft_prefix._prompts[drafter]
    assert len(kept) == 3
    set_kept_prompts(max_prompts=2)  # applies at once: the least recently read goes
    assert kept_now(drafter) == [id(read) for read in kept[1:]]
    set_kept_prompts(max_bytes=kept[-1].nbytes)  # room for one
    assert kept_now(drafter) == [id(read) for read in kept[2:]]
    set_kept_prompts(max_bytes=kept[-1].nbytes - 1)  # a prompt larger than the bound alone is not kept
    assert kept_now(drafter) == []
    feeds = PrefillFeeds(drafter)
    out, _ = speculate(target, drafter, questions(documents[2])[1], prefilled_cache(target, documents[2]))
    assert sum(feeds.fed) == 220 and kept_now(drafter) == []
    assert torch.equal(
        out, target.generate(questions(documents[2])[1], do_sample=False, max_new_tokens=NEW_TOKENS)
    )


@pytest.mark.parametrize(
    "limits", [{"max_prompts": -1}, {"max_bytes": -5}, {"max_prompts": 1.5}, {"max_bytes": True}]
)
def test_invalid_limits_are_refused_and_change_nothing(limits, kept_limits):
    before = set_kept_prompts()
    with pytest.raises(ValueError, match=next(iter(limits))):
        set_kept_prompts(**limits)
    assert set_kept_prompts() == before == KeptPrompts()
