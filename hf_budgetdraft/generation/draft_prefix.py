"""The drafter's prefill, continued from a prompt it read in an earlier call that continued a target cache (a
document prefilled once, then one question after another; a conversation, turn after turn).

Such a call feeds the target only the tokens its cache lacks, but the drafter, which keeps no cache across calls,
used to read the whole sequence again. A position's keys/values depend only on the tokens up to it, as the prefill
reads them, so when a prompt shares its first tokens with a prompt the drafter read (same drafter weights,
same way of reading), their keys/values are that prompt's, copied, and the prefill runs on from there:

- a windowed prefill (`cache/windowed_prefill.py`) runs in chunks of `W` tokens from position 0, each reading the
  sink and the `W` tokens before it, so whole chunks are shared, and the chunks after them are the same forwards a
  full re-read runs: the same keys/values, bit for bit, and the same draft cache;
- a full prefill (every query reads every earlier token) shares every common token; the rest is one forward over
  them, the same attention as a re-read up to floating-point order.

Either way the draft cache is then filled from the whole prompt's keys/values, as a re-read fills it. Only calls
that continue a target cache keep prompts: per drafter (weakly keyed: dropped with it) the most recently read, up to
`set_kept_prompts`' limits on their number and bytes, so documents or conversations taken in turn each continue
their own; a prompt replaces the one it continued when they share at least half of it (another question on the
document, the next turn). Entries are never written after they are stored, so concurrent calls only ever read them.
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
_prompts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> [_ReadPrompt], oldest first
_lock = threading.Lock()


@dataclass(frozen=True)
class KeptPrompts:
    """How many read prompts a drafter keeps, and their keys/values' bytes at most (on the drafter's device)."""

    max_prompts: int = 8
    max_bytes: int = 1 << 30


_limits = KeptPrompts()


@dataclass(frozen=True)
class _ReadPrompt:
    """A prompt `ids (1, L)` a drafter read, every layer's keys/values `(1, H, L, D)`, and what they depend on."""

    settings: tuple
    ids: torch.LongTensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (*self.keys, *self.values))


def set_kept_prompts(max_prompts: int | None = None, max_bytes: int | None = None) -> KeptPrompts:
    """Bound the prompts each drafter keeps for later calls to continue (default: 8 prompts, 1 GiB); the least
    recently read go first, and a prompt whose keys/values exceed `max_bytes` alone is not kept (`max_prompts=0`
    keeps none). Process-wide; applies at once. Returns the limits in force before, to restore them."""
    global _limits
    for name, value in (("max_prompts", max_prompts), ("max_bytes", max_bytes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an int >= 0 (None keeps it), got {value!r}")
    with _lock:
        before = _limits
        _limits = KeptPrompts(
            before.max_prompts if max_prompts is None else max_prompts,
            before.max_bytes if max_bytes is None else max_bytes,
        )
        for model, kept in list(_prompts.items()):
            _prompts[model] = _within_limits(kept)
    return before


@contextlib.contextmanager
def reusing_read_prompts() -> Iterator[None]:
    """Within this call, the drafter's prefill continues a prompt it read (and keeps this one)."""
    token = _reusing.set(True)
    try:
        yield
    finally:
        _reusing.reset(token)


def reusing() -> bool:
    """Whether this call's drafter prefill continues (and keeps) a prompt it read."""
    return _reusing.get()


def windowed_prefill(
    model, ids: torch.LongTensor, num_sink_tokens: int, window: int
) -> tuple[WindowedPrefillCache, torch.Tensor]:
    """`model`'s windowed prefill of `ids (1, L)` (`cache.windowed_prefill`), inside `reusing_read_prompts()` from
    the first chunk a kept prompt does not share; `(the recorder, the last position's logits (1, V))`."""
    recorder = WindowedPrefillCache(model.config, num_sink_tokens, window, ids.shape[1])
    return recorder, _prefill(model, ids, recorder, ("windowed", num_sink_tokens, window), window, window)


def full_prefill(model, ids: torch.LongTensor) -> tuple[DynamicCache, torch.Tensor]:
    """`model`'s prefill of `ids (1, L)` with full attention into a `DynamicCache`, from the first token a kept
    prompt (inside `reusing_read_prompts()`) does not share; `(the cache, the last logits (1, V))`."""
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
    """Whether a full prefill of `model` goes through a recorder to continue a prompt it read: inside
    `reusing_read_prompts()`, when the draft cache is filled from keys/values alone (no prefill queries to score
    them with) and `model`'s layers are all full attention (whose keys/values a `DynamicCache` records)."""
    return _reusing.get() and not capture_queries and is_full_attention_only(model.config)


def _prefill(
    model, ids: torch.LongTensor, recorder: Cache, how: tuple, chunk: int, step: int
) -> torch.Tensor:
    """Feed `ids` into `recorder` `chunk` tokens a forward, resuming at a multiple of `step` shared with the kept
    prompt of `model` that shares the most (the most recent of equals); keep this one. The last position's logits
    `(1, V)`."""
    if not _reusing.get():
        return prefill_in_chunks(model, ids, recorder, chunk, logits_to_keep=1)
    settings = (*how, _weights_version(model))
    with _lock:
        kept = list(_prompts.get(model, ()))
    candidates = ((_shared(read, settings, ids, step), read) for read in reversed(kept))
    start, source = max(candidates, key=lambda candidate: candidate[0], default=(0, None))
    if start:
        fill_from_prefix(
            recorder, [k[:, :, :start] for k in source.keys], [v[:, :, :start] for v in source.values]
        )
    logits = prefill_in_chunks(model, ids, recorder, chunk, start, logits_to_keep=1)
    # the same document with another question, the next turn: this prompt stands for the one it continued
    replaces = source if start and 2 * start >= source.ids.shape[1] else None
    _keep(model, _ReadPrompt(settings, ids.clone(), *recorded(recorder)), replaces)
    return logits


def _keep(model, read: _ReadPrompt, replaces: _ReadPrompt | None) -> None:
    """Keep `read` as `model`'s most recent prompt, dropping the one it continued and those of older weights."""
    with _lock:
        kept = [
            old
            for old in _prompts.get(model, ())
            if old is not replaces and old.settings[-1] == read.settings[-1]
        ]
        _prompts[model] = _within_limits([*kept, read])


def _within_limits(kept: list[_ReadPrompt]) -> list[_ReadPrompt]:
    """The most recent of `kept` (oldest first) that fit the limits together."""
    chosen, total = [], 0
    for read in reversed(kept):
        if len(chosen) == _limits.max_prompts or total + read.nbytes > _limits.max_bytes:
            break
        chosen.append(read)
        total += read.nbytes
    return chosen[::-1]


def _weights_version(model) -> tuple:
    """Changes when a parameter is replaced or written in place (fine-tuning between calls, `.to(dtype)`; a
    quantised tensor subclass has no data pointer of its own, but a new one is a new object)."""
    return tuple((id(p), p.data_ptr(), p._version) for p in model.parameters())


def _shared(read: _ReadPrompt, settings: tuple, ids: torch.LongTensor, step: int) -> int:
    """Tokens `ids (1, L)` shares with `read`, rounded down to a multiple of `step`, short of its last token (always
    fed: its logits start the draft)."""
    if read.settings != settings or read.ids.device != ids.device:
        return 0
    length = min(read.ids.shape[1], ids.shape[1] - 1)
    differ = (read.ids[0, :length] != ids[0, :length]).nonzero()
    shared = int(differ[0]) if differ.numel() else length
    return shared // step * step
