"""Cost of verifying γ+1 tokens in one target forward vs a one-token decode step, vs context length.

Speculative decoding pays only if verifying γ+1 tokens costs about one decode step. On CPU, stock transformers
(`sdpa` + `DynamicCache`) does not get there at long context: it repeats the whole GQA KV cache on the masked path
and copies the whole cache on every append. This script measures each target setup (attention implementation +
cache) on a random-weight 27M-parameter Llama (hidden 512, 8 layers, 8 query / 2 KV heads; results in
`benchmarks/results/verify_cost*.md`):

- `stock`: `attn_implementation="sdpa"` + `DynamicCache` (transformers' default);
- `fast`: `attn_implementation="budgetdraft_sdpa"` + `GrowableCache` (this package);
- `--setups` also takes `sdpa+growable` and `budgetdraft_sdpa+dynamic`, to tell the two gains apart.

For each context length the prompt is prefilled once and copied into every setup's cache; then, over `--repeats`
interleaved rounds (setups and block sizes in a rotating order), each setup runs a forward of `q` tokens
(q ∈ `--verify-lengths`, 1 = the decode step) and rolls it back with `crop(-q)`, so the context stays fixed. Ratios
are of medians, with 95% bootstrap intervals over rounds (paired: one round gives both numerator and denominator).
Also checked: the `fast` logits equal the `stock` ones (max |diff| reported). `--dtype bfloat16` runs the same
model in bf16 (`verify_cost_bfloat16.{json,md}`): on CPUs with AMX the bf16 attention kernel makes the grouped rows
of a verification far cheaper than in fp32, where they are compute-bound. Goal: verifying ≤ 8 tokens at
16K costs ≤ 1.5x a one-token step.

Run it alone (no other busy process: on 2 cores a second one stalls torch's threads) and report the threads:
    python benchmarks/verify_cost.py --threads 2 --output-dir bench-out
Quick smoke run:
    python benchmarks/verify_cost.py --contexts 1024 4096 --repeats 3 --threads 1 --output-dir /tmp/verify
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_budgetdraft  # noqa: F401  (registers budgetdraft_sdpa)
from hf_budgetdraft import GrowableCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

SETUPS = {  # name -> (attn_implementation, cache class)
    "stock": ("sdpa", DynamicCache),
    "fast": ("budgetdraft_sdpa", GrowableCache),
    "sdpa+growable": ("sdpa", GrowableCache),
    "budgetdraft_sdpa+dynamic": ("budgetdraft_sdpa", DynamicCache),
}
GOAL_RATIO, GOAL_MAX_TOKENS = 1.5, 8
PREFILL_CHUNK = 2048


def target_config(max_positions: int) -> LlamaConfig:
    """27M parameters: hidden 512, 8 layers, 8 query heads, 2 KV heads (GQA 4:1), vocab 2048, RoPE base 1e6."""
    return LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def bootstrap_ratio_ci(
    num: list[float], den: list[float], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of median(num) / median(den), resampling the interleaved rounds in pairs."""
    generator = torch.Generator().manual_seed(seed)
    a, b = torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)
    idx = torch.randint(0, len(num), (draws, len(num)), generator=generator)
    ratios = a[idx].median(dim=1).values / b[idx].median(dim=1).values
    return float(ratios.quantile(0.025)), float(ratios.quantile(0.975))


def ratio(num: list[float], den: list[float]) -> dict:
    low, high = bootstrap_ratio_ci(num, den)
    return {"median_ratio": statistics.median(num) / statistics.median(den), "ci95": [low, high]}


def fill_cache(cache_class, config, keys_values, extra: int):
    """A cache of `cache_class` holding `keys_values` (one `(keys, values)` per layer), copied."""
    context = keys_values[0][0].shape[-2]
    cache = (
        GrowableCache(config=config, initial_capacity=context + extra)
        if cache_class is GrowableCache
        else DynamicCache(config=config)
    )
    for idx, (keys, values) in enumerate(keys_values):
        cache.update(keys.clone(), values.clone(), layer_idx=idx)
    return cache


