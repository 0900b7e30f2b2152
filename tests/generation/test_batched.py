"""Batched speculative decoding: left-padded batches of ragged prompts, every row token-identical to the target's
own greedy `generate()` of the same padded batch and to the row generated alone; per-row rollback of the ragged
caches against independent single-row caches; sampling keeps each row's distribution; bad input is refused."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sampling import chi_square, chi_square_quantile, warped
from tiny_models import FAMILIES, model_pair, random_prompt, supports
from transformers import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_budgetdraft import BudgetedCache, SinkWindowCache, record_speculation
from hf_budgetdraft.attention import fast_sdpa
from hf_budgetdraft.attention.ragged_rows import row_by_row_attention
from hf_budgetdraft.cache.ragged import RaggedCache
from hf_budgetdraft.cache.ragged_draft import RaggedBudgetedCache, RaggedSinkWindowCache
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation import batched_loop as batched_module
from hf_budgetdraft.generation.batched_loop import MAX_BATCH_SIZE, left_padding

CACHES = {
    "sink_window": {"num_sink_tokens": 4, "window_length": 24},
    "budgeted": {"budget": 32, "window_length": 16},
}
NEW_TOKENS = 20


def padded_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`(ids (B, P), mask (B, P), rows)`: random prompts of `lengths`, left-padded with token 0."""
    rows = [random_prompt(n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask, rows


def greedy(model, ids, mask, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
    )


LENGTHS = {2: [120, 70], 3: [130, 60, 100], 5: [110, 50, 120, 80, 65]}


@pytest.mark.parametrize("batch", sorted(LENGTHS))
@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_equals_target_batch(family, cache, batch):
    implementation = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, implementation)
    ids, mask, _ = padded_batch(LENGTHS[batch], seed=batch)
    expected = greedy(target, ids, mask)
    with record_speculation() as stats:
        out = greedy(
            target, ids, mask, assistant_model=drafter, cache_implementation=cache, cache_config=CACHES[cache]
        )
    assert torch.equal(out, expected)
    assert len(stats.rows) == batch and stats.mean_accepted_length > 1.0  # the drafts were used


def test_rows_equal_rows_generated_alone_and_acceptance_is_ragged():
    target, drafter = model_pair("qwen3")
    ids, mask, rows = padded_batch([200, 90, 170, 130])
    with record_speculation() as stats:
        out = greedy(
            target,
            ids,
            mask,
            assistant_model=drafter,
            cache_implementation="budgeted",
            cache_config=CACHES["budgeted"],
        )
    for i, row in enumerate(rows):
        alone = greedy(target, row[None], torch.ones_like(row[None]))[0, len(row) :]
        assert torch.equal(out[i, ids.shape[1] :], alone)
    # in some round, one row kept every draft, another some, another none
    gamma = 3
    rounds = [
        [r.accepted_per_round[k] for r in stats.rows if len(r.accepted_per_round) > k] for k in range(1, 30)
    ]
    assert any({gamma, 0} <= set(kept) and set(kept) - {gamma, 0} for kept in rounds if kept)
    # rows finished at different rounds
    assert len({len(r.accepted_per_round) for r in stats.rows}) > 1
    assert all(r.latency_seconds is not None for r in stats.rows)


def test_rows_stop_at_their_own_eos():
    target, drafter = model_pair("llama")
    ids, mask, _ = padded_batch([120, 80, 100], seed=3)
    free = greedy(target, ids, mask)
    eos = int(free[1, ids.shape[1] + 5])  # row 1's sixth new token ends row 1 (and any row that emits it)
    expected = greedy(target, ids, mask, eos_token_id=eos)
    out = greedy(
        target, ids, mask, eos_token_id=eos, assistant_model=drafter, cache_implementation="sink_window"
    )
    assert torch.equal(out, expected)
    assert int((out[1, ids.shape[1] :] == 0).sum()) >= NEW_TOKENS - 6  # padded after its EOS


def test_batched_speculation_uses_the_adaptive_policy_by_default():
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    ids, mask, _ = padded_batch([100, 60])
    with record_speculation() as stats:
        out = greedy(target, ids, mask, assistant_model=drafter, cache_implementation="budgeted")
    assert torch.equal(out, greedy(target, ids, mask))
    assert stats.draft_length_policy == "adaptive" and stats.plan.spec.draft_length == "adaptive"
    assert stats.plan.spec.static is False  # ragged caches are dynamic


@pytest.mark.parametrize("batch", [1, 2])
def test_a_full_draft_cache_runs_the_batched_loop_at_any_batch_size(batch):
    target, drafter = model_pair("llama")
    ids, mask, _ = padded_batch([100, 60][:batch])
    options = {**CACHES["budgeted"], "full_draft_cache": True}
    with record_speculation() as stats:
        out = greedy(
            target, ids, mask, assistant_model=drafter, cache_implementation="budgeted", cache_config=options
        )
    assert torch.equal(out, greedy(target, ids, mask))
    assert stats.plan.batched and len(stats.rows) == batch
    assert (
        type(stats.candidate_generator.draft_cache) is RaggedCache
    )  # every past token, not the budgeted view


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_a_batch_of_64_ragged_rows_equals_the_target_batch(cache):
    """The largest batch the tests drive: 64 rows of 30-90 tokens (every row longer than the draft cache keeps)."""
    target, drafter = model_pair("llama")
    lengths = [30 + (37 * i) % 61 for i in range(64)]
    ids, mask, _ = padded_batch(lengths, seed=11)
    expected = greedy(target, ids, mask)
    with record_speculation() as stats:
        out = greedy(
            target, ids, mask, assistant_model=drafter, cache_implementation=cache, cache_config=CACHES[cache]
        )
    assert torch.equal(out, expected)
    assert len(stats.rows) == 64 and stats.mean_accepted_length > 1.0


# -- the ragged caches against B independent single-row caches ---------------------------------------------------
def _single(kind: str, config):
    if kind == "sink_window":
        return SinkWindowCache(config=config, num_sink_tokens=3, window_length=10, slack=4)
    return BudgetedCache(
        config=config,
        budget=8,
        policy="streaming",
        policy_kwargs={"num_sink_tokens": 2},
        window_length=10,
        slack=4,
    )


def _ragged(kind: str, config, batch: int):
    if kind == "sink_window":
        return RaggedSinkWindowCache(config, batch, num_sink_tokens=3, window_length=10, slack=4, capacity=64)
    return RaggedBudgetedCache(
        config,
        batch,
        budget=8,
        policy="streaming",
        policy_kwargs={"num_sink_tokens": 2},
        window_length=10,
        slack=4,
        capacity=64,
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["sink_window", "budgeted", "full"]),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    steps=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 2**16)), min_size=1, max_size=8),
)
def test_ragged_rows_match_independent_caches(kind, lengths, steps):
    _, drafter = model_pair("llama", draft_layers=1)
    batch, generator = len(lengths), torch.Generator().manual_seed(sum(lengths))
    ragged = RaggedCache(drafter.config, batch, 8) if kind == "full" else _ragged(kind, drafter.config, batch)
    singles = [None if kind == "full" else _single(kind, drafter.config) for _ in lengths]
    singles = [DynamicCache(config=drafter.config) if s is None else s for s in singles]
    with torch.no_grad():
        for row, length in enumerate(lengths):
            prompt = torch.randint(0, 128, (1, length), generator=generator)
            ragged.prefill_row(row, length, prompt.device)
            got = drafter(input_ids=prompt, **cache_kwargs(ragged), use_cache=True).logits
            want = drafter(input_ids=prompt, **cache_kwargs(singles[row]), use_cache=True).logits
            torch.testing.assert_close(got, want)
        for width, seed in steps:
            tokens = torch.randint(0, 128, (batch, width), generator=torch.Generator().manual_seed(seed))
            positions = ragged.lengths[:, None] + torch.arange(width)
            mask = ragged.step_mask(width, drafter.dtype)
            got = drafter(
                input_ids=tokens, attention_mask=mask, position_ids=positions, **cache_kwargs(ragged)
            ).logits
            remove = torch.randint(0, width + 1, (batch,), generator=torch.Generator().manual_seed(seed + 1))
            for row in range(batch):
                start = singles[row].get_seq_length()
                want = drafter(
                    input_ids=tokens[row : row + 1],
                    position_ids=torch.arange(start, start + width)[None],
                    **cache_kwargs(singles[row]),
                ).logits
                torch.testing.assert_close(got[row : row + 1], want, rtol=1e-4, atol=1e-5)
                if int(remove[row]):
                    singles[row].crop(-int(remove[row]))
            ragged.crop_rows(remove)
            assert ragged.lengths.tolist() == [s.get_seq_length() for s in singles]


