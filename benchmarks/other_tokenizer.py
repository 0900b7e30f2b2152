"""A drafter with another tokenizer on a sparse draft cache, against the same drafter sharing the target's tokenizer,
transformers' own universal assisted generation and plain decoding.

    python benchmarks/other_tokenizer.py                          # 4K and 8K, 3 repeats, about 10 minutes
    python benchmarks/other_tokenizer.py --contexts 4096 --repeats 1 --out /tmp/other_tokenizer

The drafter with another tokenizer is the bundled BudgetDraft drafter re-indexed under a permuted, padded copy of
the demo tokenizer (`hf_budgetdraft.demo.permuted_vocabulary`): it drafts what the bundled drafter drafts, under
other ids, so the rows differ only in the translation between the two tokenizers. Rows, interleaved per repeat on
the last `context` tokens of the held-out play: stock AR (`target.generate(ids)`), the one-liner with the bundled
drafter, the one-liner with the re-indexed drafter (`tokenizer=`, `assistant_tokenizer=`), and transformers'
universal assisted generation with the re-indexed drafter (no `cache_implementation`: its drafter on a full cache).
Greedy, float32, 128 new tokens; every row's output is checked against stock AR's; a failure of transformers' own
loop is recorded in its row. Writes
`benchmarks/results/other_tokenizer.{json,md}`. Run it alone: it sets the thread count and times wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text  # noqa: E402

import hf_budgetdraft  # noqa: E402, F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models  # noqa: E402
from hf_budgetdraft.demo.documents import DEMO_TEXT  # noqa: E402
from hf_budgetdraft.demo.models import DEMO_DIR  # noqa: E402
from hf_budgetdraft.demo.permuted_vocabulary import permuted_pair  # noqa: E402
from hf_budgetdraft.runs.timed_call import timed_generate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "other_tokenizer"
ROWS = ("stock AR", "one-liner", "one-liner, drafter's own tokenizer", "stock universal assisted generation")


def calls(demo, permuted, tokenizer) -> dict[str, dict]:
    """Each row's `generate()` arguments."""
    translated = {"assistant_model": permuted, "tokenizer": demo.tokenizer, "assistant_tokenizer": tokenizer}
    return {
        ROWS[0]: {},
        ROWS[1]: {"assistant_model": demo.drafter, "cache_implementation": "budgeted"},
        ROWS[2]: translated | {"cache_implementation": "budgeted"},
        ROWS[3]: translated,
    }


def measure(contexts: list[int], repeats: int, new_tokens: int) -> list[dict]:
    demo = load_demo_models()
    with tempfile.TemporaryDirectory() as folder:
        permuted, tokenizer = permuted_pair(demo.drafter, DEMO_DIR / "tokenizer", Path(folder))
    rows_of = calls(demo, permuted, tokenizer)
    stream = demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    results = []
    for context in contexts:
        ids = stream[:, -context - new_tokens : -new_tokens]
        runs, failures = {name: [] for name in rows_of}, {}
        timed_generate(demo.target, ids, 8, assistant_model=demo.drafter, cache_implementation="budgeted")
        for _ in range(repeats):
            for name, kwargs in rows_of.items():  # interleaved
                if name in failures:
                    continue
                try:
                    runs[name].append(timed_generate(demo.target, ids, new_tokens, **kwargs))
                except RuntimeError as error:  # transformers' own loop: recorded, not fatal
                    if name != ROWS[3]:
                        raise
                    failures[name] = f"{type(error).__name__}: {error}"
        reference = runs[ROWS[0]][0].new_ids
        ar_decode = statistics.median(r.decode_tokens_per_second for r in runs[ROWS[0]])
        ar_seconds = statistics.median(r.seconds for r in runs[ROWS[0]])
        for name, done in runs.items():
            if name in failures:
                results.append({"context": context, "row": name, "failed": failures[name]})
                print(f"{context:>6} {name:<40} failed: {failures[name]}", flush=True)
                continue
            decode = statistics.median(r.decode_tokens_per_second for r in done)
            seconds = statistics.median(r.seconds for r in done)
            per_round = [r.stats.mean_accepted_length for r in done if r.stats.rounds]
            results.append(
                {
                    "context": context,
                    "row": name,
                    "decode_tokens_per_second": decode,
                    "seconds": seconds,
                    "decode_speedup": decode / ar_decode,
                    "end_to_end_speedup": ar_seconds / seconds,
                    "tokens_per_round": statistics.median(per_round) if per_round else None,
                    "identical": all(torch.equal(r.new_ids, reference) for r in done),
                    "failed": None,
                }
            )
            print(f"{context:>6} {name:<40} {decode:7.1f} tok/s  {decode / ar_decode:5.2f}x", flush=True)
    return results


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# A drafter with another tokenizer on a sparse draft cache",
        "",
        f"{run_text(meta)}, {meta['threads']} threads; the bundled target and BudgetDraft drafter, the drafter also "
        f"re-indexed under a permuted, padded tokenizer; the last `context` tokens of the held-out play, "
        f"{meta['new_tokens']} new tokens, greedy, float32, median of {meta['repeats']} interleaved repeats. "
        "`python benchmarks/other_tokenizer.py`.",
        "",
        "| context | row | decode tok/s | decode vs AR | end to end vs AR | tokens a round | identical |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        if row["failed"]:
            lines.append(f"| {row['context']:,} | {row['row']} | failed: {row['failed'][:120]} | | | | |")
            continue
        per_round = "-" if row["tokens_per_round"] is None else f"{row['tokens_per_round']:.2f}"
        lines.append(
            f"| {row['context']:,} | {row['row']} | {row['decode_tokens_per_second']:.1f} | "
            f"{row['decode_speedup']:.2f}x | {row['end_to_end_speedup']:.2f}x | {per_round} | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not all(64 <= c <= 32768 for c in args.contexts) or not 1 <= args.repeats <= 20:
        parser.error("--contexts in [64, 32768] (the play holds about 45K tokens) and --repeats in [1, 20]")
    if not 8 <= args.new_tokens <= 1024:
        parser.error("--new_tokens in [8, 1024]")
    torch.set_num_threads(args.threads)
    rows = measure(args.contexts, args.repeats, args.new_tokens)
    meta = {**run_record(threads=args.threads), "repeats": args.repeats, "new_tokens": args.new_tokens}
    result = {"meta": meta, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result))
    if not all(row["identical"] for row in rows if not row["failed"]):
        raise SystemExit("a row's output differs from stock AR's")


if __name__ == "__main__":
    main()
