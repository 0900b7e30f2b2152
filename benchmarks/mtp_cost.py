"""Windowed-MTP cost model on CPU: per-round phase times of native vs windowed MTP drafting, 4K..64K context.

Windowed-MTP (arXiv 2607.21535) models a decode round as t_step = t_verify + t_ctx_draft + γ·t_fwd_draft: the
target verifies γ+1 tokens on its full cache; the MTP head's pass over the newly verified tokens (t_ctx_draft)
absorbs them into its own cache and emits the first draft token, and γ − 1 chained one-token steps emit the rest.
Every MTP forward ends in the shared LM head on its last position and an argmax, as in transformers'
`MtpModel.forward` and SGLang's draft loop, so t_fwd_draft includes the head (at a 32K vocabulary it costs about what
the windowed MTP layer does). Native MTP attends over the whole MTP cache, so both draft terms grow with context;
windowed MTP reads a sink + window ring, so they stay flat. Two windowed layouts are timed:
`windowed` reads the ring in place (`cache_config={"static": True}`: the sink + ring buffer in slot order under a
slot mask, `attn_implementation="budgetdraft_varlen"`), `windowed_gather` gathers `[sink, window, new]` into a fresh
tensor at every draft forward (the dynamic ring layers) — the same keys, one copy of the window more per step.

Costs depend on shapes, not values: the caches are filled with random keys/values of the given context length
(no 64K prefill). `--shape` picks the target: `qwen3-0.6b` (default) has Qwen3-0.6B's layer shapes (hidden 1024,
16 heads / 8 KV heads of 128, MLP 3072) in a GLM-4-style dense model of 8 layers with a 32K vocabulary (the LM
head is ~20% of the target's weights, as on Qwen3.6-35B-A3B's active path) and an MTP layer of the same active size
(a MoE block, as transformers builds GLM-4 MTP layers: 2 of 8 routed experts of 1,024 + one shared = 3,072);
`demo` is the bundled demo target's shape (hidden 320, its MTP layer's 2 experts top-1 + 1 shared of 192), where
per-op overhead, not attention, dominates. `--dtype bfloat16` runs weights, activations and caches in bf16, the
dtype MTP checkpoints ship in (on CPUs with AMX the bf16 attention kernel makes verification nearly flat in γ).
Draft step j runs MTP layer j mod `--depth` (one MTP layer reused γ times, as SGLang/vLLM draft several tokens from
DeepSeek-V3's single MTP layer). Both
draft caches append in O(1) (native: preallocated `GrowableLayer`s, like a paged cache; transformers' own
`MtpCache` copies its whole cache on every append, which would inflate the win), so the win is the attention read
alone. Phases are timed interleaved (verify, native draft, windowed drafts, ...) in `--repeats` blocks, each block
rolled back with `crop`.

Reports per context: t_verify (γ + 1 tokens) for γ = 1, 3 and `--gamma`; t_ctx_draft and mean t_fwd_draft per
method with a least-squares fit of the draft time over γ = 1..`--gamma`, draft = c + γ·t_fwd (standard errors; c =
t_ctx_draft − t_fwd_draft);
win% = step_native / step_windowed − 1 at those γ (and at γ = `--gamma` for the gathering layout); the ceiling: the
win of the same ring with a `--ceiling-window`-token window (64), whose attention reads next to nothing — about the
most any window can win at these shapes; and the draft-KV bytes reclaimed (also as a share of all KV).
Run alone:
    python benchmarks/mtp_cost.py --threads 2 --output-dir bench-out
On a GPU (the paper's setting; not run here, no GPU was lent):
    python benchmarks/mtp_cost.py --device cuda --dtype bfloat16 --contexts 32768 65536 131072 --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

import hf_budgetdraft  # noqa: F401
from hf_budgetdraft import GrowableCache, cache_nbytes
from hf_budgetdraft.cache import GrowableLayer, WindowedMtpCache
from hf_budgetdraft.generation.draft_length.clock import synchronize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

SHAPES = {
    # MoE fields: transformers builds GLM-4 MTP layers as MoE blocks whatever `first_k_dense_replace` says; the
    # active width (top-k routed + shared, × moe_intermediate_size) is set to the dense layers' intermediate_size
    "qwen3-0.6b": dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=1024,
    ),
    # the bundled demo target's own MTP layer: 2 routed experts top-1 + 1 shared, 192 wide
    "demo": dict(
        vocab_size=2048, hidden_size=320, intermediate_size=1024, num_attention_heads=10, num_key_value_heads=2,
        head_dim=32, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=192,
    ),
}  # fmt: skip


def target_config(shape: str, depth: int, max_positions: int) -> Glm4MoeConfig:
    """An 8-layer GLM-4-style target, dense decoder layers, partial RoPE; its MTP layers are MoE blocks (as
    transformers builds them) with the active width of a dense layer, like DeepSeek-V3's MTP module, which is one more
    block of the main model."""
    layers = 8
    return Glm4MoeConfig(
        **SHAPES[shape], num_hidden_layers=layers, first_k_dense_replace=layers + depth,
        partial_rotary_factor=0.5, max_position_embeddings=max_positions, num_mtp_layers=depth,
    )  # fmt: skip


def growable_mtp_cache(config, capacity: int) -> MtpCache:
    """transformers' `MtpCache` (per-depth query offsets) on preallocated layers: appends copy nothing."""
    cache = MtpCache(config=config)
    cache.layers = [GrowableLayer(initial_capacity=capacity) for _ in cache.layers]
    return cache


