"""Aggregate bench records and write `results.json`, `results.csv`, `report.md` and the PNG plots.

- `summarize`: one row per cell (target × drafter × task × method × cache × policy × budget × context × γ), plus
  the same pooled over tasks (`task == "all"`): max greedy diff, acceptance with Wilson intervals (per draft
  position too), speed-ups with bootstrap intervals, median phase times, memory.
- `phase_fits`: `round = c + γ·t_draft_forward` (and the draft / verify phases alone) per method, budget and
  context, over every round of every γ, task and repeat (each call's first round, which holds the prefills, is
  left out).
- plots (matplotlib, Agg canvas; no pyplot state is touched): acceptance vs context length per budget, speed-up
  vs budget, phase costs vs context.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from .metrics import acceptance_intervals, bootstrap_ci, fit_round_time, wilson_interval

REQUIRED_FIELDS = (
    "task",
    "method",
    "cache",
    "policy",
    "budget",
    "context_length",
    "gamma",
    "repeat",
    "new_tokens",
    "diff_tokens",
    "first_diff",
    "mean_accepted_length",
    "tokens_per_second",
    "speedup_vs_ar",
    "draft_cache_bytes",
)
CELL_KEYS = (
    "target",
    "drafter",
    "task",
    "method",
    "name",
    "label",
    "cache",
    "policy",
    "budget",
    "context_length",
    "gamma",
)
FIT_KEYS = ("target", "drafter", "method", "name", "cache", "policy", "budget", "context_length")
_PER_ROUND = (
    "proposed_per_round",
    "accepted_per_round",
    "draft_seconds_per_round",
    "verify_seconds_per_round",
)
# paired per-repeat ratios summarised as a median with a bootstrap interval (`*_stock` / `*_growable`: over the
# stock-sdpa AR and the GrowableCache AR baselines, present when those baselines ran)
SPEEDUP_KEYS = (
    "speedup_vs_ar",
    "decode_speedup_vs_ar",
    "speedup_vs_native",
    "speedup_vs_ar_stock",
    "decode_speedup_vs_ar_stock",
    "speedup_vs_ar_growable",
    "decode_speedup_vs_ar_growable",
    "speedup_vs_ar_fast",
    "decode_speedup_vs_ar_fast",
)
PLOTS = ("acceptance_vs_context.png", "speedup_vs_budget.png", "phase_costs_vs_context.png")


# ---------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _speedup(ratios: list[float], draws: int, seed: int) -> tuple[float | None, float | None, float | None]:
    """Median of paired per-repeat ratios and its bootstrap 95% interval."""
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return None, None, None
    low, high = bootstrap_ci(ratios, np.median, draws=draws, seed=seed, vectorized=True)
    return float(np.median(ratios)), low, high


def summarize(records: list[dict], draws: int = 2000, seed: int = 0) -> list[dict]:
    """One row per cell and per cell pooled over tasks (`task == "all"`).

    Acceptance is pooled over samples from repeat 0 only: repeats of a deterministic run repeat the same rounds,
    so counting them again would shrink the intervals without new information (`acceptance_repeatable` says
    whether the repeats agreed). Speed-ups pool every (sample, repeat) pair.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        key = tuple(record[k] for k in CELL_KEYS)
        groups[key].append(record)
        groups[key[:2] + ("all",) + key[3:]].append(record)
    rows = []
    for key, members in groups.items():
        row = dict(zip(CELL_KEYS, key, strict=True))
        first = [m for m in members if m["repeat"] == 0]
        speculative = members[0]["method"] != "ar"
        diffs = [m["diff_tokens"] for m in members]
        first_diffs = [m["first_diff"] for m in members if m["first_diff"] is not None]
        row.update(
            runs=len(members),
            diff_tokens_max=max(diffs),
            runs_with_diff=sum(d > 0 for d in diffs),
            first_diff_min=min(first_diffs) if first_diffs else None,
            new_tokens=members[0]["new_tokens"],
        )
        if speculative:
            accepted = sum(m["accepted_tokens"] for m in first)
            proposed = sum(m["proposed_tokens"] for m in first)
            rounds = sum(m["rounds"] for m in first)
            low, high = wilson_interval(accepted, proposed)
            depth = max((len(m["acceptance_per_position"]) for m in first), default=0)
            per_position = [[0, 0] for _ in range(depth)]
            for m in first:
                for k, (a, r) in enumerate(m["acceptance_per_position"]):
                    per_position[k][0] += a
                    per_position[k][1] += r
            by_unit = defaultdict(set)
            for m in members:
                by_unit[(m["task"], m["sample"])].add(tuple(m["accepted_per_round"]))
            row.update(
                rounds=rounds,
                proposed_tokens=proposed,
                accepted_tokens=accepted,
                acceptance_rate=accepted / proposed if proposed else None,
                acceptance_low=low if proposed else None,
                acceptance_high=high if proposed else None,
                mean_accepted_length=(accepted + rounds) / rounds if rounds else None,
                acceptance_per_position=acceptance_intervals([tuple(c) for c in per_position]),
                acceptance_repeatable=all(len(v) == 1 for v in by_unit.values()),
            )
        for key in SPEEDUP_KEYS:
            point, low, high = _speedup([m.get(key) for m in members], draws, seed)
            row.update({key: point, f"{key}_low": low, f"{key}_high": high})
        answers = [m["answer_match"] for m in first if m["answer_match"] is not None]
        row.update(
            tokens_per_second=_median(m["tokens_per_second"] for m in members),
            decode_tokens_per_second=_median(m["decode_tokens_per_second"] for m in members),
            draft_ms_per_round=_median(m["draft_ms_per_round"] for m in members),
            verify_ms_per_round=_median(m["verify_ms_per_round"] for m in members),
            overhead_ms_per_run=_median(
                1e3 * m["overhead_seconds"] if m["overhead_seconds"] is not None else None for m in members
            ),
            ar_ms_per_token=(
                _median(1e3 / m["decode_tokens_per_second"] for m in members if m["decode_tokens_per_second"])
                if not speculative
                else None
            ),
            draft_cache_bytes=max(m["draft_cache_bytes"] for m in members),
            target_cache_bytes=max(m["target_cache_bytes"] for m in members),
            peak_rss_bytes=max((m["peak_rss_bytes"] or 0) for m in members) or None,
            cuda_peak_bytes=max((m["cuda_peak_bytes"] or 0) for m in members) or None,
            answer_match_rate=sum(answers) / len(answers) if answers else None,
        )
        rows.append(row)
    return rows


