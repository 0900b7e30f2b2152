"""`hf-budgetdraft bench`: every method on every task, context length, budget and γ, in one interleaved run.

For each cell (task × context length × sample) the methods run in a fixed order A B C ... and that pass is
repeated `repeats` times (A B C A B C ...), so slow drifts of the machine hit every method alike and each
repeat pairs a method with the AR run next to it. Per run it records the greedy diff against the target's own AR
output, the speculation statistics, timings, and memory (`records.make_records`); then `report.write_report`
writes `results.json`, `results.csv`, `report.md` and the plots. The flags and presets are `BenchArguments`
(`bench_args`), the models and documents per preset `bench_models`.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..demo.corpus import Document
from ..demo.tasks import TaskSample, build_sample
from ..quiet import quiet_transformers
from ..runs.timed_call import AR_SETUPS, RunResult
from .bench_args import BenchArguments
from .bench_models import BenchModels, load_corpus, load_models
from .records import bench_metadata, envelope_rows, load_average, make_records
from .runners import MethodSpec, run_method, sparse_cache_config


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
        """Every greedy-diff cell is 0 (a sampling bench has no greedy diff: its token diffs check nothing)."""
        return bool(self.metadata.get("sampling")) or all(r["diff_tokens"] == 0 for r in self.records)


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
        if (
            "oneliner" in args.methods
        ):  # `generate(ids, use_mtp=True, cache_implementation="sink_window")` alone
            specs.append(MethodSpec("mtp", "sink_window", target="mtp", defaults=True))
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


def run_bench(args: BenchArguments, models: BenchModels | None = None) -> BenchResult:
    """Run the whole grid and write the report.

    Args:
        args (`BenchArguments`): the grid and the output folder.
        models (`BenchModels`, *optional*): models to use instead of the preset's (tests inject faulty ones).
    """
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
            metadata = bench_metadata(args, models, specs, corpus)
            metadata["tasks"] = tasks
            cells = build_cells(args, models, documents, tasks)
            records, envelope = _run_grid(args, models, specs, cells)
            metadata["load_average_end"] = load_average()
            metadata["threads"] = torch.get_num_threads()
            summary, fits = write_report(Path(args.output_dir), records, envelope, metadata, args)
    finally:
        torch.set_num_threads(previous_threads)
    return BenchResult(records, summary, fits, envelope, metadata, Path(args.output_dir))


def build_cells(
    args: BenchArguments, models: BenchModels, documents: list[Document], tasks: list[str]
) -> list[tuple[TaskSample, int]]:
    """`(sample, sample index)` per context length, task and sample, in the order they run."""
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
    return cells


def _warm_prompts(cells: list[tuple[TaskSample, int]], device: str) -> list[torch.Tensor]:
    """The prompts the warm-up runs every method on: the first cell's on the CPU; on an accelerator one of each
    prompt length, since what compiles there (transformers' static cache, the one-liner's device round) compiles
    per shape, which would otherwise land in a cell's first timed repeat."""
    by_length: dict[int, torch.Tensor] = {}
    for sample, _ in cells if device != "cpu" else cells[:1]:
        by_length.setdefault(sample.input_ids.shape[1], sample.input_ids)
    return [ids.to(device) for ids in by_length.values()]


def _run_grid(
    args: BenchArguments, models: BenchModels, specs: list[MethodSpec], cells: list[tuple[TaskSample, int]]
) -> tuple[list[dict], list[dict]]:
    """The warm-up pass, then every cell's interleaved repeats: `(records, noise envelope rows)`."""
    from tqdm.auto import tqdm

    records, envelope = [], []
    warm_prompts = _warm_prompts(cells, args.device) if args.warmup else []
    total = args.num_runs(len(specs), len(warm_prompts)) if cells else 0
    common = dict(
        targets=models.targets,
        drafters=models.drafters,
        new_tokens=args.new_tokens,
        num_sink_tokens=args.num_sink_tokens,
        budgeted_window_length=args.budgeted_window_length,
        policy_kwargs=args.policy_options,
        confidence_threshold=args.assistant_confidence_threshold,
        sampling=args.sampling,
        tokenizer=models.tokenizer,
        drafter_tokenizers=models.drafter_tokenizers,
    )
    with tqdm(total=total, desc="bench", unit="run", disable=not args.progress, file=sys.stderr) as bar:
        for warm_ids in warm_prompts:
            for spec in specs:
                bar.set_postfix_str(f"warm-up L={warm_ids.shape[1]} {spec.label}", refresh=False)
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
                    if args.sampling:  # every method of a repeat draws from the same seed
                        torch.manual_seed(args.seed * 1_000_003 + 7_919 * index + repeat)
                    results[spec].append(run_method(spec, input_ids=input_ids, **common))
                    bar.update()
            records += make_records(args, models, sample, index, input_ids, results)
            envelope += envelope_rows(sample, index, input_ids.shape[1], results)
    return records, envelope
