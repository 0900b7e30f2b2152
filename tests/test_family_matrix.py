"""Every drafter family stock assisted generation runs also drafts on a sparse cache, token-identical to the target.

Matrix: the 17 families of `tiny_families.MORE_FAMILIES` (hybrid convolution LFM2 / Inkling, all-sliding Mistral,
Falcon, gpt-oss with sinks, MoE, MLA, mixed sliding, NoPE, learned positions, HRM-Text's layers reused at several
cache indices, NanoChat's weightless norms) x {sink_window, budgeted chunk}, and all 27 families (with
`tiny_models.FAMILIES`, whose other caches `test_generate_equivalence` covers) x the query-scored policies {snapkv,
chunk with `query_proxy="last_query"`}. Plus the contracts behind them: exact rollback of convolution states, the
all-sliding rule, stateful drafters refused, queries captured from attention that bypasses transformers' attention
interface.
"""

import copy
import functools
import logging

import pytest
import torch
import transformers
from resolved_plans import plan_for
from tiny_families import ALL_FAMILIES, MORE_FAMILIES, family_pair, kv_sharing_model, more_config
from tiny_models import COMMON, random_prompt, skip_unless_static
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

from hf_budgetdraft import BudgetedCache, SinkWindowCache, compat, query_capture, record_speculation
from hf_budgetdraft.cache import DraftLayer, StaticDraftLayer, draft_cache, get_policy
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation.draft_steps import DraftSteps
from hf_budgetdraft.generation.mtp_heads import expose_mtp_layers, new_mtp_head, save_pretrained_with_mtp
from hf_budgetdraft.generation.windowed_mtp import windowed_mtp_cache

PROMPT_LENGTH, NEW_TOKENS = 240, 32
CACHES = {
    "sink_window": ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8}),
    "budgeted-chunk": ("budgeted", {"budget": 48, "policy": "chunk", "window_length": 16}),
}
QUERY_CACHES = {
    "snapkv": ("budgeted", {"budget": 32, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}),
    "chunk-last_query": (
        "budgeted",
        {
            "budget": 48,
            "policy": "chunk",
            "window_length": 16,
            "policy_kwargs": {"query_proxy": "last_query"},
        },
    ),
}
NOTHING_TO_SPARSIFY = {"mistral-all-sliding"}


@functools.cache
def _target_greedy(family: str) -> torch.Tensor:
    target, _ = family_pair(family)
    return target.generate(random_prompt(PROMPT_LENGTH), do_sample=False, max_new_tokens=NEW_TOKENS)


def _speculate(family: str, implementation: str, cache_config: dict):
    target, drafter = family_pair(family)
    with record_speculation() as stats:
        out = target.generate(
            random_prompt(PROMPT_LENGTH),
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            cache_implementation=implementation,
            cache_config=cache_config,
        )
    return out, stats


def _check_cell(family: str, implementation: str, cache_config: dict) -> None:
    out, stats = _speculate(family, implementation, cache_config)
    expected = _target_greedy(family)
    assert torch.equal(out, expected), f"first diff at {(out != expected).nonzero()[:1].tolist()}"
    accepted, proposed = sum(stats.accepted_per_round), sum(stats.proposed_per_round)
    if family in NOTHING_TO_SPARSIFY:  # the drafter is the target on its own cache: every draft is accepted
        assert accepted == proposed > 0
    else:  # the check can fail: the sparse draft both agreed and disagreed with the target
        assert 0 < accepted < proposed


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_greedy_identical_on_every_family(family, cache_name):
    _check_cell(family, *CACHES[cache_name])


@pytest.mark.parametrize("cache_name", list(QUERY_CACHES))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_query_scored_policies_on_every_family(family, cache_name):
    _check_cell(family, *QUERY_CACHES[cache_name])


