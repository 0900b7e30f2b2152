"""How fast the CPU attention kernel reads the past during a verification, against this machine's sgemm peak.

`budgetdraft_sdpa` attends a verification's `q` new tokens to the past with one call of PyTorch's CPU flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`), the `G` query heads of each KV head folded into `G * q` rows
(`hf_budgetdraft/attention/fast_sdpa.py`). A one-token step reads the same keys with `G` rows, so what verifying
more tokens adds is `G * (q - 1)` rows over the same past. This script times that call alone for a grid of rows and
context lengths and reports its throughput, `4 * H_kv * rows * context * D` flops (QKᵀ and PV), next to a
`--gemm-size`³ fp32 matmul on the same threads (what the cores can do), and fits `ms = a + b * rows` per context: a
slope `b` that carries most of the time says the kernel is compute-bound for these rows, so a verification of
`q` tokens cannot cost about one decode step once `G * q * context` is large (e.g. q = 8 at 16K).

Run it alone (no other busy process: on 2 cores a second one stalls torch's threads):
    python benchmarks/attention_kernel.py --threads 2 --output-dir bench-out
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402


def median_seconds(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_gflops(size: int, repeats: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: a @ b, repeats) / 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 16, 24, 32, 35, 48, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gemm-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    for name in ("contexts", "head_dims", "rows"):
        if any(not 1 <= v <= 1 << 20 for v in getattr(args, name)):
            parser.error(
                f"--{name.replace('_', '-')} values must be in [1, 2**20], got {getattr(args, name)}"
            )
    if not 1 <= args.kv_heads <= 256 or not 1 <= args.repeats <= 1000 or not 64 <= args.gemm_size <= 8192:
        parser.error("--kv-heads in [1, 256], --repeats in [1, 1000], --gemm-size in [64, 8192]")
    if getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None) is None:
        parser.error("this torch build has no CPU flash attention kernel")
    return args


def measure_cell(flash, context: int, head_dim: int, args, generator, peak: float) -> tuple[list[dict], dict]:
    """`(records, fit)` of one context and head dim: the kernel's median time per query row count, interleaved,
    and the least-squares line `ms = fixed + per_row · rows`."""
    shape = (1, args.kv_heads, context, head_dim)
    key, value = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    times = {rows: [] for rows in args.rows}
    queries = {rows: torch.randn(1, args.kv_heads, rows, head_dim) for rows in args.rows}
    for rows in args.rows:  # warm-up
        flash(queries[rows], key, value, 0.0, False, scale=head_dim**-0.5)
    for _ in range(args.repeats):  # interleaved: drift does not favour one row count
        for rows in args.rows:
            start = time.perf_counter()
            flash(queries[rows], key, value, 0.0, False, scale=head_dim**-0.5)
            times[rows].append(time.perf_counter() - start)
    medians = {rows: statistics.median(t) for rows, t in times.items()}
    records = []
    for rows, seconds in medians.items():
        flops = 4 * args.kv_heads * rows * context * head_dim
        records.append(
            {
                "context_length": context,
                "head_dim": head_dim,
                "rows": rows,
                "ms_median": 1e3 * seconds,
                "gflops": flops / seconds / 1e9,
                "share_of_gemm_peak": flops / seconds / 1e9 / peak,
                "kv_gb_per_s": 2 * key.numel() * key.element_size() / seconds / 1e9,
            }
        )
    rows_axis = np.array(list(medians), dtype=float)
    slope, intercept = np.polyfit(rows_axis, 1e3 * np.array(list(medians.values())), 1)
    print(
        f"context {context}, D {head_dim}: "
        + ", ".join(f"{r} rows {1e3 * s:.2f} ms" for r, s in medians.items()),
        flush=True,
    )
    return records, {
        "context_length": context,
        "head_dim": head_dim,
        "ms_fixed": intercept,
        "ms_per_row": slope,
    }


def markdown(summary: dict, args) -> list[str]:
    """The report's lines: every record, the per-cell fits, and how they were measured."""
    records, fits, peak = summary["records"], summary["fits"], summary["gemm_gflops"]
    load_before = summary["load_average_before"]
    lines = [
        "| context | head dim | rows | ms | GFLOPS | share of sgemm peak | KV read (GB/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['context_length']} | {r['head_dim']} | {r['rows']} | {r['ms_median']:.3f} | {r['gflops']:.1f} | "
            f"{r['share_of_gemm_peak']:.0%} | {r['kv_gb_per_s']:.1f} |"
        )
    lines += [
        "",
        "| context | head dim | fit: ms fixed | fit: ms per row | 1 row / 32 rows from the fit |",
        "|---|---|---|---|---|",
    ]
    for f in fits:
        one, many = f["ms_fixed"] + f["ms_per_row"], f["ms_fixed"] + 32 * f["ms_per_row"]
        lines.append(
            f"| {f['context_length']} | {f['head_dim']} | {f['ms_fixed']:.3f} | {f['ms_per_row']:.4f} | "
            f"{one:.3f} / {many:.3f} ms |"
        )
    lines += [
        "",
        f"`_scaled_dot_product_flash_attention_for_cpu` over `(1, {args.kv_heads}, context, D)` fp32 keys/values, "
        f"medians of {args.repeats} interleaved calls; sgemm peak: {peak:.0f} GFLOPS ({args.gemm_size}³ fp32 "
        f"matmul); {summary['threads']} torch threads, load average before/after "
        f"{load_before[0]:.2f} / {summary['load_average_after'][0]:.2f}; {run_text(summary)}. A verification "
        "of q tokens reads G·q rows (G query heads per KV head), a one-token step G rows.",
    ]
    return lines


def main() -> None:
    args = parse_args()
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peak = gemm_gflops(args.gemm_size, args.repeats)
    records, fits = [], []
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        for head_dim in args.head_dims:
            cell_records, fit = measure_cell(flash, context, head_dim, args, generator, peak)
            records += cell_records
            fits.append(fit)

    summary = {
        **run_record(torch.get_num_threads()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "gemm_gflops": peak,
        "records": records,
        "fits": fits,
    }
    write_results(args.output_dir / "attention_kernel", summary, "\n".join(markdown(summary, args)))


if __name__ == "__main__":
    main()
