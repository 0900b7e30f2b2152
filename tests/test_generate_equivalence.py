"""Greedy output with a sparse draft cache must be token-identical to the target's own greedy output.

Matrix: 10 decoder families x {eager, sdpa} x {sink_window, budgeted(chunk|streaming|snapkv|dynamic)}; prompts are
several times longer than the window/budget, so the draft's eviction really happens."""

import pytest
import torch
from tiny_models import FAMILIES, model_pair, random_prompt, supports
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from hf_budgetdraft import record_speculation
from hf_budgetdraft.generation.candidate_generator import SparseDraftCandidateGenerator

PROMPT_LENGTH, NEW_TOKENS = 240, 48
CACHES = {
    "sink_window": ("sink_window", {"num_sink_tokens": 4, "window_length": 32, "slack": 8}),
    "budgeted-chunk": ("budgeted", {"budget": 48, "policy": "chunk", "window_length": 16}),
    "budgeted-streaming": ("budgeted", {"budget": 48, "policy": "streaming"}),
    "budgeted-snapkv": ("budgeted", {"budget": 48, "policy": "snapkv", "policy_kwargs": {"window_size": 8}}),
    "budgeted-dynamic": ("budgeted", {"budget": 48, "policy": "dynamic", "policy_kwargs": {"components": 4}}),
}
GAMMA = 3


def speculate(target, drafter, ids, cache_name, **kwargs):
    implementation, cache_config = CACHES.get(cache_name, (cache_name, {}))
    cache_config = kwargs.pop("cache_config", cache_config)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            cache_implementation=implementation,
            cache_config=cache_config,
            **kwargs,
        )
    return out, stats


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_identical_to_target(family, attn_implementation, cache_name):
    if not supports(family, attn_implementation):
        pytest.skip(f"{family} has no {attn_implementation} attention in transformers")
    target, drafter = model_pair(family, attn_implementation, num_assistant_tokens=GAMMA)
    ids = random_prompt(PROMPT_LENGTH)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    out, stats = speculate(target, drafter, ids, cache_name)
    assert torch.equal(out, expected), f"first diff at {(out != expected).nonzero()[:1].tolist()}"
    # the check can fail: the sparse draft both agreed and disagreed with the target
    assert sum(stats.accepted_per_round) > 0
    assert sum(stats.proposed_per_round) > sum(stats.accepted_per_round)
    assert stats.rounds < NEW_TOKENS


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("family", ["llama", "phi3", "starcoder2"])
def test_rounds_with_full_partial_and_zero_acceptance(family, cache_name):
    target, drafter = model_pair(family, "sdpa", num_assistant_tokens=GAMMA)
    ids = random_prompt(PROMPT_LENGTH)
    out, stats = speculate(target, drafter, ids, cache_name)
    accepted = stats.accepted_per_round
    assert any(a == GAMMA for a in accepted), accepted
    assert any(0 < a < GAMMA for a in accepted), accepted
    assert any(a == 0 for a in accepted), accepted
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_smaller_drafter_from_first_layers():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=GAMMA, draft_layers=1)
    ids = random_prompt(PROMPT_LENGTH, seed=1)
    out, _ = speculate(target, drafter, ids, "budgeted-chunk")
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))


def test_heuristic_schedule_is_capped_by_slack():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=2)
    drafter.generation_config.num_assistant_tokens_schedule = "heuristic"
    ids = random_prompt(PROMPT_LENGTH, seed=2)
    out, stats = speculate(target, drafter, ids, "sink_window")  # slack 8
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS))
    assert max(stats.proposed_per_round) <= 8
    assert len(set(stats.proposed_per_round)) > 1  # the schedule did move


def test_window_covering_the_whole_context_equals_native_assisted():
    target, drafter = model_pair("qwen2", "sdpa", num_assistant_tokens=GAMMA)
    ids = random_prompt(PROMPT_LENGTH, seed=3)
    with record_speculation() as native:
        expected = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS)
    out, windowed = speculate(
        target, drafter, ids, "sink_window", cache_config={"num_sink_tokens": 4, "window_length": 4096}
    )
    assert torch.equal(out, expected)
    assert windowed.accepted_per_round == native.accepted_per_round