EVERY_KEY = {  # a selection and a window covering prompt and output
    "sink_window": {"num_sink_tokens": 4, "window_length": 1024},
    "budgeted": {"budget": 1024, "window_length": 1024},
}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cache", list(EVERY_KEY))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_target_drafting_over_every_key_accepts_every_draft(family, cache, static):
    """A window covering the call keeps every key: the target's copy drafting for it must then accept each draft, on
    either storage. Output alone cannot show a draft path that computes something other than the drafter's own
    forward (a bias, scale or kwarg the sparse attention drops); acceptance does."""
    target, _ = family_pair(family)
    if static:
        skip_unless_static(target)
        if target.config._attn_implementation == "eager":
            pytest.skip("eager drafters keep their attention: no static draft cache")
    out, stats = _speculate(family, cache, {**EVERY_KEY[cache], "draft_length": 4, "static": static})
    assert torch.equal(out, _target_greedy(family))
    assert stats.plan.spec.static is static
    assert sum(stats.accepted_per_round) == sum(stats.proposed_per_round) > 0, stats.accepted_per_round


# -- hybrid drafters: convolution states kept as transformers keeps them, rolled back exactly ------------------------
def _step_logits(model, cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Feed `tokens` `(1, n)` one at a time at positions `start..`; the last step's logits `(V,)`."""
    for i in range(tokens.shape[1]):
        position = torch.tensor([[start + i]])
        logits = model(
            tokens[:, i : i + 1], **cache_kwargs(cache), position_ids=position, use_cache=True
        ).logits
    return logits[0, -1]


def _draft_cache(model, kind: str, static: bool):
    if kind == "sink_window":
        cache = SinkWindowCache(model.config, num_sink_tokens=4, window_length=16, slack=8, static=static)
    else:
        cache = BudgetedCache(model.config, budget=32, window_length=16, slack=8, static=static)
    cache.activate_past_recording()  # as the candidate generator does
    return cache


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["sink_window", "budgeted"])
@pytest.mark.parametrize("family", ["lfm2", "inkling"])
@torch.no_grad()
def test_convolution_state_rolls_back_exactly(family, kind, static):
    """Drafting 3 tokens then `crop(-3)` leaves the cache exactly as if they were never drafted: the next step's
    logits equal those of a cache that never saw them (attention keys and convolution states alike)."""
    model, _ = family_pair(family)
    if static:
        skip_unless_static(model)
        model.set_attn_implementation("budgetdraft_varlen")
    prompt, wrong, right = random_prompt(80), random_prompt(3, seed=7), random_prompt(2, seed=8)
    caches = [_draft_cache(model, kind, static) for _ in range(2)]
    for cache in caches:
        model(prompt, **cache_kwargs(cache), use_cache=True)
    _step_logits(model, caches[0], wrong, start=80)
    caches[0].crop(-3)
    rolled_back = _step_logits(model, caches[0], right, start=80)
    never_drafted = _step_logits(model, caches[1], right, start=80)
    assert torch.equal(rolled_back, never_drafted)
    conv_layer, attention_layer = caches[0].layers  # lfm2: conv, attention; inkling: hybrid_sliding, hybrid
    assert isinstance(conv_layer, LinearAttentionLayer)
    assert isinstance(attention_layer, StaticDraftLayer if static else DraftLayer)
    # a "hybrid" layer is both: sparse attention keys and a convolution state; masks take it for full attention
    assert isinstance(attention_layer, LinearAttentionLayer) == (family == "inkling")
    assert caches[0].is_linear == ([True, False] if family == "lfm2" else [False, False])


@pytest.mark.parametrize("kind", ["sink_window", "budgeted"])
@torch.no_grad()
def test_a_recurrent_state_rolls_back_exactly(kind):
    """Qwen3-Next's gated delta net (transformers 5.25 records its per-token states): a block of 3 tokens and 2 single
    drafted tokens, then `crop(-4)`, leave the cache as if only the block's first token had been fed."""
    if not compat._RECURRENT_STATES_TO_KEEP:
        pytest.skip(f"transformers {transformers.__version__} records no recurrent states: refused there")
    model = _qwen3_next_drafter()
    prompt, block, drafted = random_prompt(80), random_prompt(3, seed=7), random_prompt(2, seed=8)
    caches = [_draft_cache(model, kind, static=False) for _ in range(2)]
    for cache in caches:
        compat.activate_past_recording(cache, recurrent_states_to_keep=8)
        model(prompt, **cache_kwargs(cache), use_cache=True)
    model(block, **cache_kwargs(caches[0]), position_ids=torch.arange(80, 83)[None], use_cache=True)
    _step_logits(model, caches[0], drafted, start=83)
    caches[0].crop(-4)
    _step_logits(model, caches[1], block[:, :1], start=80)
    right = random_prompt(2, seed=9)
    rolled_back = _step_logits(model, caches[0], right, start=81)
    torch.testing.assert_close(
        rolled_back, _step_logits(model, caches[1], right, start=81), rtol=1e-5, atol=1e-5
    )
    unrolled = caches[1]  # the check can fail: a state that read the drafts reads otherwise
    _step_logits(model, unrolled, torch.cat([block[:, 1:], drafted], dim=1), start=83)
    assert not torch.allclose(rolled_back, _step_logits(model, unrolled, right, start=85), atol=1e-3)


