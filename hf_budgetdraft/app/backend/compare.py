"""One comparison (`compare`): plain AR first, then the chosen speculative method, on the same prompt and the same
cores one after the other so that their timings compare, yielding a `Snapshot` of the page as tokens stream."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..arguments import AppArguments
from .columns import IncrementalDecoder, SideView, chunk_origins, token_origins
from .comparison_numbers import summarize
from .methods import decoding_kwargs, method_title, require_method, speculative_call
from .prompts import Prompt, build_prompt
from .request import DemoInputError, RunRequest
from .store import ModelPair, ModelStore
from .streaming import RunProgress, stream_generate

REFRESH_SECONDS = 0.2  # the page's update interval while tokens stream (each update re-renders both columns)

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """What the page shows at one moment of a comparison."""

    status: str
    prompt: Prompt | None = None
    ar: SideView | None = None
    spec: SideView | None = None
    summary: dict | None = None
    acceptance: list[dict] | None = None
    error: bool = False


def compare(
    request: RunRequest,
    store: ModelStore,
    limits: AppArguments,
    cancel: threading.Event | None = None,
    refresh_seconds: float | None = None,
) -> Iterator[Snapshot]:
    """Run AR and then the speculative method of `request`, yielding what the page should show as they stream.

    Bad input ends the iteration with one `Snapshot(error=True)` whose `status` says what to fix; nothing raises.

    Args:
        request (`RunRequest`): the visitor's choices (checked here).
        store (`ModelStore`): loaded models.
        limits (`AppArguments`): the server's bounds.
        cancel (`threading.Event`, *optional*): set to stop the running generation.
        refresh_seconds (`float`, *optional*): at most one snapshot per this many seconds while tokens stream
            (default `REFRESH_SECONDS`).
    """
    cancel = cancel or threading.Event()
    refresh_seconds = REFRESH_SECONDS if refresh_seconds is None else refresh_seconds
    try:
        request = request.check(limits)
        yield Snapshot("Loading the models…")
        pair = store.get(
            request.model, request.target_path, request.drafter_path, request.device, request.dtype
        )
        require_method(request, pair)
        prompt = build_prompt(request, pair, limits, store.builtin_documents)
        decoding = decoding_kwargs(request, pair.tokenizer)
        spec_kwargs, gamma = speculative_call(request, pair) if request.method != "ar" else ({}, 0)
    except DemoInputError as error:
        yield Snapshot(f"⚠ {error}", error=True)
        return
    except Exception as error:  # noqa: BLE001 - shown in the page, traceback in the server log
        logger.exception("demo app: preparing the run failed")
        yield Snapshot(f"⚠ Could not prepare the run: {type(error).__name__}: {error}", error=True)
        return

    ar_view = SideView("Plain AR (the target alone)", running=True)
    spec_view = (
        SideView(f"Speculative: {method_title(request, gamma)}", note="waits for the AR run")
        if spec_kwargs
        else None
    )
    snapshot = Snapshot("Running plain AR…", prompt, ar_view, spec_view)
    yield snapshot
    runs: dict[str, RunProgress] = {}
    for name, view, kwargs in (("ar", ar_view, {}), ("spec", spec_view, spec_kwargs)):
        if view is None:
            continue
        snapshot.status = "Running plain AR…" if name == "ar" else f"Running {view.title}…"
        stream = stream_generate(
            pair.target,
            prompt.input_ids.to(pair.target.device),
            decoding | kwargs,
            seed=request.seed,
            cancel=cancel,
            max_seconds=limits.max_run_seconds,
        )
        progress = yield from _stream_column(
            snapshot, view, stream, pair.tokenizer, refresh_seconds, name == "spec"
        )
        if progress is None:
            return
        runs[name] = progress
    yield _summarized(snapshot, request, pair, runs, gamma)


def _stream_column(
    snapshot: Snapshot,
    view: SideView,
    stream: Iterator[RunProgress],
    tokenizer,
    refresh_seconds: float,
    speculative: bool,
) -> Iterator[Snapshot]:
    """Fill `view` from `stream`, yielding `snapshot` at most once per `refresh_seconds` (and when done).

    Returns the finished run's `RunProgress`, or `None` once it has yielded the error snapshot of a failed run.
    """
    view.running, view.note = True, ""
    decoder = IncrementalDecoder(tokenizer)
    last = 0.0
    try:
        with contextlib.closing(stream):
            for progress in stream:
                new = progress.tokens[len(decoder.ids) :]
                view.pieces = list(decoder.extend(new, final=progress.done))
                view.token_ids = list(decoder.ids)
                view.origins = _origins(progress, len(view.token_ids), speculative)
                now = time.perf_counter()
                if progress.done or now - last >= refresh_seconds:
                    last = now
                    yield snapshot
    except (ValueError, DemoInputError) as error:  # the library's messages name the parameter and the fix
        view.running = False
        yield _failed(snapshot, f"⚠ {view.title} failed: {error}")
        return None
    except Exception as error:  # noqa: BLE001
        logger.exception("demo app: generation failed")
        view.running = False
        yield _failed(snapshot, f"⚠ {view.title} failed: {type(error).__name__}: {error}")
        return None
    view.running = False
    if progress.stopped:
        view.note = f"stopped early after {len(progress.tokens)} tokens (cancelled or over the time limit)"
    return progress


def _origins(progress: RunProgress, num_tokens: int, speculative: bool) -> list[str]:
    """Where each decoded token came from: all `"ar"` for plain AR; for the speculative run, the per-round
    accepted counts once done, the streamed chunks until then."""
    if not speculative:
        return ["ar"] * num_tokens
    if progress.done and progress.stats is not None:
        return token_origins(progress.stats.accepted_per_round, num_tokens)
    return chunk_origins(progress.chunk_sizes)[:num_tokens]


def _failed(snapshot: Snapshot, status: str) -> Snapshot:
    return Snapshot(status, snapshot.prompt, snapshot.ar, snapshot.spec, error=True)


def _summarized(
    snapshot: Snapshot, request: RunRequest, pair: ModelPair, runs: dict[str, RunProgress], gamma: int
) -> Snapshot:
    """`snapshot` with the stats of the finished runs and the final status (or why the stats failed)."""
    try:
        summary, acceptance = summarize(request, pair, snapshot.prompt, runs["ar"], runs.get("spec"), gamma)
    except Exception as error:  # noqa: BLE001 - the outputs stay; the numbers are missing
        logger.exception("demo app: summarizing the run failed")
        snapshot.status, snapshot.error = f"⚠ The runs finished but their stats failed: {error}", True
        return snapshot
    snapshot.summary, snapshot.acceptance = summary, acceptance
    random_note = " Random weights: the numbers check the machinery, not quality or speed."
    snapshot.status = "Done." + (random_note if pair.random_weights else "")
    return snapshot
