"""`hf-budgetdraft bench`: every decoding method on long-context tasks (greedy-diff losslessness, acceptance,
speed-up, phase costs, memory), written to `results.json`, `results.csv`, `report.md` and plots
(`hf_budgetdraft.eval`); with `--batch_sizes`, the batched grid instead. Its flags are `BenchArguments`."""

from __future__ import annotations

import sys

from ..eval.bench_args import BenchArguments


def bench_command(args: BenchArguments) -> int:
    """Exit 0 when every greedy-diff cell is 0, 1 otherwise, 2 when it cannot run."""
    if args.batch_sizes:
        from ..eval.batched_bench import batched_bench_command

        return batched_bench_command(args)
    from ..eval.bench_run import run_bench
    from ..eval.report_markdown import console_summary

    try:
        result = run_bench(args)
    except FileNotFoundError as error:  # e.g. a broken install without the bundled demo weights
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(console_summary(result.summary, result.records, result.output_dir, result.metadata))
    return 0 if result.ok else 1
