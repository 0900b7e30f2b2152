"""Varlen attention for sparse draft views (`hf_budgetdraft.attention.varlen`).

- the packing / cu_seqlens / index logic against a plain loop reference (hypothesis);
- the SDPA fallback kernel against a per-segment float64 softmax, and the padded-in/padded-out path against masked
  SDPA on the same keys (GQA, per-row and per-KV-head key sets, causal blocks, bf16, gradients);
- the dispatch contract: the calls into flash-attn's `flash_attn_varlen_func` and torch's `varlen_attn` bind to
  their real signatures and mean the same attention;
- `attn_implementation="budgetdraft_varlen"` in real models, with the packed path forced on CPU: logits, greedy
  speculative decoding and BudgetDraft training views (values and gradients) equal stock attention.
"""

import importlib.util
import inspect
import sys
import types

import pytest
import torch
from attention_oracles import masked_sdpa_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import model_pair, random_prompt
from transformers import DynamicCache

from hf_budgetdraft import query_capture, record_speculation
from hf_budgetdraft.attention import varlen
from hf_budgetdraft.attention.varlen import kernels
from hf_budgetdraft.trainer.views import SparseViewSpec, full_cache, run_shared_prefix, view_logits

HAS_TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None  # torch >= 2.10

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_case(seed, batch, kv_heads, groups, kv_length, dim, q_length, per_head, density=0.5):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, q_length, dim, generator=generator)
    key = torch.randn(batch, kv_heads, kv_length, dim, generator=generator)
    value = torch.randn(batch, kv_heads, kv_length, dim + 1, generator=generator)  # D_v != D on purpose
    valid = torch.rand(batch, kv_heads if per_head else 1, kv_length, generator=generator) < density
    return query, key, value, valid


# ---------------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------------


def _loop_pack(key, value, valid):
    """The obvious implementation: walk every (row, KV-head group) segment and every slot."""
    batch, kv_heads, kv_length = key.shape[:3]
    segment_heads = valid.shape[1]
    group = kv_heads // segment_heads
    keys, values, lengths, index = [], [], [], []
    for b in range(batch):
        for s in range(segment_heads):
            count = 0
            for j in range(kv_length):
                if valid[b, s, j]:
                    keys.append(key[b, s * group : (s + 1) * group, j])  # (group, D)
                    values.append(value[b, s * group : (s + 1) * group, j])
                    index.append((b * segment_heads + s) * kv_length + j)
                    count += 1
            lengths.append(count)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    empty_k = key.new_zeros(0, group, key.shape[-1])
    empty_v = value.new_zeros(0, group, value.shape[-1])
    return (
        torch.stack(keys) if keys else empty_k,
        torch.stack(values) if values else empty_v,
        cu,
        max(lengths),
        index,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2, 4]),
    kv_length=st.integers(1, 12),
    dim=st.integers(1, 4),
    per_head=st.booleans(),
    density=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_pack_keys_matches_loop_reference(batch, kv_heads, kv_length, dim, per_head, density, seed):
    _, key, value, valid = _random_case(seed, batch, kv_heads, 1, kv_length, dim, 1, per_head, density)
    packed = varlen.pack_keys(key, value, valid)
    keys, values, cu, max_len, index = _loop_pack(key, value, valid.expand(batch, -1, -1))
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == cu
    assert packed.max_seqlen == max_len
    assert packed.index.tolist() == index
    assert packed.num_segment_heads == (kv_heads if per_head else 1)
    torch.testing.assert_close(packed.keys, keys, rtol=0, atol=0)
    torch.testing.assert_close(packed.values, values, rtol=0, atol=0)


def test_pack_keys_without_mask_is_uniform_and_needs_no_index():
    _, key, value, _ = _random_case(0, 2, 2, 1, 5, 3, 1, False)
    packed = varlen.pack_keys(key, value)
    reference = varlen.pack_keys(key, value, torch.ones(2, 1, 5, dtype=torch.bool))
    assert packed.index is None and packed.cu_seqlens.tolist() == [0, 5, 10] and packed.max_seqlen == 5
    torch.testing.assert_close(packed.keys, reference.keys, rtol=0, atol=0)


