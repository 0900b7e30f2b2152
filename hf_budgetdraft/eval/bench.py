"""`hf-budgetdraft bench`: every method on every task, context length, budget and γ, in one interleaved run.

For each cell (task × context length × sample) the methods run in a fixed order A B C ... and that pass is
repeated `repeats` times (A B C A B C ...), so slow drifts of the machine hit every method alike and each
repeat pairs a method with the AR run next to it. Per run it records the greedy diff against the target's own AR
output, the speculation statistics, timings, and memory; then `report.write_report` writes `results.json`,
`results.csv`, `report.md` and the plots. The exit code is 1 when any greedy-diff cell is nonzero.

Presets (`--preset`):
- `smoke`: tiny random models built in memory (`random_models.smoke_pair`, whose drafter partly agrees with the
  target, and `random_models.smoke_mtp_model`), the bundled demo tokenizer, an offline corpus from the Python
  standard library; < 2 min on 2 cores. It checks the machinery (lossless, bounded caches, the statistics), not
  the speed of a real drafter: its drafter is as large as its target.
- `demo`: the bundled demo pair (`hf_budgetdraft.demo.load_demo_models()`, the base and the BudgetDraft-trained
  drafter) on the demo corpus.
- `full`: your models (`--target`, `--drafter`, optionally `--base_drafter`, `--mtp_model`) and data
  (`--data_files`, or `--dataset_name` with network).
Every grid option (`--contexts`, `--budgets`, ...) overrides the preset's default.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..attention.varlen import NAME as VARLEN_NAME
from ..cache.base import MAX_CACHE_TOKENS
from ..cache.policies import POLICIES
from ..quiet import quiet_transformers
from .greedy_diff import divergence_margin, noise_envelope, token_diff
from .runners import AR_SETUPS, MethodSpec, RunResult, run_method, sparse_cache_config
from .tasks import TASKS, Document, build_sample, load_documents, load_hub_documents, stdlib_documents

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
)
MAX_RUNS = 200_000  # bound on the generate() calls one bench may schedule
MAX_NEW_TOKENS = 4096
MAX_GAMMA = 64
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "demo" / "tokenizer"

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
class BenchArguments:
    """Flags of `hf-budgetdraft bench`. `None` grid options take the preset's default."""

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
            "stock sdpa attention, ar_growable = AR on the fast GrowableCache: the baselines of the extra speed-up "
            "columns."
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
    warmup: bool = field(default=True, metadata={"help": "One untimed run of every method before timing."})
    threads: int | None = field(
        default=None, metadata={"help": "torch threads, set explicitly and recorded (smoke: 1, demo: 2)."}
    )
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:N."})
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
    do_sample: bool = field(default=False, metadata={"help": "--batch_sizes: sample (temperature 0.8)."})

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
        def bounded(name: str, values: list[int], low: int, high: int) -> None:
            if not values:
                raise ValueError(f"--{name} needs at least one value")
            bad = [v for v in values if not low <= v <= high]
            if bad:
                raise ValueError(f"--{name} values must be in [{low}, {high}], got {bad}")

        bounded("contexts", self.contexts, 16, MAX_CACHE_TOKENS)
        if self.batch_sizes is not None:
            from ..generation.batched import MAX_BATCH_SIZE

            bounded("batch_sizes", self.batch_sizes, 1, MAX_BATCH_SIZE)
        bounded("budgets", self.budgets, 1, MAX_CACHE_TOKENS)
        bounded("gammas", self.gammas, 1, MAX_GAMMA)
        bounded("new_tokens", [self.new_tokens], 1, MAX_NEW_TOKENS)
        bounded("repeats", [self.repeats], 1, 1000)
        bounded("samples", [self.samples], 1, 1000)
        bounded("threads", [self.threads], 1, 4096)
        bounded("num_sink_tokens", [self.num_sink_tokens], 0, MAX_CACHE_TOKENS)
        bounded("budgeted_window_length", [self.budgeted_window_length], 1, MAX_CACHE_TOKENS)
        bounded("max_documents", [self.max_documents], 1, 100_000)
        bounded("bootstrap_draws", [self.bootstrap_draws], 1, 1_000_000)
        if not 0.0 <= self.assistant_confidence_threshold < 1.0:
            raise ValueError(
                f"--assistant_confidence_threshold must be in [0, 1), got {self.assistant_confidence_threshold}; "
                "0 drafts γ tokens every round"
            )
        if not 0.0 <= self.passkey_depth <= 1.0:
            raise ValueError(f"--passkey_depth must be in [0, 1], got {self.passkey_depth}")
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
        if self.preset == "full" and not (self.target and self.drafter):
            raise ValueError("--preset full needs --target and --drafter (model folders or hub names)")
        if self.preset != "full" and (self.target or self.drafter or self.base_drafter):
            raise ValueError(f"--target/--drafter/--base_drafter are for --preset full, not {self.preset!r}")
        if self.data_files and self.dataset_name:
            raise ValueError("pass --data_files or --dataset_name, not both")
        runs = self.num_runs(num_specs=self.max_specs())
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
        mtp = (1 + len(self.budgets)) if "mtp" in self.methods else 0
        return 3 + oneliner + 2 * per_gamma * len(self.gammas) + mtp

    def num_runs(self, num_specs: int) -> int:
        cells = len(self.contexts) * len(self.tasks) * self.samples
        return cells * self.repeats * num_specs + self.warmup * num_specs