def fill(
    cache, num_layers: int, length: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Fill a cache to `length` tokens with random `dtype` keys/values."""
    for layer in range(num_layers):
        keys = torch.randn(1, heads, length, dim, dtype=dtype, device=device)
        values = torch.randn(1, heads, length, dim, dtype=dtype, device=device)
        cache.update(keys, values, layer)


@torch.inference_mode()
def timed(fn, device: torch.device) -> float:
    """Wall seconds of `fn()`, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
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


def parse_args() -> tuple[argparse.Namespace, torch.device]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument(
        "--depth", type=int, default=1, help="MTP layers; draft step j runs layer j mod depth"
    )
    parser.add_argument(
        "--gamma", type=int, default=7, help="draft tokens per round; γ = 1..gamma are fitted"
    )
    parser.add_argument(
        "--accepted", type=int, default=1, help="verified tokens absorbed per round (t_ctx_draft)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=4032)
    parser.add_argument(
        "--ceiling-window",
        type=int,
        default=64,
        help="also time a draft whose window is only this long (sink + ceiling-window): its win is about the most "
        "any window can win at these shapes, since its attention reads next to nothing; 0 skips it",
    )
    parser.add_argument(
        "--target-setup",
        choices=["fast", "stock"],
        default="fast",
        help="target verification: 'fast' = budgetdraft_varlen (budgetdraft_sdpa's CPU path + the static ring's slot "
        "mask) + GrowableCache (this package), 'stock' = sdpa + "
        "DynamicCache (transformers' default)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights, activations and caches; bfloat16 runs the matmuls and attention on the CPU's bf16 units "
        "(AMX / AVX512-BF16 where present), the dtype MTP checkpoints ship in",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda: the same phases timed on a GPU (synchronised around every phase); the fast "
        "setup's verification and ring then run budgetdraft_varlen's CUDA path (verified on CPU only so far)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    device = torch.device(args.device) if args.device.split(":")[0] in ("cpu", "cuda") else None
    if device is None or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device {args.device!r}: expected cpu, or cuda on a machine where torch sees a GPU")
    if (
        max(args.contexts) > 262144
        or not 1 <= args.depth <= 8
        or not 2 <= args.gamma <= 16
        or args.repeats > 1000
        or not 0 <= args.ceiling_window < args.window
    ):
        parser.error(
            "contexts <= 262144, 1 <= depth <= 8, 2 <= gamma <= 16, repeats <= 1000, 0 <= ceiling-window < window"
        )
    return args, device


@dataclass
class Bench:
    """What every timed phase of a run shares: the target, its MTP head, the settings."""

    target: Glm4MoeForCausalLM
    mtp: MtpModel
    args: argparse.Namespace
    dtype: torch.dtype
    device: torch.device
    absorbed: int  # the accepted tokens and the target's bonus token
    headline: list[int]  # the γ the report shows

    @property
    def config(self) -> Glm4MoeConfig:
        return self.target.config

    @property
    def slack(self) -> int:
        return self.absorbed + self.args.gamma


def context_caches(bench: Bench, context: int):
    """`(target cache, MTP caches by method, the windowed layout timed)` at `context`, filled with random keys and
    values: the native MTP cache, the windowed ring read in place (fast target only), the gathered one and the
    near-empty-window ceiling."""
    config, args, dtype, device = bench.config, bench.args, bench.dtype, bench.device
    heads, dim = config.num_key_value_heads, config.head_dim
    capacity = context + 2 * bench.slack
    if args.target_setup == "fast":
        target_cache = GrowableCache(config=config, initial_capacity=capacity)
    else:
        target_cache = DynamicCache(config=config)
    fill(target_cache, config.num_hidden_layers, context, heads, dim, dtype, device)
    mtp_config = config.get_mtp_config()
    window = dict(config=mtp_config, num_sink_tokens=args.sink, window_length=args.window, slack=bench.slack)
    caches = {"native": growable_mtp_cache(mtp_config, capacity)}
    # reading the ring in place needs budgetdraft_varlen (stock sdpa cannot hide the stale slots)
    if args.target_setup == "fast":
        caches["windowed"] = WindowedMtpCache(**window, static=True)
    caches["windowed_gather"] = WindowedMtpCache(**window)
    windowed = "windowed" if "windowed" in caches else "windowed_gather"
    if args.ceiling_window:  # the windowed layout with a near-empty window: what no window can beat
        ceiling = {**window, "window_length": args.ceiling_window, "static": windowed == "windowed"}
        caches["ceiling"] = WindowedMtpCache(**ceiling)
    for cache in caches.values():
        fill(cache, args.depth, context, heads, dim, dtype, device)
    return target_cache, caches, windowed


def verify(bench: Bench, cache, gamma: int, context: int) -> None:
    """The target scores the γ drafts and the token before them: γ + 1 tokens on its full cache."""
    device = bench.device
    ids = torch.randint(0, bench.config.vocab_size, (1, gamma + 1), device=device)
    bench.target(
        ids, cache=cache, position_ids=torch.arange(context, context + gamma + 1, device=device)[None]
    )
    cache.crop(-(gamma + 1))


def draft_round(bench: Bench, cache, context: int) -> list[float]:
    """t_ctx_draft (layer 0 absorbs the verified tokens and emits draft 1), then the γ − 1 chained one-token
    steps that emit drafts 2..γ; rolled back. Returns [t_ctx_draft, t_fwd_draft × (γ − 1)] in seconds."""
    args, device, absorbed, mtp = bench.args, bench.device, bench.absorbed, bench.mtp
    appended = [0] * args.depth
    state = {
        "hidden": torch.randn(1, absorbed, bench.config.hidden_size, dtype=bench.dtype, device=device),
        "ids": torch.randint(0, bench.config.vocab_size, (1, absorbed), device=device),
    }

    def step(layer, position):
        """One MTP forward plus the shared head on its last position: the next draft token."""
        tokens = state["ids"].shape[1]
        positions = torch.arange(position, position + tokens, device=device)[None]
        out = mtp.forward_layer(layer, state["hidden"], positions, cache, input_ids=state["ids"])
        state["hidden"] = out[:, -1:]
        state["ids"] = mtp._project_to_logits(state["hidden"]).argmax(-1)
        appended[layer] += tokens

    times = [timed(lambda: step(0, context), device)]
    for j in range(1, args.gamma):
        times.append(timed(lambda j=j: step(j % args.depth, context + absorbed + j - 1), device))
    for layer, tokens in enumerate(appended):
        if tokens:
            cache.layers[layer].crop(-tokens)
    return times


def time_context(bench: Bench, target_cache, caches: dict, context: int) -> dict:
    """Per key, the timings of every repeat after a warm-up block: `("verify", γ)` -> seconds for the headline γ,
    a method -> its rounds' `[t_ctx_draft, t_fwd_draft, ...]`."""
    samples = {**{("verify", g): [] for g in bench.headline}, **{m: [] for m in caches}}
    for repeat in range(bench.args.repeats + 1):  # the first block is a warm-up
        block = {
            **{
                ("verify", g): timed(lambda g=g: verify(bench, target_cache, g, context), bench.device)
                for g in bench.headline
            }
        }
        block.update({m: draft_round(bench, caches[m], context) for m in caches})
        if repeat:
            for key, value in block.items():
                samples[key].append(value)
    return samples


def context_record(
    bench: Bench, samples: dict, target_cache, caches: dict, windowed: str, context: int
) -> dict:
    """One context's medians, the round-time fits, the windowed layouts' wins over native and the KV reclaimed."""
    args, headline = bench.args, bench.headline

    def draft_s(method, i, g):
        """Draft seconds of a round of γ = g drafts in repeat i: t_ctx_draft + the first g − 1 steps."""
        ctx, *fwd = samples[method][i]
        return ctx + sum(fwd[: g - 1])

    record = {
        "context_length": context,
        "verify_ms": {g: 1e3 * statistics.median(samples["verify", g]) for g in headline},
    }
    for method in caches:
        record[f"{method}_ctx_ms"] = 1e3 * statistics.median(t[0] for t in samples[method])
        record[f"{method}_fwd_ms"] = 1e3 * statistics.median(statistics.mean(t[1:]) for t in samples[method])
        record[f"{method}_round_ms"] = {
            g: 1e3
            * statistics.median(samples["verify", g][i] + draft_s(method, i, g) for i in range(args.repeats))
            for g in headline
        }
        # draft time = c + γ·t_fwd, fitted on every repeat so the standard errors reflect the noise
        pairs = [(g, draft_s(method, i, g)) for i in range(args.repeats) for g in range(1, args.gamma + 1)]
        record[f"{method}_fit"] = fit_line([g for g, _ in pairs], [t for _, t in pairs])
        record[f"{method}_draft_kv_bytes"] = cache_nbytes(caches[method])
    record["windowed_layout"] = windowed
    for method in ("windowed", "windowed_gather", "ceiling"):
        if method in caches:
            record[f"{method}_win_percent"] = {
                g: 100 * (record["native_round_ms"][g] / record[f"{method}_round_ms"][g] - 1)
                for g in headline
            }
    record["win_percent"] = record[f"{windowed}_win_percent"]
    total_native = cache_nbytes(target_cache) + record["native_draft_kv_bytes"]
    reclaimed = record["native_draft_kv_bytes"] - record[f"{windowed}_draft_kv_bytes"]
    record["reclaimed_kv_bytes"] = reclaimed
    record["reclaimed_share_of_all_kv"] = reclaimed / total_native
    return record


def markdown(bench: Bench, records: list[dict], where: str) -> str:
    """The report: per context the verify and draft times, the fits, the wins and the KV reclaimed; the setting."""
    args, headline, absorbed = bench.args, bench.headline, bench.absorbed
    methods = [m for m in ("native", "windowed", "windowed_gather") if f"{m}_fwd_ms" in records[0]]
    shown = " / ".join(m.replace("_", " ") for m in methods)
    gather = "windowed_gather_win_percent" in records[0] and "windowed_win_percent" in records[0]
    ceiling = "ceiling_win_percent" in records[0]
    rows = [
        f"| context | t_verify at γ = {' / '.join(map(str, headline))} (ms) | t_ctx_draft {shown} (ms) "
        f"| t_fwd_draft {shown} (ms) | fit t_fwd {shown} (ms ± SE) | step {shown} at γ={args.gamma} (ms) "
        f"| win at γ = {' / '.join(map(str, headline))}"
        + (f" | win of windowed gather at γ={args.gamma}" if gather else "")
        + (
            f" | ceiling: win with a {args.ceiling_window}-token window at γ = {' / '.join(map(str, headline))}"
            if ceiling
            else ""
        )
        + " | draft KV reclaimed (MiB, share of all KV) |",
        "|---|---|---|---|---|---|---|" + ("---|" if gather else "") + ("---|" if ceiling else "") + "---|",
    ]
    for r in records:
        wins = " / ".join(f"{w:+.0f}%" for w in r["win_percent"].values())
        cells = [
            str(r["context_length"]),
            " / ".join(f"{v:.1f}" for v in r["verify_ms"].values()),
            " / ".join(f"{r[f'{m}_ctx_ms']:.2f}" for m in methods),
            " / ".join(f"{r[f'{m}_fwd_ms']:.2f}" for m in methods),
            " / ".join(
                f"{r[f'{m}_fit']['t_fwd_ms']:.2f} ± {r[f'{m}_fit']['t_fwd_se_ms']:.2f}" for m in methods
            ),
            " / ".join(f"{r[f'{m}_round_ms'][args.gamma]:.1f}" for m in methods),
            wins,
            *([f"{r['windowed_gather_win_percent'][args.gamma]:+.0f}%"] if gather else []),
            *([" / ".join(f"{w:+.0f}%" for w in r["ceiling_win_percent"].values())] if ceiling else []),
            f"{r['reclaimed_kv_bytes'] / 2**20:.1f} ({100 * r['reclaimed_share_of_all_kv']:.1f}%)",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    rows.append(
        f"Shape {args.shape}, {where}, run alone, {args.repeats} interleaved repeats (medians), "
        f"sink {args.sink}, window {args.window}, MTP depth {args.depth} (draft step j runs layer j mod depth), "
        f"{args.dtype}, {absorbed} tokens absorbed per round (that pass emits draft 1, γ − 1 one-token steps the "
        f"rest; each MTP forward includes the shared LM head on its last position), target {args.target_setup}; "
        "windowed = the ring read in place (static slots + slot mask), windowed gather = `[sink, window, new]` "
        f"gathered each forward; the win column is {records[0]['windowed_layout'].replace('_', ' ')}'s; random "
        "weights, caches filled with random keys/values (cost depends on shapes only)."
        + (
            f" Ceiling = the same layout with sink {args.sink} + a {args.ceiling_window}-token window, timed in the "
            "same pass: its draft attention reads next to nothing, so its win is about the most any window can win "
            "at these shapes on this machine."
            if ceiling
            else ""
        )
    )
    return "\n".join(rows)


def main() -> None:
    args, device = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = target_config(args.shape, args.depth, max(args.contexts) + 64)
    dtype = getattr(torch, args.dtype)
    target = Glm4MoeForCausalLM(config).to(device=device, dtype=dtype).eval()
    if args.target_setup == "fast":
        target.set_attn_implementation("budgetdraft_varlen")  # the MTP head shares it (static ring needs it)
    mtp = MtpModel(target, args.depth).to(device=device, dtype=dtype).eval()
    headline = sorted({g for g in (1, 3, args.gamma) if g <= args.gamma})
    bench = Bench(target, mtp, args, dtype, device, absorbed=args.accepted + 1, headline=headline)

    records = []
    for context in args.contexts:
        target_cache, caches, windowed = context_caches(bench, context)
        samples = time_context(bench, target_cache, caches, context)
        record = context_record(bench, samples, target_cache, caches, windowed, context)
        records.append(record)
        wins = ", ".join(f"γ={g} {w:+.0f}%" for g, w in record["win_percent"].items())
        print(
            f"context {context}: verify {record['verify_ms'][args.gamma]:.1f} ms, draft fwd {'/'.join(caches)} "
            f"{' / '.join(format(record[m + '_fwd_ms'], '.2f') for m in caches)} ms, win ({windowed}) {wins}",
            flush=True,
        )
        del target_cache, caches

    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = f"mtp_cost_{args.shape}_{args.target_setup}" + (
        "" if args.dtype == "float32" else f"_{args.dtype}"
    )
    name += "" if device.type == "cpu" else f"_{device.type}"
    where = f"{args.threads} torch threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    summary = {
        **run_record(args.threads),
        "device": where,
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "records": records,
    }
    table = markdown(bench, records, where) + f"\n\n{run_text(summary)}."
    write_results(args.output_dir / name, summary, table)


if __name__ == "__main__":
    main()
