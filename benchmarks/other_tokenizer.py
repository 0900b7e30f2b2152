"""A drafter with another tokenizer on a sparse draft cache, against the same drafter sharing the target's tokenizer,
transformers' own universal assisted generation and plain decoding.

    python benchmarks/other_tokenizer.py                   # 4K and 8K, 2 passages, 5 repeats, about 15 minutes
    python benchmarks/other_tokenizer.py --contexts 1024 --passages 1 --repeats 1 --out /tmp/other_tokenizer

The drafter with another tokenizer is a bundled BudgetDraft drafter re-indexed under a permuted, padded copy of the
demo tokenizer (`hf_budgetdraft.demo.permuted_vocabulary`): it drafts what the bundled drafter drafts, under other
ids, so the rows differ only in the translation between the two tokenizers. Rows, interleaved per repeat on each
passage (the play's last `context` tokens, then the `context` before them): stock AR (`target.generate(ids)`), the
one-liner with the bundled drafter, the one-liner with the re-indexed drafter (`tokenizer=`,
`assistant_tokenizer=`), and, greedy only, transformers' universal assisted generation with the re-indexed drafter
(no `cache_implementation`: its drafter on a full cache; its sampling version prunes the drafter in place). Greedy
and sampling (T 0.8, the sampling drafter, rows seeded alike), float32, 128 new tokens; greedy outputs are checked
against stock AR's; a failure of transformers' own loop is recorded in its row. Writes
`benchmarks/results/other_tokenizer.{json,md}`. Run it alone: it sets the thread count and times wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

import hf_budgetdraft  # noqa: E402, F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models  # noqa: E402
from hf_budgetdraft.demo.documents import DEMO_TEXT  # noqa: E402
from hf_budgetdraft.demo.models import DEMO_DIR  # noqa: E402
from hf_budgetdraft.demo.permuted_vocabulary import permuted_pair  # noqa: E402
from hf_budgetdraft.runs.timed_call import timed_generate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "other_tokenizer"
ROWS = ("stock AR", "one-liner", "one-liner, drafter's own tokenizer", "stock universal assisted generation")
SAMPLING = {"do_sample": True, "temperature": 0.8}


def calls(demo, mode: str, folder: Path) -> dict[str, dict]:
    """Each row's `generate()` arguments in `mode` (greedy: the four rows; sampling: the first three, with the
    drafter trained for sampling; transformers' sampling version would prune the re-indexed drafter in place)."""
    drafter = demo.drafter_for(mode == "sampling")
    permuted, tokenizer = permuted_pair(drafter, DEMO_DIR / "tokenizer", folder / mode)
    translated = {"assistant_model": permuted, "tokenizer": demo.tokenizer, "assistant_tokenizer": tokenizer}
    rows = {
        ROWS[0]: {},
        ROWS[1]: {"assistant_model": drafter, "cache_implementation": "budgeted"},
        ROWS[2]: translated | {"cache_implementation": "budgeted"},
        ROWS[3]: translated,
    }
    if mode == "sampling":
        return {name: kwargs | SAMPLING for name, kwargs in rows.items() if name != ROWS[3]}
    return rows


def cell(target, ids, rows_of: dict, repeats: int, new_tokens: int, seed: int) -> list[dict]:
    """One prompt's rows, interleaved per repeat (sampled rows seeded alike): medians, and ratios to stock AR."""
    runs, failures = {name: [] for name in rows_of}, {}
    for repeat in range(repeats):
        for name, kwargs in rows_of.items():
            if name in failures:
                continue
            torch.manual_seed(seed + repeat)
            try:
                runs[name].append(timed_generate(target, ids, new_tokens, **kwargs))
            except RuntimeError as error:  # transformers' own loop: recorded, not fatal
                if name != ROWS[3]:
                    raise
                failures[name] = f"{type(error).__name__}: {error}"
    greedy = not rows_of[ROWS[0]].get("do_sample")
    reference = runs[ROWS[0]][0].new_ids
    ar_decode = statistics.median(r.decode_tokens_per_second for r in runs[ROWS[0]])
    ar_seconds = statistics.median(r.seconds for r in runs[ROWS[0]])
    rows = []
    for name, done in runs.items():
        if name in failures:
            rows.append({"row": name, "failed": failures[name], "identical": None})
            continue
        decode = statistics.median(r.decode_tokens_per_second for r in done)
        seconds = statistics.median(r.seconds for r in done)
        per_round = [r.stats.mean_accepted_length for r in done if r.stats.rounds]
        rows.append(
            {
                "row": name,
                "decode_tokens_per_second": decode,
                "seconds": seconds,
                "decode_speedup": decode / ar_decode,
                "end_to_end_speedup": ar_seconds / seconds,
                "tokens_per_round": statistics.median(per_round) if per_round else None,
                "identical": all(torch.equal(r.new_ids, reference) for r in done) if greedy else None,
                "failed": None,
            }
        )
    return rows


