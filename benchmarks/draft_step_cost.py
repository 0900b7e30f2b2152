"""Per-draft-step cost of one drafter on a full `DynamicCache` vs `sink_window` vs `budgeted`, vs context length.

The "draft-KV tax" (Windowed-MTP, arXiv 2607.21535): a drafter attending over the whole cache pays a per-step cost
that grows with context; a sparse draft cache makes it constant. For each context length the caches are prefilled
once, then timed interleaved (A B C D A B C D ...) over `--repeats` blocks of `--steps` one-token draft steps, each
block rolled back with `crop(-steps)` so the context stays fixed. The fourth, `budgeted_compiled`, is the same
budgeted cache with `static=True` and the step compiled the way `generate()` compiles it (the drafter on
`budgetdraft_varlen`, `compiled_call`; compiled once, before the timing); the fifth, `budgeted_dynamic`, the same
budget with `policy="dynamic"` (each step re-selects it with its query, stepped inside `query_capture` as
`generate()` steps it; its cache holds the prompt's keys and values too); the sixth, `budgeted_lean`, the static
budgeted cache stepped by the lean draft step CPU `generate()` runs uncompiled (`hf_budgetdraft.cpu.lean_step`).
`lean/compiled` is what compiling saves over the lean step: the saving the CPU's compile-when-it-pays rule prices.
Writes JSON and a Markdown table.

Run it alone (no other busy process: on 2 cores a second one stalls torch's threads):
    python benchmarks/draft_step_cost.py --threads 2 --output-dir bench-out
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaForCausalLM

import hf_budgetdraft  # noqa: F401
from hf_budgetdraft import (
    BudgetedCache,
    SinkWindowCache,
    cache_nbytes,
    draft_step_compile_config,
    query_capture,
)
from hf_budgetdraft.cpu.lean_step import LeanDraftStep
from hf_budgetdraft.demo.random_models import random_llama_config
from hf_budgetdraft.generation.compiled_call import compiled_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402


def make_caches(config, static_config, args) -> dict:
    return {
        "full": DynamicCache(config=config),
        "sink_window": SinkWindowCache(
            config, num_sink_tokens=args.sink, window_length=args.window, slack=args.steps
        ),
        "budgeted": BudgetedCache(config, budget=args.budget, policy="chunk", slack=args.steps),
        "budgeted_compiled": BudgetedCache(
            static_config, budget=args.budget, policy="chunk", slack=args.steps, static=True
        ),
        "budgeted_dynamic": BudgetedCache(config, budget=args.budget, policy="dynamic", slack=args.steps),
        "budgeted_lean": BudgetedCache(
            static_config, budget=args.budget, policy="chunk", slack=args.steps, static=True
        ),
    }


STATIC_CACHES = ("budgeted_compiled", "budgeted_lean")  # prefilled by the drafter on budgetdraft_varlen


class Captured:
    """`model`'s forward inside `query_capture`, as `generate()` runs the steps of a dynamic budgeted cache."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        with query_capture(self.model):
            return self.model(*args, **kwargs)


class Lean:
    """The lean draft step with a model's call signature: `(input_ids, cache=, position_ids=, logits_to_keep=1)`."""

    def __init__(self, model):
        self.step = LeanDraftStep(model)

    def __call__(self, input_ids, cache, position_ids, logits_to_keep: int = 1):
        return self.step(input_ids, position_ids, cache)


@torch.inference_mode()
def time_block(model, cache, context: int, steps: int, token: torch.Tensor) -> float:
    """Seconds per one-token draft step of `model` (a module or its compiled call) over `steps` steps, then roll the
    cache back to `context`."""
    start = time.perf_counter()
    for i in range(steps):
        model(input_ids=token, cache=cache, position_ids=torch.tensor([[context + i]]), logits_to_keep=1)
    elapsed = time.perf_counter() - start
    cache.crop(-steps)
    return elapsed / steps


