"""`DraftSpec` / `DraftPlan`: the defaults resolved once and visible, every off switch honoured, and the one-liner
(`cache_implementation=` and nothing else) lossless on every test family with all its defaults on."""

import pytest
import torch
from resolved_plans import plan_for
from tiny_models import FAMILIES, model_pair, random_prompt, supports

from hf_budgetdraft import DraftSpec, record_speculation
from hf_budgetdraft.generation import compiled_step, draft_steps
from hf_budgetdraft.generation.plan import copied_reused_keys_problem, static_source_problem

NEW_TOKENS = 24
LLAMA_LAYOUT = {"llama", "mistral", "qwen2", "qwen3", "granite"}  # what the lean draft step can run


def test_spec_defaults_are_visible_and_round_trip():
    spec = DraftSpec()
    text = repr(spec)
    for part in ("cache='budgeted'", "budget=512", "policy='chunk'", "static='auto'", "compile='auto'"):
        assert part in text
    assert "draft_length='adaptive'" in text and "max_draft_length=16" in text and "window_length=256" in text
    assert DraftSpec(cache="sink_window").window_length == 1024
    custom = DraftSpec.from_cache_config("budgeted", {"budget": 64, "draft_length": 4, "static": False})
    assert custom.to_cache_config() == {"budget": 64, "static": False, "draft_length": 4}
    assert DraftSpec.from_cache_config("budgeted", custom.to_cache_config()) == custom
    assert custom.cache_kwargs(static=False) == {
        "budget": 64,
        "policy": "chunk",
        "window_length": 256,
        "slack": 32,
        "static": False,
    }


@pytest.mark.parametrize(
    "config,error,message",
    [
        ({"budgett": 3}, ValueError, r"cache_config keys \['budgett'\] are not options"),
        ({"num_sink_tokens": 3}, ValueError, "not options of cache_implementation='budgeted'"),
        ({"static": "yes"}, TypeError, "static must be True, False or 'auto'"),
        ({"compile": 1}, TypeError, "compile must be True, False or 'auto'"),
        ({"lean_step": "yes"}, TypeError, "lean_step must be True, False or 'auto'"),
        ({"draft_length": "fast"}, ValueError, "draft_length must be 'adaptive', 'heuristic' or an int"),
        ({"draft_length": 40}, ValueError, "exceeds the draft cache's rollback slack"),
        ({"max_draft_length": 40}, ValueError, r"max_draft_length=40 must be in \[1, slack=32\]"),
        ({"fast_verify": "no"}, TypeError, "fast_verify must be a bool"),
    ],
)
def test_spec_errors_teach(config, error, message):
    with pytest.raises(error, match=message):
        DraftSpec.from_cache_config("budgeted", config)


def test_plan_resolves_the_fast_path_by_default():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    plan = plan_for(target, drafter)
    assert plan.spec.static is True and plan.draft_attention == "budgetdraft_varlen"
    assert plan.target_attention == "budgetdraft_sdpa" and plan.target_linear is True
    assert plan.spec.lean_step is True and plan.lean_step_problem is None
    assert plan.spec.compile is False  # a fresh process has not paid for a compilation yet
    assert plan.spec.draft_length == "adaptive" and plan.draft_length_source == "default"
    assert "static=True" in repr(plan) and "draft_length='adaptive'" in repr(plan)


@pytest.mark.parametrize(
    "cache_config,check",
    [
        ({"static": False}, lambda p: p.spec.static is False and p.draft_attention is None),
        ({"fast_verify": False}, lambda p: p.target_attention is None and p.target_linear is False),
        ({"compile": False}, lambda p: p.spec.compile is False),
        ({"lean_step": False}, lambda p: p.spec.lean_step is False and p.spec.static is True),
        ({"static": False}, lambda p: p.spec.lean_step is False and p.lean_step_problem is not None),
        ({"draft_length": 5}, lambda p: p.spec.draft_length == 5 and p.draft_length_source == "cache_config"),
        ({"draft_length": "heuristic"}, lambda p: p.spec.draft_length == "heuristic"),
        ({"draft_length": 0}, lambda p: p.spec.draft_length == 0),
    ],
)
def test_each_off_switch_is_honoured(cache_config, check):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    assert check(plan_for(target, drafter, cache_config=cache_config))