@torch.inference_mode()
def time_forward(model, cache, tokens: torch.Tensor, context: int, inner: int) -> float:
    """Seconds per forward of `tokens` (1, q) at a fixed context, each rolled back with `crop(-q)`."""
    q = tokens.shape[1]
    position_ids = torch.arange(context, context + q)[None]
    start = time.perf_counter()
    for _ in range(inner):
        model(tokens, cache=cache, position_ids=position_ids, logits_to_keep=q)
        cache.crop(-q)
    return (time.perf_counter() - start) / inner


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument(
        "--verify-lengths",
        type=int,
        nargs="+",
        default=[1, 2, 4, 6, 8],
        help="tokens per forward (γ+1); 1 is the one-token decode step every ratio is taken against",
    )
    parser.add_argument("--setups", nargs="+", default=["stock", "fast"], choices=list(SETUPS))
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per context")
    parser.add_argument("--inner", type=int, default=2, help="forwards averaged per measurement")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights, activations and cache; bfloat16 uses the CPU's bf16 units (AMX / AVX512-BF16 where present)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    if (
        max(args.contexts) > 131072
        or args.repeats > 1000
        or args.inner > 100
        or max(args.verify_lengths) > 64
    ):
        parser.error("contexts <= 131072, repeats <= 1000, inner <= 100, verify lengths <= 64")
    if min(args.verify_lengths) < 1 or min(args.contexts) < 1 or args.repeats < 2:
        parser.error("verify lengths >= 1, contexts >= 1, repeats >= 2 (for intervals)")
    return args


def build_models(config, dtype: torch.dtype, setups: list[str]) -> tuple[dict, int]:
    """`(attention implementation -> model, parameter count)`: one random Llama's weights under every attention the
    setups (and the shared prefill) run."""
    base = LlamaForCausalLM(config).to(dtype).eval()
    models = {}  # one model per attention implementation, same weights
    for attn in dict.fromkeys([SETUPS[name][0] for name in setups] + ["budgetdraft_sdpa"]):
        # own config: it holds the attention choice
        models[attn] = LlamaForCausalLM(copy.deepcopy(config)).to(dtype).eval()
        models[attn].load_state_dict(base.state_dict())
        models[attn].set_attn_implementation(attn)
    return models, sum(p.numel() for p in base.parameters())


@torch.inference_mode()
def check_logits(models: dict, caches: dict, block, context: int, args) -> list[dict]:
    """Every setup's logits for `block` against the first setup's (and every path warmed up)."""
    logits = {}
    for name in args.setups:
        q = block.shape[1]
        logits[name] = models[SETUPS[name][0]](
            block, cache=caches[name], position_ids=torch.arange(context, context + q)[None]
        ).logits
        caches[name].crop(-q)
    reference = logits[args.setups[0]]
    return [
        {
            "context_length": context,
            "setup": name,
            "vs": args.setups[0],
            "max_abs_logit_diff": (logits[name] - reference).abs().max().item(),
            "same_argmax": bool(torch.equal(logits[name].argmax(-1), reference.argmax(-1))),
        }
        for name in args.setups[1:]
    ]


def context_records(models: dict, caches: dict, block, context: int, lengths: list[int], args) -> list[dict]:
    """One record per setup and verify length at `context`: median forward time over interleaved rounds (the order
    rotated each round), against the setup's own one-token step and against stock."""
    times = {(name, q): [] for name in args.setups for q in lengths}
    order = [(name, q) for q in lengths for name in args.setups]
    for round_idx in range(args.repeats):
        shift = round_idx % len(order)  # rotate the order so drift does not favour one cell
        for name, q in order[shift:] + order[:shift]:
            model = models[SETUPS[name][0]]
            times[(name, q)].append(time_forward(model, caches[name], block[:, :q], context, args.inner))
    records = []
    for name in args.setups:
        step = times[(name, 1)]
        for q in lengths:
            record = {
                "context_length": context,
                "setup": name,
                "attn_implementation": SETUPS[name][0],
                "cache": SETUPS[name][1].__name__,
                "tokens": q,
                "ms_median": 1e3 * statistics.median(times[(name, q)]),
                "ms_all": [1e3 * t for t in times[(name, q)]],
                "vs_own_one_token_step": ratio(times[(name, q)], step),
            }
            if "stock" in args.setups and name != "stock":
                record["stock_over_this"] = ratio(times[("stock", q)], times[(name, q)])
                record["vs_stock_one_token_step"] = ratio(times[(name, q)], times[("stock", 1)])
            records.append(record)
    return records


def goal_by_context(records: list[dict], args) -> list[dict]:
    """Per setup and context, the dearest verification of at most `GOAL_MAX_TOKENS` tokens against the goal."""
    goal = []
    for name in args.setups:
        for context in args.contexts:
            cells = [
                r
                for r in records
                if r["setup"] == name
                and r["context_length"] == context
                and 1 < r["tokens"] <= GOAL_MAX_TOKENS
            ]
            if cells:
                worst = max(cells, key=lambda r: r["vs_own_one_token_step"]["median_ratio"])
                goal.append(
                    {
                        "setup": name,
                        "context_length": context,
                        "worst_tokens": worst["tokens"],
                        "worst_ratio": worst["vs_own_one_token_step"]["median_ratio"],
                        "worst_ratio_ci95": worst["vs_own_one_token_step"]["ci95"],
                        "meets_goal": worst["vs_own_one_token_step"]["median_ratio"] <= GOAL_RATIO,
                    }
                )
    return goal