def round_budget_rows(pooled: list[dict]) -> list[dict]:
    """Per speculative cell (pooled over tasks): the accepted length its median phase costs need for a 2× decode
    speed-up over the AR baseline of the same target and context (stock AR where it ran, else AR), the speed-up
    those costs predict at the measured accepted length, and at full acceptance (γ + 1 tokens a round)."""
    baselines = {}
    for r in pooled:
        if r["method"] == "ar" and r["ar_ms_per_token"]:
            name = "stock AR" if r["label"] == "ar_stock" else "AR"
            key = (r["target"], r["context_length"])
            if name == "stock AR" or key not in baselines:
                baselines[key] = (name, r["ar_ms_per_token"])
    rows = []
    for r in pooled:
        baseline = baselines.get((r["target"], r["context_length"]))
        if r["method"] == "ar" or baseline is None or r.get("mean_accepted_length") is None:
            continue
        if r["draft_ms_per_round"] is None or r["verify_ms_per_round"] is None:
            continue
        name, ar_ms = baseline
        round_ms = r["draft_ms_per_round"] + r["verify_ms_per_round"]
        rows.append(
            dict(
                label=r["label"],
                context_length=r["context_length"],
                baseline=name,
                ar_ms_per_token=ar_ms,
                round_ms=round_ms,
                mean_accepted_length=r["mean_accepted_length"],
                predicted_speedup=r["mean_accepted_length"] * ar_ms / round_ms,
                accepted_length_for_2x=2 * round_ms / ar_ms,
                full_acceptance_speedup=(r["gamma"] + 1) * ar_ms / round_ms,
            )
        )
    return rows