@dataclass
class BenchModels:
    """The models one bench compares: targets by name (`"target"`, `"mtp"`), drafters by name."""

    tokenizer: Any
    targets: dict[str, Any]
    drafters: dict[str, Any]
    description: dict[str, str] = field(default_factory=dict)


@dataclass
class BenchResult:
    records: list[dict]
    summary: list[dict]
    fits: list[dict]
    envelope: list[dict]
    metadata: dict
    output_dir: Path

    @property
    def ok(self) -> bool:
        """Every greedy-diff cell is 0."""
        return all(r["diff_tokens"] == 0 for r in self.records)


# ---------------------------------------------------------------------------------------------------------------
# Models and data per preset
# ---------------------------------------------------------------------------------------------------------------


def _bundled_tokenizer():
    from transformers import AutoTokenizer

    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"the bundled tokenizer is missing from {TOKENIZER_DIR}; reinstall hf-budgetdraft"
        )
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def smoke_models(args: BenchArguments, mtp_dir: str | None) -> BenchModels:
    """The smoke preset's tiny pair (+ a tiny MTP model saved under `mtp_dir` when MTP is benchmarked)."""
    from ..random_models import smoke_mtp_model, smoke_pair

    positions = max(args.contexts) + args.new_tokens + MAX_GAMMA + 8
    target, drafter = smoke_pair(seed=args.seed, max_position_embeddings=positions)
    targets = {"target": target}
    description = {
        "target": "smoke_pair target (random Llama, 2 layers, hidden 64)",
        "drafter": "target + 1% noise",
    }
    if "mtp" in args.methods and mtp_dir is not None:
        targets["mtp"] = smoke_mtp_model(mtp_dir, seed=args.seed, max_position_embeddings=positions)
        description["mtp"] = "smoke_mtp_model (random GLM-4-style, 2 dense layers + 2 random MTP layers)"
    return BenchModels(_bundled_tokenizer(), targets, {"drafter": drafter}, description)


def demo_models() -> BenchModels:
    """The bundled demo models (`hf_budgetdraft.demo.load_demo_models`)."""
    from ..demo import load_demo_models

    demo = load_demo_models()
    return BenchModels(
        demo.tokenizer,
        {"target": demo.target, "mtp": demo.target},  # the target's own trained MTP layer drafts for `mtp`
        {"base_drafter": demo.base_drafter, "drafter": demo.drafter},
        {
            "target": "bundled demo target (GLM-4-style, 7 dense layers, 9.9M)",
            "mtp": "the bundled target with its trained MTP layer",
            "drafter": "bundled BudgetDraft drafter (base drafter + BudgetDraft LoRA)",
            "base_drafter": "bundled base drafter (Llama, distilled on a full cache)",
        },
    )


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def full_models(args: BenchArguments) -> BenchModels:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..generation.mtp import expose_mtp_layers

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(args.dtype)).eval()

    targets = {"target": load(args.target)}
    drafters = {"drafter": load(args.drafter)}
    description = {"target": args.target, "drafter": args.drafter}
    if args.base_drafter:
        drafters["base_drafter"] = load(args.base_drafter)
        description["base_drafter"] = args.base_drafter
    if "mtp" in args.methods and args.mtp_model:
        targets["mtp"] = expose_mtp_layers(load(args.mtp_model))
        description["mtp"] = args.mtp_model
    return BenchModels(
        AutoTokenizer.from_pretrained(args.tokenizer or args.target), targets, drafters, description
    )


