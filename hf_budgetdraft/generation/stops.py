"""Stopping criteria checked at every token of a speculative round, in transformers' own assisted loop.

That loop appends a round's kept tokens, cuts them at `max_length` and at the first EOS, streams them, and only then
calls the stopping criteria, which look at the sequence's end. A criterion that would have fired at an earlier token
of the round (a stop string, a user's `StoppingCriteria`) is missed, and the output runs on past where the target's
own `generate()` stops. `EveryTokenStops` stands in for those criteria (and for the call's streamer): it checks
every prefix a round added, streams only the tokens up to the first prefix that fires, stops the loop there, and
`trim` cuts what the loop returned back to that token (the batched loop checks every prefix itself).
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

# transformers' loop already cuts a round at the first two; a deadline does not depend on the tokens, so a round
# that ends past it keeps its tokens
ROUND_AWARE = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
PER_TOKEN_FIELDS = ("scores", "logits", "attentions", "hidden_states")  # one entry per generated token


class EveryTokenStops(StoppingCriteria, BaseStreamer):
    """The call's other criteria, checked on `ids[:, :end]` for every `end` a round added (with `scores=None`, as
    the batched loop checks them). `stop_at`: the length of the sequence the target's own call would return."""

    def __init__(self, criteria: list, input_ids: torch.LongTensor, streamer: BaseStreamer | None):
        self.criteria, self.streamer = criteria, streamer
        self.ids = input_ids  # (1, P + streamed tokens): what the streamer has been given
        self.prompt = self.checked = input_ids.shape[1]
        self.stop_at: int | None = None

    @classmethod
    def wrap(cls, kwargs: dict, input_ids: torch.LongTensor) -> EveryTokenStops | None:
        """Put the stand-in into `_assisted_decoding`'s `kwargs` in place of the criteria transformers' loop checks
        only at a round's end (and of its streamer); `None` (nothing changed) when there are none."""
        criteria = kwargs.get("stopping_criteria") or []
        others = [c for c in criteria if not isinstance(c, ROUND_AWARE)]
        if not others or input_ids is None or input_ids.shape[0] != 1:
            return None
        stops = cls(others, input_ids, kwargs.get("streamer"))
        kwargs["stopping_criteria"] = StoppingCriteriaList([c for c in criteria if c not in others] + [stops])
        if stops.streamer is not None:
            kwargs["streamer"] = stops
        return stops

    def _advance(self, ids: torch.LongTensor) -> None:
        """Check the prefixes of `ids (1, n)` not checked yet, up to the first that fires."""
        for end in range(self.checked + 1, ids.shape[1] + 1):
            if self.stop_at is not None:
                return
            prefix = ids[:, :end]
            if any(bool(criterion(prefix, None).any()) for criterion in self.criteria):
                self.stop_at = end
            self.checked = end

    # -- as a streamer: transformers' loop puts a round's tokens before it calls the criteria ----------------------
    def put(self, value: torch.Tensor) -> None:
        if self.stop_at is not None:
            return
        start = self.ids.shape[1]
        self.ids = torch.cat([self.ids, value.reshape(1, -1).to(self.ids.device)], 1)
        self._advance(self.ids)
        end = self.ids.shape[1] if self.stop_at is None else self.stop_at
        if end > start:
            self.streamer.put(self.ids[0, start:end].cpu())

    def end(self) -> None:
        self.streamer.end()

    # -- as a criterion ---------------------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self._advance(input_ids)
        return torch.full((input_ids.shape[0],), self.stop_at is not None, device=input_ids.device)

    def trim(self, output, cache=None):
        """`output` (ids `(1, L)` or a `GenerateDecoderOnlyOutput`) cut to `stop_at` tokens: the sequence, the
        per-token outputs and the target's `cache` (the call's, returned or passed in), as the target's own call would
        have left them."""
        if self.stop_at is None:
            return output
        if cache is not None:
            excess = int(cache.get_seq_length()) - (self.stop_at - 1)
            if excess > 0:
                cache.crop(-excess)
        if torch.is_tensor(output):
            return output[:, : self.stop_at]
        new_tokens = self.stop_at - self.prompt
        output.sequences = output.sequences[:, : self.stop_at]
        for name in PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if value is not None:
                setattr(output, name, value[:new_tokens])
        return output
