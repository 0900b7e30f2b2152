"""Windowed DFlash: transformers' DFlash block drafter on a sink + window ring (`speculation_type="dflash"`,
`cache_implementation="sink_window"`). Greedy output equals plain greedy decoding with prompts far longer than the
window; a window covering the whole context reproduces native DFlash's proposals exactly, a short one changes
them (the window is really applied); draft memory is constant in context; bad input fails clearly."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

import hf_budgetdraft  # noqa: F401  (registers the sparse cache implementations)
from hf_budgetdraft import cache_nbytes, record_speculation
from hf_budgetdraft.cache import WindowedDFlashCache

VOCAB, HIDDEN, BLOCK = 96, 64, 4
WINDOWED = {
    "cache_implementation": "sink_window",
    "cache_config": {"num_sink_tokens": 4, "window_length": 24},
}


def pair(layer_types=("full_attention", "full_attention"), seed=0):
    torch.manual_seed(seed)
    target = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    drafter = MuseGlimmerAssistantModel(
        MuseGlimmerAssistantConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            block_size=BLOCK,
            mask_token_id=VOCAB - 1,
            target_layer_ids=[0, 2],
            layer_types=list(layer_types),
            sliding_window=16,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    ).eval()
    return target, drafter


def prompt(length, seed=1):
    return torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def dflash(target, drafter, ids, new_tokens=24, **kwargs):
    return target.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        assistant_model=drafter,
        speculation_type="dflash",
        **kwargs,
    )


def proposals(monkeypatch, run):
    """The draft tokens and logits DFlash proposes each round during `run()`."""
    seen = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, *args, **kwargs):
        ids, logits = original(self, *args, **kwargs)
        if logits is not None:
            seen.append((ids[0, -logits.shape[1] :].clone(), logits.clone()))
        return ids, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", spy)
    output = run()
    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", original)
    return output, seen


@pytest.mark.parametrize("layer_types", [("full_attention",) * 2, ("full_attention", "sliding_attention")])
def test_windowed_dflash_greedy_equals_plain_greedy(layer_types):
    target, drafter = pair(layer_types)
    ids = prompt(120)  # 5x the window
    reference = target.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with record_speculation() as stats:
        windowed = dflash(target, drafter, ids, **WINDOWED)
    assert torch.equal(windowed, reference)
    assert stats.rounds > 1 and isinstance(stats.draft_cache, WindowedDFlashCache)


def test_a_prompt_given_as_embeddings_keeps_the_targets_output():
    """`inputs_embeds`: DFlash drafts nothing before the target's first forward, so transformers' loop feeds the
    prompt's embeddings whole, and the output is the target's own on them."""
    target, drafter = pair()
    ids = prompt(120)
    other = torch.cat([ids[:, :-30], prompt(30, seed=5)], dim=1)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(other)  # the last 30 positions read other tokens
    reference = target.generate(
        ids, inputs_embeds=embeds, max_new_tokens=24, min_new_tokens=24, do_sample=False
    )
    assert not torch.equal(
        reference, target.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    )
    assert torch.equal(dflash(target, drafter, ids, inputs_embeds=embeds, **WINDOWED), reference)


def test_window_covering_the_context_reproduces_native_dflash(monkeypatch):
    target, drafter = pair()
    ids = prompt(120)
    native, native_rounds = proposals(monkeypatch, lambda: dflash(target, drafter, ids))
    whole = {
        "cache_implementation": "sink_window",
        "cache_config": {"num_sink_tokens": 4, "window_length": 512},
    }
    covered, covered_rounds = proposals(monkeypatch, lambda: dflash(target, drafter, ids, **whole))
    short, short_rounds = proposals(monkeypatch, lambda: dflash(target, drafter, ids, **WINDOWED))
    assert torch.equal(native, covered) and torch.equal(native, short)
    assert len(native_rounds) == len(covered_rounds) > 2
    for (native_ids, native_logits), (ids_, logits) in zip(native_rounds, covered_rounds, strict=True):
        assert torch.equal(native_ids, ids_)
        torch.testing.assert_close(logits, native_logits, atol=1e-5, rtol=1e-5)
    # the first round's forward holds the whole prompt as new keys (never windowed); from the second round on, a
    # window shorter than the prompt reads fewer keys: the proposals' logits move
    assert torch.allclose(short_rounds[0][1], native_rounds[0][1], atol=1e-5)
    assert not torch.allclose(short_rounds[1][1], native_rounds[1][1], atol=1e-3)


def test_draft_memory_is_constant_in_context():
    target, drafter = pair()
    sizes = []
    for length in (80, 240):
        with record_speculation() as stats:
            dflash(target, drafter, prompt(length), new_tokens=8, **WINDOWED)
        sizes.append(cache_nbytes(stats.draft_cache))
    assert sizes[0] == sizes[1] > 0


def test_bad_windowed_dflash_input_fails_clearly():
    target, drafter = pair()
    ids = prompt(40)
    with pytest.raises(ValueError, match="supports cache_implementation='sink_window'"):
        dflash(target, drafter, ids, cache_implementation="budgeted", cache_config={"budget": 16})
    with pytest.raises(ValueError, match="not options of windowed DFlash"):
        dflash(target, drafter, ids, cache_implementation="sink_window", cache_config={"budget": 16})
    with pytest.raises(ValueError, match="smaller than the drafter's block_size"):
        dflash(target, drafter, ids, cache_implementation="sink_window", cache_config={"slack": BLOCK - 1})
    with pytest.raises(ValueError, match="window_length must be in"):
        dflash(target, drafter, ids, cache_implementation="sink_window", cache_config={"window_length": 0})


def test_all_sliding_dflash_drafter_runs_on_its_own_sliding_layers():
    """Nothing to sparsify: the drafter drafts exactly as native DFlash, whatever window is asked for."""
    target, sliding_only = pair(("sliding_attention", "sliding_attention"))
    ids = prompt(40)
    with record_speculation() as native:
        expected = dflash(target, sliding_only, ids)
    with record_speculation() as windowed:
        out = dflash(target, sliding_only, ids, **WINDOWED)
    assert torch.equal(out, expected)
    assert windowed.accepted_per_round == native.accepted_per_round