def test_crop_rows_refuses_what_the_ring_lost():
    _, drafter = model_pair("llama", draft_layers=1)
    cache = _ragged("sink_window", drafter.config, 1)
    with torch.no_grad():
        cache.prefill_row(0, 20, torch.device("cpu"))
        drafter(input_ids=torch.arange(20)[None], **cache_kwargs(cache))
        for _ in range(3):  # 12 tokens written: more than the slack (4) can roll back
            mask = cache.step_mask(4, drafter.dtype)
            positions = cache.lengths[:, None] + torch.arange(4)
            drafter(
                input_ids=torch.ones(1, 4, dtype=torch.long),
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(cache),
            )
    with pytest.raises(ValueError, match="already overwritten"):
        cache.crop_rows(torch.tensor([12]))


def test_a_rows_prefill_in_chunks_continues_only_where_the_row_stands():
    _, drafter = model_pair("llama", draft_layers=1)
    cache = RaggedCache(drafter.config, 2, 64)
    with torch.no_grad():
        cache.prefill_row(0, 20, torch.device("cpu"))
        drafter(input_ids=torch.arange(20)[None], **cache_kwargs(cache))
    with pytest.raises(ValueError, match="does not hold exactly 10 tokens"):
        cache.prefill_row(0, 30, torch.device("cpu"), start=10)
    with pytest.raises(ValueError, match="does not hold exactly 0 tokens"):
        cache.prefill_row(0, 30, torch.device("cpu"))
    sparse = _ragged("budgeted", drafter.config, 1)
    with torch.no_grad():
        sparse.prefill_row(0, 20, torch.device("cpu"))
        drafter(input_ids=torch.arange(20)[None], **cache_kwargs(sparse))
    with pytest.raises(ValueError, match="selects from the whole prompt"):
        sparse.prefill_row(0, 30, torch.device("cpu"), start=20)


