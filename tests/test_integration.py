"""The `generate()` integration: bad calls fail loudly with a message that says what to change, the hook changes
nothing else, `record_speculation()` reports what ran."""

import accelerate
import pytest
import torch
from tiny_models import model_pair, random_prompt
from transformers.generation.utils import GenerationMixin

import hf_budgetdraft
from hf_budgetdraft import (
    BudgetedCache,
    integration,
    query_capture,
    record_speculation,
)


def _generate(target, drafter, **kwargs):
    defaults = dict(
        assistant_model=drafter, do_sample=False, max_new_tokens=8, cache_implementation="sink_window"
    )
    return target.generate(random_prompt(64), **{**defaults, **kwargs})


def test_draft_length_beyond_slack():
    target, drafter = model_pair("llama", num_assistant_tokens=20)
    with pytest.raises(ValueError, match="num_assistant_tokens=20 exceeds the draft cache's rollback slack"):
        _generate(target, drafter, cache_config={"slack": 8})


def test_unknown_cache_config_key():
    target, drafter = model_pair("llama")
    with pytest.raises(ValueError, match=r"cache_config keys \['windw'\]"):
        _generate(target, drafter, cache_config={"windw": 8})


def test_vocab_mismatch():
    target, _ = model_pair("llama")
    _, other = model_pair("qwen2")
    other.resize_token_embeddings(130)
    # transformers refuses a vocabulary mismatch itself before our generator is built; ours names the sizes
    with pytest.raises(ValueError, match="different tokenizers"):
        _generate(target, other)
    with pytest.raises(ValueError, match="drafter vocab_size=130 differs from the target's vocab_size=128"):
        integration._check_assistant(target, other, target.generation_config, None)


@pytest.mark.parametrize("name", ["sink_window", "budgeted"])
def test_prompts_a_call_cannot_start_from(name):
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    call = dict(assistant_model=drafter, max_new_tokens=4, cache_implementation=name)
    with pytest.raises(ValueError, match=r"the prompt is empty \(input_ids of shape \(1, 0\)\)"):
        target.generate(random_prompt(8)[:, :0], **call)
    limit, rope = target.config.max_position_embeddings, target.config.rope_parameters
    beyond = random_prompt(limit + 1)
    target.config.rope_parameters = None  # as a target with a learned position table reads
    with pytest.raises(
        ValueError, match=f"{limit + 1} tokens, more than the target's max_position_embeddings"
    ):
        target.generate(beyond, **call)
    target.config.rope_parameters = rope  # RoPE runs past the limit: lossless, with a warning
    assert torch.equal(
        target.generate(beyond, **call, do_sample=False), target.generate(beyond, max_new_tokens=4)
    )


def test_target_and_drafter_on_different_devices_are_refused():
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    with pytest.raises(ValueError, match="the target is on cpu and the drafter on meta"):
        _generate(target, drafter.to("meta"), cache_implementation="budgeted")


