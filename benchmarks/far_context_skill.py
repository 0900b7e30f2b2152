"""Does a target read far context? Copying by distance, retrieval in untrained formats, held-out perplexity.

    python benchmarks/far_context_skill.py --threads 2 --model far=runs/far/model \
        --out benchmarks/results/far_target/skill

Every model (`--model name=path`, plus the bundled target as `bundled`, the reference) is measured on the same
probes, built from held-out text only: King John (a play of the corpus's held-out split, no training row holds a
64-token span of it) as the filler, the licence texts as the passages (`hf_budgetdraft.eval.far_context`).

- `copy`: a 128-token passage, `distance` tokens of filler, the passage again; per-token agreement of the model's
  argmax with the second copy after its first 32 tokens; mean over probes, 95% bootstrap interval.
- `retrieval`: a fact in a format no training row used (a code worded otherwise, a name, a number inside prose),
  `distance` tokens of filler, the question; answered when every answer token is the argmax; Wilson 95%.
- `perplexity`: of `--ppl-tokens` tokens of King John in windows of `--ppl-window`, every model on the same tokens.

The far-context target's goals, checked per model: copying >= 90% at every distance up to 8K, retrieval >= 50% at
8K, perplexity no worse than the bundled target's. Writes `<out>.json` (with the git commit) and `<out>.md`. Run
it alone: a second busy process on 2 cores stalls torch's threads.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.eval.far_context import (
    RETRIEVAL_FORMATS,
    copy_probe,
    held_out_sources,
    retrieval_probe,
    score,
)
from hf_budgetdraft.eval.metrics import bootstrap_ci
from hf_budgetdraft.quiet import quiet_transformers
from hf_budgetdraft.runs.intervals import wilson_interval

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

COPY_GOAL, RETRIEVAL_GOAL, GOAL_DISTANCE = 0.90, 0.50, 8192


def copy_scores(model, filler, passages, distance: int, count: int, rng: random.Random) -> list[float]:
    scores = []
    for _ in range(count):
        offset = rng.randrange(filler.numel() - distance - 256)
        start = rng.randrange(passages.numel() - 128)
        scores.append(score(model, copy_probe(filler[offset:], passages[start : start + 128], distance)))
    return scores


def retrieval_scores(model, tokenizer, filler, distance: int, count: int, rng: random.Random) -> list[float]:
    formats = sorted(RETRIEVAL_FORMATS)
    scores = []
    for index in range(count):
        offset = rng.randrange(filler.numel() - distance - 256)
        probe = retrieval_probe(
            tokenizer, filler[offset:], formats[index % len(formats)], distance, rng.randrange(1 << 30)
        )
        scores.append(score(model, probe))
    return scores


@torch.inference_mode()
def perplexity(model, tokens: torch.Tensor, window: int) -> float:
    """exp(mean NLL) over `tokens (n,)`, cut into windows of `window + 1` tokens (every window scored whole)."""
    nll, count = 0.0, 0
    for start in range(0, tokens.numel() - window, window):
        ids = tokens[None, start : start + window + 1]
        logits = model(input_ids=ids[:, :-1]).logits[0].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += window
    return math.exp(nll / count)


def measure(model, tokenizer, sources: tuple[torch.Tensor, torch.Tensor], args) -> dict:
    """Copying and retrieval by distance and perplexity of `model` on `sources` (`held_out_sources`)."""
    filler, passages = sources
    rows = []
    for distance in args.distances:
        rng = random.Random(f"{args.seed}-{distance}")
        copied = copy_scores(model, filler, passages, distance, args.count, rng)
        answered = retrieval_scores(model, tokenizer, filler, distance, args.count, rng)
        rows.append(
            {
                "distance": distance,
                "copy": float(np.mean(copied)),
                "copy_ci": bootstrap_ci(copied, np.mean, draws=args.bootstrap_draws),
                "retrieval": float(np.mean(answered)),
                "retrieval_ci": wilson_interval(int(sum(answered)), len(answered)),
                "probes": args.count,
            }
        )
    return {
        "by_distance": rows,
        "perplexity": perplexity(model, filler[: args.ppl_tokens + 1], args.ppl_window),
    }


def goals(result: dict, reference_ppl: float) -> dict:
    near = [r for r in result["by_distance"] if r["distance"] <= GOAL_DISTANCE]
    at_goal = [r for r in result["by_distance"] if r["distance"] == GOAL_DISTANCE]
    return {
        "copy >= 90% to 8K": all(r["copy"] >= COPY_GOAL for r in near) if near else None,
        "retrieval >= 50% at 8K": at_goal[0]["retrieval"] >= RETRIEVAL_GOAL if at_goal else None,
        "perplexity <= bundled": result["perplexity"] <= reference_ppl,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", action="append", default=[], help="name=path of a saved model (repeatable)"
    )
    parser.add_argument("--distances", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--count", type=int, default=12, help="probes of each kind per distance")
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--ppl-window", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap-draws", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/far_target/skill"))
    args = parser.parse_args(argv)
    for spec in args.model:
        if "=" not in spec:
            parser.error(f"--model takes name=path, got {spec!r}")
    if not 1 <= args.count <= 1000 or not all(0 <= d <= 1 << 20 for d in args.distances):
        parser.error("--count must be in [1, 1000] and every distance in [0, 1M]")
    if not 16 <= args.ppl_window <= args.ppl_tokens <= 1 << 20:
        parser.error("need 16 <= --ppl-window <= --ppl-tokens <= 1M")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    models = {"bundled": DEMO_DIR / "target", **dict(spec.split("=", 1) for spec in args.model)}
    sources = held_out_sources(tokenizer)
    results = {}
    for name, path in models.items():
        with quiet_transformers():  # an MTP layer is "unexpected" to the main model
            model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=torch.float32)
        model.eval()
        results[name] = {"path": str(path), **measure(model, tokenizer, sources, args)}
        print(f"{name}: {time.time() - started:.0f} s", flush=True)
    for result in results.values():
        result["goals"] = goals(result, results["bundled"]["perplexity"])
    command = "python benchmarks/far_context_skill.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, **run_record(args.threads)}
    meta["seconds"] = round(time.time() - started)
    write_results(args.out, {"meta": meta, "models": results}, markdown(results, meta, args))
    return results


def markdown(results: dict, meta: dict, args) -> str:
    lines = [
        "# Does the target read far context?\n",
        f"`{meta['command']}`: {args.count} probes of each kind per distance, CPU fp32, "
        f"{args.threads} threads, {run_text(meta)}. Held-out filler (King John) and passages (licence texts). "
        "`copy` = per-token agreement with a 128-token passage seen once `distance` tokens back (after its first "
        "32 tokens; mean, 95% bootstrap interval); `retrieval` = facts in formats no training row used, answered "
        "whole (Wilson 95%); perplexity on King John in 2K windows.\n",
        "| model | distance | copy | retrieval |",
        "|---|---|---|---|",
    ]
    for name, result in results.items():
        for r in result["by_distance"]:
            lines.append(
                f"| {name} | {r['distance']} | {r['copy']:.2f} [{r['copy_ci'][0]:.2f}, {r['copy_ci'][1]:.2f}] | "
                f"{r['retrieval']:.2f} [{r['retrieval_ci'][0]:.2f}, {r['retrieval_ci'][1]:.2f}] |"
            )
    goal_names = list(results["bundled"]["goals"])
    lines += [
        "",
        "| model | perplexity | " + " | ".join(goal_names) + " |",
        "|---|---|" + "---|" * len(goal_names),
    ]
    for name, result in results.items():
        marks = " | ".join(
            "n/a" if v is None else ("met" if v else "missed") for v in result["goals"].values()
        )
        lines.append(f"| {name} | {result['perplexity']:.2f} | {marks} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
