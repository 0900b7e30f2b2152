"""bf16 end to end on the 10 test families: the one-liner's greedy output is the bf16 target's own, or first differs
only where the target's top-2 logits are within bf16's rounding (the noise envelope the CLI and the bench use)."""

import copy

import pytest
import torch
from tiny_models import FAMILIES, model_pair, random_prompt, supports

from hf_budgetdraft import record_speculation
from hf_budgetdraft.runs.token_diff import divergence_margin, tie_tolerance, token_diff

NEW_TOKENS = 24
CACHE_CONFIGS = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 28},
}


@pytest.mark.parametrize("cache", ["budgeted", "sink_window"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_one_liner_is_the_targets_greedy_output_within_the_envelope(family, cache):
    attention = "sdpa" if supports(family, "sdpa") else "eager"  # gemma2 has no sdpa path in transformers
    target, drafter = (copy.deepcopy(m).to(torch.bfloat16) for m in model_pair(family, attention))
    ids = random_prompt(120, seed=5)
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, ids.shape[1] :]
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            cache_implementation=cache,
            cache_config=CACHE_CONFIGS[cache],
        )[0, ids.shape[1] :]
    assert stats.rounds > 0
    diff = token_diff(out, expected)
    if diff.diff_tokens:
        margin = divergence_margin(target, ids, expected, out, diff.first_diff)
        assert abs(margin) <= tie_tolerance(torch.bfloat16), (family, diff, margin)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_bf16_batch_keeps_each_rows_greedy_output_within_the_envelope(family):
    target, drafter = (copy.deepcopy(m).to(torch.bfloat16) for m in model_pair(family, "sdpa"))
    ids = torch.cat([random_prompt(100, seed=seed) for seed in (1, 2, 3)])  # (3, 100): the batched loop
    call = dict(
        do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, attention_mask=torch.ones_like(ids)
    )
    expected = target.generate(ids, **call)[:, ids.shape[1] :]
    with record_speculation() as stats:
        out = target.generate(ids, assistant_model=drafter, cache_implementation="budgeted", **call)
    assert len(stats.rows) == 3
    for row, (ours, theirs) in enumerate(zip(out[:, ids.shape[1] :], expected, strict=True)):
        diff = token_diff(ours, theirs)
        if diff.diff_tokens:
            margin = divergence_margin(target, ids[row : row + 1], theirs, ours, diff.first_diff)
            assert abs(margin) <= tie_tolerance(torch.bfloat16), (family, row, diff, margin)
