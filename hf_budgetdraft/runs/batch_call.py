"""Timed batched calls: one `generate()` of a left-padded batch, `new_tokens` tokens per row, exactly.

- `ar`: batched autoregressive decoding on the package's fast target (`budgetdraft_sdpa`, a `GrowableCache`);
- `run_batch_static_ar`: transformers' own static-cache batched AR (`cache_implementation="static"`, compiled on its
  first call on an accelerator: the baseline a GPU user has; `hf-budgetdraft generate` runs it there);
- `loop_ar`: the speculative loop with `draft_length=0`, the target alone on its ragged cache;
- `speculative`: `generate(batch, attention_mask=mask, assistant_model=drafter, cache_implementation=...)`, the
  one-liner for a batch (every default; `cache_config` optional);
- `full_draft`: the same loop with the drafter reading its full cache (`cache_config={"full_draft_cache": True}`):
  what the sparse draft is compared with in the same batch.

Throughput = every row's new tokens after its first one / decode time (the call minus its prefill); per-row
latency = from the call's start to the row's last token (speculative rows finish at different rounds).
`hf-budgetdraft generate --batch_size` runs them; `eval/batched_bench.py` grids them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..attention.fast_sdpa import NAME as FAST_SDPA
from ..attention.scoped import using_attention
from ..cache.growable import GrowableCache
from ..cache.sizes import cache_nbytes
from ..compat import cache_kwargs, output_cache
from ..cpu import few_row_linears
from ..generation.stats import SpeculationStats, record_speculation
from .timed_call import ChunkTimer

BATCH_METHODS = ("ar", "loop_ar", "speculative", "full_draft")


@dataclass
class BatchRun:
    """One timed batched call."""

    method: str
    sequences: torch.LongTensor  # (B, P + n)
    prompt_width: int
    seconds: float
    prefill_seconds: float  # until every row's first new token
    row_latency_seconds: list[float]
    target_cache_bytes: int = 0
    draft_cache_bytes: int = 0
    stats: SpeculationStats | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def new_ids(self, row: int) -> torch.LongTensor:
        return self.sequences[row, self.prompt_width :]

    @property
    def decode_tokens_per_second(self) -> float | None:
        rest = self.batch_size * (self.sequences.shape[1] - self.prompt_width - 1)
        duration = self.seconds - self.prefill_seconds
        return rest / duration if rest > 0 and duration > 0 else None

    @property
    def tokens_per_second(self) -> float:
        return self.batch_size * (self.sequences.shape[1] - self.prompt_width) / self.seconds


def _kwargs(new_tokens: int, sampling: dict | None) -> dict:
    sample = {"do_sample": True, **sampling} if sampling else {"do_sample": False}
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": 0, **sample}


def _timed_ar(method: str, target, ids, mask, new_tokens: int, sampling: dict | None, **cache) -> BatchRun:
    """One timed batched AR call of `target.generate`; `cache`: its cache arguments."""
    streamer = ChunkTimer()
    start = time.perf_counter()
    out = target.generate(
        ids, attention_mask=mask, streamer=streamer, **cache, **_kwargs(new_tokens, sampling)
    )
    seconds = time.perf_counter() - start
    return BatchRun(
        method=method,
        sequences=out,
        prompt_width=ids.shape[1],
        seconds=seconds,
        prefill_seconds=streamer.times[0] - start if streamer.times else seconds,
        row_latency_seconds=[seconds] * ids.shape[0],
    )


@torch.inference_mode()
def run_batch_ar(target, ids, mask, new_tokens: int, sampling: dict | None = None) -> BatchRun:
    """Batched AR on the fast target (`budgetdraft_sdpa` + `GrowableCache` + few-row linear layers)."""
    cache = GrowableCache(config=target.config, initial_capacity=ids.shape[1] + new_tokens)
    with using_attention(target, FAST_SDPA), few_row_linears(target):
        run = _timed_ar("ar", target, ids, mask, new_tokens, sampling, **cache_kwargs(cache))
    run.target_cache_bytes = cache_nbytes(cache)
    return run


@torch.inference_mode()
def run_batch_static_ar(target, ids, mask, new_tokens: int, sampling: dict | None = None) -> BatchRun:
    """transformers' batched AR on a static cache, the target as loaded (on CUDA/XPU transformers compiles its
    forward on the first call: run it once untimed first)."""
    return _timed_ar("ar_static", target, ids, mask, new_tokens, sampling, cache_implementation="static")


@torch.inference_mode()
def run_batch_speculative(
    target,
    drafter,
    ids,
    mask,
    new_tokens: int,
    cache_implementation: str = "budgeted",
    cache_config: dict | None = None,
    sampling: dict | None = None,
    full_draft: bool = False,
) -> BatchRun:
    """The batched one-liner (`full_draft`: the drafter on its full cache instead, in the batched loop whatever the
    batch size)."""
    if full_draft:
        cache_config = {**(cache_config or {}), "full_draft_cache": True}
    with record_speculation() as stats:
        start = time.perf_counter()
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=drafter,
            cache_implementation=cache_implementation,
            cache_config=cache_config,
            return_dict_in_generate=True,
            **_kwargs(new_tokens, sampling),
        )
        seconds = time.perf_counter() - start
    # a batch reports the bytes of its ragged caches with every row in; one row (the single-sequence path) its
    # target cache and draft cache
    single = output_cache(out)
    speculation = stats.candidate_generator
    sizes = getattr(speculation, "cache_bytes", None) or {
        "target": cache_nbytes(single) if single is not None else 0,
        "draft": cache_nbytes(stats.draft_cache),
    }
    stats.candidate_generator = None  # drop the caches now that they are measured
    return BatchRun(
        method="full_draft" if full_draft else "speculative",
        sequences=out.sequences,
        prompt_width=ids.shape[1],
        seconds=seconds,
        prefill_seconds=stats.verify_seconds_per_round[0] + stats.draft_seconds_per_round[0],
        row_latency_seconds=[row.latency_seconds for row in stats.rows] or [seconds],
        target_cache_bytes=sizes["target"],
        draft_cache_bytes=sizes["draft"],
        stats=stats,
    )


def run_batch(method: str, target, drafter, ids, mask, new_tokens: int, **options) -> BatchRun:
    """`ar`: stock batched AR; `loop_ar`: the speculative loop with `draft_length=0` (the target alone on its ragged
    cache: what the loop is worth without drafting); `speculative`; `full_draft`."""
    if method == "ar":
        return run_batch_ar(target, ids, mask, new_tokens, options.get("sampling"))
    if method not in BATCH_METHODS:
        raise ValueError(f"method must be one of {BATCH_METHODS}, got {method!r}")
    if method == "loop_ar":
        run = run_batch_speculative(
            target, drafter, ids, mask, new_tokens, cache_config={"draft_length": 0}, **options
        )
        run.method = "loop_ar"
        return run
    return run_batch_speculative(
        target, drafter, ids, mask, new_tokens, full_draft=method == "full_draft", **options
    )


def ragged_batch(
    stream: torch.LongTensor, batch_size: int, context: int, pad_token_id: int = 0, seed: int = 0
):
    """`(ids (B, P), mask (B, P))`: `batch_size` passages of `stream` `(N,)` at spread offsets, lengths in
    `[7/8 context, context]` (ragged, left-padded)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [context] + [
        int(context - torch.randint(0, max(1, context // 8), (1,), generator=generator))
        for _ in range(batch_size - 1)
    ]
    span = max(1, stream.numel() - context)
    rows = [stream[(i * span) // max(1, batch_size) :][:n] for i, n in enumerate(lengths)]
    return left_pad(rows, pad_token_id)


def left_pad(rows: list[torch.LongTensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids (B, P), mask (B, P))`: 1-D token rows left-padded to the longest, `mask` 1 on real tokens."""
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.numel() :], mask[i, width - row.numel() :] = row, 1
    return ids, mask
