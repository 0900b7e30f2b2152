"""What serving the drafter with a serving engine's sliding window costs in acceptance, against `sink_window`.

    python benchmarks/serving_window.py --context 4096 --passages 8 --new-tokens 128 --gamma 6 --windows 1024 256 128

Bundled pair (`load_demo_models()`), greedy, a fixed draft length γ, prompts = `context` tokens of the held-out play
(King John) at evenly spaced offsets. Rows, all reading the same drafter weights:

- `full`: the drafter on its own full cache (stock transformers assisted generation);
- `sink_window S=64 W`: the package's draft cache (sink + window, its prefill reads the whole prompt);
- `sink_window S=64 W-64`: the same number of keys as an engine's window of W;
- `sink_window S=0 W`: no sink, the package's prefill: what dropping the sink alone costs;
- `engine W`: the checkpoint `hf-budgetdraft export` writes (`sliding_window = W + 1` on every layer), loaded with
  `AutoModelForCausalLM` and drafting on its own cache (stock assisted generation): no sink and a windowed prefill,
  the attention vLLM applies to it;
- `budgeted B=512`: the package's default draft cache (chunk policy), for reference.

Reported per row: mean accepted length (tokens emitted per verification round, `record_speculation()`), acceptance
rate, per-passage values, and whether the greedy output equals the `full` row's (it must: only the draft differs).
Runs single-threaded (`torch.set_num_threads(1)`; the machine is shared) and writes
`benchmarks/results/serving_window.{json,md}`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.eval.runners import run_assisted
from hf_budgetdraft.export_drafter import export_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SINK = 64
EXPLICIT = {
    "static": False,
    "compile": False,
    "fast_verify": False,
}  # the drafter's γ decides the draft length


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens")
    parser.add_argument(
        "--passages", type=int, default=8, help="prompts at evenly spaced offsets of the play"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=6, help="draft tokens a round (fixed)")
    parser.add_argument("--windows", type=int, nargs="+", default=[1024, 256, 128], help="engine windows W")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS / "serving_window")
    args = parser.parse_args(argv)
    if not (1 <= args.passages <= 16 and 1 <= args.new_tokens <= 1024 and 1 <= args.gamma <= 32):
        parser.error("need 1 <= passages <= 16, 1 <= new-tokens <= 1024, 1 <= gamma <= 32")
    if not all(SINK < w < args.context for w in args.windows):
        parser.error(f"every window must be in ({SINK}, context)")
    return args


def passages(tokenizer, context: int, count: int, new_tokens: int) -> list[tuple[int, torch.LongTensor]]:
    """`count` prompts `(offset, ids (1, context))` of the play, evenly spaced, each followed by enough text."""
    ids = tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids  # (1, N)
    room = ids.shape[1] - context - new_tokens
    if room < 0:
        raise ValueError(f"the play has {ids.shape[1]} tokens, fewer than context + new tokens")
    offsets = [round(i * room / max(count - 1, 1)) for i in range(count)]
    return [(o, ids[:, o : o + context]) for o in offsets]


def rows(windows: list[int]) -> list[tuple[str, str, dict | None, int | None, str | None]]:
    """`(name, drafter kind, cache_config or None for stock assisted, engine window, row it is compared with)`."""
    table = [("full", "drafter", None, None, None)]
    for w in windows:
        package = f"sink_window S={SINK} W={w}"
        same_keys = {"num_sink_tokens": SINK, "window_length": w - SINK}
        table += [
            (package, "drafter", {"num_sink_tokens": SINK, "window_length": w}, None, "full"),
            (f"sink_window S={SINK} W={w - SINK}", "drafter", same_keys, None, package),
            (f"sink_window S=0 W={w}", "drafter", {"num_sink_tokens": 0, "window_length": w}, None, package),
            (f"engine W={w}", "engine", None, w, package),
        ]
    budgeted = {"budget": 512, "policy": "chunk", "window_length": 256}
    table.append(("budgeted B=512", "drafter", budgeted, None, "full"))
    return table


def run_row(target, drafter, ids, args, cache_config: dict | None):
    cache = None if cache_config is None else ("budgeted" if "budget" in cache_config else "sink_window")
    config = None if cache_config is None else {**cache_config, **EXPLICIT}
    return run_assisted(target, drafter, ids, args.new_tokens, args.gamma, cache, config)


def summarise(name: str, runs: list) -> dict:
    """Pooled and per-passage acceptance of one row's runs."""
    accepted = [a for r in runs for a in r.stats.accepted_per_round]
    proposed = [p for r in runs for p in r.stats.proposed_per_round]
    return {
        "row": name,
        "rounds": len(accepted),
        "mean_accepted_length": (sum(accepted) + len(accepted)) / len(accepted),
        "acceptance_rate": sum(accepted) / sum(proposed),
        "per_passage_mean_accepted_length": [r.stats.mean_accepted_length for r in runs],
        "max_draft_tokens_a_round": max(proposed),
    }


