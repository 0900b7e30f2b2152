"""Windowed-MTP: transformers' built-in MTP head drafting on a sink + window ring; output stays the target's."""

import functools

import pytest
import torch
from tiny_models import random_prompt, skip_unless_known, skip_unless_static
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from hf_budgetdraft import cache_nbytes, record_speculation
from hf_budgetdraft.cache import DraftLayer, StaticDraftLayer, WindowedMtpCache
from hf_budgetdraft.compat import cache_kwargs, output_cache
from hf_budgetdraft.generation import windowed_mtp as mtp_module
from hf_budgetdraft.generation.draft_length import DraftLength
from hf_budgetdraft.generation.draft_length import factory as draft_length_factory
from hf_budgetdraft.generation.mtp_heads import expose_mtp_layers, new_mtp_head, save_pretrained_with_mtp

MTP_FAMILIES = {
    "glm4_moe": dict(first_k_dense_replace=2, head_dim=16, num_key_value_heads=2),
    "deepseek_v3": dict(
        first_k_dense_replace=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
        n_group=1,
        topk_group=1,
    ),
    "sarvam_mla": {},
    "sarvam_moe": {},
}
WINDOW = {"num_sink_tokens": 4, "window_length": 32}


@functools.cache
def _saved_mtp_model(family: str, num_mtp_layers: int, tmp_root: str) -> str:
    """A tiny random target with random MTP layers, saved where `generate(use_mtp=True)` can load them."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_mtp_layers=num_mtp_layers,
        initializer_range=0.2,
        max_position_embeddings=16384,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **MTP_FAMILIES[family],
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    path = f"{tmp_root}/{family}-{num_mtp_layers}"
    save_pretrained_with_mtp(model, new_mtp_head(model, num_mtp_layers), path)
    return path


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mtp"))


def load(family, tmp_root, num_mtp_layers=1):
    skip_unless_known(family)
    path = _saved_mtp_model(family, num_mtp_layers, tmp_root)
    return expose_mtp_layers(AutoModelForCausalLM.from_pretrained(path)).eval()


def generate(model, ids, **kwargs):
    with record_speculation() as stats:
        out = model.generate(ids, do_sample=False, max_new_tokens=32, **kwargs)
    return out, stats


@pytest.mark.parametrize("num_mtp_layers", [1, 2])
@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_windowed_mtp_is_lossless(family, num_mtp_layers, tmp_root):
    model = load(family, tmp_root, num_mtp_layers)
    ids = random_prompt(400)  # >10x the window
    expected = model.generate(ids, do_sample=False, max_new_tokens=32)
    out, stats = generate(model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=WINDOW)
    assert torch.equal(out, expected)
    assert stats.rounds > 0 and max(stats.proposed_per_round) == num_mtp_layers


@pytest.mark.parametrize("num_mtp_layers", [1, 2])
@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_static_windowed_mtp_reads_the_ring_in_place_and_drafts_the_same(
    family, num_mtp_layers, tmp_root, monkeypatch
):
    """`cache_config={"static": True}`: every draft forward after the prefill (one-token steps and the multi-token
    absorption of a round's verified tokens) is a slot-order step, and the drafts equal the dynamic ring's. The model
    stays as loaded: the MTP head reads the ring through budgetdraft_varlen for the call, the target verifies on its
    own attention."""
    model = load(family, tmp_root, num_mtp_layers)
    skip_unless_static(model)
    ids = random_prompt(400)
    expected = model.generate(ids, do_sample=False, max_new_tokens=32)
    fixed = {**WINDOW, "draft_length": num_mtp_layers}  # every round drafts: rounds comparable across runs
    _, dynamic_stats = generate(
        model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=fixed
    )
    verified_on = []
    model.register_forward_pre_hook(
        lambda module, args: verified_on.append(module.config._attn_implementation)
    )
    forwards = []
    step, block = StaticDraftLayer._step, DraftLayer.update
    monkeypatch.setattr(
        StaticDraftLayer,
        "_step",
        lambda self, k, *a: forwards.append(("step", k.shape[-2])) or step(self, k, *a),
    )
    monkeypatch.setattr(  # a static layer's prefill and blocks longer than the slack go through DraftLayer's update
        DraftLayer,
        "update",
        lambda self, k, *a, **kw: forwards.append(("block", k.shape[-2])) or block(self, k, *a, **kw),
    )
    out, stats = generate(
        model, ids, use_mtp=True, cache_implementation="sink_window", cache_config={**fixed, "static": True}
    )
    assert torch.equal(out, expected) and model.config._attn_implementation == "sdpa"
    assert verified_on and "budgetdraft_varlen" not in verified_on
    assert stats.accepted_per_round == dynamic_stats.accepted_per_round
    assert stats.proposed_per_round == dynamic_stats.proposed_per_round
    blocks = [n for kind, n in forwards if kind == "block"]
    if num_mtp_layers == 1:  # its prefill feeds the sink (a block), skips, then feeds the window by steps
        assert blocks == [WINDOW["num_sink_tokens"]]
    else:  # the stock generator's prefill of the whole prompt
        assert blocks in ([ids.shape[1]] * num_mtp_layers, [ids.shape[1] - 1] * num_mtp_layers)
    assert sum(kind == "step" for kind, _ in forwards) >= stats.rounds - 2  # every later forward: in place


def test_static_windowed_mtp_needs_an_sdpa_family_head(tmp_root):
    model = load("glm4_moe", tmp_root)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="MTP head cannot: it runs attn_implementation='eager'"):
        model.generate(
            random_prompt(64),
            max_new_tokens=4,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config={**WINDOW, "static": True},
        )


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_window_covering_everything_reproduces_native_mtp(family, tmp_root):
    model = load(family, tmp_root)
    ids = random_prompt(300, seed=4)
    native, native_stats = generate(model, ids, use_mtp=True)
    windowed, windowed_stats = generate(
        model,
        ids,
        use_mtp=True,
        cache_implementation="sink_window",
        cache_config={"num_sink_tokens": 4, "window_length": 8192, "draft_length": 1},
    )
    assert torch.equal(native, windowed)
    assert windowed_stats.accepted_per_round == native_stats.accepted_per_round
    assert windowed_stats.proposed_per_round == native_stats.proposed_per_round


class PatternLength(DraftLength):
    """Drafts (1) or not (0) by a fixed pattern, repeated: which rounds skip the head is the test's choice."""

    name = "pattern"

    def __init__(self, pattern):
        self.pattern, self.calls = pattern, 0

    def next_length(self) -> int:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]