@pytest.mark.parametrize("family", ["lfm2", "inkling"])
def test_hybrid_drafter_with_a_window_covering_everything_drafts_as_stock(family):
    """A window longer than the context reads every key: each round drafts and accepts what stock assisted
    generation (a full `DynamicCache` with transformers' own rollback) drafts and accepts. Dynamic layers, on the
    drafter's own sdpa attention (`budgetdraft_varlen`, which a static cache needs, does not add Inkling's
    relative position bias)."""
    target, drafter = family_pair(family)
    ids = random_prompt(PROMPT_LENGTH)
    with record_speculation() as native:
        expected = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS)
    window = {"num_sink_tokens": 4, "window_length": 4096, "static": False}
    out, windowed = _speculate(family, "sink_window", window)
    assert torch.equal(out, expected)
    assert windowed.accepted_per_round == native.accepted_per_round
    assert windowed.proposed_per_round == native.proposed_per_round


def test_a_drafter_with_a_relative_position_bias_drafts_on_the_dynamic_cache():
    """Inkling's attention adds a bias built on `arange(kv_length) + kv_offset`, which a static cache's ring slots are
    not: the default plan keeps the dynamic cache (saying why), where the target drafting for itself over a window
    covering the context accepts every draft (on a static cache, which dropped the bias, it accepted 6 of 11);
    asking for a static cache is refused, and a static cache built by hand refuses its first step."""
    target, _ = family_pair("inkling")
    window = {"num_sink_tokens": 4, "window_length": 4096}
    with record_speculation() as stats:
        out = target.generate(
            random_prompt(PROMPT_LENGTH), assistant_model=target, do_sample=False, max_new_tokens=NEW_TOKENS,
            cache_implementation="sink_window", cache_config=window,
        )  # fmt: skip
    assert torch.equal(out, _target_greedy("inkling"))
    assert stats.plan.spec.static is False
    assert sum(stats.accepted_per_round) == sum(stats.proposed_per_round) > 0
    assert "position bias" in stats.plan.reasons["static"]
    with pytest.raises(ValueError, match="InklingAttention adds a position bias.*'static': False"):
        target.generate(
            random_prompt(PROMPT_LENGTH), assistant_model=target, max_new_tokens=4,
            cache_implementation="sink_window", cache_config={**window, "static": True},
        )  # fmt: skip
    target.set_attn_implementation("budgetdraft_varlen")
    try:
        cache = SinkWindowCache(target.config, num_sink_tokens=4, window_length=16, slack=8, static=True)
        target(random_prompt(40), **cache_kwargs(cache), use_cache=True)
        with pytest.raises(ValueError, match="static draft cache's slots are not"):
            _step_logits(target, cache, random_prompt(1, seed=3), start=40)
    finally:
        target.set_attn_implementation("sdpa")


