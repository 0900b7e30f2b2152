"""A windowed draft prefill (`cache_config={"prefill_window": W}`): each chunk reads exactly the sink, the W tokens
before it and itself (against a full forward under that mask), the one-liner stays lossless, and training builds
the same prefix (`run_shared_prefix(..., prefill_window=W)`)."""

import pytest
import torch
from tiny_models import model_pair, random_prompt
from transformers import DynamicCache

from hf_budgetdraft import BudgetedCache, DraftSpec, record_speculation
from hf_budgetdraft.attention.function_parts import as_additive
from hf_budgetdraft.cache.windowed_prefill import (
    WindowedPrefillCache,
    fill_from_prefix,
    recorded,
    windowed_prefill,
)
from hf_budgetdraft.generation import draft_prefix
from hf_budgetdraft.generation.spec import DEFAULT_PREFILL_WINDOW
from hf_budgetdraft.trainer.views import SparseViewSpec, run_shared_prefix, view_logits

pytestmark = pytest.mark.usefixtures("one_thread")

SINK, WINDOW, LENGTH = 4, 16, 70  # chunks [0, 16), [16, 32), ... the last one partial


def windowed_mask(length: int, sink: int, window: int) -> torch.Tensor:
    """`(1, 1, L, L)` bool: query p (in the chunk starting at c = p // window * window) reads keys j < sink, keys
    max(sink, c - window) <= j < c, and its own chunk causally."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    chunk_start = q // window * window
    before = (k < chunk_start) & ((k < sink) | (k >= torch.clamp(chunk_start - window, min=sink)))
    return (before | ((k >= chunk_start) & (k <= q)))[None, None]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_chunk_reads_the_sink_the_window_before_it_and_itself(attn):
    _, drafter = model_pair("llama", attn)
    ids = random_prompt(LENGTH, seed=3)
    recorder, last = windowed_prefill(drafter, ids, SINK, WINDOW)
    reference_cache = DynamicCache(config=drafter.config)
    mask = as_additive(windowed_mask(LENGTH, SINK, WINDOW), torch.float32)  # eager adds its mask
    with torch.no_grad():
        reference = drafter(ids, attention_mask=mask, cache=reference_cache)
    torch.testing.assert_close(last, reference.logits[:, -1], rtol=1e-4, atol=1e-4)
    keys, values = recorded(recorder)
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(k, reference_cache.layers[layer].keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, reference_cache.layers[layer].values, rtol=1e-4, atol=1e-5)
    full = DynamicCache(config=drafter.config)
    with torch.no_grad():
        drafter(ids, cache=full)
    assert not torch.allclose(keys[1], full.layers[1].keys, atol=1e-3)  # deeper layers read less than in full
    torch.testing.assert_close(
        keys[0], full.layers[0].keys, rtol=1e-5, atol=1e-6
    )  # layer 0: token projections


def test_a_window_covering_the_prompt_is_a_plain_prefill():
    _, drafter = model_pair("llama", "sdpa")
    ids = random_prompt(40, seed=4)
    _, last = windowed_prefill(drafter, ids, SINK, 64)
    with torch.no_grad():
        torch.testing.assert_close(last, drafter(ids).logits[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("cache_config", [{"cache": "budgeted", "budget": 24}, {"cache": "sink_window"}])
@pytest.mark.parametrize("static", [False, True])
def test_the_one_liner_with_a_windowed_prefill_is_lossless(family, cache_config, static):
    target, drafter = model_pair(family, "sdpa")
    ids = random_prompt(300, seed=5)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    options = {k: v for k, v in cache_config.items() if k != "cache"}
    if cache_config["cache"] == "sink_window":
        options.update(num_sink_tokens=SINK, window_length=32)
    options.update(prefill_window=WINDOW, static=static, compile=False)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=24,
            cache_implementation=cache_config["cache"],
            cache_config=options,
        )
    assert torch.equal(out, expected)
    assert stats.plan.spec.prefill_window == WINDOW and stats.draft_prefill_seconds > 0


def test_the_draft_cache_after_a_windowed_prefill_holds_what_training_views_select():
    """Inference (the generator's windowed prefill + the cache's own update) and training (run_shared_prefix with
    the same window + SparseViewSpec.build) read the same keys: their continuation logits agree."""
    _, drafter = model_pair("llama", "sdpa")
    ids = random_prompt(LENGTH + 8, seed=6)
    prefix, continuation = ids[:, :LENGTH], ids[:, LENGTH:]
    spec = SparseViewSpec(kind="budgeted", policy="chunk", policy_kwargs={"chunk_size": 4}, window_length=16)
    shared = run_shared_prefix(drafter, prefix, prefill_window=WINDOW, num_sink_tokens=SINK)
    with torch.no_grad():
        trained = view_logits(drafter, continuation, spec.build(drafter.config, shared, 24))
        recorder, _ = windowed_prefill(drafter, prefix, SINK, WINDOW)
        cache = fill_from_prefix(
            BudgetedCache(
                drafter.config, budget=24, policy="chunk", policy_kwargs={"chunk_size": 4}, window_length=16
            ),
            *recorded(recorder),
        )
        deployed = torch.cat(
            [drafter(continuation[:, t : t + 1], cache=cache).logits for t in range(8)], dim=1
        )
    torch.testing.assert_close(trained, deployed, rtol=1e-4, atol=1e-4)


def test_bad_prefill_windows():
    with pytest.raises(ValueError, match=r"prefill_window must be an int in \[1"):
        DraftSpec(prefill_window=0)
    with pytest.raises(ValueError, match=r"prefill_window must be an int in \[1"):
        DraftSpec(prefill_window=True)
    with pytest.raises(ValueError, match=r"None or 'auto', got 'full'"):
        DraftSpec(prefill_window="full")
    with pytest.raises(ValueError, match="scores the prefix with the prefill's queries"):
        DraftSpec(policy="snapkv", prefill_window=64)
    _, hybrid = model_pair("gemma2", "eager")
    with pytest.raises(ValueError, match="all full attention"):
        WindowedPrefillCache(hybrid.config, SINK, WINDOW, 40)


def test_the_default_prefills_windowed_where_it_applies_and_says_so():
    """`prefill_window="auto"` (the default): 1024-token chunks for a full-attention drafter and a policy that does not
    score with the prefill's queries; a full prefill otherwise (and for the full-draft-cache baseline), and `None`
    switches it off."""
    _, drafter = model_pair("llama", "sdpa")
    _, sliding = model_pair("gemma2", "eager")
    assert DraftSpec().prefill_window == "auto" and "prefill_window" not in DraftSpec().to_cache_config()
    assert DraftSpec().resolved_prefill_window(drafter.config) == DEFAULT_PREFILL_WINDOW == 1024
    assert DraftSpec(cache="sink_window").resolved_prefill_window(drafter.config) == 1024
    assert DraftSpec(full_draft_cache=True).resolved_prefill_window(drafter.config) is None
    assert DraftSpec().resolved_prefill_window(sliding.config) is None
    snapkv = DraftSpec(policy="snapkv", policy_kwargs={"window_size": 4})
    assert snapkv.resolved_prefill_window(drafter.config) is None
    assert DraftSpec(prefill_window=None).resolved_prefill_window(drafter.config) is None
    assert DraftSpec(prefill_window=64).resolved_prefill_window(drafter.config) == 64


@pytest.mark.parametrize("cache_config", [{}, {"prefill_window": None}])
def test_the_one_liner_reports_the_prefill_window_it_ran(cache_config, monkeypatch):
    """The plan shows the resolved window; a prompt longer than it is prefilled in chunks (lossless), and `None`
    runs the drafter's full prefill."""
    monkeypatch.setattr("hf_budgetdraft.generation.spec.DEFAULT_PREFILL_WINDOW", WINDOW)
    target, drafter = model_pair("llama", "sdpa")
    ids = random_prompt(120, seed=8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    chunks = []
    monkeypatch.setattr(
        draft_prefix,
        "windowed_prefill",
        lambda model, prompt, sink, window: (
            chunks.append(window) or windowed_prefill(model, prompt, sink, window)
        ),
    )
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=12,
            cache_implementation="budgeted",
            cache_config={"budget": 24, **cache_config},
        )
    assert torch.equal(out, expected)
    windowed = "prefill_window" not in cache_config
    assert stats.plan.spec.prefill_window == (WINDOW if windowed else None)
    assert chunks == ([WINDOW] if windowed else [])


