"""`eval/replay.py`, the benchmark's replayed acceptance: it reproduces a survival trace within sampling error, in
transformers' loop and in the device round, and never changes the output (the target verifies every token)."""

import math

import pytest
import torch
from tiny_models import model_pair, random_prompt

from hf_budgetdraft import record_speculation
from hf_budgetdraft.eval.replay import ReplayedAcceptance, divergence, paper_survival
from hf_budgetdraft.generation.device_loop import DeviceRound

TRACE = [0.8, 0.6, 0.45, 0.3]


def test_the_draws_follow_the_trace():
    replay = ReplayedAcceptance(torch.zeros(1, 1, dtype=torch.long), TRACE, vocab_size=8, seed=1)
    draws = [replay.survivors(4) for _ in range(20000)]
    for k, expected in enumerate(TRACE):
        share = sum(1 for m in draws if m > k) / len(draws)
        assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / len(draws))
    assert paper_survival(0.5, 3) == [0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="non-increasing"):
        ReplayedAcceptance(torch.zeros(1, 1, dtype=torch.long), [0.5, 0.7], vocab_size=8)


def test_the_rewrite_keeps_the_survivors_and_breaks_the_next():
    reference = torch.arange(20)[None]
    replay = ReplayedAcceptance(reference, [1.0, 1.0, 0.0], vocab_size=100)
    out = replay.rewrite(torch.full((1, 4), 99), start=10)
    assert out.tolist() == [[10, 11, 13, 99]] and replay.rounds == [(4, 2)]
    assert divergence(torch.tensor([[0, 1, 2, 9]]), torch.arange(6)[None], prompt=1) == 3
    assert divergence(torch.arange(4)[None], torch.arange(6)[None], prompt=1) is None


@pytest.mark.parametrize(
    "cache_config", [{}, {"device_round": True}], ids=["transformers_loop", "device_round"]
)
def test_a_replayed_call_accepts_as_the_trace_says_and_keeps_the_output(cache_config):
    """Random-looking drafts (a 1-layer drafter) accept what the trace says; the output is the target's own."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=None, draft_layers=1)
    ids = random_prompt(100, seed=3)
    new_tokens = 300
    reference = target.generate(ids, do_sample=False, max_new_tokens=new_tokens + 8)
    replay = ReplayedAcceptance(reference, TRACE, vocab_size=target.config.vocab_size, seed=0)
    with replay.installed(), record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=new_tokens,
            cache_implementation="budgeted",
            cache_config={"budget": 32, "window_length": 16, "draft_length": 4, **cache_config},
        )
    assert torch.equal(out, reference[:, : out.shape[1]])
    assert stats.runtime["loop"] == ("device_round" if cache_config else "transformers")
    per_position = stats.acceptance_per_position()  # (accepted, reached)
    rounds = per_position[0][1]
    survival = 1.0
    for k, (accepted, reached) in enumerate(per_position):
        survival *= accepted / reached
        expected = TRACE[k]
        assert abs(survival - expected) < 4 * math.sqrt(expected * (1 - expected) / rounds) + 0.02, (
            k,
            survival,
        )
    assert DeviceRound._draft.__name__ == "_draft"  # restored on exit