def _qwen3_next_drafter():
    config = AutoConfig.for_model(
        "qwen3_next",
        **{**COMMON, "num_hidden_layers": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2},
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name", ["sink_window", "budgeted"])
def test_a_stateful_drafter_rolls_its_recurrent_state_back(name):
    """A recurrent state (qwen3_next's gated delta net) rolls back through the states transformers records per token
    from 5.25 on (the drafter: a Qwen3-Next of its own, the target's full-attention layer sparsified); before 5.25 it
    is refused at the first rollback, naming the upgrade."""
    drafter = _qwen3_next_drafter()
    ids = random_prompt(120)
    call = dict(do_sample=False, max_new_tokens=24)
    sizes = {"sink_window": {"num_sink_tokens": 4, "window_length": 16}, "budgeted": {"budget": 24}}
    speculative = dict(assistant_model=drafter, cache_implementation=name, cache_config=sizes[name])
    if not compat._RECURRENT_STATES_TO_KEEP:  # a stateless target (transformers refuses a stateful one there)
        target, _ = family_pair("llama")
        with pytest.raises(ValueError, match="layer 0 .* holds a recurrent state .* Upgrade transformers"):
            target.generate(ids, **speculative, **call)
        return
    target = _qwen3_next_drafter()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    with record_speculation() as stats:
        out = target.generate(ids, **speculative, **call)
    assert torch.equal(out, target.generate(ids, **call))
    assert (
        0 < sum(stats.accepted_per_round) < sum(stats.proposed_per_round)
    )  # drafts rejected: states rolled back


def test_unknown_layer_type_is_refused():
    config = more_config("lfm2")
    config.layer_types = ["conv", "mamba_attention"]
    with pytest.raises(ValueError, match="layer 1 of 'lfm2' is 'mamba_attention'.*has no cache layer"):
        SinkWindowCache(config)


def test_a_drafter_scoring_every_past_position_is_refused():
    """CPM-Ant adds a position bias built for every past token to its scores (stock assisted generation runs it on
    a full cache): it is refused by name, single and batched, before its forward fails on a shape."""
    sizes = dict(
        vocab_size=128, hidden_size=64, dim_ff=128, num_hidden_layers=1, num_attention_heads=4, dim_head=16
    )
    config = AutoConfig.for_model("cpmant", **sizes)
    torch.manual_seed(0)
    drafter = AutoModelForCausalLM.from_config(config).eval()
    target, _ = family_pair("llama")
    ids = random_prompt(120)
    for rows in (1, 2):
        with pytest.raises(
            ValueError, match="'cpmant' cannot run on a sparse cache: CPM-Ant adds a segment position"
        ):
            target.generate(
                ids.expand(rows, -1), assistant_model=drafter, cache_implementation="budgeted", max_new_tokens=8,
                attention_mask=torch.ones(rows, ids.shape[1], dtype=torch.long), do_sample=False,
            )  # fmt: skip


@pytest.mark.parametrize("cache_name", ["budgeted", "sink_window"])
def test_a_kv_sharing_model_drafts_single_and_batched(cache_name):
    """Gemma 4 layers past the KV-sharing point read an earlier layer's keys/values (transformers 5.25 gives them a
    "dummy" cache layer, earlier releases none): as target and drafter, one sequence and a padded batch (its target
    prefilled in chunks) give the target's own greedy output."""
    target = kv_sharing_model()
    sizes = {
        "sink_window": {"num_sink_tokens": 4, "window_length": 24},
        "budgeted": {"budget": 32, "window_length": 8},
    }
    sparse = dict(assistant_model=target, cache_implementation=cache_name, cache_config=sizes[cache_name])
    ids = torch.cat([random_prompt(160, seed=1), random_prompt(160, seed=2)]).clamp(
        min=3
    )  # no pad ids inside
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    for rows, extra in ((ids[:1], {}), (ids, dict(attention_mask=mask, prefill_chunk_size=64))):
        call = dict(do_sample=False, max_new_tokens=16, **extra)
        expected = target.generate(rows.masked_fill(mask[: len(rows)] == 0, 0), **call)
        with record_speculation() as stats:
            out = target.generate(rows.masked_fill(mask[: len(rows)] == 0, 0), **sparse, **call)
        assert torch.equal(out, expected) and stats.rounds > 0


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text"])
@pytest.mark.parametrize(
    "window_length", [1024, 24]
)  # covering the call; shorter than the prompt (rings wrap)
def test_a_kv_sharing_drafter_reads_the_same_keys_on_both_storages(model_type, window_length):
    """A reusing layer attends over the keys its storing layer's step returned: on a static cache, that layer's slot
    buffers, whose slot mask only that layer's attention receives; the reusing layer finds it through the buffer.
    Both storages then draft round for round alike (before, a wrapped ring was read as if slot = position), and a
    window covering the call accepts every draft."""
    target = kv_sharing_model(model_type)
    skip_unless_static(target)
    ids = random_prompt(160, seed=1).clamp(min=3)  # no pad ids
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    rounds = {}
    for static in (False, True):
        with record_speculation() as stats:
            out = target.generate(
                ids, assistant_model=copy.deepcopy(target), do_sample=False, max_new_tokens=24,
                cache_implementation="sink_window",
                cache_config={"num_sink_tokens": 4, "window_length": window_length, "draft_length": 4,
                              "static": static},
            )  # fmt: skip
        assert torch.equal(out, expected) and stats.plan.spec.static is static
        rounds[static] = stats.accepted_per_round, stats.proposed_per_round
    assert rounds[True] == rounds[False]
    accepted, proposed = rounds[True]
    if window_length > ids.shape[1]:
        assert sum(accepted) == sum(proposed) > 0
    else:  # the check can fail: the sparse draft both agreed and disagreed with the target
        assert 0 < sum(accepted) < sum(proposed)


# -- all-sliding drafters: their own bounded cache, logged once ------------------------------------------------------
@pytest.fixture
def fresh_log(caplog):
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-message warnings, shared by every logger
    caplog.set_level(logging.WARNING, logger=draft_cache.__name__)
    return caplog


def _nothing_sparsified(records) -> list[str]:
    return [r.getMessage() for r in records if "nothing is sparsified" in r.getMessage()]


def test_all_sliding_drafter_keeps_its_own_cache_and_logs_once(fresh_log):
    config = more_config("mistral-all-sliding")
    caches = [
        SinkWindowCache(config, window_length=8),
        BudgetedCache(config, budget=64),
        SinkWindowCache(config),
    ]
    for cache in caches:
        assert all(
            type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == 24 for layer in cache.layers
        )
    assert len(_nothing_sparsified(fresh_log.records)) == 2  # once per cache class
    assert "'mistral' has no full-attention layer" in _nothing_sparsified(fresh_log.records)[0]


@pytest.mark.parametrize("window_length", [8, 4096])  # smaller and larger than the model's window of 24
def test_all_sliding_drafter_drafts_exactly_as_stock(window_length):
    """Whatever window is asked for, an all-sliding drafter reads its own sliding window: the rounds are stock
    assisted generation's, round for round."""
    target, drafter = family_pair("mistral-all-sliding")
    ids = random_prompt(PROMPT_LENGTH)
    with record_speculation() as native:
        expected = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS)
    out, windowed = _speculate(
        "mistral-all-sliding", "sink_window", {"num_sink_tokens": 4, "window_length": window_length}
    )
    assert torch.equal(out, expected)
    assert windowed.accepted_per_round == native.accepted_per_round


