"""`BenchArguments`: the flags of `hf-budgetdraft bench`, its presets and the bounds every grid option is held to.

Presets (`--preset`) set every grid option a flag leaves unset:
- `smoke`: tiny random models built in memory, the bundled demo tokenizer, an offline corpus from the Python
  standard library; < 2 min on 2 cores. It checks the machinery (lossless, bounded caches, the statistics), not
  the speed of a real drafter.
- `demo`: the bundled demo pair (the base and the BudgetDraft-trained drafter) on the demo corpus.
- `full`: your models (`--target`, `--drafter`, optionally `--base_drafter`, `--mtp_model`) and data
  (`--data_files`, or `--dataset_name` with network).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..cache.policies import POLICIES
from ..cache.sizes import MAX_CACHE_TOKENS
from ..demo.tasks import TASKS
from ..loading import check_device, revision_field, trust_remote_code_field

BENCH_METHODS = (
    "oneliner",
    "native",
    "sink_window",
    "budgeted",
    "prompt_lookup",
    "mtp",
    "ar_stock",
    "ar_growable",
    "ar_fast",
    "ar_static",
)
MAX_RUNS = 200_000  # bound on the generate() calls one bench may schedule
MAX_NEW_TOKENS = 4096
MAX_GAMMA = 64

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(
        contexts=[256, 512],
        budgets=[32, 96],
        gammas=[2, 4],
        policies=["chunk", "streaming", "snapkv"],
        methods=list(BENCH_METHODS),
        tasks=list(TASKS),
        new_tokens=24,
        repeats=2,
        samples=1,
        num_sink_tokens=4,
        budgeted_window_length=64,
        policy_kwargs='{"snapkv": {"window_size": 8}}',
        threads=1,
    ),
    "demo": dict(  # the README's table: ~20 min on 2 cores, alone
        contexts=[4096, 8192, 16384],
        budgets=[256, 512, 1024, 2048],
        gammas=[4],
        policies=["chunk"],
        methods=["oneliner", "native", "budgeted", "mtp", "ar_stock", "ar_growable", "ar_fast"],
        tasks=["document"],
        new_tokens=128,
        repeats=2,
        samples=1,
        num_sink_tokens=64,
        budgeted_window_length=256,
        threads=2,
    ),
    "full": dict(
        contexts=[4096, 8192, 16384],
        budgets=[256, 512, 1024, 2048],
        gammas=[4, 8],
        policies=["chunk"],
        methods=list(BENCH_METHODS),
        tasks=list(TASKS),
        new_tokens=256,
        repeats=5,
        samples=3,
        num_sink_tokens=64,
        budgeted_window_length=256,
        threads=None,  # torch's default (all cores)
    ),
}


@dataclass
class _SourceFlags:
    """Where the models and documents come from."""

    preset: Literal["smoke", "demo", "full"] = field(
        default="smoke",
        metadata={
            "help": "smoke: tiny random models (CI, < 2 min); demo: bundled pair; full: your models + data."
        },
    )
    output_dir: str = field(
        default="bench-out", metadata={"help": "Where results.json/.csv, report.md and the plots go."}
    )
    target: str | None = field(default=None, metadata={"help": "full: target model folder or hub name."})
    drafter: str | None = field(default=None, metadata={"help": "full: drafter model folder or hub name."})
    base_drafter: str | None = field(
        default=None,
        metadata={"help": "full: a second drafter to compare (e.g. before BudgetDraft training)."},
    )
    mtp_model: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint with MTP layers: runs native vs windowed MTP (generate(use_mtp=True))."
        },
    )
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer (default: the target's)."})
    data_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Local corpus: .txt/.md (prose), source files (code), .jsonl with 'text', folders."
        },
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "full: a `datasets` name to stream documents from (needs network)."}
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Configuration of --dataset_name."}
    )
    dataset_split: str = field(default="test", metadata={"help": "Split of --dataset_name."})
    text_column: str = field(default="text", metadata={"help": "Text column of --dataset_name."})
    max_documents: int = field(default=64, metadata={"help": "--dataset_name: documents to stream."})


@dataclass
class _GridFlags:
    """The grid every cell runs (`None`: the preset's default)."""

    tasks: list[str] | None = field(default=None, metadata={"help": f"Tasks among {list(TASKS)}."})
    contexts: list[int] | None = field(default=None, metadata={"help": "Prompt lengths in tokens."})
    budgets: list[int] | None = field(
        default=None,
        metadata={"help": "Prefix keys the draft reads: budgeted budget, or sink + window for sink_window."},
    )
    policies: list[str] | None = field(
        default=None, metadata={"help": f"Budgeted policies among {sorted(POLICIES)}."}
    )
    methods: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Methods among {list(BENCH_METHODS)}. Plain AR (the reference) always runs; ar_stock = AR with "
            "stock sdpa attention, ar_growable = AR on the fast GrowableCache, ar_fast = both, ar_static = "
            "transformers' static cache (compiled by transformers on an accelerator): the baselines of the extra "
            "speed-up columns."
        },
    )
    gammas: list[int] | None = field(
        default=None,
        metadata={
            "help": "Draft tokens per round; >= 2 values let the cost model round = c + γ·t_draft be fitted."
        },
    )
    num_sink_tokens: int | None = field(
        default=None, metadata={"help": "sink_window: attention-sink tokens."}
    )
    budgeted_window_length: int | None = field(
        default=None, metadata={"help": "budgeted: recent tokens kept after the prefill, besides the budget."}
    )
    policy_kwargs: str | None = field(
        default=None,
        metadata={"help": 'JSON: hyper-parameters per policy, e.g. \'{"snapkv": {"window_size": 8}}\'.'},
    )
    new_tokens: int | None = field(default=None, metadata={"help": "Tokens generated per run."})
    repeats: int | None = field(default=None, metadata={"help": "Interleaved timed repeats per cell."})
    samples: int | None = field(default=None, metadata={"help": "Prompts per task and context length."})


