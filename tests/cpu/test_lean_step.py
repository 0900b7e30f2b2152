"""The lean draft step: the drafter's own logits and cache writes from its weights, checked in every call."""

import logging

import pytest
import torch
from resolved_plans import plan_for
from tiny_models import COMMON, FAMILIES, model_pair, random_prompt, supports
from transformers import AutoConfig, AutoModelForCausalLM

from hf_budgetdraft import DraftSpec, record_speculation
from hf_budgetdraft.cpu.lean_step import LeanDraftStep, lean_step_problem
from hf_budgetdraft.generation import draft_steps

LLAMA_LAYOUT = ["llama", "mistral", "qwen2", "qwen3", "granite"]
SMALL = {
    "budgeted": {"budget": 16, "window_length": 24, "slack": 8},
    "sink_window": {"num_sink_tokens": 4, "window_length": 24, "slack": 8},
}


def static_drafter(family: str):
    _, drafter = model_pair(family, "budgetdraft_varlen", num_assistant_tokens=None)
    return drafter


@pytest.mark.parametrize("cache_name", list(SMALL))
@pytest.mark.parametrize("family", LLAMA_LAYOUT)
def test_lean_step_gives_the_drafters_logits_and_cache(family, cache_name):
    """Blocks of 2, 1, 1 and 3 tokens after a prefill longer than the window, a rollback, then more steps: the
    lean step's logits and slot buffers equal the drafter's own forward's on a twin cache."""
    drafter = static_drafter(family)
    spec = DraftSpec.from_cache_config(cache_name, SMALL[cache_name])
    own, lean_cache = (spec.build_cache(drafter.config, static=True) for _ in range(2))
    prompt = random_prompt(60)
    with torch.no_grad():
        for cache in (own, lean_cache):
            drafter(prompt, cache=cache, use_cache=True)
    lean, tokens, position = LeanDraftStep(drafter), random_prompt(12, seed=1), 60
    for size in (2, 1, 1, 3, -3, 3, 1):
        if size < 0:
            own.crop(size)
            lean_cache.crop(size)
            position += size
            continue
        block = tokens[:, :size]
        positions = torch.arange(position, position + size)[None]
        with torch.no_grad():
            expected = drafter(block, position_ids=positions, cache=own, use_cache=True).logits[:, -1]
        torch.testing.assert_close(lean(block, positions, lean_cache), expected, rtol=1e-5, atol=1e-5)
        position += size
    for mine, theirs in zip(lean_cache.layers, own.layers, strict=True):
        assert torch.equal(mine.length, theirs.length)
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


@pytest.mark.parametrize("family", ["gpt_neox", "phi3", "olmo2", "gemma2", "starcoder2"])
def test_families_of_another_layout_are_named_with_the_reason(family):
    _, drafter = model_pair(family, "eager", num_assistant_tokens=None)
    problem = lean_step_problem(drafter)
    assert problem is not None and type(drafter).__name__ in problem
    with pytest.raises(ValueError, match="lean_step': False"):
        LeanDraftStep(drafter)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_gated_attention_drafts_with_its_own_forward(family):
    """Qwen3.5 and Qwen3-Next name their attention parts as Llama does, but their query projection also holds a gate
    that scales the output: a drafter of full-attention layers only is not run lean (it failed on a shape in the
    lean step before the first-step check could compare), and drafts losslessly."""
    sizes = dict(COMMON, num_hidden_layers=1, head_dim=16, layer_types=["full_attention"])
    if family == "qwen3_next":
        sizes.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        )
    config = AutoConfig.for_model(family, **sizes)
    torch.manual_seed(0)
    drafter = AutoModelForCausalLM.from_config(config).eval()
    assert "gated attention" in lean_step_problem(drafter)
    target, _ = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(120)
    call = dict(do_sample=False, max_new_tokens=12)
    out = target.generate(ids, assistant_model=drafter, cache_implementation="budgeted", **call)
    assert torch.equal(out, target.generate(ids, **call))


def test_a_drafter_with_layers_without_rope_is_not_run_lean(caplog):
    """SmolLM3 leaves rotary embeddings out of every fourth layer (NoPE): the lean step, which rotates every layer's
    queries and keys, is not tried (before, its first-step check caught the difference and warned at every call)."""
    sizes = dict(COMMON, num_hidden_layers=4, head_dim=16)
    torch.manual_seed(0)
    drafter = AutoModelForCausalLM.from_config(AutoConfig.for_model("smollm3", **sizes)).eval()
    assert "without rotary embeddings" in lean_step_problem(drafter)
    target, _ = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(120)
    call = dict(do_sample=False, max_new_tokens=12)
    with caplog.at_level(logging.WARNING), record_speculation() as stats:
        out = target.generate(ids, assistant_model=drafter, cache_implementation="budgeted", **call)
    assert torch.equal(out, target.generate(ids, **call)) and stats.plan.spec.lean_step is False
    assert "lean draft step" not in caplog.text


def test_an_unmerged_adapter_is_not_run_lean():
    peft = pytest.importorskip("peft")
    drafter = static_drafter("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    wrapped = peft.get_peft_model(drafter, config).base_model.model  # the Llama with LoRA layers inside
    assert "plain nn.Linear" in lean_step_problem(wrapped)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_one_liner_drafts_lean_and_stays_lossless(family):
    target, drafter = model_pair(family, "sdpa", num_assistant_tokens=None)
    ids = random_prompt(700)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=24, cache_implementation="budgeted"
        )
    assert torch.equal(out, expected)
    generator = stats.candidate_generator
    lean = generator.steps.block
    assert stats.plan.spec.lean_step is True and lean.checked and not lean.failed
    assert sum(stats.accepted_per_round) > 0


def test_a_drafter_that_computes_something_else_drafts_with_its_own_forward(caplog, monkeypatch):
    """Granite has Llama's module names but scales its logits: the first-step check catches it, warns once and
    the call drafts with the drafter's own forward (the output is the target's either way)."""
    monkeypatch.setattr(draft_steps.logger, "warning_once", draft_steps.logger.warning)
    target, drafter = model_pair("granite", "sdpa", num_assistant_tokens=None)
    drafter.config.logits_scaling = 4.0
    assert lean_step_problem(drafter) is None
    ids = random_prompt(700)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    caplog.set_level(logging.WARNING)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=24, cache_implementation="budgeted"
        )
    assert torch.equal(out, expected)
    assert stats.plan.spec.lean_step is True and stats.candidate_generator.steps.block.failed
    assert "lean draft step and GraniteForCausalLM's own forward disagree" in caplog.text


def test_explicit_lean_step_is_refused_where_it_cannot_run():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    with pytest.raises(ValueError, match="lean_step=True, but the draft cache is not static"):
        plan_for(target, drafter, cache_config={"lean_step": True, "static": False})
    target, drafter = model_pair("gpt_neox", "sdpa", num_assistant_tokens=None)
    with pytest.raises(
        ValueError, match="lean_step=True, but GPTNeoXForCausalLM has no plain embedding table"
    ):
        plan_for(target, drafter, cache_config={"lean_step": True})
    target, drafter = model_pair("phi3", "sdpa", num_assistant_tokens=None)
    assert plan_for(target, drafter).spec.lean_step is False
    with pytest.raises(ValueError, match="lean_step=True, but Phi3ForCausalLM has"):
        plan_for(target, drafter, cache_config={"lean_step": True})


def test_tiny_families_cover_every_layout_case():
    assert set(LLAMA_LAYOUT) <= set(FAMILIES) and supports("llama", "sdpa")