def load_models(args: BenchArguments, mtp_dir: str | None) -> BenchModels:
    if args.preset == "smoke":
        models = smoke_models(args, mtp_dir)
    elif args.preset == "demo":
        models = demo_models()
        if args.mtp_model:
            from transformers import AutoModelForCausalLM

            from ..generation.mtp import expose_mtp_layers

            models.targets["mtp"] = expose_mtp_layers(
                AutoModelForCausalLM.from_pretrained(args.mtp_model).eval()
            )
    else:
        models = full_models(args)
    for model in (*models.targets.values(), *models.drafters.values()):
        model.to(device=args.device, dtype=_torch_dtype(args.dtype))
    if args.target_attn_implementation is not None:
        for model in models.targets.values():
            model.set_attn_implementation(args.target_attn_implementation)
    if args.compiled_draft:
        for model in models.drafters.values():
            model.set_attn_implementation(VARLEN_NAME)
        # one graph per static-cache shape (budget) and drafter: room for the whole grid before dynamo gives up
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 4 * len(args.budgets) * len(models.drafters)
        )
    return models


def load_corpus(args: BenchArguments) -> tuple[list[Document], str]:
    """The documents of the `document`/`code` tasks and where they came from."""
    if args.data_files:
        return load_documents(args.data_files), f"files {args.data_files}"
    if args.dataset_name:
        documents = load_hub_documents(
            args.dataset_name,
            args.dataset_config_name,
            args.dataset_split,
            args.text_column,
            args.max_documents,
        )
        return documents, f"datasets {args.dataset_name} ({args.dataset_split})"
    if args.preset == "demo":
        from ..demo.documents import demo_documents

        return demo_documents()
    if args.preset == "full":
        if not args.tasks_from_preset and any(t in ("document", "code") for t in args.tasks):
            raise ValueError(
                "--preset full with the document/code tasks needs --data_files or --dataset_name"
            )
        return [], "none (no --data_files/--dataset_name: passkey tasks only)"
    return stdlib_documents(), "Python standard library (pydoc topics + stdlib sources), offline"


# ---------------------------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------------------------


def build_specs(args: BenchArguments, models: BenchModels) -> list[MethodSpec]:
    """Every run of one cell, in the interleaving order: AR first (the reference) and the AR baselines, then per
    drafter and γ the native run, the sparse runs and prompt lookup; then the MTP model's AR, native and windowed
    MTP."""
    specs = [MethodSpec("ar")]
    specs += [MethodSpec("ar", ar_setup=s) for s in AR_SETUPS if f"ar_{s}" in args.methods]
    for drafter in models.drafters:
        # the one-liner, `generate(ids, assistant_model=drafter, cache_implementation=...)` alone, for each sparse
        # cache the grid runs (budgeted when it runs neither)
        if "oneliner" in args.methods:
            caches = [c for c in ("budgeted", "sink_window") if c in args.methods] or ["budgeted"]
            specs += [MethodSpec("assisted", c, drafter=drafter, defaults=True) for c in caches]
        for gamma in args.gammas:
            if "native" in args.methods:
                specs.append(MethodSpec("assisted", "full", gamma=gamma, drafter=drafter))
            for budget in args.budgets:
                for compiled in (False, True) if args.compiled_draft else (False,):
                    common = dict(budget=budget, gamma=gamma, drafter=drafter, compiled=compiled)
                    if "sink_window" in args.methods:
                        specs.append(MethodSpec("assisted", "sink_window", **common))
                    if "budgeted" in args.methods:
                        specs += [
                            MethodSpec("assisted", "budgeted", policy, **common) for policy in args.policies
                        ]
    if "prompt_lookup" in args.methods:
        specs += [MethodSpec("prompt_lookup", gamma=gamma) for gamma in args.gammas]
    if "mtp" in args.methods and "mtp" in models.targets:
        depth = models.targets["mtp"].config.get_text_config().num_mtp_layers
        specs.append(MethodSpec("ar", target="mtp"))
        specs.append(MethodSpec("mtp", "full", gamma=depth, target="mtp"))
        specs += [MethodSpec("mtp", "sink_window", budget=b, gamma=depth, target="mtp") for b in args.budgets]
    return specs