def _record_proposals(monkeypatch) -> dict:
    """{input length: proposed token} of every round the MTP head drafted (stock or adaptive generator)."""
    proposals, stock = {}, MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = stock(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            proposals[input_ids.shape[1]] = candidates[0, input_ids.shape[1]].item()
        return candidates, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    return proposals


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_adaptive_mtp_head_catches_up_on_the_rounds_it_skipped(family, tmp_root, monkeypatch):
    """Rounds that skip the head (the first ones too: its prefill is deferred) are fed to it later in one block:
    every proposal equals the one the head makes when it runs every round, and the output is the target's."""
    model = load(family, tmp_root)
    ids = random_prompt(300, seed=5)
    expected = model.generate(ids, do_sample=False, max_new_tokens=32)
    full = {"num_sink_tokens": 4, "window_length": 8192}  # a block and its steps read the same keys
    every_round = _record_proposals(monkeypatch)
    generate(
        model, ids, use_mtp=True, cache_implementation="sink_window", cache_config={**full, "draft_length": 1}
    )
    every_round = dict(every_round)
    pattern = _record_proposals(monkeypatch)
    monkeypatch.setattr(
        draft_length_factory, "AdaptiveDraftLength", lambda maximum: PatternLength([0, 0, 1, 0, 1, 1, 0])
    )
    out, stats = generate(model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=full)
    assert torch.equal(out, expected)
    assert stats.draft_length_policy == "pattern" and 0 < stats.ar_rounds < stats.rounds - 1
    shared = set(pattern) & set(every_round)
    assert len(shared) >= 3 and all(pattern[n] == every_round[n] for n in shared)


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_windowed_catch_up_feeds_the_head_only_the_sink_and_the_window(family, tmp_root, monkeypatch):
    """A catch-up longer than the window (the deferred prefill, many skipped rounds) feeds the head the sink and the
    last `window_length` positions and skips the rest: the head's cache then holds what the whole block would leave,
    so every later proposal equals the whole-block catch-up's; the output is the target's."""
    model = load(family, tmp_root)
    ids = random_prompt(400, seed=8)
    expected = model.generate(ids, do_sample=False, max_new_tokens=32)
    monkeypatch.setattr(
        draft_length_factory, "AdaptiveDraftLength", lambda maximum: PatternLength([0] * 6 + [1] * 4)
    )
    head_inputs, forward_layer = [], MtpModel.forward_layer
    monkeypatch.setattr(
        MtpModel,
        "forward_layer",
        lambda self, i, hidden, *a, **k: (
            head_inputs.append(hidden.shape[1]) or forward_layer(self, i, hidden, *a, **k)
        ),
    )
    runs = {}
    for skip in (True, False):
        monkeypatch.setattr(mtp_module.AdaptiveMtpCandidateGenerator, "skip_what_the_window_drops", skip)
        proposals = _record_proposals(monkeypatch)
        head_inputs.clear()
        out, stats = generate(
            model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=WINDOW
        )
        assert torch.equal(out, expected)
        runs[skip] = dict(proposals), max(head_inputs)
    (skipping, longest_skipping), (whole, longest_whole) = runs[True], runs[False]
    assert longest_whole >= ids.shape[1] - 1 and longest_skipping <= WINDOW["window_length"]
    # the first drafting round catches up the prompt and 6 AR steps (later ones, 6 steps: shorter than the window);
    # its own proposal is not compared: its last query reads sink + window, not the whole block
    later = [n for n in skipping if n != min(skipping)]
    assert set(skipping) == set(whole) and len(later) >= 3
    assert all(skipping[n] == whole[n] for n in later)


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_adaptive_windowed_mtp_is_lossless_and_says_which_policy_ran(family, tmp_root):
    model = load(family, tmp_root)
    ids = random_prompt(400, seed=6)
    expected = model.generate(ids, do_sample=False, max_new_tokens=32)
    out, stats = generate(model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=WINDOW)
    assert torch.equal(out, expected)
    assert stats.draft_length_policy == "adaptive" and max(stats.proposed_per_round) <= 1
    never, never_stats = generate(
        model,
        ids,
        use_mtp=True,
        cache_implementation="sink_window",
        cache_config={**WINDOW, "draft_length": 0},
    )
    assert torch.equal(never, expected) and max(never_stats.proposed_per_round) == 0


def test_windowed_mtp_verifies_on_the_fast_target_path(tmp_root):
    model = load("glm4_moe", tmp_root)
    ids = random_prompt(200, seed=7)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, k: seen.append(m.config._attn_implementation), with_kwargs=True
    )
    try:
        fast = model.generate(
            ids,
            max_new_tokens=8,
            use_mtp=True,
            cache_implementation="sink_window",
            return_dict_in_generate=True,
        )
        assert type(output_cache(fast)).__name__ == "GrowableCache" and set(seen) == {"budgetdraft_sdpa"}
        seen.clear()
        slow = model.generate(
            ids,
            max_new_tokens=8,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config={"fast_verify": False},
            return_dict_in_generate=True,
        )
        assert type(output_cache(slow)).__name__ == "DynamicCache" and set(seen) == {"sdpa"}
    finally:
        hook.remove()
    assert model.config._attn_implementation == "sdpa" and torch.equal(fast.sequences, slow.sequences)


