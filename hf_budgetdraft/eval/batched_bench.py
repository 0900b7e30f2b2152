"""The batch-size grid of `hf-budgetdraft bench --batch_sizes`: the timed batched calls of `runs/batch_call.py` at
each batch size and context, interleaved, their records and the grid's table.
"""

from __future__ import annotations

import statistics

import torch

from ..runs.batch_call import BATCH_METHODS, BatchRun, ragged_batch, run_batch


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
    from .bench_run import load_corpus, load_models

    torch.set_num_threads(args.threads)
    with quiet_transformers():
        models = load_models(args, mtp_dir=None)
        if models.drafter_tokenizers:
            raise ValueError(
                f"--batch_sizes: the drafter(s) {sorted(models.drafter_tokenizers)} have a tokenizer other than the "
                "target's, and such a drafter drafts one sequence at a time; bench them without --batch_sizes"
            )
        documents, corpus = load_corpus(args)
        tokenizer = models.tokenizer
        if tokenizer is not None and documents:
            text = "\n\n".join(d.text for d in documents)
            stream = tokenizer(text, return_tensors="pt").input_ids[0]
        else:  # random models: a random token stream
            vocab = models.targets["target"].config.get_text_config().vocab_size
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