def _tasks_with_data(args: BenchArguments, documents: list[Document]) -> list[str]:
    """The tasks to run: a preset's default `document`/`code` task is dropped (with a note) when the corpus has no
    prose/code; tasks asked for explicitly fail later with a message saying what data they need."""
    if not args.tasks_from_preset:
        return list(args.tasks)
    kinds = {d.kind for d in documents}
    needs = {"document": "text", "code": "code"}
    kept = [t for t in args.tasks if t not in needs or needs[t] in kinds]
    for task in sorted(set(args.tasks) - set(kept)):
        print(f"note: skipping task {task!r}: the corpus has no {needs[task]!r} documents", file=sys.stderr)
    return kept


def check_specs(args: BenchArguments, models: BenchModels, specs: list[MethodSpec]) -> None:
    """Build every sparse draft cache once before anything runs, so a bad budget/policy fails in seconds."""
    from ..integration import build_sparse_cache

    for spec in specs:
        if spec.method == "assisted" and spec.cache in ("sink_window", "budgeted"):
            config = sparse_cache_config(
                spec, args.num_sink_tokens, args.budgeted_window_length, args.policy_options.get(spec.policy)
            )
            build_sparse_cache(spec.cache, models.drafters[spec.drafter].config, config)


def _with_bos(sample, tokenizer):
    """Start the prompt with BOS when the tokenizer adds one by itself (as models trained with one expect); the
    first token is replaced, so the prompt keeps its exact length."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and tokenizer("x").input_ids[:1] == [bos] and sample.input_ids[0, 0] != bos:
        sample.input_ids = sample.input_ids.clone()
        sample.input_ids[0, 0] = bos
    return sample


def _round_times(result: RunResult) -> tuple[list[float], list[float]]:
    """Per-round draft/verify seconds without each call's first round (it holds the prefills)."""
    stats = result.stats
    return stats.draft_seconds_per_round[1:], stats.verify_seconds_per_round[1:]


def _median(values: list[float]) -> float | None:
    return float(torch.tensor(values, dtype=torch.float64).median()) if values else None


def _paired_speedups(suffix: str, run: RunResult, ar: RunResult) -> dict:
    """`speedup_vs_ar{suffix}` (end to end) and `decode_speedup_vs_ar{suffix}` of `run` over the AR run `ar`."""
    decode = run.decode_tokens_per_second, ar.decode_tokens_per_second
    return {
        f"speedup_vs_ar{suffix}": ar.seconds / run.seconds,
        f"decode_speedup_vs_ar{suffix}": decode[0] / decode[1] if all(decode) else None,
    }