@dataclass
class _RunFlags:
    """How the runs are made and reported."""

    warmup: bool = field(
        default=True,
        metadata={
            "help": "One untimed run of every method before timing (on an accelerator one per prompt length: "
            "what compiles there compiles per shape)."
        },
    )
    threads: int | None = field(
        default=None, metadata={"help": "torch threads, set explicitly and recorded (smoke: 1, demo: 2)."}
    )
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:N."})
    revision: str | None = revision_field()
    trust_remote_code: bool = trust_remote_code_field()
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "Model dtype (fp32 on CPU: every greedy-diff cell must be 0)."}
    )
    target_attn_implementation: Literal["sdpa", "eager", "budgetdraft_sdpa"] | None = field(
        default=None,
        metadata={
            "help": "Attention of the target(s) for every method alike, AR included (e.g. budgetdraft_sdpa: cheap "
            "verification on CPU); default: as loaded."
        },
    )
    compiled_draft: bool = field(
        default=False,
        metadata={
            "help": "Also run every sparse draft on a static cache with its one-token step torch.compile'd (CPU "
            "included; labels '+compiled'), interleaved with the eager runs. The drafters then run "
            "budgetdraft_varlen attention (what a static draft cache needs) in every method."
        },
    )
    assistant_confidence_threshold: float = field(
        default=0.0,
        metadata={
            "help": "Drafters stop a round early once their top token's probability falls below this (transformers' "
            "assistant_confidence_threshold); γ is then the most a round drafts. 0: always γ tokens."
        },
    )
    passkey_depth: float = field(
        default=0.25,
        metadata={"help": "passkey: needle depth as a fraction of the haystack (0 = start, 1 = end)."},
    )
    seed: int = field(default=0, metadata={"help": "Seeds the prompts (and the smoke models)."})
    bootstrap_draws: int = field(default=2000, metadata={"help": "Bootstrap resamples per interval."})
    plots: bool = field(default=True, metadata={"help": "Write the PNG plots (matplotlib)."})
    progress: bool = field(default=True, metadata={"help": "Progress bar (tqdm) over the runs."})
    batch_sizes: list[int] | None = field(
        default=None,
        metadata={
            "help": "Run the batched grid instead: batched AR, the batched one-liner and a full-cache draft per "
            "batch size and context (throughput of all rows, per-row latency); see docs/batched.md."
        },
    )
    do_sample: bool = field(
        default=False,
        metadata={
            "help": "Sample at --temperature instead of greedy decoding (transformers' default top-k); every method "
            "of a repeat draws from the same seed. Token diffs then check nothing (each run draws its own tokens): "
            "the report gives acceptance and speed against AR sampling; the chi-square tests check the distribution."
        },
    )
    temperature: float = field(default=0.8, metadata={"help": "--do_sample: the sampling temperature."})

    @property
    def sampling(self) -> dict | None:
        """`generate()` settings of a sampling bench (`None`: greedy)."""
        return {"temperature": self.temperature} if self.do_sample else None