# -- sampling ------------------------------------------------------------------------------------------------------
def sample_batch(target, drafter, ids, mask):
    """One batched sampling call on the budgeted draft cache: 2 new tokens a row, temperature 1, no top-k."""
    return target.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        top_k=0,
        max_new_tokens=2,
        pad_token_id=0,
        assistant_model=drafter,
        cache_implementation="budgeted",
        cache_config={"budget": 16},
    )


def test_batched_sampling_keeps_each_rows_distribution():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=3, draft_layers=1)
    prompts = [random_prompt(64, seed=5)[0], random_prompt(40, seed=9)[0]]
    copies, calls = 120, 5  # 600 samples per prompt
    ids, mask, _ = padded_batch([64, 40])
    ids, mask = ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)
    for row, prompt in enumerate(prompts):
        ids[row * copies : (row + 1) * copies, ids.shape[1] - len(prompt) :] = prompt
    torch.manual_seed(0)
    counts = torch.zeros(len(prompts), 2, 128)
    for _ in range(calls):
        out = sample_batch(target, drafter, ids, mask)
        for p in range(len(prompts)):
            rows = out[p * copies : (p + 1) * copies, -2:]
            for position in range(2):
                counts[p, position] += torch.bincount(rows[:, position], minlength=128).float()
    with torch.no_grad():
        for p, prompt in enumerate(prompts):
            first = warped(target(prompt[None]).logits[0, -1:])[0]
            continued = torch.cat([prompt[None].expand(128, -1), torch.arange(128)[:, None]], dim=1)
            second = (first[:, None] * warped(target(continued).logits[:, -1])).sum(0)
            for position, probs in enumerate((first, second)):
                stat, df = chi_square(counts[p, position], probs)
                assert stat < chi_square_quantile(max(df, 1)), (p, position, stat, df)


