"""Timed batched calls and the batch-size grid of `hf-budgetdraft bench --batch_sizes`.

Methods (one timed `generate()` of a left-padded batch, `new_tokens` tokens per row, exactly):

- `ar`: batched autoregressive decoding on the package's fast target (`budgetdraft_sdpa`, a `GrowableCache`);
- `speculative`: `generate(batch, attention_mask=mask, assistant_model=drafter, cache_implementation=...)`, the
  one-liner for a batch (every default; `cache_config` optional);
- `full_draft`: the same loop with the drafter reading its full cache (`cache_config={"full_draft_cache": True}`):
  what the sparse draft is compared with in the same batch.

Throughput = every row's new tokens after its first one / decode time (the call minus its prefill); per-row
latency = from the call's start to the row's last token (speculative rows finish at different rounds).
"""

from __future__ import annotations

import statistics
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
from .timing import ChunkTimer as _TimingStreamer

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


@torch.inference_mode()
def run_batch_ar(target, ids, mask, new_tokens: int, sampling: dict | None = None) -> BatchRun:
    """Batched AR on the fast target (`budgetdraft_sdpa` + `GrowableCache` + few-row linear layers)."""
    cache = GrowableCache(config=target.config, initial_capacity=ids.shape[1] + new_tokens)
    streamer = _TimingStreamer()
    with using_attention(target, FAST_SDPA), few_row_linears(target):
        start = time.perf_counter()
        out = target.generate(
            ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            streamer=streamer,
            **_kwargs(new_tokens, sampling),
        )
        seconds = time.perf_counter() - start
    return BatchRun(
        method="ar",
        sequences=out,
        prompt_width=ids.shape[1],
        seconds=seconds,
        prefill_seconds=streamer.times[0] - start if streamer.times else seconds,
        row_latency_seconds=[seconds] * ids.shape[0],
        target_cache_bytes=cache_nbytes(cache),
    )


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


def record(run: BatchRun, reference: BatchRun | None, compare_tokens: bool = True) -> dict:
    """A run's numbers for the grid (`reference`: the same batch's AR run, for the speed-up and, with
    `compare_tokens` (greedy), the rows identical to it)."""
    out = {
        "method": run.method,
        "batch_size": run.batch_size,
        "seconds": run.seconds,
        "prefill_seconds": run.prefill_seconds,
        "decode_tokens_per_second": run.decode_tokens_per_second,
        "row_latency_seconds": statistics.median(run.row_latency_seconds),
        "target_cache_bytes": run.target_cache_bytes,
        "draft_cache_bytes": run.draft_cache_bytes,
    }
    if run.stats is not None:
        out.update(
            mean_accepted_length=run.stats.mean_accepted_length,
            rounds=run.stats.rounds,
            ar_rounds=run.stats.ar_rounds,
            ar_row_share=ar_row_share(run.stats),
        )
    if reference is not None and run is not reference:
        ref, got = reference.decode_tokens_per_second, run.decode_tokens_per_second
        out["decode_vs_ar"] = got / ref if ref and got else None
    if reference is not None and run is not reference and compare_tokens:
        out["rows_identical"] = sum(
            bool(torch.equal(run.new_ids(i), reference.new_ids(i))) for i in range(run.batch_size)
        )
    return out


def ar_row_share(stats) -> float | None:
    """Of every row's decode rounds, the share in which that row drafted nothing (a plain AR step)."""
    rounds = sum(len(row.proposed_per_round) - 1 for row in stats.rows)  # less each row's prefill round
    steps = sum(row.ar_rounds - 1 for row in stats.rows)
    return steps / rounds if rounds > 0 else None


def batched_grid(
    target,
    drafter,
    stream: torch.LongTensor,
    contexts: list[int],
    batch_sizes: list[int],
    new_tokens: int,
    repeats: int,
    methods: tuple[str, ...] = BATCH_METHODS,
    sampling: dict | None = None,
    progress=None,
) -> list[dict]:
    """Every (context, batch size, repeat) cell: the methods back to back on the same batch, in an order that
    rotates with the repeat (no method always runs first). One record per run; greedy runs are checked row by row
    against the cell's AR run."""
    records = []
    for repeat in range(repeats):
        for context in contexts:
            if stream.numel() < context:
                continue
            for batch in batch_sizes:
                ids, mask = ragged_batch(stream, batch, context, seed=repeat)
                order = list(methods[repeat % len(methods) :] + methods[: repeat % len(methods)])
                runs = {}
                for method in order:
                    torch.manual_seed(repeat)
                    runs[method] = run_batch(
                        method, target, drafter, ids, mask, new_tokens, sampling=sampling
                    )
                    if progress is not None:
                        progress.update(1)
                reference = runs.get("ar")
                for method in methods:
                    row = record(runs[method], reference, compare_tokens=not sampling)
                    if "full_draft" in runs and method == "speculative":
                        full = runs["full_draft"].decode_tokens_per_second
                        row["decode_vs_full_draft"] = (
                            runs[method].decode_tokens_per_second / full if full else None
                        )
                    records.append({"context": context, "repeat": repeat, "sampling": bool(sampling), **row})
    return records