def phase_fits(records: list[dict]) -> list[dict]:
    """Least-squares cost model per (target, drafter, method, cache, policy, budget, context) over its rounds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        if record["method"] != "ar":
            groups[tuple(record[k] for k in FIT_KEYS)].append(record)
    rows = []
    for key, members in groups.items():
        proposed, draft, verify = [], [], []
        for m in members:  # each call's first round holds the prefills: left out
            proposed += m["proposed_per_round"][1:]
            draft += m["draft_seconds_per_round"][1:]
            verify += m["verify_seconds_per_round"][1:]
        row = dict(zip(FIT_KEYS, key, strict=True))
        row["label"] = members[0]["label"].split(" γ=")[0]
        row["gammas"] = sorted({m["gamma"] for m in members})
        try:
            fits = fit_round_time(proposed, draft, verify)
        except ValueError as error:
            reason = str(error)
            if key[FIT_KEYS.index("method")] == "mtp":
                reason = (
                    "MTP drafts num_mtp_layers tokens every round, so γ does not vary; the per-depth costs are "
                    "measured by benchmarks/mtp_cost.py"
                )
            row.update(fit=None, reason=reason, n=len(proposed))
        else:
            row.update(fit={name: fit.as_dict() for name, fit in fits.items()}, reason=None, n=len(proposed))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def _clean(value):
    """JSON-safe: NaN/inf -> null, tuples -> lists, numpy scalars -> Python."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, records, summary, fits, envelope, metadata) -> None:
    payload = {
        "metadata": metadata,
        "records": records,
        "summary": summary,
        "phase_fits": fits,
        "noise_envelope": envelope,
    }
    path.write_text(json.dumps(_clean(payload), indent=1, allow_nan=False) + "\n")


def write_csv(path: Path, records: list[dict]) -> None:
    """Scalar fields of every record (per-round lists stay in results.json; acceptance per position as JSON)."""
    columns = [k for k in records[0] if k not in _PER_ROUND] if records else list(REQUIRED_FIELDS)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for record in records:
            row = dict(record)
            row["acceptance_per_position"] = json.dumps(row.get("acceptance_per_position"))
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _ci(point, low, high, digits: int = 2) -> str:
    if point is None:
        return "–"
    return f"{_fmt(point, digits)} [{_fmt(low, digits)}, {_fmt(high, digits)}]"


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ranker(metadata: dict):
    """Sort key: the interleaving order of the methods (AR, native, sparse drafts, prompt lookup, MTP), then
    context length."""
    rank = {label: i for i, label in enumerate(metadata.get("methods", []))}
    return lambda row: (rank.get(row["label"], len(rank)), row["label"], row["context_length"])


def _draft_stop(args: dict) -> str:
    threshold = args.get("assistant_confidence_threshold") or 0.0
    return f" (at most: a draft stops below top-token probability {threshold:g})" if threshold else ""


def _kib(value) -> str:
    return "–" if not value else f"{value / 1024:.1f}"