def paired_difference(runs: list, baseline: list) -> dict:
    """Mean accepted length of `runs` minus `baseline`'s, passage by passage: mean, min and max over passages."""
    diffs = [
        r.stats.mean_accepted_length - b.stats.mean_accepted_length
        for r, b in zip(runs, baseline, strict=True)
    ]
    return {"mean": statistics.fmean(diffs), "min": min(diffs), "max": max(diffs), "per_passage": diffs}


def markdown(meta: dict, table: list[dict]) -> str:
    lines = [
        "# Serving-engine window vs `sink_window`: acceptance on the bundled pair",
        "",
        f"`benchmarks/serving_window.py`: {meta['passages']} passages of the held-out play (offsets "
        f"{meta['offsets']}), {meta['context']}-token context, {meta['new_tokens']} new tokens, greedy, γ = "
        f"{meta['gamma']}, {meta['threads']} thread; {meta['seconds']:.0f} s; {run_text(meta)}. Mean accepted length = tokens "
        "emitted per verification round; the difference is paired by passage (mean [min, max] over passages).",
        "",
        "| row | mean accepted length | per passage | acceptance rate | minus the row compared with | greedy = `full` |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        per = " / ".join(f"{x:.2f}" for x in r["per_passage_mean_accepted_length"])
        delta = ""
        if "paired_difference" in r:
            d = r["paired_difference"]
            delta = f"{d['mean']:+.2f} [{d['min']:+.2f}, {d['max']:+.2f}] vs {r['compared_with']}"
        same = "yes" if r["identical_to_full"] else "NO"
        lines.append(
            f"| {r['row']} | {r['mean_accepted_length']:.2f} | {per} | {r['acceptance_rate']:.1%} | {delta} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    demo = load_demo_models()
    prompts = passages(demo.tokenizer, args.context, args.passages, args.new_tokens)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        engines = {  # the exported checkpoints, loaded the way a user (or an engine's config reader) would
            w: AutoModelForCausalLM.from_pretrained(
                export_drafter(demo.drafter, Path(folder) / f"w{w}", engine="vllm", window_length=w)
            ).eval()
            for w in args.windows
        }
        results = {name: [] for name, *_ in rows(args.windows)}
        for offset, ids in prompts:
            for name, kind, cache_config, window, _ in rows(args.windows):
                drafter = engines[window] if kind == "engine" else demo.drafter
                results[name].append(run_row(demo.target, drafter, ids, args, cache_config))
                print(
                    f"offset {offset} {name}: {results[name][-1].stats.mean_accepted_length:.2f}", flush=True
                )
    reference = [r.new_ids for r in results["full"]]
    table = []
    for name, _, _, _, compared_with in rows(args.windows):
        runs = results[name]
        row = summarise(name, runs)
        row["identical_to_full"] = all(
            torch.equal(r.new_ids, ref) for r, ref in zip(runs, reference, strict=True)
        )
        if compared_with is not None:
            row["compared_with"] = compared_with
            row["paired_difference"] = paired_difference(runs, results[compared_with])
        table.append(row)
    meta = {
        "context": args.context,
        "passages": args.passages,
        "offsets": [o for o, _ in prompts],
        "new_tokens": args.new_tokens,
        "gamma": args.gamma,
        "windows": args.windows,
        "sink": SINK,
        **run_record(args.threads),
        "seconds": time.perf_counter() - start,
    }
    write_results(args.output, {"meta": meta, "rows": table}, markdown(meta, table))
    return 0 if all(r["identical_to_full"] for r in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
