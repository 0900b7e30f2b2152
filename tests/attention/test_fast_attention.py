"""`budgetdraft_sdpa` computes what stock `sdpa`/`eager` compute: logits allclose on tiny models (GQA and MHA, a block
of 1..8 new tokens after a past, with and without left padding, eager and sdpa references), the attention function
against transformers' `sdpa_attention_forward` on a materialised mask, every fallback, and greedy identity of
whole generations (plain AR and speculative)."""

import copy

import pytest
import torch
from tiny_models import model_pair, random_prompt, tiny_config
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    StaticCache,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

import hf_budgetdraft
from hf_budgetdraft import GrowableCache, record_speculation
from hf_budgetdraft.attention import fast_sdpa
from hf_budgetdraft.attention.fast_sdpa import (
    budgetdraft_sdpa_attention_forward,
    budgetdraft_sdpa_mask,
    lower_right_causal_mask,
)

NAME = "budgetdraft_sdpa"
PAST = 97  # not a multiple of anything, longer than every block
FAMILIES = ["llama", "qwen3", "mistral", "gpt_neox"]  # GQA 4:2 x3 (mistral without sliding window), MHA
ATOL = 2e-4  # logits are O(10) (sharpened heads); run-to-run noise of stock sdpa vs eager is ~1e-5


class _Module(torch.nn.Module):
    """The attributes transformers' sdpa reads from an attention module."""

    def __init__(self, num_key_value_groups: int, is_causal: bool = True):
        super().__init__()
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = is_causal