@dataclass
class BenchArguments(_RunFlags, _GridFlags, _SourceFlags):
    """Flags of `hf-budgetdraft bench` (the source, grid and run flags, in that order). `None` grid options take
    the preset's default."""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        defaults = PRESETS[self.preset]
        self.tasks_from_preset = self.tasks is None  # then tasks without data are dropped, not an error
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)
        if self.threads is None:
            self.threads = torch.get_num_threads()
        if self.device == "auto":
            raise ValueError(
                "--device auto (device_map) is for generate; the bench places models on one device"
            )
        check_device(self.device)
        self._check()
        self.policy_options = self._parse_policy_kwargs()

    def _parse_policy_kwargs(self) -> dict[str, dict]:
        if not self.policy_kwargs:
            return {}
        try:
            options = json.loads(self.policy_kwargs)
        except json.JSONDecodeError as error:
            raise ValueError(f"--policy_kwargs must be JSON, got {self.policy_kwargs!r}: {error}") from None
        if not isinstance(options, dict) or not all(
            name in POLICIES and isinstance(kwargs, dict) for name, kwargs in options.items()
        ):
            raise ValueError(
                f"--policy_kwargs must map policy names {sorted(POLICIES)} to dicts, e.g. "
                f'\'{{"snapkv": {{"window_size": 8}}}}\', got {self.policy_kwargs!r}'
            )
        return options

    def _check(self) -> None:
        self._check_ranges()
        self._check_choices()
        self._check_sources()

    def _check_ranges(self) -> None:
        _bounded("contexts", self.contexts, 16, MAX_CACHE_TOKENS)
        if self.batch_sizes is not None:
            from ..generation.batched_loop import MAX_BATCH_SIZE

            _bounded("batch_sizes", self.batch_sizes, 1, MAX_BATCH_SIZE)
        _bounded("budgets", self.budgets, 1, MAX_CACHE_TOKENS)
        _bounded("gammas", self.gammas, 1, MAX_GAMMA)
        _bounded("new_tokens", [self.new_tokens], 1, MAX_NEW_TOKENS)
        _bounded("repeats", [self.repeats], 1, 1000)
        _bounded("samples", [self.samples], 1, 1000)
        _bounded("threads", [self.threads], 1, 4096)
        _bounded("num_sink_tokens", [self.num_sink_tokens], 0, MAX_CACHE_TOKENS)
        _bounded("budgeted_window_length", [self.budgeted_window_length], 1, MAX_CACHE_TOKENS)
        _bounded("max_documents", [self.max_documents], 1, 100_000)
        _bounded("bootstrap_draws", [self.bootstrap_draws], 1, 1_000_000)
        if not 0.0 <= self.assistant_confidence_threshold < 1.0:
            raise ValueError(
                f"--assistant_confidence_threshold must be in [0, 1), got {self.assistant_confidence_threshold}; "
                "0 drafts γ tokens every round"
            )
        if not 0.0 <= self.passkey_depth <= 1.0:
            raise ValueError(f"--passkey_depth must be in [0, 1], got {self.passkey_depth}")
        if not 0.0 < self.temperature <= 10.0:
            raise ValueError(f"--temperature must be in (0, 10], got {self.temperature}")

    def _check_choices(self) -> None:
        for name, values, allowed in (
            ("tasks", self.tasks, TASKS),
            ("policies", self.policies, tuple(POLICIES)),
            ("methods", self.methods, BENCH_METHODS),
        ):
            unknown = sorted(set(values) - set(allowed))
            if unknown or not values:
                raise ValueError(f"--{name} must be among {list(allowed)}, got {values}")
        if "sink_window" in self.methods or "mtp" in self.methods:
            small = [b for b in self.budgets if b <= self.num_sink_tokens]
            if small:
                raise ValueError(
                    f"--budgets {small} must exceed --num_sink_tokens={self.num_sink_tokens} (sink_window reads "
                    "num_sink_tokens + window = budget); raise the budgets or lower the sink"
                )

    def _check_sources(self) -> None:
        if self.preset == "full" and not (self.target and self.drafter):
            raise ValueError("--preset full needs --target and --drafter (model folders or hub names)")
        if self.preset != "full" and (self.target or self.drafter or self.base_drafter):
            raise ValueError(f"--target/--drafter/--base_drafter are for --preset full, not {self.preset!r}")
        if self.data_files and self.dataset_name:
            raise ValueError("pass --data_files or --dataset_name, not both")
        # the most the warm-up may run: every cell's prompt on an accelerator
        runs = self.num_runs(self.max_specs(), warm_prompts=self.num_cells if self.device != "cpu" else 1)
        if runs > MAX_RUNS:
            raise ValueError(
                f"this grid schedules {runs} generate() calls (> {MAX_RUNS}); shrink --contexts/--budgets/--gammas/"
                "--policies/--repeats/--samples"
            )

    def max_specs(self) -> int:
        """Upper bound on the runs per cell and repeat (2 targets' AR, 2 drafters)."""
        oneliner = 2 * ("oneliner" in self.methods)
        per_gamma = ("native" in self.methods) + ("prompt_lookup" in self.methods)
        per_gamma += len(self.budgets) * (
            ("sink_window" in self.methods) + len(self.policies) * ("budgeted" in self.methods)
        )
        mtp = (2 + len(self.budgets)) if "mtp" in self.methods else 0
        return 3 + oneliner + 2 * per_gamma * len(self.gammas) + mtp

    @property
    def num_cells(self) -> int:
        """Prompts timed: contexts x tasks x samples."""
        return len(self.contexts) * len(self.tasks) * self.samples

    def num_runs(self, num_specs: int, warm_prompts: int = 1) -> int:
        """`generate()` calls of a bench of `num_specs` methods, the warm-up's over `warm_prompts` prompts."""
        return self.num_cells * self.repeats * num_specs + self.warmup * warm_prompts * num_specs


def _bounded(name: str, values: list[int], low: int, high: int) -> None:
    if not values:
        raise ValueError(f"--{name} needs at least one value")
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise ValueError(f"--{name} values must be in [{low}, {high}], got {bad}")
