"""One bench record per run: what ran, its greedy diff against the target's own output, acceptance, speed paired
with the AR / native run of the same repeat, phase times and memory; the noise envelope of a cell; the run's
metadata."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import asdict

import torch

from ..runs.timed_call import AR_SETUPS, RunResult
from ..runs.token_diff import divergence_margin, noise_envelope, token_diff
from .bench_args import BenchArguments
from .bench_models import BenchModels
from .machine import machine
from .runners import MethodSpec

# a record's per-round lists (results.json holds them, results.csv leaves them out)
PER_ROUND_FIELDS = (
    "proposed_per_round",
    "accepted_per_round",
    "draft_seconds_per_round",
    "verify_seconds_per_round",
)


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
    for spec, runs in results.items():
        reference = results[MethodSpec("ar", target=spec.target)][0].new_ids
        cell = _cell_fields(spec, sample, sample_index, input_ids.shape[1])
        for repeat, run in enumerate(runs):
            speculative = spec.method != "ar"
            records.append(
                {
                    **cell,
                    **_plan_fields(run.stats, speculative),
                    "repeat": repeat,
                    "new_tokens": len(run.new_ids),
                    **_diff_fields(models.targets[spec.target], input_ids, reference, run.new_ids),
                    **_acceptance_fields(run.stats, speculative),
                    **_speed_fields(spec, repeat, results),
                    **_phase_fields(run, speculative),
                    "draft_cache_bytes": run.draft_cache_bytes or 0,
                    "target_cache_bytes": run.target_cache_bytes or 0,
                    "peak_rss_bytes": run.peak_rss_bytes,
                    "cuda_peak_bytes": run.cuda_peak_bytes,
                    "threads": args.threads,
                    "device": args.device,
                    "dtype": args.dtype,
                    "answer_match": _answer_match(sample, run.new_ids),
                    "needle_position": sample.meta.get("needle_position"),
                    **{name: list(getattr(run.stats, name)) for name in PER_ROUND_FIELDS},
                }
            )
    return records


def _cell_fields(spec: MethodSpec, sample, sample_index: int, context: int) -> dict:
    return {
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
    }


def _plan_fields(stats, speculative: bool) -> dict:
    """The resolved draft plan and the prefills (speculative runs only)."""
    return {
        "plan": repr(stats.plan.spec) if speculative and stats.plan is not None else None,
        "draft_length_policy": stats.draft_length_policy if speculative else None,
        "ar_rounds": stats.ar_rounds if speculative else None,
        "draft_prefill_seconds": stats.draft_prefill_seconds if speculative else None,
        "target_prefill_seconds": stats.target_prefill_seconds if speculative else None,
    }


def _diff_fields(target, input_ids: torch.LongTensor, reference, new_ids) -> dict:
    """Differing tokens, the first divergence and the target's logit margin there (near 0: an argmax near-tie)."""
    diff = token_diff(new_ids, reference)
    margin = None
    if diff.first_diff is not None and diff.first_diff < min(len(new_ids), len(reference)):
        margin = divergence_margin(target, input_ids, reference, new_ids, diff.first_diff)
    return {"diff_tokens": diff.diff_tokens, "first_diff": diff.first_diff, "first_diff_margin": margin}


def _acceptance_fields(stats, speculative: bool) -> dict:
    return {
        "rounds": stats.rounds if speculative else None,
        "proposed_tokens": sum(stats.proposed_per_round) if speculative else None,
        "accepted_tokens": sum(stats.accepted_per_round) if speculative else None,
        "mean_accepted_length": stats.mean_accepted_length if speculative else None,
        "acceptance_rate": stats.acceptance_rate if speculative else None,
        "acceptance_per_position": [list(c) for c in stats.acceptance_per_position()],
    }


def _speed_fields(spec: MethodSpec, repeat: int, results: dict[MethodSpec, list[RunResult]]) -> dict:
    """Throughput and the speed-ups paired with the AR runs (and the AR baselines that ran) of the same repeat."""
    run = results[spec][repeat]
    fields = {
        "seconds": run.seconds,
        "tokens_per_second": run.tokens_per_second,
        "first_token_seconds": run.first_token_seconds,
        "decode_tokens_per_second": run.decode_tokens_per_second,
        **_paired_speedups("", run, results[MethodSpec("ar", target=spec.target)][repeat]),
    }
    for setup in AR_SETUPS:
        baseline = results.get(MethodSpec("ar", target=spec.target, ar_setup=setup))
        if baseline:
            fields.update(_paired_speedups(f"_{setup}", run, baseline[repeat]))
    native = spec.native_counterpart()
    fields["speedup_vs_native"] = (
        results[native][repeat].seconds / run.seconds
        if native in results
        else (1.0 if spec.is_native else None)
    )
    return fields


def _paired_speedups(suffix: str, run: RunResult, ar: RunResult) -> dict:
    """`speedup_vs_ar{suffix}` (end to end) and `decode_speedup_vs_ar{suffix}` of `run` over the AR run `ar`."""
    decode = run.decode_tokens_per_second, ar.decode_tokens_per_second
    return {
        f"speedup_vs_ar{suffix}": ar.seconds / run.seconds,
        f"decode_speedup_vs_ar{suffix}": decode[0] / decode[1] if all(decode) else None,
    }


def _phase_fields(run: RunResult, speculative: bool) -> dict:
    """Draft / verify seconds of the call and median ms a round, each call's first round (the prefills) left
    out of the medians."""
    stats = run.stats
    draft_ms = _median_ms(stats.draft_seconds_per_round[1:])
    verify_ms = _median_ms(stats.verify_seconds_per_round[1:])
    return {
        "draft_seconds": stats.draft_seconds if speculative else None,
        "verify_seconds": stats.verify_seconds if speculative else None,
        "overhead_seconds": (
            run.seconds - stats.draft_seconds - stats.verify_seconds if speculative else None
        ),
        "draft_ms_per_round": draft_ms,
        "verify_ms_per_round": verify_ms,
    }


def _median_ms(seconds: list[float]) -> float | None:
    if not seconds:
        return None
    return 1e3 * float(torch.tensor(seconds, dtype=torch.float64).median())


def _answer_match(sample, new_ids) -> bool | None:
    """Passkey tasks: whether the output starts with the key's tokens."""
    if sample.task not in ("passkey", "needle_outside_window"):
        return None
    answer = sample.reference_ids[0]
    return bool(torch.equal(new_ids[: len(answer)], answer))


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


def bench_metadata(args: BenchArguments, models: BenchModels, specs: list[MethodSpec], corpus: str) -> dict:
    """What ran where: the arguments, models, corpus, methods, library versions, machine and load."""
    import transformers

    return {
        "preset": args.preset,
        "arguments": {k: v for k, v in asdict(args).items()},
        "models": models.description,
        "corpus": corpus,
        "sampling": args.sampling,
        "methods": [spec.label for spec in specs],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": machine(),
        "device": args.device,
        "cuda_device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
        "load_average_start": load_average(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None
