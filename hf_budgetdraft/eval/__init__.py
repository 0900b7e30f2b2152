"""Evaluation and benchmarks: does a sparse draft keep the output exact, how often is it accepted, how much
faster is it, where does the time go, and how much memory does it save (`hf-budgetdraft bench`).

- `tasks`: seeded prompts — long-document continuation, code completion, passkey at a depth, a needle just outside
  a draft's window;
- `runners`: one runner per method (AR, native assisted, sink_window, budgeted, prompt lookup, native / windowed
  MTP), each one `hf_budgetdraft.eval.timing.timed_generate` call;
- `greedy_diff`: differing tokens vs the target's own greedy output and the noise envelope;
- `metrics`: Wilson and bootstrap intervals, the least-squares cost model;
- `bench_args`: `BenchArguments`, the flags and presets; `bench_models`: the models and corpus per preset;
- `bench`: the interleaved grid (`run_bench`); `records`: one record per run;
- `summary`: the records aggregated per cell, the phase fits; `report`: results.json / results.csv, with
  `report_markdown` (report.md, the terminal summary) and `plots` (the PNGs);
- `batched_bench`: timed batched calls and the `--batch_sizes` grid.
"""

from ..demo.corpus import Document, load_documents, stdlib_documents
from .bench import BenchResult, run_bench
from .bench_args import BenchArguments
from .bench_models import BenchModels
from .greedy_diff import TokenDiff, divergence_margin, noise_envelope, token_diff
from .metrics import (
    LineFit,
    acceptance_intervals,
    bootstrap_ci,
    fit_line,
    fit_round_time,
    paired_speedup,
    wilson_interval,
)
from .runners import MethodSpec, run_method
from .tasks import (
    TASKS,
    TaskSample,
    build_sample,
    code_completion_sample,
    continuation_sample,
    needle_outside_window_sample,
    passkey_sample,
)
from .timing import RunResult

__all__ = [
    "TASKS",
    "BenchArguments",
    "BenchModels",
    "BenchResult",
    "Document",
    "LineFit",
    "MethodSpec",
    "RunResult",
    "TaskSample",
    "TokenDiff",
    "acceptance_intervals",
    "bootstrap_ci",
    "build_sample",
    "code_completion_sample",
    "continuation_sample",
    "divergence_margin",
    "fit_line",
    "fit_round_time",
    "load_documents",
    "needle_outside_window_sample",
    "noise_envelope",
    "paired_speedup",
    "passkey_sample",
    "run_bench",
    "run_method",
    "stdlib_documents",
    "token_diff",
    "wilson_interval",
]
