"""One timed `generate()` call, measured the same way by the `generate` command, the bench and the demo app.

`timed_generate` runs `model.generate(input_ids, ...)` inside `record_speculation()` with a `ChunkTimer` streamer
(it skips the prompt `generate()` puts first and records when each chunk of new tokens is emitted) and returns a
`RunResult`: the new tokens, the wall time and the time to the first emitted chunk (so decode throughput can be
told apart from the prefill), the per-round speculation statistics, the bytes of the draft cache the candidate
generator held and of the cache `generate()` returned for the target, the process's peak RSS and, on CUDA, the
peak allocated memory.

A speculative call is described by a `DraftSpec` (`spec=`), as everywhere in the package. `ar_setup` gives the
plain-AR baselines a speculative call is compared with, `configure_drafter` a drafter's fixed draft length for
stock assisted generation.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from ..attention.fast_sdpa import NAME as FAST_SDPA
from ..attention.scoped import using_attention
from ..cache.growable import GrowableCache
from ..cache.sizes import cache_nbytes
from ..compat import CACHE_KWARG, output_cache
from ..cpu import few_row_linears
from ..generation.compiled_step import draft_step_compile_config
from ..generation.draft_length.clock import synchronize
from ..generation.spec import DraftSpec
from ..generation.stats import SpeculationStats, record_speculation

# plain-AR baselines besides the target as loaded (see `ar_setup`)
AR_SETUPS = ("stock", "growable", "fast", "static")


class ChunkTimer(BaseStreamer):
    """A streamer that records when each chunk of new tokens is emitted.

    `generate()` first puts the prompt (skipped), then one chunk per step: one token for AR, a round's accepted
    draft tokens plus the target's own token when speculating. `times` holds `time.perf_counter()` stamps, `counts`
    the chunks' token counts; `on_chunk(token_ids, seconds since begin())`, if given, is called with every chunk.
    """

    def __init__(self, on_chunk: Callable[[list[int], float], None] | None = None):
        self.on_chunk = on_chunk
        self.times: list[float] = []
        self.counts: list[int] = []
        self.started = time.perf_counter()
        self._prompt_seen = False

    def begin(self) -> float:
        """Start the clock `on_chunk`'s seconds count from; returns the start stamp."""
        self.started = time.perf_counter()
        return self.started

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter()
        self.times.append(now)
        self.counts.append(int(value.numel()))
        if self.on_chunk is not None:
            self.on_chunk(value.reshape(-1).tolist(), now - self.started)

    def end(self) -> None:
        pass


@dataclass
class RunResult:
    """One timed `generate()` call.

    Attributes:
        new_ids (`torch.LongTensor` of shape `(n,)`): the new tokens (row 0), on CPU.
        seconds (`float`): wall time of the call.
        first_token_seconds (`float`): until the first emitted chunk (the whole call when nothing was streamed).
        first_chunk_tokens (`int`): tokens in that chunk.
        stats (`SpeculationStats`): the call's rounds (empty for plain AR).
        draft_cache_bytes (`int`, *optional*): `cache_nbytes` of the draft cache; `None` without one.
        target_cache_bytes (`int`, *optional*): `cache_nbytes` of the returned cache; `None` without one.
        peak_rss_bytes (`int`, *optional*): the process's peak resident set size so far.
        cuda_peak_bytes (`int`, *optional*): peak allocated CUDA memory during the call (CUDA only).
        runtime (`dict`, *optional*): `stats.runtime`, what ran (kept: `stats` drops its generator after the call).
    """

    new_ids: torch.LongTensor
    seconds: float
    first_token_seconds: float
    first_chunk_tokens: int
    stats: SpeculationStats
    draft_cache_bytes: int | None
    target_cache_bytes: int | None
    peak_rss_bytes: int | None
    cuda_peak_bytes: int | None
    runtime: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_ids) / self.seconds

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Throughput after the first emitted chunk (excludes the prefill); `None` if nothing came after it."""
        rest = len(self.new_ids) - self.first_chunk_tokens
        duration = self.seconds - self.first_token_seconds
        return rest / duration if rest > 0 and duration > 0 else None


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far (monotone over a run), `None` where `resource` is missing."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


def _call_kwargs(input_ids, new_tokens, spec, sampling, generate_kwargs: dict) -> dict:
    """`generate()`'s arguments: greedy unless `sampling` (or `generate_kwargs`) says otherwise, exactly
    `new_tokens` new tokens when given, the spec's draft cache."""
    kwargs: dict = {"do_sample": False}
    if sampling:
        kwargs = {"do_sample": True, **sampling}
    if new_tokens is not None:
        # EOS is suppressed until `new_tokens` through `min_length`: transformers' assistant drops the target's
        # min-length processor before drafting, where a `min_new_tokens` one would be passed in twice
        kwargs |= {"max_new_tokens": new_tokens, "min_length": input_ids.shape[1] + new_tokens}
    if spec is not None:
        kwargs |= {"cache_implementation": spec.cache, "cache_config": spec.to_cache_config()}
    return kwargs | generate_kwargs