@pytest.mark.parametrize("segment_heads", [1, 2])
def test_pack_queries_segments_and_unpack_round_trip(segment_heads):
    query, *_ = _random_case(1, 3, 2, 3, 4, 5, 4, False)  # (B=3, H_q=6, q=4, D=5), 2 KV heads
    packed, cu, max_q = varlen.pack_queries(query, segment_heads)
    group = query.shape[1] // segment_heads
    assert cu.tolist() == [4 * i for i in range(3 * segment_heads + 1)] and max_q == 4
    for b in range(3):
        for s in range(segment_heads):
            segment = packed[(b * segment_heads + s) * 4 : (b * segment_heads + s + 1) * 4]  # (q, group, D)
            torch.testing.assert_close(segment, query[b, s * group : (s + 1) * group].transpose(0, 1))
    unpacked = varlen.unpack_output(packed, batch=3, q_length=4, num_segment_heads=segment_heads)
    torch.testing.assert_close(unpacked, query.transpose(1, 2), rtol=0, atol=0)  # (B, q, H_q, D)


def test_packing_errors_teach():
    _, key, value, _ = _random_case(0, 2, 2, 1, 5, 3, 1, False)
    with pytest.raises(ValueError, match=r"bool tensor \(B, 1 or H_kv, K\)"):
        varlen.pack_keys(key, value, torch.ones(2, 1, 5))
    with pytest.raises(ValueError, match=r"expected \(1 or 2, 1 or 2, 5\)"):
        varlen.pack_keys(key, value, torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of H_kv"):
        varlen.pack_queries(torch.zeros(1, 3, 1, 4), 2)
    query = torch.zeros(2, 4, 2, 3)
    hidden_block = torch.ones(2, 1, 5, dtype=torch.bool)
    hidden_block[0, 0, -1] = False
    with pytest.raises(ValueError, match="needs its own keys in the last 2 slots"):
        varlen.sparse_varlen_attention(query, key, value, hidden_block, causal=True)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


def _segment_loop_reference(query, key, value, cu_q, cu_k, causal, scale):
    """Per segment, softmax(q k^T * scale + bottom-right causal mask) v in float64; a row with no key -> 0."""
    groups = query.shape[1] // key.shape[1]
    out = torch.zeros(query.shape[0], query.shape[1], value.shape[-1], dtype=torch.float64)
    for n in range(len(cu_q) - 1):
        q = query[cu_q[n] : cu_q[n + 1]].double().transpose(0, 1)  # (H_q, n_q, D)
        k = (
            key[cu_k[n] : cu_k[n + 1]].double().transpose(0, 1).repeat_interleave(groups, dim=0)
        )  # (H_q, n_k, D)
        v = value[cu_k[n] : cu_k[n + 1]].double().transpose(0, 1).repeat_interleave(groups, dim=0)
        n_q, n_k = q.shape[1], k.shape[1]
        scores = q @ k.transpose(1, 2) * scale  # (H_q, n_q, n_k)
        visible = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal:
            visible = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
        out[cu_q[n] : cu_q[n + 1]] = (weights @ v).transpose(0, 1)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_lengths=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    k_lengths=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sdpa_varlen_matches_per_segment_reference(q_lengths, k_lengths, kv_heads, groups, causal, seed):
    k_lengths = k_lengths[: len(q_lengths)]
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(q_lengths), kv_heads * groups, 4, generator=generator)
    key = torch.randn(sum(k_lengths), kv_heads, 4, generator=generator)
    value = torch.randn(sum(k_lengths), kv_heads, 3, generator=generator)
    cu_q = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen.varlen_attention(
        query,
        key,
        value,
        cu_q,
        cu_k,
        max(q_lengths),
        max(k_lengths),
        causal=causal,
        scale=0.7,
        backend="auto",
    )
    expected = _segment_loop_reference(query, key, value, cu_q.tolist(), cu_k.tolist(), causal, 0.7)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def _naive_masked_attention(query, key, value, valid, causal, scale):
    """Padded reference: repeat KV heads, add -inf where a key is hidden, softmax in float64. `(B, q, H_q, D_v)`."""
    groups = query.shape[1] // key.shape[1]
    q_length, kv_length = query.shape[2], key.shape[2]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    visible = valid[:, :, None, :]  # (B, 1 or H_kv, 1, K)
    if valid.shape[1] > 1:
        visible = visible.repeat_interleave(groups, dim=1)  # per KV head -> per query head
    if causal:
        rows = torch.arange(q_length)[:, None] + (kv_length - q_length)
        visible = visible & (torch.arange(kv_length)[None, :] <= rows)
    scores = (query.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v  # (B, H_q, q, D_v)
    return out.transpose(1, 2)


CASES = [  # (batch, kv_heads, groups, kv_length, q_length, causal, per_head)
    (2, 2, 2, 11, 1, False, False),  # one-token step, rows with different key sets
    (2, 2, 2, 11, 1, False, True),  # one-token step, per-KV-head key sets
    (3, 2, 4, 16, 4, True, False),  # a causal draft block after ragged past keys
    (3, 4, 1, 16, 4, True, True),  # MHA, per-head
    (1, 1, 8, 9, 3, True, True),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-Hkv{c[1]}-G{c[2]}-q{c[4]}-head{c[6]}" for c in CASES])
def test_sparse_varlen_equals_masked_sdpa(case, dtype):
    batch, kv_heads, groups, kv_length, q_length, causal, per_head = case
    query, key, value, valid = _random_case(7, batch, kv_heads, groups, kv_length, 8, q_length, per_head)
    valid[..., -q_length:] = True  # the new block (and at least one key per segment)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    out = varlen.sparse_varlen_attention(
        query, key, value, valid, causal=causal, scale=0.4, backend="sdpa_packed"
    )
    masked = masked_sdpa_reference(query, key, value, valid, causal=causal, scale=0.4)
    naive = _naive_masked_attention(query, key, value, valid, causal, 0.4)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert out.shape == (batch, q_length, kv_heads * groups, value.shape[-1]) and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive, **tolerance)
    torch.testing.assert_close(masked.double(), naive, **tolerance)