def _qkv(batch, heads, kv_heads, q_length, kv_length, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return (
        rand(batch, heads, q_length, dim),
        rand(batch, kv_heads, kv_length, dim),
        rand(batch, kv_heads, kv_length, dim),
    )


def _fast_copy(model, cache_class):
    fast = copy.deepcopy(model)
    fast.set_attn_implementation(NAME)
    return fast, cache_class(config=fast.config)


def test_registered_on_import_idempotently():
    assert NAME in AttentionInterface._global_mapping
    assert NAME in AttentionMaskInterface._global_mapping
    hf_budgetdraft.integration.install()
    fast_sdpa.register()
    assert AttentionInterface._global_mapping[NAME] is budgetdraft_sdpa_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is budgetdraft_sdpa_mask


@pytest.mark.parametrize("kernel_gqa", [True, False], ids=["kernel_gqa", "repeated_block_keys"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_function_matches_stock_sdpa_on_the_equivalent_mask(
    kv_heads, dtype, kernel_gqa, monkeypatch
):
    """`None` from the mask function = lower-right causal; stock sdpa gets that mask spelled out. Both ways of the
    new block's GQA: the kernel's (torch >= 2.9) and its keys repeated per query head (before)."""
    if kernel_gqa and not fast_sdpa._KERNEL_GQA_EXACT:
        pytest.skip(
            f"torch {torch.__version__}'s CPU flash kernel is wrong with fewer key heads than query heads"
        )
    monkeypatch.setattr(fast_sdpa, "_KERNEL_GQA_EXACT", kernel_gqa)
    module = _Module(4 // kv_heads)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for q_length in [1, 2, 3, 5, 8, 40]:
        query, key, value = _qkv(2, 4, kv_heads, q_length, 40 if q_length == 40 else 61, dtype=dtype)
        kv_length = key.shape[2]
        mask = lower_right_causal_mask(q_length, kv_length, query.device).expand(2, 1, -1, -1)
        for scaling in (None, 0.37):
            expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
            out, weights = budgetdraft_sdpa_attention_forward(
                module, query, key, value, None, scaling=scaling
            )
            assert weights is None and out.shape == (2, q_length, 4, 16) and out.is_contiguous()
            torch.testing.assert_close(out, expected, **tolerance)


def test_split_path_is_taken_and_merges_exactly():
    calls = []
    original = fast_sdpa._split_past_and_block

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    query, key, value = _qkv(1, 8, 2, 6, 300, dim=32)
    expected, _ = sdpa_attention_forward(
        _Module(4), query, key, value, lower_right_causal_mask(6, 300, "cpu")
    )
    fast_sdpa._split_past_and_block = spy
    try:
        with torch.no_grad():
            out, _ = budgetdraft_sdpa_attention_forward(_Module(4), query, key, value, None)
    finally:
        fast_sdpa._split_past_and_block = original
    assert calls == [(1, 8, 6, 32)]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_output_flags_generate_passes_down_keep_the_fast_path(monkeypatch):
    """`generate(use_mtp=True)` verifies with `output_hidden_states=True`, which reaches the attention function: it
    changes nothing there, so it must not send verification to stock sdpa on a materialised mask (2x slower)."""
    monkeypatch.setattr(fast_sdpa, "sdpa_attention_forward", None)  # any stock fallback would fail loudly
    query, key, value = _qkv(1, 8, 2, 3, 40, dim=32)
    flags = {"output_hidden_states": True, "return_dict": True, "use_cache": True}
    with torch.no_grad():
        out, _ = budgetdraft_sdpa_attention_forward(_Module(4), query, key, value, None, **flags)
    expected, _ = sdpa_attention_forward(_Module(4), query, key, value, lower_right_causal_mask(3, 40, "cpu"))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_non_causal_and_masked_paths_match_stock():
    module = _Module(2, is_causal=False)
    query, key, value = _qkv(2, 4, 2, 5, 23)
    torch.testing.assert_close(
        budgetdraft_sdpa_attention_forward(module, query, key, value, None)[0],
        sdpa_attention_forward(module, query, key, value, None)[0],
    )
    # a padding mask (row 1 left-padded by 4) goes to masked SDPA with GQA, KV not repeated
    padding = torch.ones(2, 23, dtype=torch.bool)
    padding[1, :4] = False
    mask = sdpa_mask(2, 5, 23, q_offset=18, attention_mask=padding, allow_is_causal_skip=False)
    causal = _Module(2)
    torch.testing.assert_close(
        budgetdraft_sdpa_attention_forward(causal, query, key, value, mask)[0],
        sdpa_attention_forward(causal, query, key, value, mask)[0],
    )


def test_gradients_match_stock_sdpa():
    """With gradients on, the public path (no log-sum-exp kernel) is used; gradients equal stock's."""
    module = _Module(2)
    grads = []
    for function, mask in (
        (sdpa_attention_forward, lower_right_causal_mask(4, 19, "cpu")),
        (budgetdraft_sdpa_attention_forward, None),
    ):
        query, key, value = (t.requires_grad_() for t in _qkv(1, 4, 2, 4, 19))
        function(module, query, key, value, mask)[0].square().sum().backward()
        grads.append([query.grad, key.grad, value.grad])
    for stock, fast in zip(*grads, strict=True):
        torch.testing.assert_close(fast, stock)


def test_unknown_kwargs_and_dropout_go_to_stock_sdpa_on_a_materialised_mask(monkeypatch):
    seen = []

    def stock(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(fast_sdpa, "sdpa_attention_forward", stock)
    query, key, value = _qkv(1, 4, 2, 3, 10)
    out, _ = budgetdraft_sdpa_attention_forward(_Module(2), query, key, value, None, future_feature=1.0)
    mask, kwargs = seen[-1]
    assert kwargs["future_feature"] == 1.0
    assert torch.equal(mask, lower_right_causal_mask(3, 10, "cpu"))
    expected, _ = sdpa_attention_forward(_Module(2), query, key, value, mask)
    torch.testing.assert_close(out, expected)
    torch.manual_seed(0)
    budgetdraft_sdpa_attention_forward(_Module(2), query, key, value, None, dropout=0.5)
    assert len(seen) == 2


def test_attention_sinks_fall_back_to_the_family_eager():
    """gpt-oss sinks: stock sdpa would silently ignore `s_aux`; the family's eager attention computes them."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    config = AutoConfig.for_model(
        "gpt_oss",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
    )
    module = modeling_gpt_oss.GptOssAttention(config, layer_idx=0).eval()
    torch.nn.init.normal_(module.sinks)
    query, key, value = _qkv(1, 4, 2, 5, 30)
    mask = lower_right_causal_mask(5, 30, "cpu")
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected, _ = modeling_gpt_oss.eager_attention_forward(
        module, query, key, value, additive, scaling=0.25, s_aux=module.sinks
    )
    out, _ = budgetdraft_sdpa_attention_forward(
        module, query, key, value, None, scaling=0.25, s_aux=module.sinks
    )
    torch.testing.assert_close(out, expected)


def test_logit_softcapping_model_matches_eager():
    """gemma3 with attention logit softcapping (which stock sdpa rejects) and a sliding layer: eager is the reference."""
    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        attn_logit_softcapping=5.0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = random_prompt(40)
    _compare_blocks(model, ids, fast_cache=GrowableCache, block_sizes=[1, 4])


def test_mask_function_skips_only_a_plain_lower_right_causal_block():
    def full(**kwargs):
        args = dict(batch_size=2, q_length=5, kv_length=30, q_offset=25, kv_offset=0, **kwargs)
        return budgetdraft_sdpa_mask(**args), sdpa_mask(**{**args, "allow_is_causal_skip": False})

    assert full()[0] is None
    assert full(attention_mask=torch.ones(2, 30, dtype=torch.bool))[0] is None
    assert budgetdraft_sdpa_mask(1, 3, 10, q_offset=11, kv_offset=4) is None  # sparse draft cache layout
    padding = torch.ones(2, 30, dtype=torch.bool)
    padding[0, :3] = False
    for kwargs in (
        {"attention_mask": padding},
        {"mask_function": sliding_window_causal_mask_function(8), "local_size": 8},
        {"allow_is_causal_skip": False},
    ):
        got, expected = full(**kwargs)
        assert torch.equal(got, expected), kwargs
    # empty static cache: stock skips the mask and relies on an upper-left `is_causal`; never `None` here
    static = budgetdraft_sdpa_mask(1, 4, 16, q_offset=0, kv_offset=0, mask_function=causal_mask_function)
    assert torch.equal(static, sdpa_mask(1, 4, 16, allow_is_causal_skip=False))


def _compare_blocks(reference, ids, fast_cache, block_sizes, attention_mask=None):
    """Prefill `ids[:, :-8]`, then feed blocks of `q` tokens (cropped back after each); logits must agree."""
    fast, cache = _fast_copy(reference, fast_cache)
    ref_cache = DynamicCache(config=reference.config)
    for c in (cache, ref_cache):
        c.activate_past_recording()  # sliding-window layers (gemma3) must be able to roll back too
    past = ids.shape[1] - 8
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:, :past]}
    with torch.no_grad():
        torch.testing.assert_close(
            fast(ids[:, :past], cache=cache, **kwargs).logits,
            reference(ids[:, :past], cache=ref_cache, **kwargs).logits,
            atol=ATOL,
            rtol=1e-4,
        )
        for q in block_sizes:
            block = {"input_ids": ids[:, past : past + q]}
            if attention_mask is not None:
                block["attention_mask"] = attention_mask[:, : past + q]
                block["position_ids"] = (attention_mask[:, : past + q].cumsum(-1) - 1)[:, past:]
            expected = reference(**block, cache=ref_cache).logits
            got = fast(**block, cache=cache).logits
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4, msg=lambda m, q=q: f"q={q}: {m}")
            ref_cache.crop(-q)
            cache.crop(-q)
            assert cache.get_seq_length() == ref_cache.get_seq_length() == past


@pytest.mark.parametrize("cache_class", [DynamicCache, GrowableCache])
@pytest.mark.parametrize("reference", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_allclose_for_blocks_of_1_to_8_tokens_after_a_past(family, reference, cache_class):
    target, _ = model_pair(family, reference)
    _compare_blocks(target, random_prompt(PAST + 8), cache_class, block_sizes=range(1, 9))


@pytest.mark.parametrize("reference", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_logits_allclose_with_left_padding(family, reference):
    target, _ = model_pair(family, reference)
    ids = torch.cat([random_prompt(PAST + 8, seed=1), random_prompt(PAST + 8, seed=2)])
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :7] = 0  # row 1 left-padded
    fast, cache = _fast_copy(target, GrowableCache)
    ref_cache = DynamicCache(config=target.config)
    past = PAST
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        fast(
            ids[:, :past],
            attention_mask=attention_mask[:, :past],
            position_ids=position_ids[:, :past],
            cache=cache,
        )
        target(
            ids[:, :past],
            attention_mask=attention_mask[:, :past],
            position_ids=position_ids[:, :past],
            cache=ref_cache,
        )
        for q in (1, 3, 8):
            block = {
                "input_ids": ids[:, past : past + q],
                "attention_mask": attention_mask[:, : past + q],
                "position_ids": position_ids[:, past : past + q],
            }
            torch.testing.assert_close(
                fast(**block, cache=cache).logits,
                target(**block, cache=ref_cache).logits,
                atol=ATOL,
                rtol=1e-4,
            )
            cache.crop(-q)
            ref_cache.crop(-q)


def test_four_query_heads_per_kv_head():
    config = tiny_config("llama")
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    _compare_blocks(model, random_prompt(PAST + 8), GrowableCache, block_sizes=[1, 2, 5, 8])


def test_static_cache_prefill_and_decode():
    """An empty StaticCache has more keys than queries: the mask is materialised, never read as lower-right."""
    target, _ = model_pair("llama", "sdpa")
    ids = random_prompt(30)
    fast = copy.deepcopy(target)
    fast.set_attn_implementation(NAME)
    logits = {}
    with torch.no_grad():
        for name, model in (("stock", target), ("fast", fast)):
            cache = StaticCache(config=model.config, max_cache_len=48)
            logits[name] = [model(ids[:, :26], cache=cache).logits, model(ids[:, 26:], cache=cache).logits]
    for got, expected in zip(logits["fast"], logits["stock"], strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


NEW_TOKENS = 32


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ar_identical_to_stock(family):
    target, _ = model_pair(family, "sdpa")
    ids = random_prompt(160)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    target.set_attn_implementation(NAME)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS), expected)
    cache = GrowableCache(config=target.config, initial_capacity=64)  # grows during the call
    assert torch.equal(
        target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, cache=cache), expected
    )
    assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1


SPECULATIVE = {
    "sink_window": ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8}),
    "budgeted-chunk": ("budgeted", {"budget": 48, "policy": "chunk", "window_length": 16}),
    # query-scored: the drafter's prefill runs under budgetdraft_capture_budgetdraft_sdpa
    "budgeted-snapkv": ("budgeted", {"budget": 48, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}),
}


@pytest.mark.parametrize("cache_name", list(SPECULATIVE))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_neox"])
def test_greedy_speculative_identical_to_target_greedy(family, cache_name):
    target, drafter = model_pair(family, "sdpa", num_assistant_tokens=5)
    ids = random_prompt(200)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)  # stock sdpa + DynamicCache
    for model in (target, drafter):
        model.set_attn_implementation(NAME)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            cache_implementation=SPECULATIVE[cache_name][0],
            cache_config=SPECULATIVE[cache_name][1],
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, expected), (
        f"first diff at {(out.sequences != expected).nonzero()[:1].tolist()}"
    )
    assert isinstance(out.cache, GrowableCache)  # the target's cache
    # the check can fail: rounds with rejections happened, so the target cache was cropped
    assert sum(stats.proposed_per_round) > sum(stats.accepted_per_round) > 0