def test_a_target_offloaded_in_part_by_accelerate_drafts_losslessly(tmp_path):
    """Layers offloaded to disk by a device_map (weights on the meta device, brought in by accelerate's hooks)."""
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    ids = random_prompt(200)
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    layers = len(target.model.layers)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    device_map |= {f"model.layers.{i}": "cpu" if i < layers // 2 else "disk" for i in range(layers)}
    target = accelerate.dispatch_model(target, device_map=device_map, offload_dir=str(tmp_path))
    assert any(p.device.type == "meta" for p in target.parameters())
    out = target.generate(
        ids, assistant_model=drafter, do_sample=False, max_new_tokens=12, cache_implementation="budgeted"
    )
    assert torch.equal(out, expected)


def test_a_target_offloaded_whole_is_refused_with_what_to_keep():
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    accelerate.cpu_offload(target, execution_device="cpu")
    with pytest.raises(ValueError, match="keep the embeddings on the device it computes on"):
        _generate(target, drafter, cache_implementation="budgeted")


def test_a_drafter_of_another_dtype_drafts_losslessly():
    target, drafter = model_pair("llama", num_assistant_tokens=None)
    target = target.to(torch.bfloat16)  # the drafter stays float32
    ids = random_prompt(200)
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    out = target.generate(
        ids, assistant_model=drafter, do_sample=False, max_new_tokens=12, cache_implementation="budgeted"
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ["sink_window", "budgeted"])
def test_lossy_mode_takes_padded_batches(name):
    """Without a draft, a left-padded batch on a sparse cache: each row equals that row generated alone on the same
    sparse cache (its sink / selection is of its own tokens); beam search stays a clear error."""
    target, _ = model_pair("llama")
    config = (
        {"num_sink_tokens": 4, "window_length": 16}
        if name == "sink_window"
        else {"budget": 32, "window_length": 16}
    )
    rows = [random_prompt(90, seed=1)[0], random_prompt(50, seed=2)[0]]
    ids = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 90 - len(row) :], mask[i, 90 - len(row) :] = row, 1
    call = dict(
        max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation=name, cache_config=config
    )
    out = target.generate(ids, attention_mask=mask, **call)
    full = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for i, row in enumerate(rows):
        alone = target.generate(row[None], attention_mask=torch.ones_like(row[None]), **call)
        assert torch.equal(out[i, 90:], alone[0, len(row) :])
    assert not torch.equal(out, full)  # lossy: the sparse cache changes the output on this case
    with pytest.raises(ValueError, match="beam search"):
        target.generate(ids, attention_mask=mask, num_beams=2, **call)


def test_sparse_cache_needs_a_draft_model_for_prompt_lookup():
    target, _ = model_pair("llama")
    with pytest.raises(ValueError, match="has no draft model"):
        target.generate(random_prompt(64), prompt_lookup_num_tokens=3, cache_implementation="budgeted")


def test_snapkv_without_query_capture_is_explained():
    target, _ = model_pair("llama")
    cache = BudgetedCache(target.config, budget=32, policy="snapkv", policy_kwargs={"window_size": 4})
    target(random_prompt(64), cache=cache)
    with pytest.raises(ValueError, match="query_capture"):
        target(torch.tensor([[1]]), cache=cache)
    with pytest.raises(ValueError, match="query_capture"):
        target.generate(
            random_prompt(64),
            max_new_tokens=2,
            cache_implementation="budgeted",
            cache_config={"budget": 32, "policy": "snapkv", "policy_kwargs": {"window_size": 4}},
        )


def test_query_capture_restores_attention_and_feeds_snapkv():
    target, _ = model_pair("llama", "eager")
    cache = BudgetedCache(target.config, budget=32, policy="snapkv", policy_kwargs={"window_size": 4})
    with query_capture(target):
        assert target.config._attn_implementation == "budgetdraft_capture_eager"
        target(random_prompt(64), cache=cache)
        target(torch.tensor([[1]]), cache=cache)
    assert target.config._attn_implementation == "eager"
    assert cache.layers[0].num_kept == 32


def test_install_is_idempotent_and_leaves_other_calls_alone():
    steps = ("generate", *(step.__name__ for step in integration.STEPS))
    before = {name: GenerationMixin.__dict__[name] for name in steps}
    integration.install()
    assert {name: GenerationMixin.__dict__[name] for name in steps} == before  # nothing wrapped twice
    target, drafter = model_pair("llama")
    ids = random_prompt(64)
    plain = target.generate(ids, do_sample=False, max_new_tokens=8)
    with record_speculation() as stats:  # stock assisted generation is recorded too
        stock = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert torch.equal(plain, stock)
    assert stats.rounds > 0 and stats.draft_seconds > 0 and stats.verify_seconds > 0
    assert stats.mean_accepted_length == (sum(stats.accepted_per_round) + stats.rounds) / stats.rounds


def test_stats_fields():
    stats = hf_budgetdraft.SpeculationStats()
    for proposed, accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        stats.add_round(proposed, accepted, 0.1, 0.2)
    assert stats.rounds == 4 and stats.accepted_per_round == [3, 1, 0, 2]
    assert stats.mean_accepted_length == 10 / 4
    assert stats.acceptance_rate == 6 / 11
    assert stats.acceptance_per_position() == [(3, 4), (2, 3), (1, 1)]
    assert stats.draft_seconds == pytest.approx(0.4) and stats.verify_seconds == pytest.approx(0.8)