def test_draft_length_settings_of_generate_and_of_the_drafter_take_effect():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    plan = plan_for(target, drafter, num_assistant_tokens=6)
    assert plan.spec.draft_length == 6 and plan.draft_length_source == "generate()"
    plan = plan_for(target, drafter, num_assistant_tokens=6, num_assistant_tokens_schedule="heuristic")
    assert plan.spec.draft_length == "heuristic" and plan.heuristic_start == 6
    plan = plan_for(target, drafter, assistant_confidence_threshold=0.3)
    assert plan.confidence_threshold == pytest.approx(0.3)
    drafter.generation_config.num_assistant_tokens = 3
    plan = plan_for(target, drafter)
    assert plan.spec.draft_length == 3 and plan.draft_length_source == "drafter.generation_config"
    plan = plan_for(target, drafter, cache_config={"draft_length": "adaptive"})
    assert plan.spec.draft_length == "adaptive"  # cache_config wins over both
    with pytest.raises(ValueError, match="num_assistant_tokens=40 exceeds the draft cache's rollback slack"):
        plan_for(target, drafter, num_assistant_tokens=40)


def test_generate_num_assistant_tokens_changes_the_rounds():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(120)
    for gamma in (1, 5):
        with record_speculation() as stats:
            target.generate(
                ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, cache_implementation="budgeted",
                cache_config={"budget": 32}, num_assistant_tokens=gamma, do_sample=False,
            )  # fmt: skip
        assert max(stats.proposed_per_round) == gamma and stats.draft_length_policy == "fixed"


def test_where_the_slot_mask_can_travel_the_cache_is_static():
    """GPT-NeoX passes no kwargs to `cache.update` but hands its keys to the attention function as they are: the
    slot mask travels with them."""
    target, drafter = model_pair("gpt_neox", "sdpa", num_assistant_tokens=None)
    assert plan_for(target, drafter).spec.static is True
    target, drafter = model_pair("llama", "eager", num_assistant_tokens=None)
    assert plan_for(target, drafter).spec.static is False  # eager drafters keep their attention
    assert plan_for(target, drafter).target_attention is None  # and so do eager targets


_PASSES_ITS_KWARGS = """
def forward(self, hidden_states, cache=None, **kwargs):
    key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    key_states = key_states.repeat(1, 2, 1, 1)  # the slot mask travels in the kwargs: fine
    return attention_interface(self, query_states, key_states, value_states, mask, **kwargs)
"""
_KEYS_AS_RETURNED = """
def forward(self, hidden_states, layer_past=None, **kwargs):
    if layer_past is not None:
        key_states, value_states = layer_past.update(key_states, value_states, self.layer_idx)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    return attention_interface(self, query_states, key_states, value_states, mask, scaling=self.scaling)
"""
_KEYS_EXPANDED = """
def forward(self, hidden_states, cache=None, **kwargs):
    kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)
    key_states, value_states = self.expand_kv(kv_nope, k_rot)
    return attention_interface(self, query_states, key_states, value_states, mask)
"""
_KEYS_REBOUND = _KEYS_AS_RETURNED.replace(
    "    attention_interface =", "    key_states = key_states[:, :, :9]\n    attention_interface ="
)
_OWN_ATTENTION = """
def forward(self, hidden_states, layer_past=None):
    key_states, value_states = layer_past.update(key_states, value_states, self.layer_idx)
    return torch.matmul(query_states, key_states.transpose(-1, -2)).softmax(-1) @ value_states
"""


@pytest.mark.parametrize(
    "source,static",
    [
        (_PASSES_ITS_KWARGS, True),
        (_KEYS_AS_RETURNED, True),
        (_KEYS_EXPANDED, False),
        (_KEYS_REBOUND, False),
        (_OWN_ATTENTION, False),
    ],
    ids=["passes_its_kwargs", "keys_as_returned", "keys_expanded", "keys_rebound", "own_attention"],
)
def test_the_slot_mask_must_reach_the_attention_function(source, static):
    """A static step's slot mask reaches `budgetdraft_varlen` in the kwargs a layer passes to `cache.update`, or else
    with the key buffer the step returned, which must then be what the attention function receives (DeepSeek-V3
    before transformers 5.24 caches latents and expands them into new keys: the buffer, and the mask, never arrive)."""
    problem = static_source_problem("TinyAttention", source)
    assert (problem is None) is static
    if not static:
        assert "neither passes its kwargs to cache.update nor hands the keys" in problem


_REUSES_KEYS = """
def forward(self, hidden_states, shared_kv_states, past_key_values=None, **kwargs):
    if self.is_kv_shared_layer:
        key_states, value_states = shared_kv_states[self.layer_type]
    else:
        key_states = self.k_proj(hidden_states)
    if past_key_values is not None and not self.is_kv_shared_layer:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    return attention_interface(self, query_states, key_states, value_states, mask, **kwargs)
"""
_COPIES_REUSED_KEYS = _REUSES_KEYS.replace(
    "self.layer_type]\n", "self.layer_type]\n        key_states = key_states.to(query_states.device)\n"
)