@torch.inference_mode()
def timed_generate(
    model,
    input_ids: torch.LongTensor,
    new_tokens: int | None = None,
    *,
    spec: DraftSpec | None = None,
    sampling: dict | None = None,
    seed: int | None = None,
    on_chunk: Callable[[list[int], float], None] | None = None,
    **generate_kwargs,
) -> RunResult:
    """Run and time `model.generate(input_ids, ...)`.

    Args:
        model (`PreTrainedModel`): the model whose `generate()` runs (the target).
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt, on the model's device.
        new_tokens (`int`, *optional*): generate exactly this many tokens (EOS suppressed before); `None`: the
            `generate_kwargs` decide (`max_new_tokens`, a stopping criterion).
        spec (`DraftSpec`, *optional*): the draft cache of a speculative call (with `assistant_model=` in
            `generate_kwargs`), passed as `cache_implementation=spec.cache, cache_config=spec.to_cache_config()`.
        sampling (`dict`, *optional*): sample with these settings (e.g. `{"temperature": 0.8}`); default greedy.
        seed (`int`, *optional*): `torch.manual_seed(seed)` right before the call.
        on_chunk (`Callable[[list[int], float], None]`, *optional*): called with every emitted chunk's token ids
            and the seconds since the call started (the streamer's thread: the caller's own).
        **generate_kwargs: the rest of `generate()`'s arguments (they take precedence).
    """
    kwargs = _call_kwargs(input_ids, new_tokens, spec, sampling, generate_kwargs)
    device = input_ids.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    streamer = ChunkTimer(on_chunk)
    if seed is not None:
        torch.manual_seed(seed)
    with record_speculation() as stats:
        synchronize(device)
        start = streamer.begin()
        output = model.generate(input_ids, return_dict_in_generate=True, streamer=streamer, **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
    new_ids = output.sequences[0, input_ids.shape[1] :].cpu()
    draft_cache, target_cache = stats.draft_cache, output_cache(output)
    result = RunResult(
        new_ids=new_ids,
        seconds=seconds,
        first_token_seconds=(streamer.times[0] - start) if streamer.times else seconds,
        first_chunk_tokens=streamer.counts[0] if streamer.counts else len(new_ids),
        stats=stats,
        draft_cache_bytes=cache_nbytes(draft_cache) if draft_cache is not None else None,
        target_cache_bytes=cache_nbytes(target_cache) if target_cache is not None else None,
        peak_rss_bytes=peak_rss_bytes(),
        cuda_peak_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else None,
        runtime=stats.runtime,
    )
    stats.candidate_generator = None  # drop the draft cache now that it is measured
    return result


@contextlib.contextmanager
def ar_setup(target, setup: str | None, capacity: int) -> Iterator[dict]:
    """A plain-AR baseline of `target`, as the extra `generate()` arguments it needs inside the block.

    `setup=None`: the target as loaded, on transformers' default cache (the reference every speculative call must
    reproduce); `"stock"`: transformers' own `sdpa` attention (restored after); `"growable"`: a `GrowableCache` of
    `capacity` tokens (in-place appends); `"fast"`: both `budgetdraft_sdpa` and a `GrowableCache`, the fastest plain
    AR this package has (with few-row linear layers for a float32 target on CPU, `cpu/few_row_linear.py`);
    `"static"`: transformers' `StaticCache` (`cache_implementation="static"`), which transformers' `generate()`
    compiles on an accelerator (its fast path there; eager on CPU).
    """
    if setup is not None and setup not in AR_SETUPS:
        raise ValueError(f"setup must be None or one of {AR_SETUPS}, got {setup!r}")
    kwargs = {}
    if setup in ("growable", "fast"):
        kwargs[CACHE_KWARG] = GrowableCache(config=target.config, initial_capacity=capacity)
    if setup == "static":
        kwargs["cache_implementation"] = "static"
    with (
        using_attention(target, {"stock": "sdpa", "fast": FAST_SDPA}.get(setup)),
        few_row_linears(target, setup == "fast"),
    ):
        yield kwargs


def configure_drafter(
    drafter, gamma: int | None, compiled: bool = False, confidence_threshold: float = 0.0
) -> None:
    """A constant draft length γ per round (no heuristic schedule); `confidence_threshold` > 0 ends a round early
    once the draft's top token is less likely than that (so γ is the most a round drafts); `compiled`: the
    drafter's one-token step is compiled (transformers' `CompileConfig`, read by `SparseDraftCandidateGenerator`).
    `gamma=None` clears all of it, as a freshly loaded drafter has it: the call's own settings (a sparse cache's
    `DraftSpec`, or transformers' defaults) decide."""
    config = drafter.generation_config
    if gamma is None:
        config.num_assistant_tokens = config.num_assistant_tokens_schedule = None
        config.assistant_confidence_threshold = config.compile_config = None
        return
    config.num_assistant_tokens = gamma
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = confidence_threshold
    # one static graph per draft-cache shape (budget)
    config.compile_config = draft_step_compile_config(drafter.device) if compiled else None