class ScriptedRowLengths:
    """A per-row draft-length policy for tests: row r drafts `pattern[(r + k) % len(pattern)]` in round k, so every
    round mixes rows that draft long, short and not at all."""

    name = "scripted"

    def __init__(self, pattern=(0, 3, 1, 2)):
        self.pattern, self.round = pattern, 0

    def next_lengths(self, rows, remaining):
        return torch.tensor([self.pattern[(int(r) + self.round) % len(self.pattern)] for r in rows])

    def update(self, rows, drafted, accepted, draft_seconds, verify_seconds):
        self.round += 1


@pytest.fixture
def scripted_lengths(monkeypatch):
    monkeypatch.setattr(batched_module, "for_rows", lambda plan, rows: ScriptedRowLengths())


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral"])
def test_rows_drafting_different_lengths_in_one_round_stay_lossless(family, cache, scripted_lengths):
    implementation = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, implementation)
    ids, mask, _ = padded_batch([110, 50, 120, 80, 65], seed=7)
    with record_speculation() as stats:
        out = greedy(
            target, ids, mask, assistant_model=drafter, cache_implementation=cache, cache_config=CACHES[cache]
        )
    assert torch.equal(out, greedy(target, ids, mask))
    first = [row.proposed_per_round[1] for row in stats.rows]
    assert sorted(set(first)) == [0, 1, 2, 3]  # one round held every length


def test_the_target_attends_row_by_row_on_cpu(monkeypatch):
    calls = []
    original = fast_sdpa.row_by_row_attention

    def spy(query, key, value, scaling, spans, attend):
        calls.append(spans)
        return original(query, key, value, scaling, spans, attend)

    monkeypatch.setattr(fast_sdpa, "row_by_row_attention", spy)
    target, drafter = model_pair("llama", "sdpa")
    ids, mask, _ = padded_batch([120, 70, 95])
    out = greedy(target, ids, mask, assistant_model=drafter, cache_implementation="budgeted")
    assert torch.equal(out, greedy(target, ids, mask))
    assert calls and any(
        len({start for start, _ in spans}) > 1 for spans in calls
    )  # each row at its own length


@settings(max_examples=25, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5)), min_size=1, max_size=4),
    width=st.integers(1, 5),
    groups=st.sampled_from([1, 2, 3]),
)
def test_row_by_row_attention_equals_masked_attention(spans, width, groups):
    spans = [(start, min(count, width)) for start, count in spans]
    batch, kv_heads, dim = len(spans), 2, 8
    keys = max(start for start, _ in spans) + width
    gen = torch.Generator().manual_seed(len(spans) * 7 + width)
    query = torch.randn(batch, kv_heads * groups, width, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=gen) for _ in range(2))
    out = row_by_row_attention(query, key, value, None, spans, fast_sdpa._causal_unmasked)
    for row, (start, count) in enumerate(spans):
        positions = start + torch.arange(width)
        allowed = torch.arange(keys)[None] <= positions[:, None]  # (q, K): causal at the row's own positions
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[row : row + 1], key[row : row + 1], value[row : row + 1], attn_mask=allowed, enable_gqa=True
        )
        torch.testing.assert_close(out[row, :, :count], expected[0, :, :count], atol=1e-5, rtol=1e-5)
        assert not out[row, :, count:].any()  # queries a row does not need are left at zero


def test_batched_sampling_keeps_each_rows_distribution_with_per_row_lengths(scripted_lengths):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    prompt = random_prompt(48, seed=11)[0]
    copies, calls = 200, 3  # 600 samples; each copy drafts its own length every round
    ids = prompt[None].repeat(copies, 1)
    torch.manual_seed(1)
    counts = torch.zeros(128)
    for _ in range(calls):
        out = sample_batch(target, drafter, ids, torch.ones_like(ids))
        counts += torch.bincount(out[:, -1], minlength=128).float()  # drawn in the first round: mixed lengths
    with torch.no_grad():
        first = warped(target(prompt[None]).logits[0, -1:])[0]
        continued = torch.cat([prompt[None].expand(128, -1), torch.arange(128)[:, None]], dim=1)
        second = warped(target(continued).logits[:, -1])  # (128 first tokens, 128)
    stat, df = chi_square(counts, (first[:, None] * second).sum(0))  # the second token's marginal
    assert stat < chi_square_quantile(max(df, 1)), (stat, df)


