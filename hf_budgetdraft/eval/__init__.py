"""Evaluation and benchmarks: does a sparse draft keep the output exact, how often is it accepted, how much
faster is it, where does the time go, and how much memory does it save (`hf-budgetdraft bench`).

- `runners`: one runner per method (AR, native assisted, sink_window, budgeted, prompt lookup, native / windowed
  MTP), each one `hf_budgetdraft.runs.timed_call.timed_generate` call on a prompt of `hf_budgetdraft.demo.tasks`,
  compared with `hf_budgetdraft.runs.token_diff`;
- `metrics`: bootstrap intervals, the least-squares cost model;
- `bench_args`: `BenchArguments`, the flags and presets; `bench_models`: the models and corpus per preset;
- `bench`: the interleaved grid (`run_bench`); `records`: one record per run;
- `summary`: the records aggregated per cell, the phase fits; `report`: results.json / results.csv, with
  `report_markdown` (report.md, the terminal summary) and `plots` (the PNGs);
- `batched_bench`: the `--batch_sizes` grid of `hf_budgetdraft.runs.batch_call`;
- `far_context`, `replay`, `speedup_model`: the far-context probes, replayed acceptance and the speed-up model the
  benchmarks and scripts use.
"""

from .bench_args import BenchArguments
from .bench_models import BenchModels
from .bench_run import BenchResult, run_bench
from .metrics import LineFit, bootstrap_ci, fit_line, fit_round_time, paired_speedup
from .runners import MethodSpec, run_method

__all__ = [
    "BenchArguments",
    "BenchModels",
    "BenchResult",
    "LineFit",
    "MethodSpec",
    "bootstrap_ci",
    "fit_line",
    "fit_round_time",
    "paired_speedup",
    "run_bench",
    "run_method",
]
