"""One `generate()` call streamed to the page: it runs in a worker thread, one at a time in the process, and its
progress is yielded after every emitted chunk; closing the iterator stops the generation at its next step."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ...generation.stats import SpeculationStats
from ...quiet import quiet_transformers
from ...runs.timed_call import timed_generate

_GENERATE_LOCK = threading.Lock()  # one generate() at a time in this process, whatever the web server does
DRAIN_SECONDS = 0.1  # how often the page's thread reads the streamed tokens


class _StopWhen(StoppingCriteria):
    """Stops `generate()` when one of `events` is set (the visitor cancelled, or the app's iterator was closed) or
    the time limit passed."""

    def __init__(self, events: tuple[threading.Event, ...], deadline: float):
        self.events, self.deadline = events, deadline

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = any(event.is_set() for event in self.events) or time.perf_counter() > self.deadline
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@dataclass
class RunProgress:
    """One generation as it streams. `tokens`: the new token ids so far; `chunk_sizes`: tokens per emitted chunk;
    the rest is set when `done`."""

    tokens: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    done: bool = False
    stopped: bool = False  # cancelled or over the time limit before max_new_tokens
    seconds: float = math.nan
    first_chunk_seconds: float = math.nan
    stats: SpeculationStats | None = None
    draft_cache_bytes: int | None = None
    target_cache_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput after the first emitted chunk, i.e. without the prefill (`nan` if nothing came after it)."""
        rest = len(self.tokens) - (self.chunk_sizes[0] if self.chunk_sizes else 0)
        duration = self.seconds - self.first_chunk_seconds
        return rest / duration if rest > 0 and duration > 0 else math.nan


def stream_generate(
    model,
    input_ids: torch.LongTensor,
    generate_kwargs: dict,
    seed: int = 0,
    cancel: threading.Event | None = None,
    max_seconds: float = math.inf,
) -> Iterator[RunProgress]:
    """Run `model.generate(input_ids, **generate_kwargs)` in a worker thread and yield its progress after every
    emitted chunk, then once more with `done=True` and the measurements.

    Generations run one at a time in the process (a lock held by the worker; timing starts once it holds it).
    Closing the iterator (the visitor left or pressed Stop) stops the generation at its next step and waits for
    the worker.

    Args:
        model (`PreTrainedModel`): the model whose `generate()` runs.
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt.
        generate_kwargs (`dict`): `generate()` arguments (`max_new_tokens`, `do_sample`, `assistant_model`, ...).
        seed (`int`): `torch.manual_seed` before the call (sampling).
        cancel (`threading.Event`, *optional*): set it to stop the generation early.
        max_seconds (`float`): stop after this long (the output is then shorter than `max_new_tokens`).
    """
    stops = (cancel or threading.Event(), threading.Event())  # the second: this iterator ended early
    events: queue.Queue = queue.Queue()
    worker = threading.Thread(
        target=_generate,
        args=(events, model, input_ids, generate_kwargs, seed, stops, max_seconds),
        name="hf_budgetdraft-app-generate",
        daemon=True,
    )
    worker.start()
    try:
        yield from _progress(events, generate_kwargs.get("max_new_tokens"))
    finally:
        stops[1].set()
        worker.join()


def _generate(
    events: queue.Queue, model, input_ids, generate_kwargs: dict, seed: int, stops, max_seconds
) -> None:
    """The worker: put each emitted chunk as `("chunk", token ids, seconds since the start)`, then
    `("done", RunResult, stopped)`, or `("error", exception)`, on `events`."""

    def on_chunk(ids: list[int], seconds: float) -> None:
        events.put(("chunk", ids, seconds))

    try:
        with _GENERATE_LOCK:
            deadline = time.perf_counter() + max_seconds
            stopping = StoppingCriteriaList([_StopWhen(stops, deadline)])
            with quiet_transformers():
                run = timed_generate(
                    model,
                    input_ids,
                    seed=seed,
                    on_chunk=on_chunk,
                    stopping_criteria=stopping,
                    **generate_kwargs,
                )
            stopped = any(stop.is_set() for stop in stops) or time.perf_counter() > deadline
        events.put(("done", run, stopped))
    except BaseException as error:  # noqa: BLE001 - re-raised in the app's thread
        events.put(("error", error))


def _drained(events: queue.Queue, interval: float) -> Iterator[tuple]:
    """The worker's events: the first at once (the first token shows as soon as it exists), then at most one read
    per `interval` seconds: every wake-up of this thread while the worker decodes takes the GIL and a core from its
    torch threads, so it wakes per interval, not per token."""
    yield events.get()
    while True:
        batch = [events.get()]
        time.sleep(interval)
        while True:
            try:
                batch.append(events.get_nowait())
            except queue.Empty:
                break
        yield from batch


def _progress(events: queue.Queue, max_new_tokens: int | None) -> Iterator[RunProgress]:
    """The worker's events as one `RunProgress`, yielded after each batch of chunks and once more when done."""
    progress = RunProgress()
    for event in _drained(events, DRAIN_SECONDS):
        if event[0] == "chunk":
            _, ids, seconds = event
            if not progress.tokens:
                progress.first_chunk_seconds = seconds
            progress.tokens.extend(ids)
            progress.chunk_sizes.append(len(ids))
            yield progress
        elif event[0] == "done":
            _, run, stopped = event
            progress.seconds, progress.stats = run.seconds, run.stats
            progress.draft_cache_bytes = run.draft_cache_bytes
            progress.target_cache_bytes = run.target_cache_bytes
            under = max_new_tokens is not None and len(progress.tokens) < max_new_tokens
            progress.stopped = stopped and under
            progress.done = True
            yield progress
            return
        else:
            raise event[1]
