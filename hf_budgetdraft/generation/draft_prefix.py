"""The drafter's windowed prefill, continued from the prompt it read in the previous call that continued a target
cache (a document prefilled once, then one question after another; a conversation, turn after turn).

Such a call feeds the target only the tokens its cache lacks, but the drafter, which keeps no cache across calls,
used to read the whole sequence again. A windowed prefill (`cache/windowed_prefill.py`) runs in chunks of `W`
tokens starting at position 0, each reading the sink and the `W` tokens before it: the keys/values of a prompt's
first `k` chunks depend on those `k·W` tokens alone. So when a prompt shares its first `k·W` tokens with the last
prompt the drafter read (same drafter weights, sink and window), those chunks are that prompt's, copied, and the
prefill runs on from chunk `k`: the same forwards as a full re-read would run there, so the same keys/values and the
same draft cache. One prompt is kept per drafter, in calls that continue a target cache only (weakly keyed: dropped
with the drafter); entries are never written after they are stored, so concurrent calls only ever read them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..cache.windowed_prefill import WindowedPrefillCache, prefill_in_chunks

_reusing: ContextVar[bool] = ContextVar("budgetdraft_reuse_draft_prefix", default=False)
_prompts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> _ReadPrompt
_lock = threading.Lock()


@dataclass(frozen=True)
class _ReadPrompt:
    """A prompt `ids (1, L)` a drafter read, every layer's keys/values `(1, H, L, D)`, and what they depend on."""

    settings: tuple
    ids: torch.LongTensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@contextlib.contextmanager
def reusing_read_prompts() -> Iterator[None]:
    """Within this call, the drafter's windowed prefill continues the prompt it read last (and keeps this one)."""
    token = _reusing.set(True)
    try:
        yield
    finally:
        _reusing.reset(token)


def windowed_prefill(
    model, ids: torch.LongTensor, num_sink_tokens: int, window: int
) -> tuple[WindowedPrefillCache, torch.Tensor]:
    """`cache.windowed_prefill.windowed_prefill` of `ids (1, L)`, from the first chunk the last prompt `model` read
    does not share, inside `reusing_read_prompts()`; `(the recorder, the last position's logits (1, V))`."""
    recorder = WindowedPrefillCache(model.config, num_sink_tokens, window, ids.shape[1])
    if not _reusing.get():
        return recorder, prefill_in_chunks(model, ids, recorder, window, logits_to_keep=1)
    settings = (num_sink_tokens, window, _weights_version(model))
    with _lock:
        read = _prompts.get(model)
    start = _shared_chunks(read, settings, ids, window)
    if start:
        recorder.resume([k[:, :, :start] for k in read.keys], [v[:, :, :start] for v in read.values])
    logits = prefill_in_chunks(model, ids, recorder, window, start, logits_to_keep=1)
    with _lock:
        _prompts[model] = _ReadPrompt(settings, ids.clone(), *recorder.prompt_states())
    return recorder, logits


def _weights_version(model) -> tuple:
    """Changes when a parameter is replaced or written in place (fine-tuning between calls, `.to(dtype)`)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _shared_chunks(read: _ReadPrompt | None, settings: tuple, ids: torch.LongTensor, window: int) -> int:
    """Tokens of whole chunks `ids (1, L)` shares with `read`, short of its last token (always fed: its logits
    start the draft)."""
    if read is None or read.settings != settings or read.ids.device != ids.device:
        return 0
    length = min(read.ids.shape[1], ids.shape[1] - 1)
    differ = (read.ids[0, :length] != ids[0, :length]).nonzero()
    shared = int(differ[0]) if differ.numel() else length
    return shared // window * window