def make_records(
    args: BenchArguments,
    models: BenchModels,
    sample,
    sample_index: int,
    input_ids: torch.LongTensor,
    results: dict[MethodSpec, list[RunResult]],
) -> list[dict]:
    """One record per (spec, repeat) of one cell: greedy diff vs the same target's AR output of repeat 0,
    acceptance, speed (paired with the AR / native run of the same repeat), phase times and memory."""
    records = []
    context = input_ids.shape[1]
    for spec, runs in results.items():
        ar_runs = results[MethodSpec("ar", target=spec.target)]
        reference = ar_runs[0].new_ids
        native = spec.native_counterpart()
        for repeat, run in enumerate(runs):
            diff = token_diff(run.new_ids, reference)
            margin = None
            if diff.first_diff is not None and diff.first_diff < min(len(run.new_ids), len(reference)):
                margin = divergence_margin(
                    models.targets[spec.target], input_ids, reference, run.new_ids, diff.first_diff
                )
            stats = run.stats
            draft_rounds, verify_rounds = _round_times(run)
            speculative = spec.method != "ar"
            answer_match = None
            if sample.task in ("passkey", "needle_outside_window"):
                answer = sample.reference_ids[0]
                answer_match = bool(torch.equal(run.new_ids[: len(answer)], answer))
            records.append(
                {
                    "target": spec.target,
                    "drafter": spec.drafter,
                    "task": sample.task,
                    "sample": sample_index,
                    "method": spec.method,
                    "name": spec.name,
                    "label": spec.label,
                    "cache": spec.cache,
                    "policy": spec.policy,
                    "budget": spec.budget,
                    "context_length": context,
                    "gamma": spec.gamma,
                    "compiled": spec.compiled,
                    "defaults": spec.defaults,
                    "plan": repr(stats.plan.spec) if speculative and stats.plan is not None else None,
                    "draft_length_policy": stats.draft_length_policy if speculative else None,
                    "ar_rounds": stats.ar_rounds if speculative else None,
                    "draft_prefill_seconds": stats.draft_prefill_seconds if speculative else None,
                    "target_prefill_seconds": stats.target_prefill_seconds if speculative else None,
                    "repeat": repeat,
                    "new_tokens": len(run.new_ids),
                    "diff_tokens": diff.diff_tokens,
                    "first_diff": diff.first_diff,
                    "first_diff_margin": margin,
                    "rounds": stats.rounds if speculative else None,
                    "proposed_tokens": sum(stats.proposed_per_round) if speculative else None,
                    "accepted_tokens": sum(stats.accepted_per_round) if speculative else None,
                    "mean_accepted_length": stats.mean_accepted_length if speculative else None,
                    "acceptance_rate": stats.acceptance_rate if speculative else None,
                    "acceptance_per_position": [list(c) for c in stats.acceptance_per_position()],
                    "seconds": run.seconds,
                    "tokens_per_second": run.tokens_per_second,
                    "first_token_seconds": run.first_token_seconds,
                    "decode_tokens_per_second": run.decode_tokens_per_second,
                    **_paired_speedups("", run, ar_runs[repeat]),
                    **{
                        key: value
                        for setup in AR_SETUPS
                        if (baseline := results.get(MethodSpec("ar", target=spec.target, ar_setup=setup)))
                        for key, value in _paired_speedups(f"_{setup}", run, baseline[repeat]).items()
                    },
                    "speedup_vs_native": (
                        results[native][repeat].seconds / run.seconds
                        if native in results
                        else (1.0 if spec.is_native else None)
                    ),
                    "draft_seconds": stats.draft_seconds if speculative else None,
                    "verify_seconds": stats.verify_seconds if speculative else None,
                    "overhead_seconds": (
                        run.seconds - stats.draft_seconds - stats.verify_seconds if speculative else None
                    ),
                    "draft_ms_per_round": 1e3 * m if (m := _median(draft_rounds)) is not None else None,
                    "verify_ms_per_round": 1e3 * m if (m := _median(verify_rounds)) is not None else None,
                    "draft_cache_bytes": run.draft_cache_bytes,
                    "target_cache_bytes": run.target_cache_bytes,
                    "peak_rss_bytes": run.peak_rss_bytes,
                    "cuda_peak_bytes": run.cuda_peak_bytes,
                    "threads": args.threads,
                    "device": args.device,
                    "dtype": args.dtype,
                    "answer_match": answer_match,
                    "needle_position": sample.meta.get("needle_position"),
                    "proposed_per_round": list(stats.proposed_per_round),
                    "accepted_per_round": list(stats.accepted_per_round),
                    "draft_seconds_per_round": list(stats.draft_seconds_per_round),
                    "verify_seconds_per_round": list(stats.verify_seconds_per_round),
                }
            )
    return records


def envelope_rows(
    sample, sample_index: int, context: int, results: dict[MethodSpec, list[RunResult]]
) -> list[dict]:
    """The noise envelope of one cell: native vs AR, and each sparse draft vs its native counterpart."""
    outputs = {spec.label: [run.new_ids for run in runs] for spec, runs in results.items()}
    pairs = []
    for spec in results:
        if spec.method == "ar" and spec.ar_setup:
            pairs.append(("ar_setup_vs_ar", spec.label, MethodSpec("ar", target=spec.target).label))
        elif spec.method == "ar":
            pairs.append(("ar_run_to_run", spec.label, spec.label))
        elif spec.is_native:
            pairs.append(("native_vs_ar", spec.label, MethodSpec("ar", target=spec.target).label))
        elif (native := spec.native_counterpart()) is not None:
            pairs.append(("windowed_vs_native", spec.label, native.label))
        else:
            pairs.append(("other_vs_ar", spec.label, MethodSpec("ar", target=spec.target).label))
    rows = noise_envelope(outputs, pairs)
    for row in rows:
        row.update(task=sample.task, sample=sample_index, context_length=context)
    return rows