def bootstrap_ratio_ci(
    num: list[float], den: list[float], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of median(num) / median(den), resampling the interleaved repeats in pairs."""
    generator = torch.Generator().manual_seed(seed)
    n = len(num)
    a, b = torch.tensor(num), torch.tensor(den)
    idx = torch.randint(0, n, (draws, n), generator=generator)
    ratios = a[idx].median(dim=1).values / b[idx].median(dim=1).values
    return float(ratios.quantile(0.025)), float(ratios.quantile(0.975))


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved blocks per cache and context")
    parser.add_argument("--steps", type=int, default=8, help="draft steps per block (= the draft length γ)")
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out"))
    parser.add_argument(
        "--demo-drafter",
        action="store_true",
        help="time the bundled BudgetDraft drafter (hidden 192, vocab 2,048) instead of the random 2-layer Llama",
    )
    args = parser.parse_args()
    if max(args.contexts) > 262144 or args.repeats > 1000 or args.steps > 256:
        parser.error("contexts <= 262144, repeats <= 1000, steps <= 256")
    return parser, args


def load_drafter(parser: argparse.ArgumentParser, args):
    """The bundled drafter (`--demo-drafter`) or a random one of the shape `random_llama_config` documents."""
    if args.demo_drafter:
        from hf_budgetdraft.demo import load_demo_models

        model = load_demo_models().drafter
        if max(args.contexts) + args.steps > model.config.max_position_embeddings:
            parser.error(f"the demo drafter's positions end at {model.config.max_position_embeddings}")
        return model
    return LlamaForCausalLM(random_llama_config(2, max(args.contexts) + args.steps + 1)).eval()


def measure_context(context: int, model, static_model, steppers: dict, args) -> list[dict]:
    """One record per cache at `context`: the median block time over interleaved repeats, the draft KV bytes and,
    against the full cache, the speed-up with its bootstrap interval."""
    token = torch.tensor([[7]])
    prompt = torch.randint(0, model.config.vocab_size, (1, context))
    caches = make_caches(model.config, static_model.config, args)
    with torch.inference_mode():
        for name, cache in caches.items():  # the prefill runs eager
            (static_model if name in STATIC_CACHES else model)(prompt, cache=cache, logits_to_keep=1)
    times: dict[str, list[float]] = {name: [] for name in caches}
    warm_up = {}  # seconds of the first block: at the first context, `budgeted_compiled`'s includes its compilation
    for name, cache in caches.items():
        began = time.perf_counter()
        time_block(steppers[name], cache, context, args.steps, token)
        warm_up[name] = time.perf_counter() - began
    for _ in range(args.repeats):
        for name, cache in caches.items():
            times[name].append(time_block(steppers[name], cache, context, args.steps, token))
    records = []
    for name, cache in caches.items():
        record = {
            "context_length": context,
            "cache": name,
            "step_ms_median": 1e3 * statistics.median(times[name]),
            "step_ms_all": [1e3 * t for t in times[name]],
            "draft_cache_bytes": cache_nbytes(cache),
            "warm_up_seconds": warm_up[name],
        }
        if name != "full":
            low, high = bootstrap_ratio_ci(times["full"], times[name])
            record["full_over_this"] = statistics.median(times["full"]) / statistics.median(times[name])
            record["full_over_this_ci95"] = [low, high]
        if name == "budgeted_compiled":
            low, high = bootstrap_ratio_ci(times["budgeted_lean"], times[name])
            record["lean_over_this"] = statistics.median(times["budgeted_lean"]) / statistics.median(
                times[name]
            )
            record["lean_over_this_ci95"] = [low, high]
        records.append(record)
    line = ", ".join(f"{r['cache']} {r['step_ms_median']:.2f} ms" for r in records)
    print(f"context {context}: {line}", flush=True)
    return records


def markdown(records: list[dict], growth: dict, args) -> str:
    """The report: per context the step times, the speed-ups over the full cache and the draft KV sizes."""

    def ratio(record: dict) -> str:
        low, high = record["full_over_this_ci95"]
        return f"{record['full_over_this']:.2f} [{low:.2f}, {high:.2f}]"

    rows = [
        "| context | full (ms) | sink_window (ms) | budgeted (ms) | budgeted compiled (ms) | budgeted dynamic (ms) "
        "| full/sink_window [95% CI] | full/budgeted [95% CI] | full/budgeted compiled [95% CI] "
        "| full/budgeted dynamic [95% CI] | budgeted lean (ms) | lean/compiled [95% CI] "
        "| draft KV full / sink_window / budgeted / budgeted dynamic (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for context in args.contexts:
        cell = {r["cache"]: r for r in records if r["context_length"] == context}
        sw, bd, bc, dy = (
            cell[n] for n in ("sink_window", "budgeted", "budgeted_compiled", "budgeted_dynamic")
        )
        mib = " / ".join(
            f"{cell[n]['draft_cache_bytes'] / 2**20:.1f}"
            for n in ("full", "sink_window", "budgeted", "budgeted_dynamic")
        )
        low, high = bc["lean_over_this_ci95"]
        rows.append(
            f"| {context} | {cell['full']['step_ms_median']:.2f} | {sw['step_ms_median']:.2f} | "
            f"{bd['step_ms_median']:.2f} | {bc['step_ms_median']:.2f} | {dy['step_ms_median']:.2f} | {ratio(sw)} | "
            f"{ratio(bd)} | {ratio(bc)} | {ratio(dy)} | {cell['budgeted_lean']['step_ms_median']:.2f} | "
            f"{bc['lean_over_this']:.2f} [{low:.2f}, {high:.2f}] | {mib} |"
        )
    rows.append("")
    rows.append(
        f"Step-cost growth {min(args.contexts)} -> {max(args.contexts)} tokens: "
        + ", ".join(f"{name} x{value:.2f}" for name, value in growth.items())
        + f" ({args.threads} torch threads, {args.repeats} interleaved repeats of {args.steps} steps, medians)."
    )
    return "\n".join(rows)


def main() -> None:
    parser, args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_drafter(parser, args)
    static_model = copy.deepcopy(model)  # same weights, on the attention a static cache needs
    static_model.set_attn_implementation("budgetdraft_varlen")
    steppers = {
        "full": model,
        "sink_window": model,
        "budgeted": model,
        "budgeted_compiled": functools.partial(
            compiled_call(static_model, draft_step_compile_config(static_model.device))[0], static_model
        ),
        "budgeted_dynamic": Captured(model),
        "budgeted_lean": Lean(static_model),
    }
    records = []
    for context in args.contexts:
        records += measure_context(context, model, static_model, steppers, args)

    def median_ms(cache: str, context: int) -> float:
        return next(
            r["step_ms_median"] for r in records if r["cache"] == cache and r["context_length"] == context
        )

    lo, hi = min(args.contexts), max(args.contexts)
    growth = {name: median_ms(name, hi) / median_ms(name, lo) for name in steppers}
    summary = {
        **run_record(args.threads),
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "growth_from_min_to_max_context": growth,
        "records": records,
    }
    table = markdown(records, growth, args) + f" {run_text(summary)}."
    write_results(args.output_dir / "draft_step_cost", summary, table)


if __name__ == "__main__":
    main()
