"""Several samples of one prompt (`num_return_sequences > 1` with `do_sample=True`), which transformers refuses for
assisted generation: the prompt is repeated (transformers' expansion), the batched loop samples every copy on its
own, and a row whose prompt equals an earlier row's copies that row's prefilled caches (`RaggedCache.copy_row`)
rather than reading the prompt again."""

import pytest
import torch
from test_batched import _ragged, padded_batch
from tiny_models import model_pair, random_prompt, supports
from transformers import DynamicCache, StaticCache

from hf_budgetdraft import GrowableCache, record_speculation
from hf_budgetdraft.cache.ragged import RaggedCache
from hf_budgetdraft.compat import cache_kwargs

CACHES = {
    "sink_window": {"num_sink_tokens": 4, "window_length": 24},
    "budgeted": {"budget": 32, "window_length": 16},
}
NEW_TOKENS = 16


def prefill_lengths(model) -> list[int]:
    """Records the length of every forward of `model` that starts a row (its prompt's first chunk or whole)."""
    lengths = []

    def hook(module, args, kwargs):
        fed = kwargs.get("input_ids")
        fed = kwargs.get("inputs_embeds") if fed is None else fed
        if fed is not None and fed.shape[0] == 1 and kwargs.get("position_ids") is None:
            lengths.append(fed.shape[1])

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return lengths


def sample(target, drafter, ids, mask=None, name="budgeted", **kwargs):
    return target.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=0,
        assistant_model=drafter,
        cache_implementation=name,
        cache_config=CACHES[name],
        **kwargs,
    )


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_every_sample_of_a_deterministic_sampler_is_the_targets_own_output(cache):
    """top_k=1 samples the argmax: each of the 3 copies of each of 2 prompts (left-padded) is the target's own
    output, in transformers' order (a prompt's copies adjacent); each distinct prompt is prefilled once a model."""
    target, drafter = model_pair("qwen3", "sdpa", draft_layers=1)
    ids, mask, _ = padded_batch([90, 60], seed=4)
    expected = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
    )
    fed_target, fed_drafter = prefill_lengths(target), prefill_lengths(drafter)
    with record_speculation() as stats:
        out = sample(target, drafter, ids, mask, cache, top_k=1, num_return_sequences=3)
    assert torch.equal(out, expected.repeat_interleave(3, 0))
    assert len(stats.rows) == 6 and stats.mean_accepted_length > 1.0
    assert sorted(fed_target) == sorted(fed_drafter) == [60, 90]


def test_the_samples_are_drawn_independently():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    torch.manual_seed(0)
    ids = random_prompt(80, seed=1)
    out = sample(target, drafter, ids, torch.ones_like(ids), num_return_sequences=4, temperature=1.5)
    new = out[:, 80:]
    assert out.shape[0] == 4 and len({tuple(row.tolist()) for row in new}) == 4


def test_equal_rows_of_a_batch_share_their_prefill_and_keep_their_output():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids, mask, _ = padded_batch([70, 100], seed=8)
    ids, mask = ids[[0, 1, 0, 0]], mask[[0, 1, 0, 0]]
    expected = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
    )
    fed = prefill_lengths(target)
    out = target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=0,
        assistant_model=drafter,
        cache_implementation="sink_window",
        cache_config=CACHES["sink_window"],
    )
    assert torch.equal(out, expected)
    assert sorted(fed) == [70, 100]