def test_gradients_of_packed_path_equal_masked_sdpa():
    query, key, value, valid = _random_case(3, 2, 2, 3, 14, 8, 3, per_head=True)
    valid[..., -3:] = True
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    references = [t.clone().requires_grad_() for t in (query, key, value)]
    varlen.sparse_varlen_attention(
        *leaves, valid, causal=True, backend="sdpa_packed"
    ).square().sum().backward()
    masked_sdpa_reference(*references, valid, causal=True).square().sum().backward()
    for leaf, reference in zip(leaves, references, strict=True):
        torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-5)
        assert leaf.grad.abs().sum() > 0


def test_empty_key_sets_return_zeros_without_nan_gradients():
    query, key, value, _ = _random_case(4, 2, 2, 2, 6, 4, 1, per_head=True)
    valid = torch.zeros(2, 2, 6, dtype=torch.bool)
    valid[0, 1, 2] = True
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out = varlen.sparse_varlen_attention(*leaves, valid, causal=False, backend="sdpa_packed")
    assert out[1].abs().sum() == 0 and out[0, :, :2].abs().sum() == 0  # rows/heads with no key
    torch.testing.assert_close(out[0, 0, 2:], value[0, 1, 2].expand(2, -1))  # a single key: its value
    out.sum().backward()
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------