def _metadata(args: BenchArguments, models: BenchModels, specs: list[MethodSpec], corpus: str) -> dict:
    import transformers

    return {
        "preset": args.preset,
        "arguments": {k: v for k, v in asdict(args).items()},
        "models": models.description,
        "corpus": corpus,
        "methods": [spec.label for spec in specs],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical CPUs",
        "device": args.device,
        "cuda_device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def run_bench(args: BenchArguments, models: BenchModels | None = None) -> BenchResult:
    """Run the whole grid and write the report.

    Args:
        args (`BenchArguments`): the grid and the output folder.
        models (`BenchModels`, *optional*): models to use instead of the preset's (tests inject faulty ones).
    """
    from tqdm.auto import tqdm

    from .report import write_report

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        with quiet_transformers(), tempfile.TemporaryDirectory(prefix="budgetdraft-bench-") as scratch:
            if models is None:
                models = load_models(args, mtp_dir=scratch)
            documents, corpus = load_corpus(args)
            tasks = _tasks_with_data(args, documents)
            specs = build_specs(args, models)
            check_specs(args, models, specs)
            metadata = _metadata(args, models, specs, corpus)
            metadata["tasks"] = tasks
            window = max(args.budgets) - args.num_sink_tokens  # the needle sits outside the widest window
            cells = []
            for context in args.contexts:
                for task in tasks:
                    for index in range(args.samples):
                        sample = build_sample(
                            task,
                            models.tokenizer,
                            documents,
                            context,
                            args.new_tokens,
                            seed=args.seed * 1_000_003 + index,
                            passkey_depth=args.passkey_depth,
                            num_sink_tokens=args.num_sink_tokens,
                            window_length=max(window, 1),
                        )
                        cells.append((_with_bos(sample, models.tokenizer), index))
            records, envelope = [], []
            total = args.num_runs(len(specs)) if cells else 0
            with tqdm(
                total=total, desc="bench", unit="run", disable=not args.progress, file=sys.stderr
            ) as bar:
                common = dict(
                    targets=models.targets,
                    drafters=models.drafters,
                    new_tokens=args.new_tokens,
                    num_sink_tokens=args.num_sink_tokens,
                    budgeted_window_length=args.budgeted_window_length,
                    policy_kwargs=args.policy_options,
                    confidence_threshold=args.assistant_confidence_threshold,
                )
                if args.warmup and cells:
                    warm_ids = cells[0][0].input_ids.to(args.device)
                    for spec in specs:
                        bar.set_postfix_str(f"warm-up {spec.label}", refresh=False)
                        run_method(spec, input_ids=warm_ids, **common)
                        bar.update()
                for sample, index in cells:
                    input_ids = sample.input_ids.to(args.device)
                    results: dict[MethodSpec, list[RunResult]] = {spec: [] for spec in specs}
                    for repeat in range(args.repeats):
                        for spec in specs:
                            bar.set_postfix_str(
                                f"{sample.task} L={input_ids.shape[1]} r{repeat} {spec.label}", refresh=False
                            )
                            results[spec].append(run_method(spec, input_ids=input_ids, **common))
                            bar.update()
                    records += make_records(args, models, sample, index, input_ids, results)
                    envelope += envelope_rows(sample, index, input_ids.shape[1], results)
            metadata["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            metadata["threads"] = torch.get_num_threads()
            summary, fits = write_report(Path(args.output_dir), records, envelope, metadata, args)
    finally:
        torch.set_num_threads(previous_threads)
    return BenchResult(records, summary, fits, envelope, metadata, Path(args.output_dir))


def bench_command(args: BenchArguments) -> int:
    """`hf-budgetdraft bench`: exit 0 when every greedy-diff cell is 0, 1 otherwise, 2 when it cannot run."""
    if args.batch_sizes:
        from .batched import batched_bench_command

        return batched_bench_command(args)
    try:
        result = run_bench(args)
    except FileNotFoundError as error:  # e.g. a broken install without the bundled demo weights
        print(f"error: {error}", file=sys.stderr)
        return 2
    from .report import console_summary

    print(console_summary(result.summary, result.records, result.output_dir, result.metadata))
    return 0 if result.ok else 1