def test_deeper_mtp_heads_keep_their_fixed_chain(tmp_root):
    model = load("glm4_moe", tmp_root, num_mtp_layers=2)
    ids = random_prompt(200, seed=8)
    _, stats = generate(model, ids, use_mtp=True, cache_implementation="sink_window", cache_config=WINDOW)
    assert stats.draft_length_policy is None and max(stats.proposed_per_round) == 2
    for length in (0, 1, "heuristic", True):
        with pytest.raises(ValueError, match="windowed MTP takes draft_length"):
            model.generate(
                ids,
                max_new_tokens=4,
                use_mtp=True,
                cache_implementation="sink_window",
                cache_config={"draft_length": length},
            )
    with pytest.raises(TypeError, match="fast_verify must be a bool"):
        model.generate(
            ids,
            max_new_tokens=4,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config={"fast_verify": "yes"},
        )


def test_mtp_cache_memory_is_independent_of_context(tmp_root):
    model = load("glm4_moe", tmp_root)
    sizes = []
    for context in (2048, 8192):
        cache = WindowedMtpCache(config=model.config.get_mtp_config(), num_sink_tokens=4, window_length=64)
        mtp = MtpModel.from_pretrained(model)
        ids = random_prompt(context)
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        with torch.no_grad():
            mtp(
                input_ids=ids[:, 1:],
                last_hidden_states=hidden[:, :-1],
                attention_mask=None,
                position_ids=torch.arange(context - 1)[None],
                mtp_cache=cache,
            )
        sizes.append(cache_nbytes(cache))
    assert sizes[0] == sizes[1] > 0