def test_backend_resolution_on_cpu_and_errors():
    query = torch.zeros(2, 2, 4)
    assert varlen.resolve_backend("auto", query) == "sdpa_packed"
    assert varlen.available_backends()["sdpa_packed"]
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(ValueError, match="needs CUDA tensors in fp16/bf16"):
            varlen.resolve_backend(name, query)
    with pytest.raises(ValueError, match="varlen backend must be one of"):
        varlen.resolve_backend("triton", query)
    with pytest.raises(ValueError, match="varlen backend must be one of"), varlen.use_backend("fast"):
        pass
    with varlen.use_backend("sdpa_packed"):
        assert varlen.current_backend() == "sdpa_packed"
    assert varlen.current_backend() == "auto"
    assert (varlen.torch_varlen_attn() is not None) == HAS_TORCH_VARLEN


def _packed_problem():
    query, key, value, valid = _random_case(5, 2, 2, 2, 10, 8, 3, per_head=True)
    valid[..., -3:] = True
    packed = varlen.pack_keys(key, value, valid)
    queries, cu_q, max_q = varlen.pack_queries(query, packed.num_segment_heads)
    return queries, packed, cu_q, max_q


def _flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn 2.6's signature (flash_attn/flash_attn_interface.py), computed with the reference kernel."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and isinstance(max_seqlen_k, int)
    assert dropout_p == 0.0 and window_size == (-1, -1) and not return_attn_probs
    _flash_attn_varlen_func.calls += 1
    return varlen.sdpa_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=softmax_scale
    )


def test_flash_attn_call_binds_to_its_signature(monkeypatch):
    fake = types.ModuleType("flash_attn")
    _flash_attn_varlen_func.calls = 0
    fake.flash_attn_varlen_func = _flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(kernels, "resolve_backend", lambda name, query: "flash_attn")
    queries, packed, cu_q, max_q = _packed_problem()
    args = (queries, packed.keys, packed.values, cu_q, packed.cu_seqlens, max_q, packed.max_seqlen)
    out = varlen.varlen_attention(*args, causal=True, scale=0.3, backend="flash_attn")
    assert _flash_attn_varlen_func.calls == 1
    torch.testing.assert_close(out, varlen.sdpa_varlen(*args, causal=True, scale=0.3), rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TORCH_VARLEN, reason="torch < 2.10 has no varlen_attn")
def test_torch_varlen_call_binds_to_its_signature(monkeypatch):
    real = varlen.torch_varlen_attn()
    calls = []

    def checked(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)  # raises if our call would not bind
        bound.apply_defaults()
        a = bound.arguments
        assert a["cu_seq_q"].dtype == a["cu_seq_k"].dtype == torch.int32
        if "enable_gqa" in a:  # torch >= 2.13
            assert a["enable_gqa"] == (a["query"].shape[1] != a["key"].shape[1])
        else:  # older torch: the key/value heads arrive repeated to the query's
            assert a["query"].shape[1] == a["key"].shape[1]
        # torch 2.11+ takes window_size ((-1, 0) is causal, (-1, -1) full), 2.10 is_causal
        causal = a["window_size"] == (-1, 0) if "window_size" in a else a["is_causal"]
        assert "window_size" not in a or a["window_size"] in ((-1, 0), (-1, -1))
        calls.append(causal)
        return varlen.sdpa_varlen(
            a["query"],
            a["key"],
            a["value"],
            a["cu_seq_q"],
            a["cu_seq_k"],
            a["max_q"],
            a["max_k"],
            causal=causal,
            scale=a.get("scale"),  # torch 2.10 takes no scale: the query arrives scaled
        )

    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: checked)
    monkeypatch.setattr(kernels, "resolve_backend", lambda name, query: "torch_varlen")
    queries, packed, cu_q, max_q = _packed_problem()
    args = (queries, packed.keys, packed.values, cu_q, packed.cu_seqlens, max_q, packed.max_seqlen)
    # torch 2.10 takes no scale: the query arrives pre-scaled, equal up to float rounding
    exact = "scale" in inspect.signature(real).parameters
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    for causal in (True, False):
        out = varlen.varlen_attention(*args, causal=causal, scale=0.3, backend="torch_varlen")
        torch.testing.assert_close(out, varlen.sdpa_varlen(*args, causal=causal, scale=0.3), **tolerance)
    assert calls == [True, False]