@torch.no_grad()
def test_all_sliding_drafter_cache_is_bounded_by_its_window():
    model, _ = family_pair("mistral-all-sliding")
    sizes = []
    for context in (64, 256):
        cache = SinkWindowCache(model.config, window_length=8)
        model(random_prompt(context), **cache_kwargs(cache), use_cache=True)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("family", ["lfm2", "inkling", "gemma3", "cohere2"])
@torch.no_grad()
def test_the_draft_prefill_leaves_a_bounded_cache_on_every_family(family):
    """Sliding windows and convolution states record their past for rollback, and a prefill's would be the whole
    prompt's (4 times the bytes at 4 times the prompt); rollback never reaches into the prompt, so the drafter's
    prefill keeps what the next step reads: the same bytes at either length."""
    target, drafter = family_pair(family)
    sizes = []
    for context in (240, 960):
        window = {"num_sink_tokens": 4, "window_length": 32, "static": False}
        plan = plan_for(target, drafter, "sink_window", cache_config=window)
        cache = plan.draft_cache(drafter)
        compat.activate_past_recording(cache, recurrent_states_to_keep=plan.spec.slack)
        with plan.drafting(drafter)():
            DraftSteps.for_plan(plan, drafter, cache)(random_prompt(context), 0, None)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


# -- windowed MTP on a natively sliding MTP layer (Mellum) ---------------------------------------------------------
@pytest.fixture(scope="module")
def mellum(tmp_path_factory):
    """A tiny random Mellum (sliding + full main layers) with one random sliding MTP layer, saved and reloaded."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mellum",
        **{**COMMON, "num_hidden_layers": 2, "head_dim": 16, "sliding_window": 24, "num_mtp_layers": 1},
        layer_types=["sliding_attention", "full_attention"],
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("mellum")
    save_pretrained_with_mtp(model, new_mtp_head(model, 1), path)
    return expose_mtp_layers(AutoModelForCausalLM.from_pretrained(path)).eval()


def test_windowed_mtp_on_a_sliding_mtp_layer_runs_natively(mellum, fresh_log):
    ids = random_prompt(200)
    expected = mellum.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    with record_speculation() as native:
        native_out = mellum.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, use_mtp=True)
    with record_speculation() as windowed:
        out = mellum.generate(
            ids,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            use_mtp=True,
            cache_implementation="sink_window",
            # every round drafts, as native MTP does: the rounds compare one to one
            cache_config={"num_sink_tokens": 4, "window_length": 8, "draft_length": 1},
        )
    assert torch.equal(out, expected) and torch.equal(native_out, expected)
    assert windowed.rounds > 0 and windowed.proposed_per_round == native.proposed_per_round
    assert windowed.accepted_per_round == native.accepted_per_round
    messages = _nothing_sparsified(fresh_log.records)
    assert len(messages) == 1 and messages[0].startswith(
        "WindowedMtpCache: 'mellum' has no full-attention layer"
    )
    cache = windowed_mtp_cache(mellum, {"num_sink_tokens": 4, "window_length": 8})
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer]


# -- query capture for attention that bypasses transformers' AttentionInterface (Falcon) -----------------------------
def _falcon_queries(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every Falcon attention layer's prefill queries `(1, H, L, D)`, RoPE applied, times 1/sqrt(D), recomputed
    from the layer's own weights (the oracle the captured queries must equal)."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    queries, hooks = {}, []

    def record(module, args, kwargs):
        fused = module.query_key_value(args[0])
        if hasattr(module, "_split_heads"):  # transformers < 5.25
            query, key, _ = module._split_heads(fused)  # (B, L, H, D)
        else:  # the new decoder architecture: per KV group, its queries then its key and value
            grouped = fused.view(*args[0].shape[:-1], module.num_kv_heads, -1, module.head_dim)
            query, key = (
                grouped[..., :-2, :].flatten(-3, -2),
                grouped[..., -2, :],
            )  # (B, L, H, D), (B, L, H_kv, D)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # (B, H, L, D)
        query, _ = apply_rotary_pos_emb(query, key, *kwargs["position_embeddings"])
        queries[module.layer_idx] = query * module.head_dim**-0.5

    for layer in model.transformer.h:
        hooks.append(layer.self_attention.register_forward_pre_hook(record, with_kwargs=True))
    with torch.no_grad():
        model(ids, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True)
    for hook in hooks:
        hook.remove()
    return queries


@pytest.mark.parametrize("policy", ["snapkv", "chunk-last_query"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # F.scaled_dot_product_attention / query @ key^T
@torch.no_grad()
def test_query_capture_without_attention_interface_delivers_the_true_queries(attention, policy):
    # Falcon's attention calls torch directly before transformers 5.25 (the op-level capture: CI's oldest release
    # runs this) and dispatches through AttentionInterface from 5.25 on (the capturing attention): same queries
    model, _ = family_pair("falcon", attention)
    name, options = policy.split("-")[0], QUERY_CACHES[policy][1]["policy_kwargs"]
    ids = random_prompt(PROMPT_LENGTH)
    reference = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(reference), use_cache=True)
    queries = _falcon_queries(model, ids)
    cache = BudgetedCache(model.config, budget=48, policy=name, policy_kwargs=options)
    with query_capture(model):
        model(ids, **cache_kwargs(cache), use_cache=True)
    oracle = get_policy(name, **options)
    for idx, layer in enumerate(cache.layers):
        keys, window = reference.layers[idx].keys, queries[idx][:, :, -oracle.query_window :]
        assert torch.equal(layer.kept_positions, oracle.select(keys, 48, window))
        if name == "snapkv":  # the queries matter: other queries (the last keys) select otherwise
            assert not torch.equal(layer.kept_positions, oracle.select(keys, 48, keys[:, :, -8:]))
