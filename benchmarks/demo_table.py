"""The README's demo table from a `hf-budgetdraft bench --preset demo` run: per context length, per drafter and
draft cache, per budget: mean accepted length, greedy diff vs the target (tokens), and decode speed-up vs plain AR
(the target as benchmarked) and, when the bench ran the `ar_stock` baseline, vs stock-transformers AR.

    python benchmarks/demo_table.py bench-out/demo/results.json > benchmarks/results/demo_table.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROWS = (  # (label, target, drafter, method, compiled draft step)
    ("base drafter", "target", "base_drafter", "assisted", False),
    ("base drafter, compiled step", "target", "base_drafter", "assisted", True),
    ("BudgetDraft drafter", "target", "drafter", "assisted", False),
    ("BudgetDraft drafter, compiled step", "target", "drafter", "assisted", True),
    ("target's MTP head", "mtp", None, "mtp", False),
)


def cell(row: dict | None) -> str:
    if row is None:
        return "—"
    speedups = [row.get("decode_speedup_vs_ar"), row.get("decode_speedup_vs_ar_stock")]
    shown = [f"{s:.2f}×" if s is not None else "n/a" for s in speedups[: 2 if speedups[1] is not None else 1]]
    return " · ".join([f"{row['mean_accepted_length']:.2f}", str(row["diff_tokens_max"]), *shown])


def find(summary: list[dict], key: dict, cache: str, budget: int | None, compiled: bool) -> dict | None:
    """The summary row of `key` at `cache`/`budget`; `compiled`: the `+compiled` (static, compiled step) run."""
    wanted = {**key, "cache": cache, "budget": budget}
    return next(
        (
            r
            for r in summary
            if all(r[k] == v for k, v in wanted.items()) and r["name"].endswith("+compiled") == compiled
        ),
        None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    payload = json.loads(args.results.read_text())
    summary = [r for r in payload["summary"] if r["task"] == "all"]
    budgets = sorted({r["budget"] for r in summary if r["budget"] is not None})
    contexts = sorted({r["context_length"] for r in summary})
    header = ["context", "drafter", "full cache"] + [f"sparse B={b}" for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for context in contexts:
        for label, target, drafter, method, compiled in ROWS:
            sparse = "sink_window" if method == "mtp" else "budgeted"
            key = dict(context_length=context, target=target, method=method)
            if drafter is not None:
                key["drafter"] = drafter
            cells = [cell(find(summary, key, "full", None, compiled))]
            cells += [cell(find(summary, key, sparse, b, compiled)) for b in budgets]
            if any(c != "—" for c in cells):
                lines.append(f"| {context:,} | {label} | " + " | ".join(cells) + " |")
    arguments = payload["metadata"]["arguments"]
    stock = any(r.get("decode_speedup_vs_ar_stock") is not None for r in summary)
    attention = arguments.get("target_attn_implementation") or "as loaded"
    print(
        "Cells: mean accepted length (tokens per target forward) · greedy diff vs the target's own greedy output "
        f"(tokens) · decode speed-up vs plain AR with the same attention ({attention})"
        + (" · decode speed-up vs stock-transformers AR (sdpa)" if stock else "")
        + " (medians of paired ratios). Sparse = `budgeted` (chunk policy, window 256) for the drafters (`compiled "
        "step`: on a static cache with the one-token draft step torch.compile'd, `--compiled_draft`); for the MTP "
        "head, windowed MTP with sink 64 + window B − 64.\n"
    )
    print("\n".join(lines))
    print(
        f"\n{arguments['threads']} torch threads, {arguments['new_tokens']} new tokens, "
        f"{arguments['repeats']} interleaved repeats, task(s) {', '.join(arguments['tasks'])}"
    )


if __name__ == "__main__":
    main()