def test_mask_function_materialises_static_steps_only():
    kwargs = dict(batch_size=1, kv_offset=0, dtype=torch.float32, device=torch.device("cpu"))
    assert varlen.budgetdraft_varlen_mask(q_length=3, kv_length=10, q_offset=7, **kwargs) is None
    assert (
        varlen.budgetdraft_varlen_mask(q_length=3, kv_length=10, q_offset=torch.tensor(7), **kwargs) is None
    )
    mask = varlen.budgetdraft_varlen_mask(q_length=1, kv_length=10, q_offset=torch.tensor(9), **kwargs)
    assert mask is not None and mask.shape == (1, 1, 1, 10)  # same type and shape at every static decode step


@pytest.mark.parametrize("q_offset", [150, torch.tensor(150)])
@pytest.mark.parametrize("q_length", [1, 4])
def test_a_static_step_keeps_a_per_position_overlay_in_range(q_offset, q_length):
    """A static layer's step reports its 72 slots as the keys (offset 0) while its queries sit at position 150; a
    mask function reading per-position ids padded to the keys (Gemma 4's vision blocks) stays in range. Where the
    queries end with the keys, the mask is transformers' own."""
    from transformers.masking_utils import blockwise_overlay, causal_mask_function, or_masks, sdpa_mask

    kwargs = dict(batch_size=1, kv_offset=0, dtype=torch.float32, device=torch.device("cpu"))
    blocks = torch.full((1, 72), -1)
    blocks[0, 10:20] = 0  # one image block
    function = or_masks(causal_mask_function, blockwise_overlay(blocks))
    mask = varlen.budgetdraft_varlen_mask(
        q_length=q_length, kv_length=72, q_offset=q_offset, mask_function=function, **kwargs
    )
    assert mask.shape == (1, 1, q_length, 72)
    consistent = dict(q_length=q_length, kv_length=72, q_offset=72 - q_length, mask_function=function)
    expected = sdpa_mask(**consistent, allow_is_causal_skip=False, **kwargs)
    assert torch.equal(varlen.budgetdraft_varlen_mask(**consistent, **kwargs), expected)


# ---------------------------------------------------------------------------------------------------------------
# attn_implementation="budgetdraft_varlen" in models
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa_packed", "auto"])
@pytest.mark.parametrize("family,reference", [("llama", "sdpa"), ("qwen3", "sdpa"), ("gemma2", "eager")])
def test_model_logits_equal_stock_attention(family, reference, backend):
    stock, _ = model_pair(family, reference)
    model, _ = model_pair(family, "budgetdraft_varlen")
    ids = random_prompt(40, seed=3)
    logits = {}
    with torch.no_grad(), varlen.use_backend(backend):
        for name, m in (("stock", stock), ("varlen", model)):
            cache = DynamicCache(config=m.config)
            steps = [m(ids[:, :30], cache=cache).logits]
            steps += [m(ids[:, 30:34], cache=cache).logits]  # a 4-token block after a past (verify-shaped)
            steps += [m(ids[:, t : t + 1], cache=cache).logits for t in range(34, 40)]
            logits[name] = torch.cat(steps, dim=1)
    torch.testing.assert_close(logits["varlen"], logits["stock"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "implementation,cache_config",
    [
        ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8}),
        ("budgeted", {"budget": 48, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}),
        ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8, "static": True}),  # slot mask
    ],
    ids=["sink_window", "budgeted-snapkv", "sink_window-static"],
)
def test_greedy_speculation_through_the_packed_path(implementation, cache_config):
    target, stock_drafter = model_pair("llama", "sdpa", num_assistant_tokens=3)
    _, drafter = model_pair("llama", "budgetdraft_varlen", num_assistant_tokens=3)
    ids = random_prompt(200, seed=4)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    runs = {}
    dynamic_config = {k: v for k, v in cache_config.items() if k != "static"}
    for name, model, config in (("stock", stock_drafter, dynamic_config), ("varlen", drafter, cache_config)):
        with varlen.use_backend("sdpa_packed"), record_speculation() as stats:
            out = target.generate(
                ids,
                assistant_model=model,
                do_sample=False,
                max_new_tokens=40,
                cache_implementation=implementation,
                cache_config=config,
            )
        runs[name] = (out, stats.accepted_per_round)
    assert torch.equal(runs["varlen"][0], expected)
    assert runs["varlen"][1] == runs["stock"][1]  # the same drafts: the draft reads the same keys
    assert 0 < sum(runs["varlen"][1]) < 3 * len(runs["varlen"][1])  # some rounds rejected: the check can fail