def test_bad_mtp_input(tmp_root):
    model = load("glm4_moe", tmp_root)
    ids = random_prompt(64)
    with pytest.raises(ValueError, match="window_length must be in"):
        model.generate(
            ids,
            max_new_tokens=4,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config={"window_length": 0},
        )
    with pytest.raises(ValueError, match="a budgeted MTP cache is not implemented"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, cache_implementation="budgeted")
    with pytest.raises(
        ValueError,
        match=r"cache_config keys \['budget'\] are not options of windowed MTP; accepted: .*'static'",
    ):
        model.generate(
            ids,
            max_new_tokens=4,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config={"budget": 8},
        )
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2
        )
    )
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        plain.generate(ids, max_new_tokens=4, use_mtp=True, cache_implementation="sink_window")


def test_a_prefilled_target_cache_is_refused_with_the_fix(tmp_root):
    """Windowed MTP builds the target's cache itself; a cache passed in is refused before it is written
    (`assistant_model=` drafters continue one: tests/generation/test_prefilled.py)."""
    model = load("glm4_moe", tmp_root)
    ids = random_prompt(60)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :40], **cache_kwargs(cache))
    with pytest.raises(ValueError, match="builds the target's cache itself"):
        generate(
            model,
            ids,
            use_mtp=True,
            cache_implementation="sink_window",
            cache_config=WINDOW,
            **cache_kwargs(cache),
        )
    assert cache.get_seq_length() == 40


def test_a_prompt_given_as_embeddings_keeps_the_targets_output(tmp_root):
    """`inputs_embeds`: the first verification drafts nothing (the head needs the target's hidden states first), so
    transformers' loop feeds it the prompt's embeddings whole, and the output is the target's own on them."""
    model = load("glm4_moe", tmp_root)
    ids = random_prompt(400)
    other = torch.cat([ids[:, :-30], random_prompt(30, seed=4)], dim=1)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(other)  # the last 30 positions read other tokens
    expected = model.generate(ids, inputs_embeds=embeds, do_sample=False, max_new_tokens=32)
    assert not torch.equal(expected, model.generate(ids, do_sample=False, max_new_tokens=32))
    out, stats = generate(
        model,
        ids,
        inputs_embeds=embeds,
        use_mtp=True,
        cache_implementation="sink_window",
        cache_config=WINDOW,
    )
    assert torch.equal(out, expected) and stats.rounds > 0
