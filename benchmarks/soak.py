"""Long runs hold steady: many consecutive calls on the bundled pair keep the process's memory flat.

Cycles through the one-liner's paths on the same two model objects — both draft caches, greedy and sampling, a
batch of 2, a model drafting for itself, plain `generate()` — for `--calls` calls, and every `--every` calls records
the process's RSS, the live tensors (`gc`) and the compiled graphs dynamo holds. Every greedy output is checked
against the target's own greedy output of the same prompt. A leak shows as a slope: the JSON keeps every sample and
the table gives the first and last samples after the warm-up and the RSS slope per 100 calls.

    python benchmarks/soak.py --threads 2 --output-dir benchmarks/results
Quick run:
    python benchmarks/soak.py --calls 60 --every 20 --warmup 20 --output-dir /tmp/soak
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

import hf_budgetdraft  # noqa: F401  (registers the draft caches)
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

PATHS = ("budgeted", "sink_window", "sampling", "batched", "self_draft", "plain")


def _call_kwargs(path: str, models) -> dict:
    draft = {"assistant_model": models.drafter, "cache_implementation": "budgeted"}
    return {
        "budgeted": draft,
        "sink_window": {**draft, "cache_implementation": "sink_window"},
        "sampling": {
            **draft,
            "assistant_model": models.sampling_drafter,
            "do_sample": True,
            "temperature": 0.8,
        },
        "batched": draft,
        "self_draft": {**draft, "assistant_model": models.target},
        "plain": {},
    }[path]


def sample(calls: int, started: float) -> dict:
    gc.collect()
    return {
        "calls": calls,
        "seconds": round(time.perf_counter() - started, 1),
        "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
        "live_tensors": sum(1 for o in gc.get_objects() if torch.is_tensor(o)),
        "dynamo_frames": int(torch._dynamo.utils.counters["frames"].get("ok", 0)),
    }


def run(args) -> dict:
    models = load_demo_models()
    tokens = models.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    prompts = [tokens[i * args.prompt_length : (i + 1) * args.prompt_length][None] for i in range(4)]
    expected = [models.target.generate(p, do_sample=False, max_new_tokens=args.new_tokens) for p in prompts]
    samples, mismatches, started = [], 0, time.perf_counter()
    for call in range(1, args.calls + 1):
        path, index = PATHS[call % len(PATHS)], call % len(prompts)
        ids = torch.cat([prompts[index], prompts[index - 1]]) if path == "batched" else prompts[index]
        out = models.target.generate(ids, max_new_tokens=args.new_tokens, **_call_kwargs(path, models))
        if path not in ("sampling", "batched"):
            mismatches += int(not torch.equal(out, expected[index]))
        if call % args.every == 0:
            samples.append(sample(call, started))
            print(samples[-1], flush=True)
    return {"samples": samples, "greedy_mismatches": mismatches}


def summarize(result: dict, warmup: int) -> dict:
    kept = [s for s in result["samples"] if s["calls"] > warmup]
    calls = [s["calls"] for s in kept]
    rss = [s["rss_mib"] for s in kept]
    slope = statistics.linear_regression(calls, rss).slope * 100 if len(kept) > 1 else 0.0
    return {
        "first": kept[0] if kept else None,
        "last": kept[-1] if kept else None,
        "rss_mib_per_100_calls": round(slope, 3),
        "live_tensors_range": [min(s["live_tensors"] for s in kept), max(s["live_tensors"] for s in kept)]
        if kept
        else None,
    }


def table(report: dict) -> str:
    summary, first, last = report["summary"], report["summary"]["first"], report["summary"]["last"]
    return "\n".join(
        [
            f"# Soak: {report['args']['calls']} calls on the bundled pair ({', '.join(PATHS)})",
            "",
            "| after calls | RSS MiB | live tensors | dynamo frames compiled |",
            "|---|---|---|---|",
            *(
                f"| {s['calls']} | {s['rss_mib']} | {s['live_tensors']} | {s['dynamo_frames']} |"
                for s in (first, last)
            ),
            "",
            f"RSS slope after the warm-up: {summary['rss_mib_per_100_calls']} MiB per 100 calls; live tensors "
            f"{summary['live_tensors_range']}; greedy outputs differing from the target's: "
            f"{report['greedy_mismatches']}. {report['threads']} threads, {run_text(report)}.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="calls between memory samples")
    parser.add_argument("--warmup", type=int, default=100, help="calls left out of the slope")
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if min(args.calls, args.every) < 1 or args.warmup < 0 or args.calls - args.warmup < args.every:
        parser.error(
            f"got --calls {args.calls}, --every {args.every}, --warmup {args.warmup}: the slope needs a memory "
            "sample after the warm-up, so --calls must exceed --warmup by at least --every (all positive)"
        )
    torch.set_num_threads(args.threads)
    result = run(args)
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **run_record(torch.get_num_threads()),
        **result,
        "summary": summarize(result, args.warmup),
    }
    write_results(args.output_dir / "soak", report, table(report))


if __name__ == "__main__":
    main()