def markdown(summary: dict, lengths: list[int], args) -> str:
    """The report: times and ratios per context and length, the goal per context, the logit checks, the setting."""
    records, goal, checks = summary["records"], summary["goal_by_context"], summary["equivalence_checks"]
    num_parameters = summary["model"]["parameters"]
    load_before, load_after = summary["load_average_before"], summary["load_average_after"]
    header = "| context | tokens | " + " | ".join(f"{n} (ms)" for n in args.setups)
    header += " | " + " | ".join(f"{n}: q / 1-token [95% CI]" for n in args.setups)
    others = [n for n in args.setups if n != "stock"] if "stock" in args.setups else []
    header += "".join(f" | stock / {n} [95% CI]" for n in others) + " |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]

    def cell(context, name, q):
        return next(
            r for r in records if r["context_length"] == context and r["setup"] == name and r["tokens"] == q
        )

    def fmt(entry):
        return f"{entry['median_ratio']:.2f} [{entry['ci95'][0]:.2f}, {entry['ci95'][1]:.2f}]"

    for context in sorted(args.contexts):
        for q in lengths:
            row = [str(context), str(q)]
            row += [f"{cell(context, n, q)['ms_median']:.1f}" for n in args.setups]
            row += [fmt(cell(context, n, q)["vs_own_one_token_step"]) for n in args.setups]
            row += [fmt(cell(context, n, q)["stock_over_this"]) for n in others]
            rows.append("| " + " | ".join(row) + " |")
    rows.append("")
    for g in goal:
        verdict = "meets" if g["meets_goal"] else "misses"
        rows.append(
            f"- {g['setup']} at {g['context_length']}: worst q={g['worst_tokens']} costs {g['worst_ratio']:.2f}x "
            f"[{g['worst_ratio_ci95'][0]:.2f}, {g['worst_ratio_ci95'][1]:.2f}] a one-token step — {verdict} the "
            f"≤ {GOAL_RATIO}x goal"
        )
    for c in checks:
        rows.append(
            f"- logits of {c['setup']} vs {c['vs']} at {c['context_length']}: max |diff| "
            f"{c['max_abs_logit_diff']:.1e}, same argmax: {c['same_argmax']}"
        )
    rows.append("")
    rows.append(
        f"{num_parameters / 1e6:.1f}M-parameter random Llama in {args.dtype}, {torch.get_num_threads()} torch "
        f"threads, {args.repeats} interleaved rounds x {args.inner} forwards, medians. Load average before/after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f}; {run_text(summary)} — trust these numbers only from a run "
        "with nothing else busy."
    )
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    lengths = sorted(set(args.verify_lengths) | {1})
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.2f}; run alone: other busy processes distort these timings",
        flush=True,
    )
    torch.manual_seed(args.seed)
    config = target_config(max(args.contexts) + max(lengths) + 1)
    models, num_parameters = build_models(config, getattr(torch, args.dtype), args.setups)

    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (1, max(args.contexts)), generator=generator)
    block = torch.randint(0, config.vocab_size, (1, max(lengths)), generator=generator)
    master = GrowableCache(config=config, initial_capacity=max(args.contexts))
    done = 0
    records, checks = [], []
    for context in sorted(args.contexts):
        # extend the shared prefill (causal: the shorter prompt's KV is a prefix of the longer one's), in chunks so
        # no (chunk, context) mask or score matrix is ever large
        start = time.perf_counter()
        with torch.inference_mode():
            for first in range(done, context, PREFILL_CHUNK):
                chunk = prompt[:, first : min(first + PREFILL_CHUNK, context)]
                models["budgetdraft_sdpa"](chunk, cache=master, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        done = context
        keys_values = [(layer.keys, layer.values) for layer in master.layers]
        caches = {
            name: fill_cache(SETUPS[name][1], config, keys_values, extra=max(lengths) + 8)
            for name in args.setups
        }
        checks += check_logits(
            models, caches, block, context, args
        )  # the fast path computes the stock logits
        new = context_records(models, caches, block, context, lengths, args)
        records += new
        line = ", ".join(f"{r['setup']} q={r['tokens']} {r['ms_median']:.1f} ms" for r in new)
        print(f"context {context} (prefill {prefill_s:.1f} s): {line}", flush=True)

    summary = {
        "model": {
            "parameters": num_parameters,
            **{k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers")},
        },
        **run_record(torch.get_num_threads()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "goal": f"verify <= {GOAL_MAX_TOKENS} tokens <= {GOAL_RATIO}x a one-token step (own setup)",
        "goal_by_context": goal_by_context(records, args),
        "equivalence_checks": checks,
        "records": records,
    }
    stem = "verify_cost" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    write_results(args.output_dir / stem, summary, markdown(summary, lengths, args))


if __name__ == "__main__":
    main()
