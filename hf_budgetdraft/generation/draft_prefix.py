"""The drafter's prefill, continued from the prompt it read in the previous call that continued a target cache (a
document prefilled once, then one question after another; a conversation, turn after turn).

Such a call feeds the target only the tokens its cache lacks, but the drafter, which keeps no cache across calls,
used to read the whole sequence again. A position's keys/values depend only on the tokens up to it, as the prefill
reads them, so when a prompt shares its first tokens with the last prompt the drafter read (same drafter weights,
same way of reading), their keys/values are that prompt's, copied, and the prefill runs on from there:

- a windowed prefill (`cache/windowed_prefill.py`) runs in chunks of `W` tokens from position 0, each reading the
  sink and the `W` tokens before it, so whole chunks are shared, and the chunks after them are the same forwards a
  full re-read runs: the same keys/values, bit for bit, and the same draft cache;
- a full prefill (every query reads every earlier token) shares every common token; the rest is one forward over
  them, the same attention as a re-read up to floating-point order.

Either way the draft cache is then filled from the whole prompt's keys/values, as a re-read fills it. One prompt is
kept per drafter, only in calls that continue a target cache (weakly keyed: dropped with the drafter); entries are
never written after they are stored, so concurrent calls only ever read them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache

from ..cache import is_full_attention_only
from ..cache.windowed_prefill import WindowedPrefillCache, fill_from_prefix, prefill_in_chunks, recorded

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
    """Within this call, the drafter's prefill continues the prompt it read last (and keeps this one)."""
    token = _reusing.set(True)
    try:
        yield
    finally:
        _reusing.reset(token)


def reusing() -> bool:
    """Whether this call's drafter prefill continues (and keeps) the prompt it read last."""
    return _reusing.get()


def windowed_prefill(
    model, ids: torch.LongTensor, num_sink_tokens: int, window: int
) -> tuple[WindowedPrefillCache, torch.Tensor]:
    """`model`'s windowed prefill of `ids (1, L)` (`cache.windowed_prefill`), inside `reusing_read_prompts()` from
    the first chunk the last prompt it read does not share; `(the recorder, the last position's logits (1, V))`."""
    recorder = WindowedPrefillCache(model.config, num_sink_tokens, window, ids.shape[1])
    return recorder, _prefill(model, ids, recorder, ("windowed", num_sink_tokens, window), window, window)


def full_prefill(model, ids: torch.LongTensor) -> tuple[DynamicCache, torch.Tensor]:
    """`model`'s prefill of `ids (1, L)` with full attention into a `DynamicCache`, from the first token the last
    prompt it read (inside `reusing_read_prompts()`) does not share; `(the cache, the last logits (1, V))`."""
    recorder = DynamicCache(config=model.config)
    return recorder, _prefill(model, ids, recorder, ("full",), ids.shape[1], 1)


def prefill_into(
    cache: Cache, model, ids: torch.LongTensor, num_sink_tokens: int, window: int | None
) -> torch.Tensor:
    """Prefill `ids (1, L)` through a recorder, in windowed chunks of `window` tokens (`None`: full attention), then
    fill `cache` from the recorded keys/values through its layers' own `update`, as a forward over the prompt
    would; the last position's logits `(1, V)`."""
    if window is None:
        recorder, logits = full_prefill(model, ids)
    else:
        recorder, logits = windowed_prefill(model, ids, num_sink_tokens, window)
    fill_from_prefix(cache, *recorded(recorder))
    return logits


def continues_full_prefill(model, capture_queries: bool) -> bool:
    """Whether a full prefill of `model` goes through a recorder to continue the last prompt it read: inside
    `reusing_read_prompts()`, when the draft cache is filled from keys/values alone (no prefill queries to score
    them with) and `model`'s layers are all full attention (whose keys/values a `DynamicCache` records)."""
    return _reusing.get() and not capture_queries and is_full_attention_only(model.config)


def _prefill(
    model, ids: torch.LongTensor, recorder: Cache, how: tuple, chunk: int, step: int
) -> torch.Tensor:
    """Feed `ids` into `recorder` `chunk` tokens a forward, resuming at a multiple of `step` shared with the last
    prompt `model` read; keep this one. The last position's logits `(1, V)`."""
    if not _reusing.get():
        return prefill_in_chunks(model, ids, recorder, chunk, logits_to_keep=1)
    settings = (*how, _weights_version(model))
    with _lock:
        read = _prompts.get(model)
    start = _shared(read, settings, ids, step)
    if start:
        fill_from_prefix(
            recorder, [k[:, :, :start] for k in read.keys], [v[:, :, :start] for v in read.values]
        )
    logits = prefill_in_chunks(model, ids, recorder, chunk, start, logits_to_keep=1)
    with _lock:
        _prompts[model] = _ReadPrompt(settings, ids.clone(), *recorded(recorder))
    return logits


def _weights_version(model) -> tuple:
    """Changes when a parameter is replaced or written in place (fine-tuning between calls, `.to(dtype)`)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _shared(read: _ReadPrompt | None, settings: tuple, ids: torch.LongTensor, step: int) -> int:
    """Tokens `ids (1, L)` shares with `read`, rounded down to a multiple of `step`, short of its last token (always
    fed: its logits start the draft)."""
    if read is None or read.settings != settings or read.ids.device != ids.device:
        return 0
    length = min(read.ids.shape[1], ids.shape[1] - 1)
    differ = (read.ids[0, :length] != ids[0, :length]).nonzero()
    shared = int(differ[0]) if differ.numel() else length
    return shared // step * step