def measure(contexts: list[int], passages: int, repeats: int, new_tokens: int) -> list[dict]:
    demo = load_demo_models()
    stream = demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    results = []
    with tempfile.TemporaryDirectory() as folder:
        modes = {mode: calls(demo, mode, Path(folder)) for mode in ("greedy", "sampling")}
    timed_generate(
        demo.target, stream[:, :1024], 8, assistant_model=demo.drafter, cache_implementation="budgeted"
    )
    for context in contexts:
        for passage in range(
            passages
        ):  # the play's last `context` tokens, then the `context` before them, ...
            end = stream.shape[1] - new_tokens - passage * context
            if end - context < 0:
                raise ValueError(f"the play holds no passage {passage} of {context} tokens")
            ids = stream[:, end - context : end]
            for mode, rows_of in modes.items():
                for row in cell(demo.target, ids, rows_of, repeats, new_tokens, seed=1000 * passage):
                    results.append({"context": context, "passage": passage, "mode": mode, **row})
                    speed = row["failed"] or f"{row['decode_speedup']:.2f}x AR"
                    print(f"{context:>6} p{passage} {mode:<8} {row['row']:<40} {speed}", flush=True)
    return results


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# A drafter with another tokenizer on a sparse draft cache",
        "",
        f"{run_text(meta)}, {meta['threads']} threads; the bundled target and BudgetDraft drafters, each also "
        f"re-indexed under a permuted, padded tokenizer; {meta['passages']} passages of `context` tokens from the "
        f"end of the held-out play, {meta['new_tokens']} new tokens, float32, greedy and sampling (T 0.8), median of "
        f"{meta['repeats']} interleaved repeats. `python benchmarks/other_tokenizer.py`.",
        "",
        "| context | passage | mode | row | decode tok/s | decode vs AR | end to end vs AR | tokens a round | identical |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        head = f"| {row['context']:,} | {row['passage']} | {row['mode']} | {row['row']} |"
        if row["failed"]:
            lines.append(f"{head} failed: {row['failed'][:100]} | | | | |")
            continue
        per_round = "-" if row["tokens_per_round"] is None else f"{row['tokens_per_round']:.2f}"
        identical = {None: "-", True: "yes", False: "NO"}[row["identical"]]
        lines.append(
            f"{head} {row['decode_tokens_per_second']:.1f} | {row['decode_speedup']:.2f}x | "
            f"{row['end_to_end_speedup']:.2f}x | {per_round} | {identical} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--passages", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not all(64 <= c <= 16384 for c in args.contexts) or not 1 <= args.repeats <= 20:
        parser.error("--contexts in [64, 16384] (the play holds about 45K tokens) and --repeats in [1, 20]")
    if not 1 <= args.passages <= 4:
        parser.error("--passages in [1, 4]")
    if not 8 <= args.new_tokens <= 1024:
        parser.error("--new_tokens in [8, 1024]")
    torch.set_num_threads(args.threads)
    rows = measure(args.contexts, args.passages, args.repeats, args.new_tokens)
    meta = {**run_record(threads=args.threads), "repeats": args.repeats, "new_tokens": args.new_tokens}
    meta["passages"] = args.passages
    result = {"meta": meta, "rows": rows}
    write_results(args.out, result, table(result), echo=False)
    if any(row["identical"] is False for row in rows):
        raise SystemExit("a row's output differs from stock AR's")


if __name__ == "__main__":
    main()