def write_markdown(path: Path, summary, fits, envelope, metadata, records) -> None:
    order = _ranker(metadata)
    pooled = sorted((r for r in summary if r["task"] == "all"), key=order)
    per_task = [r for r in summary if r["task"] != "all"]
    tasks = sorted({(r["task"], r["context_length"]) for r in per_task}, key=lambda t: (t[1], t[0]))
    cells = [r for r in per_task]
    total_cells = len(cells)
    bad = [r for r in cells if r["diff_tokens_max"] > 0]
    args = metadata["arguments"]
    out = [
        f"# hf-budgetdraft bench — preset `{metadata['preset']}`",
        "",
        f"- models: {', '.join(f'{k}: {v}' for k, v in metadata['models'].items())}",
        f"- corpus: {metadata['corpus']}",
        f"- grid: contexts {args['contexts']}, budgets {args['budgets']}, γ {args['gammas']}{_draft_stop(args)}, policies "
        f"{args['policies']}, tasks {metadata.get('tasks', args['tasks'])}; {args['new_tokens']} new tokens, {args['samples']} sample(s) per "
        f"task and context, {args['repeats']} interleaved repeat(s){' after one warm-up pass' if args['warmup'] else ''}",
        f"- machine: {metadata['machine']}; device {metadata['device']}, dtype {args['dtype']}; torch "
        f"{metadata['torch']}, transformers {metadata['transformers']}; **torch threads {metadata['threads']}**",
        f"- load average (1/5/15 min) at start {metadata.get('load_average_start')}, at end "
        f"{metadata.get('load_average_end')}: timings on a busy machine are noisy; the intervals show how much.",
        "",
        "## Losslessness (greedy diff vs the target's own greedy output)",
        "",
        (
            f"**All {total_cells} cells identical (0 differing tokens).**"
            if not bad
            else f"**{len(bad)} of {total_cells} cells DIFFER from the target's greedy output.**"
        ),
        "",
        "Cell = differing tokens (max over samples and repeats), first divergence in parentheses.",
        "",
    ]
    labels = sorted({(r["label"], order(r)[:2]) for r in cells}, key=lambda t: t[1])
    lookup = {(r["label"], r["task"], r["context_length"]): r for r in cells}
    diff_rows = []
    for label, _ in labels:
        row = [label]
        for task, context in tasks:
            cell = lookup.get((label, task, context))
            if cell is None:
                row.append("")
            elif cell["diff_tokens_max"]:
                row.append(f"**{cell['diff_tokens_max']}** (@{cell['first_diff_min']})")
            else:
                row.append("0")
        diff_rows.append(row)
    out += [_table(["method"] + [f"{t}@{c}" for t, c in tasks], diff_rows), ""]

    out += [
        "### Noise envelope",
        "",
        "Divergence between runs of the same cell, max over cells: `native_vs_ar` (stock full-cache assisted vs AR) "
        "is the numerical-noise floor of speculation itself; `windowed_vs_native` is what a sparse draft adds on "
        "top. `run-to-run` = max diff between repeats of one method. On CPU fp32 all must be 0.",
        "",
    ]
    env = defaultdict(lambda: [0, 0, 0, 0])
    for row in envelope:
        slot = env[(row["kind"], row["label"], row["baseline"])]
        slot[0] = max(slot[0], row["diff_tokens"])
        slot[1] += row["diff_tokens"] > 0
        slot[2] = max(slot[2], row["run_to_run"])
        slot[3] += 1
    kinds = {
        "ar_run_to_run": 0,
        "ar_setup_vs_ar": 1,
        "native_vs_ar": 2,
        "windowed_vs_native": 3,
        "other_vs_ar": 4,
    }
    env_rows = [
        [kind, label, baseline, v[0], f"{v[1]}/{v[3]}", v[2]]
        for (kind, label, baseline), v in sorted(env.items(), key=lambda kv: (kinds[kv[0][0]], kv[0][1]))
    ]
    out += [_table(["kind", "run", "baseline", "max diff", "cells with diff", "run-to-run"], env_rows), ""]
    margins = [r for r in records if r["first_diff_margin"] is not None]
    if margins:
        out += [
            "Target logit margin at each first divergence (greedy token − other token; near 0 = argmax near-tie): "
            + ", ".join(
                f"{r['label']} {r['task']}@{r['context_length']}: {r['first_diff_margin']:.2e}"
                for r in margins[:20]
            ),
            "",
        ]

    out += [
        "## Acceptance",
        "",
        "Pooled over tasks and samples (repeat 0; repeats re-run the same rounds). Mean accepted length = tokens "
        "emitted per verification round (accepted + the target's own token); acceptance = accepted / proposed draft "
        "tokens, Wilson 95% interval treating draft tokens as independent (approximate); per position k: of the "
        "rounds that reached draft position k, the share accepting it (Wilson 95%).",
        "",
    ]
    acc_rows = []
    for r in pooled:
        if r["method"] == "ar":
            continue
        positions = "; ".join(
            f"{p['position']}: {_fmt(p['rate'])} [{_fmt(p['low'])}, {_fmt(p['high'])}] n={p['reached']}"
            for p in r["acceptance_per_position"]
        )
        acc_rows.append(
            [
                r["label"],
                r["context_length"],
                r["rounds"],
                _fmt(r["mean_accepted_length"]),
                _ci(r["acceptance_rate"], r["acceptance_low"], r["acceptance_high"]),
                positions,
            ]
        )
    out += [
        _table(
            ["method", "context", "rounds", "mean accepted length", "acceptance [95% CI]", "per position k"],
            acc_rows,
        ),
        "",
    ]

    out += ["### Acceptance rate per task", ""]
    task_rows = []
    for label, _ in labels:
        if label.split()[0] in ("ar", "mtp:ar"):
            continue
        row = [label]
        for task, context in tasks:
            cell = lookup.get((label, task, context))
            row.append(_fmt(cell.get("acceptance_rate")) if cell else "")
        task_rows.append(row)
    out += [_table(["method"] + [f"{t}@{c}" for t, c in tasks], task_rows), ""]

    out += [
        "## Speed",
        "",
        "Speed-up = median over (task, sample, repeat) of the paired ratio AR seconds / method seconds (AR ran in the "
        "same interleaved pass), bootstrap 95% interval. End to end (prefill included); `decode tok/s` excludes the "
        "prefill (time after the first emitted tokens), and the decode speed-up is the paired ratio of those. `AR` is "
        "the target as loaded on transformers' default cache; when the AR baselines ran, `vs stock AR` pairs with AR "
        "on stock `sdpa` attention (transformers out of the box) and `vs AR+Growable` with AR on the fast "
        "`GrowableCache` and `vs fast AR` with AR on both the fast cache and `budgetdraft_sdpa` (so the speculative "
        "gain and the cache/attention gain are told apart). `oneliner/...` rows are `generate(ids, assistant_model="
        "drafter, cache_implementation=...)` with nothing else: the package's defaults. Phase times are "
        "medians per round, each call's first round (the prefills) left out.",
        "",
    ]
    columns = [
        ("speed-up vs AR [95% CI]", "speedup_vs_ar"),
        ("decode speed-up vs AR [95% CI]", "decode_speedup_vs_ar"),
        ("decode vs stock AR [95% CI]", "decode_speedup_vs_ar_stock"),
        ("decode vs AR+Growable [95% CI]", "decode_speedup_vs_ar_growable"),
        ("decode vs fast AR [95% CI]", "decode_speedup_vs_ar_fast"),
        ("vs native [95% CI]", "speedup_vs_native"),
    ]
    columns = [(h, k) for h, k in columns if any(r.get(k) is not None for r in pooled)]
    speed_rows = [
        [
            r["label"],
            r["context_length"],
            _fmt(r["tokens_per_second"], 1),
            _fmt(r["decode_tokens_per_second"], 1),
            *(_ci(r.get(k), r.get(f"{k}_low"), r.get(f"{k}_high")) for _, k in columns),
            _fmt(r["draft_ms_per_round"]),
            _fmt(r["verify_ms_per_round"]),
            _fmt(r["overhead_ms_per_run"], 1),
        ]
        for r in pooled
    ]
    headers = ["method", "context", "tok/s", "decode tok/s", *(h for h, _ in columns)]
    headers += ["draft ms/round", "verify ms/round", "overhead ms/run"]
    out += [_table(headers, speed_rows), ""]
    gap_rows = round_budget_rows(pooled)
    if gap_rows:
        out += [
            "### What a round has to buy",
            "",
            "Decode speed-up ≈ accepted length × t_AR / t_round, with t_AR the AR baseline's median decode ms per "
            "token in this run (stock AR where it ran, else AR), t_round the median draft + verify ms of a round "
            "above and the accepted length pooled over the cell's rounds. So a 2× needs an accepted length of "
            "2·t_round / t_AR at these phase costs, and γ + 1 tokens a round (every draft accepted) is the most any "
            "drafter could reach at them. A model, not a measurement: pooled over rounds, it weighs a passage by its "
            "rounds (a poorly drafted passage has more of them), where the measured speed-up above is the median "
            "over runs, each passage counting once.",
            "",
            _table(
                [
                    "method",
                    "context",
                    "t_AR (ms/token)",
                    "t_round (ms)",
                    "accepted length",
                    "predicted decode speed-up",
                    "accepted length for 2×",
                    "speed-up if every draft were accepted",
                ],
                [
                    [
                        g["label"],
                        g["context_length"],
                        f"{g['ar_ms_per_token']:.2f} ({g['baseline']})",
                        _fmt(g["round_ms"]),
                        _fmt(g["mean_accepted_length"]),
                        _fmt(g["predicted_speedup"]),
                        _fmt(g["accepted_length_for_2x"]),
                        _fmt(g["full_acceptance_speedup"]),
                    ]
                    for g in gap_rows
                ],
            ),
            "",
        ]

    out += [
        "### Cost model",
        "",
        "Least squares over rounds: round time = c + γ·t_draft_forward (Windowed-MTP's model; γ = tokens proposed "
        "in the round), ± standard errors; the draft and verify phases fitted alone show where the per-token cost "
        "goes (a verify slope > 0 is verification cost that grows with γ). Needs >= 2 distinct γ.",
        "",
    ]
    fit_rows = []
    base_rank: dict[str, int] = {}
    for i, label in enumerate(metadata.get("methods", [])):
        base_rank.setdefault(label.split(" γ=")[0], i)
    for f in sorted(fits, key=lambda f: (base_rank.get(f["label"], len(base_rank)), f["context_length"])):
        if f["fit"] is None:
            fit_rows.append([f["label"], f["context_length"], f["n"], "–", "–", "–", "–", "–", f["reason"]])
            continue
        rnd, drf, ver = f["fit"]["round"], f["fit"]["draft"], f["fit"]["verify"]
        fit_rows.append(
            [
                f["label"],
                f["context_length"],
                f["n"],
                f"{1e3 * rnd['intercept']:.3f} ± {1e3 * rnd['intercept_se']:.3f}",
                f"{1e3 * rnd['slope']:.3f} ± {1e3 * rnd['slope_se']:.3f}",
                f"{1e3 * drf['slope']:.3f} ± {1e3 * drf['slope_se']:.3f}",
                f"{1e3 * ver['slope']:.3f} ± {1e3 * ver['slope_se']:.3f}",
                _fmt(rnd["r_squared"]),
                "",
            ]
        )
    out += [
        _table(
            [
                "method",
                "context",
                "rounds",
                "c (ms)",
                "t_draft_forward (ms)",
                "draft slope (ms)",
                "verify slope (ms)",
                "R²",
                "note",
            ],
            fit_rows,
        ),
        "",
    ]

    out += [
        "## Memory",
        "",
        "KV-cache bytes (`cache_nbytes`: preallocated buffers count in full) at the end of a run; peak RSS is the "
        "process's maximum so far (monotone over the bench).",
        "",
    ]
    mem_rows = [
        [
            r["label"],
            r["context_length"],
            _kib(r["draft_cache_bytes"]),
            _kib(r["target_cache_bytes"]),
            _fmt(r["peak_rss_bytes"] / 2**20, 0) if r["peak_rss_bytes"] else "–",
        ]
        + (
            [_fmt(r["cuda_peak_bytes"] / 2**20, 0) if r["cuda_peak_bytes"] else "–"]
            if metadata["cuda_device"]
            else []
        )
        for r in pooled
    ]
    out += [
        _table(
            ["method", "context", "draft KV (KiB)", "target KV (KiB)", "peak RSS (MiB)"]
            + (["CUDA peak (MiB)"] if metadata["cuda_device"] else []),
            mem_rows,
        ),
        "",
    ]

    passkey = [r for r in per_task if r["answer_match_rate"] is not None and r["method"] == "ar"]
    if passkey:
        out += [
            "## Passkey answers (the target's own greedy output; every lossless method gives the same)",
            "",
            _table(
                ["target", "task", "context", "exact key"],
                [
                    [r["target"], r["task"], r["context_length"], _fmt(r["answer_match_rate"])]
                    for r in sorted(passkey, key=lambda r: (r["target"], r["task"], r["context_length"]))
                ],
            ),
            "",
        ]
    if metadata.get("plots"):
        out += ["## Plots", ""] + [f"![{name}]({name})" for name in metadata["plots"]] + [""]
    path.write_text("\n".join(out))