@pytest.mark.parametrize("cache_config", [{"cache": "budgeted", "budget": 24}, {"cache": "sink_window"}])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_batch_prefills_each_long_rows_drafter_windowed(family, cache_config, monkeypatch):
    """Each row longer than the window is prefilled by the drafter in chunks (a shorter one in one forward); the
    output is the target's own for the padded batch."""
    target, drafter = model_pair(family, "sdpa")
    rows = [random_prompt(n, seed=20 + n)[0] for n in (70, 12, 45)]
    ids = torch.zeros(3, 70, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 70 - len(row) :], mask[i, 70 - len(row) :] = row, 1
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    read = []
    monkeypatch.setattr(
        draft_prefix,
        "windowed_prefill",
        lambda model, prompt, sink, window: (
            read.append(prompt.shape[1]) or windowed_prefill(model, prompt, sink, window)
        ),
    )
    options = {k: v for k, v in cache_config.items() if k != "cache"}
    with record_speculation() as stats:
        out = target.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=0,
            assistant_model=drafter,
            cache_implementation=cache_config["cache"],
            cache_config={**options, "prefill_window": WINDOW},
        )
    assert torch.equal(out, expected)
    assert read == [70, 45] and stats.plan.spec.prefill_window == WINDOW


@pytest.mark.parametrize("kind", ["sink_window", "budgeted"])
def test_a_ragged_row_filled_from_a_windowed_prefill_drafts_as_one_sequence_does(kind):
    """The batched loop's windowed row prefill (recorded keys/values through the row's own `update`) gives the
    drafter the logits the single-sequence cache filled the same way gives it."""
    from hf_budgetdraft import SinkWindowCache
    from hf_budgetdraft.cache.ragged_draft import RaggedBudgetedCache, RaggedSinkWindowCache
    from hf_budgetdraft.compat import cache_kwargs

    _, drafter = model_pair("llama", "sdpa")
    ids = random_prompt(LENGTH + 3, seed=9)
    prompt, steps = ids[:, :LENGTH], ids[:, LENGTH:]
    if kind == "sink_window":
        single = SinkWindowCache(config=drafter.config, num_sink_tokens=SINK, window_length=16, slack=4)
        ragged = RaggedSinkWindowCache(drafter.config, 2, num_sink_tokens=SINK, window_length=16, slack=4)
    else:
        options = dict(budget=24, policy="chunk", policy_kwargs={"chunk_size": 4}, window_length=16, slack=4)
        single = BudgetedCache(config=drafter.config, **options)
        ragged = RaggedBudgetedCache(drafter.config, 2, **options)
    with torch.no_grad():
        recorder, _ = windowed_prefill(drafter, prompt, SINK, WINDOW)
        fill_from_prefix(single, *recorded(recorder))
        ragged.prefill_row(1, LENGTH, prompt.device)
        fill_from_prefix(ragged, *[[t.clone() for t in part] for part in recorded(recorder)])
        ragged.prefill_row(0, 5, prompt.device)
        drafter(input_ids=prompt[:, :5], **cache_kwargs(ragged), use_cache=True)
        want = drafter(
            input_ids=steps, position_ids=torch.arange(LENGTH, LENGTH + 3)[None], cache=single
        ).logits
        positions = ragged.lengths[:, None] + torch.arange(3)
        mask = ragged.step_mask(3, drafter.dtype)
        got = drafter(
            input_ids=steps.repeat(2, 1), attention_mask=mask, position_ids=positions, **cache_kwargs(ragged)
        ).logits
    torch.testing.assert_close(got[1:], want, rtol=1e-4, atol=1e-5)
