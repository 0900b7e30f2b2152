"""A prompt given as `inputs_embeds` (a soft prompt, embeddings spliced in): the target reads the embeddings, the
drafter the ids, and the output is the target's own `generate(ids, inputs_embeds=...)`. transformers' assisted loop
feeds its first verification the prompt's embeddings without the round's drafts and reads the drafts' logits off
prompt positions (`generation/prefilled.py`); the batched loop used to read the ids alone."""

import copy

import pytest
import torch
from test_prefilled import prefilled_cache
from tiny_models import FAMILIES, model_pair, random_prompt, supports
from transformers import DynamicCache, GenerationConfig

from hf_budgetdraft import record_speculation
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation.device_loop import unsupported

SIZES = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 40},
}
NEW_TOKENS = 30


def soft_prompt(target, ids: torch.LongTensor, replaced: int = 24, seed: int = 9) -> torch.Tensor:
    """`(B, L, H)`: the embeddings of `ids` with the last `replaced` positions' taken from other tokens, so the
    target's output on them differs from its output on `ids`."""
    other = ids.clone()
    generator = torch.Generator().manual_seed(seed)
    other[:, -replaced:] = torch.randint(0, 128, (ids.shape[0], replaced), generator=generator)
    with torch.no_grad():
        return target.get_input_embeddings()(other)


def greedy(model, ids, embeds, **kwargs):
    return model.generate(ids, inputs_embeds=embeds, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs)


def speculate(target, drafter, ids, embeds, name="budgeted", cache_config=None, **kwargs):
    config = {**SIZES[name], **(cache_config or {})}
    return greedy(
        target, ids, embeds, assistant_model=drafter, cache_implementation=name, cache_config=config, **kwargs
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_target_reads_the_embeddings_and_its_output_is_its_own(family, name):
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, draft_layers=1)
    ids = random_prompt(150, seed=3)
    embeds = soft_prompt(target, ids)
    expected = greedy(target, ids, embeds)
    assert not torch.equal(expected, greedy(target, ids, None))  # the embeddings decide the output
    with record_speculation() as stats:
        out = speculate(target, drafter, ids, embeds, name)
    assert torch.equal(out, expected)
    assert stats.rounds > 0 and stats.runtime["loop"] == "transformers"


def test_sampling_reads_the_embeddings_too():
    """top_k=1 makes sampling deterministic: the sampled call must equal the greedy reference."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=4)
    embeds = soft_prompt(target, ids)
    expected = greedy(target, ids, embeds)
    torch.manual_seed(0)
    out = target.generate(
        ids,
        inputs_embeds=embeds,
        assistant_model=drafter,
        cache_implementation="sink_window",
        cache_config=SIZES["sink_window"],
        do_sample=True,
        top_k=1,
        max_new_tokens=NEW_TOKENS,
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_chunked_prefill_feeds_the_embeddings_in_chunks(family):
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, draft_layers=1)
    ids = random_prompt(200, seed=5)
    embeds = soft_prompt(target, ids)
    expected = greedy(target, ids, embeds)
    out = speculate(target, drafter, ids, embeds, prefill_chunk_size=64)
    assert torch.equal(out, expected)


def test_a_prefilled_cache_is_continued_with_the_embeddings_of_the_rest():
    """transformers' prefix caching with embeddings: the cache holds the first 120 positions (read from the same
    embeddings), `inputs_embeds` gives the whole prompt's."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=6)
    embeds = soft_prompt(target, ids, replaced=40)
    expected = greedy(target, ids, embeds)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(inputs_embeds=embeds[:, :120], **cache_kwargs(cache))
    out = speculate(target, drafter, ids, embeds, **cache_kwargs(cache))
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == out.shape[1] - 1


def test_the_device_round_leaves_an_embedded_prompt_to_transformers_loop():
    """The device round reads ids only: on CUDA such a call runs transformers' loop (asked explicitly, refused)."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(150, seed=7)
    embeds = soft_prompt(target, ids)
    assert (
        unsupported(target, GenerationConfig(), {"inputs_embeds": embeds}, ids)
        == "a prompt given as inputs_embeds"
    )
    with pytest.raises(ValueError, match="device_round=True, but a prompt given as inputs_embeds"):
        speculate(target, drafter, ids, embeds, cache_config={"device_round": True})


def _padded_batch(target, seed: int):
    rows = [random_prompt(length, seed=seed + length) for length in (150, 131, 142)]
    width = max(row.shape[1] for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, width - row.shape[1] :], mask[index, width - row.shape[1] :] = row[0], 1
    return ids, mask, soft_prompt(target, ids)


@pytest.mark.parametrize("chunk", [None, 32])
@pytest.mark.parametrize("name", sorted(SIZES))
def test_a_batch_reads_each_rows_embeddings(name, chunk):
    target, drafter = model_pair("qwen3", "sdpa", draft_layers=1)
    ids, mask, embeds = _padded_batch(target, seed=10)
    expected = greedy(target, ids, embeds, attention_mask=mask)
    assert not torch.equal(expected, greedy(target, ids, None, attention_mask=mask))
    out = speculate(target, drafter, ids, embeds, name, attention_mask=mask, prefill_chunk_size=chunk)
    assert torch.equal(out, expected)


def test_the_lossy_batch_reads_each_rows_embeddings():
    """Without a draft (the target itself on the sparse cache), a padded batch's rows equal each row alone."""
    target, _ = model_pair("llama", "sdpa")
    ids, mask, embeds = _padded_batch(target, seed=20)
    config = SIZES["sink_window"]
    out = greedy(
        target, ids, embeds, attention_mask=mask, cache_implementation="sink_window", cache_config=config
    )
    for row in range(ids.shape[0]):
        start = int((mask[row] == 0).sum())
        alone = greedy(
            target,
            ids[row : row + 1, start:],
            embeds[row : row + 1, start:],
            cache_implementation="sink_window",
            cache_config=config,
        )
        assert torch.equal(out[row, start:], alone[0])
    ids_only = greedy(
        target, ids, None, attention_mask=mask, cache_implementation="sink_window", cache_config=config
    )
    assert not torch.equal(out, ids_only)


def test_embeddings_without_ids_or_of_another_shape_are_refused():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(60, seed=8)
    embeds = soft_prompt(target, ids, replaced=8)
    with pytest.raises(ValueError, match="pass input_ids= too"):
        target.generate(
            inputs_embeds=embeds, assistant_model=drafter, cache_implementation="budgeted", max_new_tokens=4
        )
    cache = prefilled_cache(target, ids[:, :30])
    before = copy.deepcopy(cache)
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(1, 59, 64\) but input_ids \(1, 60\)"):
        speculate(target, drafter, ids, embeds[:, 1:], **cache_kwargs(cache))
    assert cache.get_seq_length() == 30
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(cache.layers, before.layers, strict=True))