# ---------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------


def _figure(panels: int, max_columns: int = 3, width: float = 4.4, height: float = 3.4):
    """A Figure on an Agg canvas (no pyplot, no global backend change) with `panels` axes in a grid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(max(panels, 1), max_columns)
    rows = math.ceil(max(panels, 1) / columns)
    figure = Figure(figsize=(width * columns, height * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax in axes[panels:]:
        ax.set_visible(False)
    return figure, axes[: max(panels, 1)]


def _yerr(points, lows, highs) -> np.ndarray:
    """Asymmetric error bars `(2, n)` from interval bounds (missing bounds -> 0)."""
    below = [p - lo if lo is not None else 0.0 for p, lo in zip(points, lows, strict=True)]
    above = [hi - p if hi is not None else 0.0 for p, hi in zip(points, highs, strict=True)]
    return np.clip(np.array([below, above], dtype=float), 0.0, None)


def _series_name(target: str, drafter: str | None, name: str) -> str:
    prefix = "" if target == "target" else f"{target}:"
    suffix = f" [{drafter}]" if drafter not in (None, "drafter") else ""
    return f"{prefix}{name}{suffix}"


def _log2_axis(ax, ticks: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)


def write_plots(directory: Path, summary: list[dict]) -> list[str]:
    """The three PNGs, from the rows pooled over tasks, at the largest γ of each drafting method."""
    from matplotlib import colormaps

    pooled = [r for r in summary if r["task"] == "all"]
    drafted = [r for r in pooled if r["method"] in ("assisted", "mtp")]
    if not drafted:
        return []
    top_gamma: dict[tuple, int] = {}
    for r in drafted:
        key = (r["target"], r["drafter"], r["method"])
        top_gamma[key] = max(top_gamma.get(key, 0), r["gamma"])
    rows = [r for r in drafted if r["gamma"] == top_gamma[(r["target"], r["drafter"], r["method"])]]
    series = sorted({(r["target"], r["drafter"], r["name"]) for r in rows if r["budget"] is not None})
    contexts = sorted({r["context_length"] for r in pooled})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    colors = colormaps["tab10"]

    def native_of(target, drafter, context=None):
        return sorted(
            (
                r
                for r in rows
                if r["budget"] is None
                and (r["target"], r["drafter"]) == (target, drafter)
                and (context is None or r["context_length"] == context)
            ),
            key=lambda r: r["context_length"],
        )

    # 1. acceptance vs context length: one panel per sparse method, one line per budget, full cache dashed
    figure, axes = _figure(len(series))
    for ax, (target, drafter, name) in zip(axes, series, strict=False):
        mine = [r for r in rows if (r["target"], r["drafter"], r["name"]) == (target, drafter, name)]
        for i, budget in enumerate(budgets):
            line = sorted(
                (r for r in mine if r["budget"] == budget and r["acceptance_rate"] is not None),
                key=lambda r: r["context_length"],
            )
            if line:
                ys = [r["acceptance_rate"] for r in line]
                err = _yerr(ys, [r["acceptance_low"] for r in line], [r["acceptance_high"] for r in line])
                xs = [r["context_length"] for r in line]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors(i), label=f"B={budget}")
        native = [r for r in native_of(target, drafter) if r["acceptance_rate"] is not None]
        if native:
            xs, ys = [r["context_length"] for r in native], [r["acceptance_rate"] for r in native]
            ax.plot(xs, ys, "k--", marker="x", label="full cache (native)")
        ax.set_title(f"{_series_name(target, drafter, name)}, γ={mine[0]['gamma']}", fontsize=9)
        _log2_axis(ax, contexts, "context length (tokens)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("acceptance rate (Wilson 95%)")
        ax.legend(fontsize=7)
    figure.savefig(directory / PLOTS[0], dpi=110)
    written = [PLOTS[0]]

    # 2. speed-up vs budget: one panel per context; full-cache drafting and prompt lookup as horizontal lines
    figure, axes = _figure(len(contexts))
    for ax, context in zip(axes, contexts, strict=True):
        for i, (target, drafter, name) in enumerate(series):
            line = sorted(
                (
                    r
                    for r in rows
                    if (r["target"], r["drafter"], r["name"]) == (target, drafter, name)
                    and r["context_length"] == context
                ),
                key=lambda r: r["budget"],
            )
            if line:
                ys = [r["speedup_vs_ar"] for r in line]
                err = _yerr(
                    ys, [r["speedup_vs_ar_low"] for r in line], [r["speedup_vs_ar_high"] for r in line]
                )
                ax.errorbar(
                    [r["budget"] for r in line],
                    ys,
                    yerr=err,
                    marker="o",
                    capsize=3,
                    color=colors(i % 10),
                    label=_series_name(target, drafter, name),
                )
        for target, drafter in sorted({(r["target"], r["drafter"]) for r in rows}, key=str):
            for r in native_of(target, drafter, context):
                style = "--" if target == "target" else "-."
                ax.axhline(
                    r["speedup_vs_ar"],
                    color="k",
                    linestyle=style,
                    label=_series_name(target, drafter, r["name"]),
                )
        lookup = [r for r in pooled if r["method"] == "prompt_lookup" and r["context_length"] == context]
        if lookup:
            best = max(lookup, key=lambda r: r["gamma"])
            ax.axhline(
                best["speedup_vs_ar"], color="grey", linestyle=":", label=f"prompt lookup γ={best['gamma']}"
            )
        ax.axhline(1.0, color="k", linewidth=0.6)
        _log2_axis(ax, budgets, "budget (prefix keys the draft reads)")
        ax.set_title(f"context {context}", fontsize=9)
        ax.set_ylabel("speed-up vs AR (bootstrap 95%)")
        ax.legend(fontsize=6)
    figure.savefig(directory / PLOTS[1], dpi=110)
    written.append(PLOTS[1])

    # 3. phase costs vs context: draft / verify ms per round (medians), AR ms per token for scale
    figure, axes = _figure(2, width=5.4, height=4.0)
    keys = sorted({(r["target"], r["drafter"], r["name"], r["budget"] or 0) for r in rows}, key=str)
    styles = {"native": "--", "sink_window": "-", "mtp_native": "--", "mtp_windowed": "-"}
    for i, (target, drafter, name, budget) in enumerate(keys):
        line = sorted(
            (
                r
                for r in rows
                if (r["target"], r["drafter"], r["name"], r["budget"] or 0) == (target, drafter, name, budget)
            ),
            key=lambda r: r["context_length"],
        )
        label = _series_name(target, drafter, name) + (f" B={budget}" if budget else "")
        for ax, field in zip(axes, ("draft_ms_per_round", "verify_ms_per_round"), strict=True):
            points = [(r["context_length"], r[field]) for r in line if r[field] is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(
                    xs, ys, styles.get(name, "-."), marker="o", color=colormaps["tab20"](i % 20), label=label
                )
    ar = sorted(
        (r for r in pooled if r["method"] == "ar" and r["target"] == "target" and r["ar_ms_per_token"]),
        key=lambda r: r["context_length"],
    )
    if ar:
        xs, ys = [r["context_length"] for r in ar], [r["ar_ms_per_token"] for r in ar]
        axes[1].plot(xs, ys, "k:", marker="s", label="AR ms/token")
    for ax, title in zip(axes, ("draft phase per round", "verify phase per round"), strict=True):
        _log2_axis(ax, contexts, "context length (tokens)")
        ax.set_title(title + " (largest γ; medians, first round excluded)", fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=6, ncols=2)
    figure.savefig(directory / PLOTS[2], dpi=110)
    written.append(PLOTS[2])
    return written


# ---------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------


def write_report(
    directory: Path, records: list[dict], envelope: list[dict], metadata: dict, args
) -> tuple[list[dict], list[dict]]:
    """Write every output under `directory`; returns `(summary, phase_fits)`."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, draws=args.bootstrap_draws, seed=args.seed)
    fits = phase_fits(records)
    metadata["plots"] = write_plots(directory, summary) if args.plots else []
    write_json(directory / "results.json", records, summary, fits, envelope, metadata)
    write_csv(directory / "results.csv", records)
    write_markdown(directory / "report.md", summary, fits, envelope, metadata, records)
    return summary, fits