class _BatchStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


# -- bad input -----------------------------------------------------------------------------------------------------
def test_bad_batched_input_is_refused():
    target, drafter = model_pair("llama")
    ids, mask, _ = padded_batch([30, 20])
    call = dict(assistant_model=drafter, cache_implementation="sink_window", max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="left padding"):
        target.generate(ids, attention_mask=mask.flip(-1), **call)
    too_many = torch.ones(MAX_BATCH_SIZE + 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds the bound"):
        target.generate(too_many, attention_mask=torch.ones_like(too_many), **call)
    with pytest.raises(ValueError, match="streamer"):
        target.generate(ids, attention_mask=mask, streamer=_BatchStreamer(), **call)
    with pytest.raises(ValueError, match="output_scores"):
        target.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **call)
    with pytest.raises(ValueError, match="shape"):
        left_padding(mask[:1], ids)
    with pytest.raises(ValueError, match="single-sequence"):
        target.generate(ids, attention_mask=mask, cache_config={"static": True}, **call)


@pytest.mark.parametrize("family", ["mistral-all-sliding", "gpt_oss", "qwen3_moe"])
def test_batched_greedy_on_more_families(family):
    """An all-sliding drafter (kept native), attention sinks + sliding layers, a MoE: batched rows stay the target's."""
    from tiny_families import family_pair

    target, drafter = family_pair(family)
    ids, mask, _ = padded_batch([110, 60, 90], seed=7)
    expected = greedy(target, ids, mask)
    for cache in sorted(CACHES):
        out = greedy(
            target, ids, mask, assistant_model=drafter, cache_implementation=cache, cache_config=CACHES[cache]
        )
        assert torch.equal(out, expected), cache


class _StopAfter(StoppingCriteria):
    """Ends a row once it emits `token` (a criterion that is not EOS or a length, so it runs row by row)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_rows_stop_at_their_own_stopping_criterion():
    """A stopped row is padded, as stock generate() pads it when the call has an EOS token (without one, stock keeps
    emitting real tokens for stopped rows until every row stopped; the batched loop always ends the row)."""
    target, drafter = model_pair("llama")
    ids, mask, _ = padded_batch([120, 80, 100], seed=3)
    free = greedy(target, ids, mask)
    token = int(free[0, ids.shape[1] + 7])
    unused = next(t for t in range(1, 128) if not bool((free[:, ids.shape[1] :] == t).any()))
    call = dict(stopping_criteria=StoppingCriteriaList([_StopAfter(token)]), eos_token_id=unused)
    expected = greedy(target, ids, mask, **call)
    out = greedy(target, ids, mask, **call, assistant_model=drafter, cache_implementation="budgeted")
    assert torch.equal(out, expected)
    assert bool((out[0, ids.shape[1] + 8 :] == 0).all())  # row 0 stopped after its eighth token, padded


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_a_batch_prefills_the_target_in_the_calls_chunks(family, cache):
    """`prefill_chunk_size=`: each row's target prefill runs in forwards of at most that many tokens (gemma2: its
    sliding layers' window of 24 crosses the chunks), the drafter's whole (its cache selects from the whole prompt);
    the output is the target's own."""
    implementation = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, implementation)
    ids, mask, _ = padded_batch(LENGTHS[3], seed=7)
    expected = greedy(target, ids, mask)
    fed = []
    target.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    out = greedy(
        target,
        ids,
        mask,
        assistant_model=drafter,
        cache_implementation=cache,
        cache_config=CACHES[cache],
        prefill_chunk_size=32,
    )
    assert torch.equal(out, expected)
    prefill = fed[: sum(-(-n // 32) for n in LENGTHS[3])]  # the rows' chunks: 130, 60 and 100 tokens
    assert [shape[1] for shape in prefill] == [32] * 4 + [2] + [32, 28] + [32] * 3 + [4]
