"""Windowed-MTP cost model on CPU: per-round phase times of native vs windowed MTP drafting, 4K..64K context.

Windowed-MTP (arXiv 2607.21535) models a decode round as t_step = t_verify + t_ctx_draft + γ·t_fwd_draft: the
target verifies γ+1 tokens on its full cache; the MTP head first absorbs the newly verified token(s) into its own
cache (t_ctx_draft) and then drafts γ tokens (one MTP depth each). Native MTP attends over the whole MTP cache, so
both draft terms grow with context; windowed MTP reads a sink + window ring, so they stay flat.

Costs depend on shapes, not values: the caches are filled with random keys/values of the given context length
(no 64K prefill), and each phase is timed on a target of realistic proportions (GLM-4 style, 8 dense layers,
hidden 320, 10 heads / 2 KV heads, partial RoPE) with `--depth` MTP layers. Phases are timed interleaved
(native draft, windowed draft, verify, ...) in `--repeats` blocks, each block rolled back with `crop`.

Reports per context: t_verify, t_ctx_draft and t_fwd_draft per method, round time for γ = 1..depth with a
least-squares fit round = c + γ·t_fwd (standard errors), win% = step_native / step_windowed − 1 at γ = depth,
and the draft-KV bytes reclaimed (also as a share of all KV). Run alone:
    python benchmarks/mtp_cost.py --threads 2 --output-dir bench-out
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import hf_budgetdraft  # noqa: F401
from hf_budgetdraft import GrowableCache, cache_nbytes
from hf_budgetdraft.generation.mtp import WindowedMtpCache


def target_config(depth: int, max_positions: int) -> Glm4MoeConfig:
    layers = 8
    return Glm4MoeConfig(
        vocab_size=2048, hidden_size=320, intermediate_size=1024, num_hidden_layers=layers,
        first_k_dense_replace=layers + depth, num_attention_heads=10, num_key_value_heads=2, head_dim=32,
        partial_rotary_factor=0.5, max_position_embeddings=max_positions, num_mtp_layers=depth,
    )  # fmt: skip


def fill(cache, num_layers: int, length: int, heads: int, dim: int) -> None:
    """Fill a cache to `length` tokens with random keys/values (chunks, so the sparse layers see a prefill)."""
    for layer in range(num_layers):
        keys, values = torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim)
        cache.update(keys, values, layer)


@torch.inference_mode()
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = c + s·x with standard errors."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    sigma2 = residual / max(n - 2, 1)
    return {
        "c_ms": 1e3 * intercept,
        "t_fwd_ms": 1e3 * slope,
        "c_se_ms": 1e3 * (sigma2 * (1 / n + mx**2 / sxx)) ** 0.5,
        "t_fwd_se_ms": 1e3 * (sigma2 / sxx) ** 0.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--depth", type=int, default=3, help="MTP layers; γ = 1..depth are fitted")
    parser.add_argument(
        "--accepted", type=int, default=1, help="verified tokens absorbed per round (t_ctx_draft)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=4032)
    parser.add_argument(
        "--target-setup",
        choices=["fast", "stock"],
        default="fast",
        help="target verification: 'fast' = budgetdraft_sdpa + GrowableCache (this package), 'stock' = sdpa + "
        "DynamicCache (transformers' default)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    if max(args.contexts) > 262144 or not 1 <= args.depth <= 8 or args.repeats > 1000:
        parser.error("contexts <= 262144, 1 <= depth <= 8, repeats <= 1000")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = target_config(args.depth, max(args.contexts) + 64)
    target = Glm4MoeForCausalLM(config).eval()
    if args.target_setup == "fast":
        target.set_attn_implementation("budgetdraft_sdpa")
    mtp = MtpModel(target, args.depth).eval()
    heads, dim, hidden = config.num_key_value_heads, config.head_dim, config.hidden_size
    gamma_tokens = args.accepted + 1

    records = []
    for context in args.contexts:
        target_cache = (
            GrowableCache(config=config) if args.target_setup == "fast" else DynamicCache(config=config)
        )
        fill(target_cache, config.num_hidden_layers, context, heads, dim)
        caches = {
            "native": MtpCache(config=config.get_mtp_config()),
            "windowed": WindowedMtpCache(
                config=config.get_mtp_config(), num_sink_tokens=args.sink, window_length=args.window, slack=32
            ),
        }
        for cache in caches.values():
            fill(cache, args.depth, context, heads, dim)

        def verify(cache=target_cache, context=context):
            ids = torch.randint(0, config.vocab_size, (1, args.depth + 1))
            target(ids, cache=cache, position_ids=torch.arange(context, context + args.depth + 1)[None])
            cache.crop(-(args.depth + 1))

        def draft_layer(method, layer, tokens, context=context, caches=caches):
            """One MTP depth absorbing `tokens` tokens (t_ctx_draft when tokens > 1, t_fwd_draft when 1)."""
            cache = caches[method]
            ids = torch.randint(0, config.vocab_size, (1, tokens))
            positions = torch.arange(context, context + tokens)[None]
            mtp.forward_layer(layer, torch.randn(1, tokens, hidden), positions, cache, input_ids=ids)
            cache.layers[layer].crop(-tokens)

        phases = {
            "verify": [],
            **{f"{m}_ctx": [] for m in caches},
            **{f"{m}_fwd": [] for m in caches},
        }
        for repeat in range(args.repeats + 1):  # the first block is a warm-up
            block = {"verify": timed(verify)}
            for method in caches:
                block[f"{method}_ctx"] = timed(lambda m=method: draft_layer(m, 0, gamma_tokens))
                block[f"{method}_fwd"] = statistics.mean(
                    timed(lambda m=method, k=k: draft_layer(m, k, 1)) for k in range(args.depth)
                )
            if repeat:
                for key, value in block.items():
                    phases[key].append(value)

        median = {key: statistics.median(values) for key, values in phases.items()}
        record = {"context_length": context, **{f"{k}_ms": 1e3 * v for k, v in median.items()}}
        for method in caches:
            gammas = list(range(1, args.depth + 1))
            rounds = [
                median["verify"] + median[f"{method}_ctx"] + g * median[f"{method}_fwd"] for g in gammas
            ]
            # fit on the per-repeat rounds so the standard errors reflect the noise
            xs, ys = [], []
            for i in range(args.repeats):
                for g in gammas:
                    xs.append(g)
                    ys.append(
                        phases["verify"][i] + phases[f"{method}_ctx"][i] + g * phases[f"{method}_fwd"][i]
                    )
            record[f"{method}_round_ms"] = {g: 1e3 * r for g, r in zip(gammas, rounds, strict=True)}
            record[f"{method}_fit"] = fit_line(xs, ys)
            record[f"{method}_draft_kv_bytes"] = cache_nbytes(caches[method])
        step_native = record["native_round_ms"][args.depth]
        step_windowed = record["windowed_round_ms"][args.depth]
        record["win_percent"] = 100 * (step_native / step_windowed - 1)
        total_native = cache_nbytes(target_cache) + record["native_draft_kv_bytes"]
        reclaimed = record["native_draft_kv_bytes"] - record["windowed_draft_kv_bytes"]
        record["reclaimed_kv_bytes"] = reclaimed
        record["reclaimed_share_of_all_kv"] = reclaimed / total_native
        records.append(record)
        print(
            f"context {context}: verify {record['verify_ms']:.1f} ms, draft ctx native/windowed "
            f"{record['native_ctx_ms']:.2f}/{record['windowed_ctx_ms']:.2f} ms, win {record['win_percent']:+.0f}%",
            flush=True,
        )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "threads": args.threads,
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "records": records,
    }
    (args.output_dir / f"mtp_cost_{args.target_setup}.json").write_text(json.dumps(summary, indent=2))
    rows = [
        f"| context | t_verify (ms) | t_ctx_draft native / windowed (ms) | t_fwd_draft native / windowed (ms) "
        f"| fit t_fwd native / windowed (ms ± SE) | step native / windowed at γ={args.depth} (ms) | win | "
        "draft KV reclaimed (MiB, share of all KV) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        nf, wf = r["native_fit"], r["windowed_fit"]
        rows.append(
            f"| {r['context_length']} | {r['verify_ms']:.1f} | {r['native_ctx_ms']:.2f} / {r['windowed_ctx_ms']:.2f} "
            f"| {r['native_fwd_ms']:.2f} / {r['windowed_fwd_ms']:.2f} | {nf['t_fwd_ms']:.2f} ± {nf['t_fwd_se_ms']:.2f} / "
            f"{wf['t_fwd_ms']:.2f} ± {wf['t_fwd_se_ms']:.2f} | {r['native_round_ms'][args.depth]:.1f} / "
            f"{r['windowed_round_ms'][args.depth]:.1f} | {r['win_percent']:+.0f}% | "
            f"{r['reclaimed_kv_bytes'] / 2**20:.1f} ({100 * r['reclaimed_share_of_all_kv']:.1f}%) |"
        )
    rows.append("")
    rows.append(
        f"{args.threads} torch threads, {args.repeats} interleaved repeats (medians), sink {args.sink}, window "
        f"{args.window}, MTP depth {args.depth}, {gamma_tokens} tokens absorbed per round, target {args.target_setup}; "
        "random weights, caches "
        "filled with random keys/values (cost depends on shapes only)."
    )
    table = "\n".join(rows)
    (args.output_dir / f"mtp_cost_{args.target_setup}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
