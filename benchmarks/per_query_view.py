"""The per-query training view's selection cost: its queries scored one per block against the default blocks.

    python benchmarks/per_query_view.py --threads 2              # run alone: writes per_query_view.{json,md}

A per-query view (`hf_budgetdraft.trainer.per_query_view`) masks, for every continuation query of a layer the
deployed dynamic cache makes sparse, the prompt chunks that query's own `DynamicChunkPolicy.choose` keeps. It scores
its queries in blocks of at most `SELECTION_ELEMENTS` chunk scores; a bound of 1 scores one query at a time, the shape of
a loop over the continuation. Both give the same mask (checked here on every call). One layer's `visible`, random
fp32 keys `(1, H_kv, P + T, D)` and queries `(1, H_q, T, D)`, medians of interleaved calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_budgetdraft.cache.policies import DynamicChunkPolicy
from hf_budgetdraft.trainer import per_query_view

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192], help="prompt lengths P")
    parser.add_argument("--continuation", type=int, default=64, help="continuation tokens T")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--components", type=int, default=16, help="the policy's scored channels")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def measure(prompt: int, head_dim: int, args) -> dict:
    """Median ms of one layer's `visible` with one query a block and with the default blocks, interleaved."""
    generator = torch.Generator().manual_seed(prompt + head_dim)
    key = torch.randn(1, 2, prompt + args.continuation, head_dim, generator=generator)
    value, query = torch.randn_like(key), torch.randn(1, 8, args.continuation, head_dim, generator=generator)
    policy = DynamicChunkPolicy(chunk_size=8, components=args.components)
    view = per_query_view.PerQueryView(DynamicCache(), policy, args.budget, 256, prompt, frozenset({0}))
    default, times = per_query_view.SELECTION_ELEMENTS, {"one_query_a_block": [], "default_blocks": []}
    try:
        for _ in range(args.repeats + 1):  # the first round warms up
            masks = []
            for name, bound in (("one_query_a_block", 1), ("default_blocks", default)):
                per_query_view.SELECTION_ELEMENTS = bound
                began = time.perf_counter()
                masks.append(view.visible(0, query, key, value))
                times[name].append((time.perf_counter() - began) * 1e3)
            if not torch.equal(*masks):
                raise AssertionError(f"the blocks changed the mask at P={prompt}, D={head_dim}")
    finally:
        per_query_view.SELECTION_ELEMENTS = default
    medians = {name: statistics.median(values[1:]) for name, values in times.items()}
    pairs = zip(times["one_query_a_block"][1:], times["default_blocks"][1:], strict=True)
    ratios = [a / b for a, b in pairs]
    return {
        "prompt": prompt,
        "head_dim": head_dim,
        "exact_scores": not DynamicChunkPolicy(components=args.components).approximates(head_dim),
        "median_ms": medians,
        "speedup_median": statistics.median(ratios),
    }


def markdown(summary: dict) -> list[str]:
    lines = [
        "# Per-query view: selection cost of one layer (`benchmarks/per_query_view.py`)",
        "",
        "| P | D | scores | one query a block (ms) | default blocks (ms) | speed-up (median of ratios) |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in summary["records"]:
        scores = "exact" if r["exact_scores"] else f"{summary['settings']['components']} channels"
        lines.append(
            f"| {r['prompt']} | {r['head_dim']} | {scores} | {r['median_ms']['one_query_a_block']:.2f} | "
            f"{r['median_ms']['default_blocks']:.2f} | {r['speedup_median']:.2f}x |"
        )
    s = summary["settings"]
    lines += [
        "",
        f"T = {s['continuation']} continuation queries, 8 query heads over 2 KV heads, budget {s['budget']}, chunks "
        f"of 8, fp32, medians of {s['repeats']} interleaved calls; {summary['threads']} torch threads, run alone "
        f"(load average before/after {summary['load_average_before'][0]:.2f} / "
        f"{summary['load_average_after'][0]:.2f}); {run_text(summary)}.",
    ]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    records = [measure(p, d, args) for p in args.prompts for d in args.head_dims]
    summary = {
        **run_record(torch.get_num_threads()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "records": records,
    }
    write_results(args.output_dir / "per_query_view", summary, "\n".join(markdown(summary)))


if __name__ == "__main__":
    main()
