"""Stopping criteria besides `max_length` and EOS (`generation/stops.py`): transformers' assisted loop checks them
at a round's end only, so a criterion that fires at an earlier token of a round used to let the output run on. A
single-sequence speculative call now stops where the target's own `generate()` stops: the ids, the streamed
tokens, the per-token scores and the returned cache."""

import pytest
import torch
from tiny_models import model_pair, random_prompt
from transformers import MaxTimeCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_budgetdraft.generation.stops import EveryTokenStops

SIZES = {
    "budgeted": {"budget": 32, "window_length": 16},
    "sink_window": {"num_sink_tokens": 4, "window_length": 40},
}
NEW_TOKENS = 40


class StopOn(StoppingCriteria):
    """Ends the call once it emits `token` (neither EOS nor a length)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1))

    def end(self):
        self.ended = True


def _generate(target, ids, token, **kwargs):
    criteria = StoppingCriteriaList([StopOn(token)])
    return target.generate(
        ids, do_sample=False, max_new_tokens=NEW_TOKENS, stopping_criteria=criteria, **kwargs
    )


def _stop_tokens(target, ids) -> list[int]:
    """Tokens whose first appearance in the target's free continuation is at a different offset each."""
    free = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)[0, ids.shape[1] :].tolist()
    firsts = {}
    for at, token in enumerate(free):
        firsts.setdefault(token, at)
    return [token for token, at in sorted(firsts.items(), key=lambda item: item[1]) if at > 0][:8]


@pytest.mark.parametrize("cache", sorted(SIZES))
def test_a_call_stops_at_the_token_the_targets_own_stops_at(cache, monkeypatch):
    """On CUDA too: the device round leaves such a call to transformers' loop (`device_loop.unsupported`)."""
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=6)
    ids = random_prompt(120, seed=4)
    cut, trim = [], EveryTokenStops.trim

    def noting_trim(self, output, cache=None):
        cut.append(self.stop_at is not None and self.stop_at < output.shape[1])
        return trim(self, output, cache)

    monkeypatch.setattr(EveryTokenStops, "trim", noting_trim)
    for token in _stop_tokens(target, ids):
        expected = _generate(target, ids, token)
        out = _generate(
            target,
            ids,
            token,
            assistant_model=drafter,
            cache_implementation=cache,
            cache_config=SIZES[cache],
        )
        assert torch.equal(out, expected), token
    assert any(cut)  # some calls stopped inside a round: the case a check at the round's end missed


def test_the_streamer_scores_and_cache_end_at_the_stop():
    target, drafter = model_pair("llama", "sdpa", num_assistant_tokens=6)
    ids = random_prompt(120, seed=4)
    kwargs = dict(return_dict_in_generate=True, output_scores=True)
    for token in _stop_tokens(target, ids)[2:5]:
        expected = _generate(target, ids, token, **kwargs)
        streamer = Collect()
        out = _generate(
            target,
            ids,
            token,
            assistant_model=drafter,
            cache_implementation="budgeted",
            cache_config=SIZES["budgeted"],
            streamer=streamer,
            **kwargs,
        )
        new = expected.sequences[0, ids.shape[1] :]
        assert torch.equal(out.sequences, expected.sequences)
        assert streamer.ended and torch.equal(torch.cat(streamer.puts[1:]), new)  # puts[0]: the prompt
        assert len(out.scores) == len(expected.scores) == new.numel()
        for ours, theirs in zip(out.scores, expected.scores, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert out.past_key_values.get_seq_length() == expected.past_key_values.get_seq_length()


def test_without_other_criteria_nothing_is_wrapped():
    """A call with only `max_length` and EOS keeps transformers' loop as it is (the loop cuts at those itself)."""
    criteria = StoppingCriteriaList()
    kwargs = {"stopping_criteria": criteria, "streamer": Collect()}
    assert EveryTokenStops.wrap(kwargs, random_prompt(8)) is None
    assert kwargs["stopping_criteria"] is criteria and isinstance(kwargs["streamer"], Collect)


def test_a_deadline_keeps_the_round_it_ends_in():
    """`max_time` reads the clock, not the tokens: checked at the round's end, as transformers checks it."""
    criteria = StoppingCriteriaList([MaxTimeCriteria(max_time=0.0), StopOn(5)])
    kwargs = {"stopping_criteria": criteria}
    stops = EveryTokenStops.wrap(kwargs, random_prompt(8))
    assert stops.criteria == [criteria[1]] and isinstance(kwargs["stopping_criteria"][0], MaxTimeCriteria)