@pytest.mark.parametrize(
    "kind,window", [("budgeted", 16), ("sink_window", None)], ids=["causal-block", "windowed-mask"]
)
def test_training_views_with_varlen_equal_sdpa(kind, window):
    _, reference = model_pair("llama", "sdpa")
    _, drafter = model_pair("llama", "budgetdraft_varlen")
    spec = SparseViewSpec(
        kind=kind,
        policy="chunk",
        policy_kwargs={"chunk_size": 4},
        window_length=window or 1,
        num_sink_tokens=4,
    )
    ids = random_prompt(72, seed=5)
    prefix, continuation = ids[:, :60], ids[:, 60:]
    results = {}
    with varlen.use_backend("sdpa_packed"):
        for name, model in (("sdpa", reference), ("varlen", drafter)):
            model.train()
            shared = run_shared_prefix(model, prefix)
            full = view_logits(model, continuation, full_cache(model.config, shared))
            view = view_logits(model, continuation, spec.build(model.config, shared, 24))
            (full.square().mean() + view.square().mean()).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            results[name] = (full.detach(), view.detach(), grads)
    for got, expected in zip(results["varlen"], results["sdpa"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_query_capture_wraps_varlen():
    _, drafter = model_pair("llama", "budgetdraft_varlen")
    with query_capture(drafter):
        assert drafter.config._attn_implementation == "budgetdraft_capture_budgetdraft_varlen"
    assert drafter.config._attn_implementation == "budgetdraft_varlen"


@pytest.mark.parametrize("release", ["2.10", "2.11"])
def test_torch_varlen_call_adapts_to_older_signatures(monkeypatch, release):
    """torch 2.10 takes `is_causal`, 2.11 `window_size` without `enable_gqa`: GQA then repeats key/value heads."""
    calls = []

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, is_causal=False):
        calls.append((key.shape[1], is_causal))
        assert key.shape[1] == query.shape[1]
        return varlen.sdpa_varlen(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, scale=scale
        )

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return torch_2_10(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, is_causal=window_size == (-1, 0)
        )

    fake = torch_2_10 if release == "2.10" else torch_2_11
    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: fake)
    monkeypatch.setattr(
        kernels, "torch_varlen_parameters", lambda: frozenset(inspect.signature(fake).parameters)
    )
    monkeypatch.setattr(kernels, "resolve_backend", lambda name, query: "torch_varlen")
    queries, packed, cu_q, max_q = _packed_problem()
    assert queries.shape[1] != packed.keys.shape[1]  # the problem is grouped-query
    args = (queries, packed.keys, packed.values, cu_q, packed.cu_seqlens, max_q, packed.max_seqlen)
    for causal in (True, False):
        out = varlen.varlen_attention(*args, causal=causal, scale=0.3, backend="torch_varlen")
        torch.testing.assert_close(
            out, varlen.sdpa_varlen(*args, causal=causal, scale=0.3), rtol=1e-6, atol=1e-6
        )
    assert calls == [(queries.shape[1], True), (queries.shape[1], False)]