def console_summary(summary: list[dict], records: list[dict], directory: Path, metadata: dict) -> str:
    """A short table for the terminal (pooled over tasks), the greedy-diff verdict and where the files are."""
    pooled = sorted((r for r in summary if r["task"] == "all"), key=_ranker(metadata))
    rows = [
        [
            r["label"],
            r["context_length"],
            r["diff_tokens_max"],
            _fmt(r.get("mean_accepted_length")),
            _fmt(r.get("acceptance_rate")),
            _ci(r["speedup_vs_ar"], r["speedup_vs_ar_low"], r["speedup_vs_ar_high"]),
            _kib(r["draft_cache_bytes"]),
        ]
        for r in pooled
    ]
    bad = sum(r["diff_tokens"] > 0 for r in records)
    verdict = (
        f"greedy diff: all {len(records)} runs identical to the target's greedy output"
        if not bad
        else f"greedy diff: {bad} of {len(records)} runs DIFFER from the target's greedy output"
    )
    table = _table(
        [
            "method",
            "context",
            "diff",
            "mean acc. len",
            "acceptance",
            "speed-up vs AR [95% CI]",
            "draft KV KiB",
        ],
        rows,
    )
    return f"{table}\n\n{verdict}\nwrote {directory}/results.json, results.csv, report.md and plots"