@pytest.mark.parametrize("setting", ["plain", "confidence_threshold", "eos", "min_new_tokens", "min_length"])
def test_greedy_draft_loop_proposes_what_nested_generate_proposes(monkeypatch, setting):
    """The sparse-draft generator drafts greedily with a plain forward loop; it must propose, round for round, what
    transformers' nested `assistant_model.generate()` proposes (stopping rules and logits processors included)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=GAMMA)
    drafter.generation_config.assistant_confidence_threshold = (
        0.4 if setting == "confidence_threshold" else 0.0
    )
    ids = random_prompt(PROMPT_LENGTH, seed=4)
    kwargs = {
        "min_new_tokens": {"min_new_tokens": NEW_TOKENS},
        "min_length": {"min_length": PROMPT_LENGTH + NEW_TOKENS},  # the draft suppresses EOS itself
    }.get(setting, {})
    if setting in (
        "eos",
        "min_new_tokens",
        "min_length",
    ):  # the token the target emits most often ends the text
        plain = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT_LENGTH:]
        kwargs["eos_token_id"] = int(plain.mode().values)
    runs = {}
    for name in ("loop", "nested generate"):
        if name == "nested generate":

            def nested(self, args):
                self.seen_tokens = None  # the nested generate() feeds the draft cache itself
                return AssistedCandidateGenerator._generate_candidates(self, args)

            monkeypatch.setattr(SparseDraftCandidateGenerator, "_draft", nested)
        out, stats = speculate(target, drafter, ids, "budgeted-chunk", **kwargs)
        runs[name] = (out, stats.proposed_per_round, stats.accepted_per_round)
    (out, proposed, accepted), (reference, *reference_rounds) = runs["loop"], runs["nested generate"]
    if setting == "eos":
        # the loop drafts past an EOS (no device read a step to stop there): only the last round proposes more,
        # and transformers' loop cuts what it accepts at the EOS
        reference_proposed, reference_accepted = reference_rounds
        assert proposed[:-1] == reference_proposed[:-1] and proposed[-1] >= reference_proposed[-1]
        assert accepted == reference_accepted
        proposed = reference_proposed
    assert torch.equal(out, reference) and [proposed, accepted] == reference_rounds
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs))
    if setting == "confidence_threshold":
        assert min(proposed) < GAMMA  # the threshold did stop some rounds early
    if setting == "eos":
        assert out.shape[1] < PROMPT_LENGTH + NEW_TOKENS  # the text did end at EOS


def _processor_calls(free: list[int], prompt: int) -> dict:
    """generate() kwargs that each add one of transformers' logits processors to a greedy call, built from the
    target's free continuation `free` so each one changes what it emits."""
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[free[4]], [free[8], free[9]]]),
        "sequence_bias": dict(sequence_bias={(free[6],): -20.0}),
        "suppress_tokens": dict(suppress_tokens=[free[3], free[7]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[free[0]]),
        "forced_eos_token_id": dict(forced_eos_token_id=free[2], max_new_tokens=12),
        "min_length": dict(min_length=prompt + 20, eos_token_id=free[5]),
        "min_new_tokens": dict(min_new_tokens=20, eos_token_id=free[5]),
        # a stray EOS id past the vocabulary (a config's): transformers' processor ignores it, so must the draft
        "eos_past_the_vocabulary": dict(min_new_tokens=20, eos_token_id=[free[5], 10**6]),
        "exponential_decay_length_penalty": dict(
            exponential_decay_length_penalty=(4, 1.5), eos_token_id=free[9]
        ),
        "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.2),
        "watermarking_config": dict(watermarking_config={"bias": 2.5, "seeding_scheme": "lefthash"}),
    }


@pytest.mark.parametrize("rows", [1, 2], ids=["one", "batch"])
def test_every_logits_processor_keeps_the_targets_output(rows):
    """Processors that read the ids run position by position (transformers' loop, or the batched loop), those that
    read only scores or lengths blockwise: each call equals the target's own with the same processor."""
    target, drafter = model_pair("llama", num_assistant_tokens=GAMMA)
    ids = random_prompt(PROMPT_LENGTH, seed=9).repeat(rows, 1)
    free = target.generate(ids[:1], do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT_LENGTH:].tolist()
    for name, call in _processor_calls(free, PROMPT_LENGTH).items():
        call = {"do_sample": False, "max_new_tokens": NEW_TOKENS, **call}
        expected = target.generate(ids, **call)
        out = target.generate(ids, assistant_model=drafter, cache_implementation="budgeted", **call)
        assert torch.equal(out, expected), name


@pytest.mark.parametrize("cache_name", ["sink_window", "budgeted-chunk"])
def test_classifier_free_guidance_is_refused(cache_name):
    """Its unconditional cache advances a token a step and is never rolled back: refused, not silently wrong."""
    target, drafter = model_pair("llama", num_assistant_tokens=GAMMA)
    with pytest.raises(ValueError, match="classifier-free guidance"):
        speculate(target, drafter, random_prompt(PROMPT_LENGTH), cache_name, guidance_scale=1.5)