def test_a_layer_that_copies_the_keys_it_reuses_keeps_its_step_eager():
    """A layer reusing an earlier layer's keys finds their slot mask through the buffer it is handed. transformers
    5.22's Gemma 3n / Gemma 4 copy them with `.to(device)` first: the buffer itself when run eagerly, a new tensor
    in a traced step, so such a step is not compiled; a layer handing them over as they are compiles."""
    assert _COPIES_REUSED_KEYS != _REUSES_KEYS
    assert copied_reused_keys_problem("TinyAttention", _REUSES_KEYS) is None
    problem = copied_reused_keys_problem("TinyAttention", _COPIES_REUSED_KEYS)
    assert problem.startswith(
        "TinyAttention hands the attention function a .to(...) copy of the keys it reuses"
    )


@pytest.mark.parametrize("name", ["budgeted", "sink_window"])
def test_a_flex_attention_drafter_drafts_on_fixed_slots(name):
    """flex_attention is its model's sdpa attention: the drafter reads fixed slots through budgetdraft_varlen for the
    call (a flex mask over a sparse cache's offset keys fails to compile on CPU; its model is not written to). A
    model without sdpa (a flex score_mod, e.g. soft-capping) keeps flex on a dynamic cache."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    drafter.set_attn_implementation("flex_attention")
    plan = plan_for(target, drafter)
    assert plan.spec.static is True and "flex_attention" in plan.reasons["static"]
    ids = random_prompt(200)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            cache_implementation=name,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
    assert torch.equal(out, expected) and stats.rounds > 0
    assert drafter.config._attn_implementation == "flex_attention"
    drafter._supports_sdpa = False
    assert plan_for(target, drafter).spec.static is False


@pytest.mark.parametrize("lean", [False, True])
def test_compile_is_rented_before_it_is_bought(monkeypatch, lean):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    monkeypatch.setattr(compiled_step, "COMPILE_SECONDS_ESTIMATE", 1.0)
    options = {"lean_step": lean}
    assert plan_for(target, drafter, cache_config=options).spec.compile is False
    saving = compiled_step.COMPILED_STEP_SAVING[
        "lean" if lean else "eager"
    ]  # a lean step leaves less to save
    compiled_step.record_eager_steps(drafter, 0.9 / saving)  # saves 0.9 s of a 1 s compilation: not yet
    assert plan_for(target, drafter, cache_config=options).spec.compile is False
    compiled_step.record_eager_steps(drafter, 0.2 / saving)
    assert plan_for(target, drafter, cache_config=options).spec.compile is True
    assert plan_for(target, drafter, cache_config={"compile": False}).spec.compile is False
    assert plan_for(target, drafter, disable_compile=True).spec.compile is False


def test_a_failed_compilation_falls_back_to_the_eager_step(monkeypatch, caplog):
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None)
    ids = random_prompt(120)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)

    def unavailable(model, compile_config):
        def step(model, **kwargs):
            raise RuntimeError("no C++ compiler")

        return step, set()

    monkeypatch.setattr(draft_steps, "compiled_call", unavailable)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS,
            cache_implementation="budgeted", cache_config={"budget": 32, "compile": True},
        )  # fmt: skip
    assert torch.equal(out, expected)
    assert stats.plan.spec.compile is True and not stats.candidate_generator.steps.compiled


@pytest.mark.parametrize("name,cache_config", [("sink_window", {}), ("budgeted", {})])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_liner_with_every_default_is_lossless(family, name, cache_config):
    """`generate(ids, assistant_model=drafter, cache_implementation=name)` and nothing else: static where allowed,
    fast verification, adaptive draft length; the drafter's and target's attention restored after the call."""
    attention = "sdpa" if supports(family, "sdpa") else "eager"
    target, drafter = model_pair(family, attention, num_assistant_tokens=None)
    ids = random_prompt(2200 if name == "sink_window" else 700)  # longer than the window / budget + window
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, cache_implementation=name
        )
    assert torch.equal(out, expected), f"first diff at {(out != expected).nonzero()[:1].tolist()}"
    assert stats.draft_length_policy == "adaptive"
    assert stats.plan.spec.static is (attention == "sdpa")
    assert stats.plan.spec.lean_step is (stats.plan.spec.static and family in LLAMA_LAYOUT)
    assert sum(stats.proposed_per_round) > 0
    assert (target.config._attn_implementation, drafter.config._attn_implementation) == (attention, attention)
    assert not any("forward" in m.__dict__ for m in target.modules())  # the few-row linear layers are gone