def test_rows_with_equal_ids_but_other_embeddings_are_prefilled_each():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(60, seed=2).repeat(2, 1)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(ids)
    embeds[1, -5:] = target.get_input_embeddings()(random_prompt(5, seed=3))[0]
    generate = dict(inputs_embeds=embeds, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    expected = target.generate(ids, **generate)
    assert not torch.equal(expected[0], expected[1])  # the embeddings decide the output
    fed_target, fed_drafter = prefill_lengths(target), prefill_lengths(drafter)
    out = target.generate(
        ids,
        **generate,
        assistant_model=drafter,
        cache_implementation="budgeted",
        cache_config=CACHES["budgeted"],
    )
    assert torch.equal(out, expected)
    assert fed_drafter == [60]  # the drafter reads the ids, equal in both rows
    assert fed_target == [60, 60]  # the target reads the embeddings, which differ


@pytest.mark.parametrize("kind", ["full", "sink_window", "budgeted"])
def test_a_copied_row_holds_what_its_own_prefill_would(kind):
    _, drafter = model_pair("llama", draft_layers=1)
    prompt = random_prompt(30, seed=5)

    def cache():
        return RaggedCache(drafter.config, 3, 8) if kind == "full" else _ragged(kind, drafter.config, 3)

    prefilled, copied = cache(), cache()
    with torch.no_grad():
        for row in (0, 2):
            prefilled.prefill_row(row, 30, prompt.device)
            drafter(input_ids=prompt, **cache_kwargs(prefilled), use_cache=True)
        copied.prefill_row(0, 30, prompt.device)
        drafter(input_ids=prompt, **cache_kwargs(copied), use_cache=True)
        copied.copy_row(0, 2)
        for row in (1,):
            for c in (prefilled, copied):
                c.prefill_row(row, 12, prompt.device)
                drafter(input_ids=prompt[:, :12], **cache_kwargs(c), use_cache=True)
        tokens = random_prompt(3, seed=6).repeat(3, 1)
        logits = []
        for c in (prefilled, copied):
            positions = c.lengths[:, None] + torch.arange(3)
            mask = c.step_mask(3, drafter.dtype)
            logits.append(
                drafter(
                    input_ids=tokens, attention_mask=mask, position_ids=positions, **cache_kwargs(c)
                ).logits
            )
    assert torch.equal(logits[0], logits[1])
    assert prefilled.lengths.tolist() == copied.lengths.tolist() == [33, 15, 33]
    for a, b in zip(prefilled.layers, copied.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for state in ("slot_positions", "ring_start", "num_kept", "floor"):
        if kind != "full":
            assert torch.equal(getattr(prefilled, state), getattr(copied, state))


def test_copy_row_refuses_a_row_that_holds_tokens():
    _, drafter = model_pair("llama", draft_layers=1)
    cache = RaggedCache(drafter.config, 2, 8)
    prompt = random_prompt(10)
    with torch.no_grad():
        for row in (0, 1):
            cache.prefill_row(row, 10, prompt.device)
            drafter(input_ids=prompt, **cache_kwargs(cache), use_cache=True)
    with pytest.raises(ValueError, match="the second empty"):
        cache.copy_row(0, 1)
    with pytest.raises(ValueError, match="2-row RaggedCache"):
        cache.copy_row(0, 2)


def test_what_transformers_refuses_stays_refused():
    """Greedy copies (identical by definition), stock assisted generation and windowed MTP keep transformers'
    refusal of several sequences."""
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(20)
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(
            ids, assistant_model=drafter, num_return_sequences=2, do_sample=True, max_new_tokens=4
        )
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation="budgeted",
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=4,
        )


@pytest.mark.parametrize(
    "family, cache_class, chunk",
    [
        ("llama", DynamicCache, None),
        ("llama", StaticCache, None),
        ("llama", GrowableCache, 16),
        ("gemma2", DynamicCache, 16),
    ],
)
def test_the_samples_continue_a_prefilled_cache_and_leave_it_as_it_was(family, cache_class, chunk):
    """A document prefilled once, n samples of a question after it: at top_k=1 each is the target's own output on
    the whole prompt; the target reads only the question (once: the copies share it), in `prefill_chunk_size`
    chunks, and the cache passed still holds the document alone (gemma2: its sliding layers keep the window's
    last tokens)."""
    target, drafter = model_pair(family, "sdpa" if supports(family, "sdpa") else "eager", draft_layers=1)
    ids = random_prompt(120, seed=11)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    kwargs = {"max_cache_len": 300} if cache_class is StaticCache else {}
    cache = cache_class(config=target.config, **kwargs)
    with torch.no_grad():
        target(input_ids=ids[:, :90], **cache_kwargs(cache))
    before = [layer.keys[:, :, :90].clone() for layer in cache.layers]
    fed = prefill_lengths(target)
    out = sample(
        target,
        drafter,
        ids,
        torch.ones_like(ids),
        **cache_kwargs(cache),
        top_k=1,
        num_return_sequences=3,
        prefill_chunk_size=chunk,
    )
    assert torch.equal(out, expected.repeat(3, 1))
    assert fed == ([30] if chunk is None else [16, 14])
    assert cache.get_seq_length() == 90
    assert all(torch.equal(a, layer.keys[:, :, :90]) for a, layer in zip(before, cache.layers, strict=True))


def test_what_a_batched_call_cannot_start_from_is_refused_before_anything_is_written():
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    ids = random_prompt(40)
    two_rows = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :30].repeat(2, 1), **cache_kwargs(two_rows))
    with pytest.raises(ValueError, match="2 rows"):
        sample(target, drafter, ids, torch.ones_like(ids), **cache_kwargs(two_rows), num_return_sequences=3)
    batch = ids.repeat(2, 1)
    one_row = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :30], **cache_kwargs(one_row))
    with pytest.raises(ValueError, match="4 rows"):
        sample(
            target, drafter, batch, torch.ones_like(batch), **cache_kwargs(one_row), num_return_sequences=2
        )
    with pytest.raises(ValueError, match="holds 30 tokens but the prompt has 30"):
        sample(target, drafter, ids[:, :30], None, **cache_kwargs(one_row), num_return_sequences=2)
    assert two_rows.get_seq_length() == one_row.get_seq_length() == 30


def test_a_static_sliding_cache_is_refused():
    """A static cache's sliding layers keep a ring of the window, not positions: nothing to start a row from."""
    target, drafter = model_pair("gemma2", "eager", draft_layers=1)
    ids = random_prompt(60)
    cache = StaticCache(config=target.config, max_cache_len=128)
    with torch.no_grad():
        target(input_ids=ids[:, :50], **cache_kwargs(cache))
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        sample(target, drafter, ids, torch.ones_like(ids), **cache_kwargs(cache), num_return_sequences=2)