def summarise_grid(records: list[dict], draws: int = 2000) -> list[dict]:
    """Medians per (context, batch size, method), speed-ups with a 95% bootstrap interval."""
    import numpy as np

    from .metrics import bootstrap_ci

    keys = sorted({(r["context"], r["batch_size"], r["method"]) for r in records})
    rows = []
    for context, batch, method in keys:
        cell = [
            r for r in records if (r["context"], r["batch_size"], r["method"]) == (context, batch, method)
        ]
        row = {"context": context, "batch_size": batch, "method": method, "runs": len(cell)}
        for key in ("decode_vs_ar", "decode_vs_full_draft"):
            values = [r[key] for r in cell if r.get(key)]
            row[key] = (
                (statistics.median(values), *bootstrap_ci(values, np.median, draws=draws)) if values else None
            )
        for key in (
            "decode_tokens_per_second",
            "row_latency_seconds",
            "prefill_seconds",
            "mean_accepted_length",
            "ar_rounds",
            "ar_row_share",
            "target_cache_bytes",
            "draft_cache_bytes",
        ):
            values = [r[key] for r in cell if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        identical = [r["rows_identical"] for r in cell if "rows_identical" in r]
        row["rows_identical"] = f"{sum(identical)}/{batch * len(identical)}" if identical else ""
        rows.append(row)
    return rows


def interval_text(value) -> str:
    """`(median, low, high)` as `"1.23 [1.10, 1.35]"`; empty for `None`."""
    return f"{value[0]:.2f} [{value[1]:.2f}, {value[2]:.2f}]" if value else ""


def number_text(value, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else ""


def grid_markdown(rows: list[dict], title: str) -> str:
    ci, num = interval_text, number_text
    lines = [
        f"# {title}",
        "",
        "| context | batch | method | decode tok/s (all rows) | vs batched AR | vs full-cache draft | row latency s | "
        "tokens a round | AR rounds | rows' AR steps % | target KV MB | draft KV MB | rows identical to AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['batch_size']} | {r['method']} | {num(r['decode_tokens_per_second'])} | "
            f"{ci(r['decode_vs_ar'])} | {ci(r['decode_vs_full_draft'])} | {num(r['row_latency_seconds'], 2)} | "
            f"{num(r['mean_accepted_length'], 2)} | {num(r['ar_rounds'], 0)} | "
            f"{num(100 * r['ar_row_share'] if r.get('ar_row_share') is not None else None, 0)} | "
            f"{num((r['target_cache_bytes'] or 0) / 2**20)} | {num((r['draft_cache_bytes'] or 0) / 2**20, 2)} | "
            f"{r['rows_identical']} |"
        )
    return "\n".join(lines) + "\n"


def batched_bench_command(args) -> int:
    """`hf-budgetdraft bench --batch_sizes ...`: the batched grid on the preset's models and held-out text; writes
    `batched.json` / `batched.md` to `--output_dir`; exit 0 when every greedy row equals batched AR."""
    import json
    import sys
    from pathlib import Path

    from tqdm.auto import tqdm

    from ..quiet import quiet_transformers
    from .bench import load_corpus, load_models

    torch.set_num_threads(args.threads)
    with quiet_transformers():
        models = load_models(args, mtp_dir=None)
        documents, corpus = load_corpus(args)
        tokenizer = models.tokenizer
        if tokenizer is not None and documents:
            text = "\n\n".join(d.text for d in documents)
            stream = tokenizer(text, return_tensors="pt").input_ids[0]
        else:  # random models: a random token stream
            vocab = models.targets["target"].config.vocab_size
            stream = torch.randint(
                1, vocab, (max(args.contexts) * 4,), generator=torch.Generator().manual_seed(0)
            )
        sampling = args.sampling
        total = args.repeats * len(args.contexts) * len(args.batch_sizes) * len(BATCH_METHODS)
        with tqdm(total=total, desc="bench", unit="run", disable=not args.progress, file=sys.stderr) as bar:
            records = batched_grid(
                models.targets["target"],
                models.drafters["drafter"],
                stream,
                args.contexts,
                args.batch_sizes,
                args.new_tokens,
                args.repeats,
                sampling=sampling,
                progress=bar,
            )
    rows = summarise_grid(records, draws=args.bootstrap_draws)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "threads": args.threads, "corpus": corpus, "sampling": sampling}
    (out / "batched.json").write_text(
        json.dumps({"meta": meta, "summary": rows, "records": records}, indent=1)
    )
    table = grid_markdown(
        rows, f"Batched decoding ({args.preset}, {args.threads} threads, {args.new_tokens} new tokens)"
    )
    (out / "batched.md").write_text(table)
    print(table)
    return (
        0
        if sampling or all(r.get("rows_identical", r["batch_size"]) == r["batch_size"] for r in records)
        else 1
    )
