"""`report.md` (`write_markdown`, one function per section) and the terminal summary of a bench
(`console_summary`), from `report.summarize`'s rows, the phase fits, the noise envelope and the records."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .aggregate import round_budget_rows
from .machine import machine_text


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


@dataclass
class _Cells:
    """The summary rows a report reads: `pooled` (over tasks, in the interleaving order) and `per_task`, with
    the `(task, context)` columns, the method labels in order and a `(label, task, context)` lookup."""

    metadata: dict
    pooled: list[dict]
    per_task: list[dict]
    tasks: list[tuple[str, int]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    lookup: dict[tuple, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, summary: list[dict], metadata: dict) -> _Cells:
        order = _ranker(metadata)
        per_task = [r for r in summary if r["task"] != "all"]
        labels = sorted({(r["label"], order(r)[:2]) for r in per_task}, key=lambda t: t[1])
        return cls(
            metadata=metadata,
            pooled=sorted((r for r in summary if r["task"] == "all"), key=order),
            per_task=per_task,
            tasks=sorted({(r["task"], r["context_length"]) for r in per_task}, key=lambda t: (t[1], t[0])),
            labels=[label for label, _ in labels],
            lookup={(r["label"], r["task"], r["context_length"]): r for r in per_task},
        )

    def per_task_table(self, cell_text, skip=lambda label: False) -> str:
        """A method × `task@context` table whose cells are `cell_text(row)` (empty where nothing ran)."""
        rows = []
        for label in self.labels:
            if skip(label):
                continue
            row = [label]
            for task, context in self.tasks:
                cell = self.lookup.get((label, task, context))
                row.append("" if cell is None else cell_text(cell))
            rows.append(row)
        return _table(["method"] + [f"{t}@{c}" for t, c in self.tasks], rows)


def write_markdown(path: Path, summary, fits, envelope, metadata, records) -> None:
    """Write `report.md`: the run's header, then losslessness, acceptance, speed, cost model, memory, passkey
    answers and plots."""
    cells = _Cells.of(summary, metadata)
    checks = (
        (_sampling_note(metadata),)
        if metadata.get("sampling")
        else (_losslessness(cells), _noise_envelope(envelope, records))
    )
    sections = (
        _header(metadata),
        *checks,
        _acceptance(cells.pooled),
        _acceptance_per_task(cells),
        _speed(cells.pooled),
        _round_budget(cells.pooled),
        _cost_model(fits, metadata),
        _memory(cells.pooled, metadata),
        _passkey(cells.per_task),
        _plots(metadata),
    )
    path.write_text("\n".join(line for section in sections for line in section))


def _header(metadata: dict) -> list[str]:
    args = metadata["arguments"]
    return [
        f"# hf-budgetdraft bench — preset `{metadata['preset']}`",
        "",
        f"- models: {', '.join(f'{k}: {v}' for k, v in metadata['models'].items())}",
        f"- corpus: {metadata['corpus']}",
        f"- grid: contexts {args['contexts']}, budgets {args['budgets']}, γ {args['gammas']}{_draft_stop(args)}, policies "
        f"{args['policies']}, tasks {metadata.get('tasks', args['tasks'])}; {args['new_tokens']} new tokens, {args['samples']} sample(s) per "
        f"task and context, {args['repeats']} interleaved repeat(s){' after one warm-up pass' if args['warmup'] else ''}",
        f"- machine: {_machine(metadata['machine'])}; device {metadata['device']}, dtype {args['dtype']}; torch "
        f"{metadata['torch']}, transformers {metadata['transformers']}; **torch threads {metadata['threads']}**",
        f"- load average (1/5/15 min) at start {metadata.get('load_average_start')}, at end "
        f"{metadata.get('load_average_end')}: timings on a busy machine are noisy; the intervals show how much.",
        "",
    ]


def _machine(described) -> str:
    """The machine line of a run's metadata: a `machine()` dict, or the plain text older results hold."""
    return machine_text(described) if isinstance(described, dict) else str(described)


def _sampling_note(metadata: dict) -> list[str]:
    return [
        f"## Sampling ({', '.join(f'{k} {v}' for k, v in metadata['sampling'].items())}, top-k as the model's "
        "generation config)",
        "",
        "Every method of a repeat draws from the same seed, but each run draws its own tokens, so token diffs check "
        "nothing here: speculative sampling keeps the target's distribution by construction (Leviathan et al., "
        "arXiv 2211.17192), which the package's chi-square tests check. Speed-ups compare with AR sampling.",
        "",
    ]


def _losslessness(cells: _Cells) -> list[str]:
    total = len(cells.per_task)
    bad = [r for r in cells.per_task if r["diff_tokens_max"] > 0]

    def diff(cell: dict) -> str:
        if cell["diff_tokens_max"]:
            return f"**{cell['diff_tokens_max']}** (@{cell['first_diff_min']})"
        return "0"

    return [
        "## Losslessness (greedy diff vs the target's own greedy output)",
        "",
        (
            f"**All {total} cells identical (0 differing tokens).**"
            if not bad
            else f"**{len(bad)} of {total} cells DIFFER from the target's greedy output.**"
        ),
        "",
        "Cell = differing tokens (max over samples and repeats), first divergence in parentheses.",
        "",
        cells.per_task_table(diff),
        "",
    ]


_ENVELOPE_KINDS = {
    "ar_run_to_run": 0,
    "ar_setup_vs_ar": 1,
    "native_vs_ar": 2,
    "windowed_vs_native": 3,
    "other_vs_ar": 4,
}


def _noise_envelope(envelope: list[dict], records: list[dict]) -> list[str]:
    out = [
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
    env_rows = [
        [kind, label, baseline, v[0], f"{v[1]}/{v[3]}", v[2]]
        for (kind, label, baseline), v in sorted(
            env.items(), key=lambda kv: (_ENVELOPE_KINDS[kv[0][0]], kv[0][1])
        )
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
    return out


def _acceptance(pooled: list[dict]) -> list[str]:
    rows = []
    for r in pooled:
        if r["method"] == "ar":
            continue
        positions = "; ".join(
            f"{p['position']}: {_fmt(p['rate'])} [{_fmt(p['low'])}, {_fmt(p['high'])}] n={p['reached']}"
            for p in r["acceptance_per_position"]
        )
        rows.append(
            [
                r["label"],
                r["context_length"],
                r["rounds"],
                _fmt(r["mean_accepted_length"]),
                _ci(r["acceptance_rate"], r["acceptance_low"], r["acceptance_high"]),
                positions,
            ]
        )
    headers = ["method", "context", "rounds", "mean accepted length", "acceptance [95% CI]", "per position k"]
    return [
        "## Acceptance",
        "",
        "Pooled over tasks and samples (repeat 0; repeats re-run the same rounds). Mean accepted length = tokens "
        "emitted per verification round (accepted + the target's own token); acceptance = accepted / proposed draft "
        "tokens, Wilson 95% interval treating draft tokens as independent (approximate); per position k: of the "
        "rounds that reached draft position k, the share accepting it (Wilson 95%).",
        "",
        _table(headers, rows),
        "",
    ]


def _acceptance_per_task(cells: _Cells) -> list[str]:
    table = cells.per_task_table(
        lambda cell: _fmt(cell.get("acceptance_rate")),
        skip=lambda label: label.split()[0] in ("ar", "mtp:ar"),
    )
    return ["### Acceptance rate per task", "", table, ""]


_SPEED_COLUMNS = (
    ("speed-up vs AR [95% CI]", "speedup_vs_ar"),
    ("decode speed-up vs AR [95% CI]", "decode_speedup_vs_ar"),
    ("decode vs stock AR [95% CI]", "decode_speedup_vs_ar_stock"),
    ("decode vs AR+Growable [95% CI]", "decode_speedup_vs_ar_growable"),
    ("decode vs fast AR [95% CI]", "decode_speedup_vs_ar_fast"),
    ("decode vs static AR [95% CI]", "decode_speedup_vs_ar_static"),
    ("vs native [95% CI]", "speedup_vs_native"),
)


def _speed(pooled: list[dict]) -> list[str]:
    columns = [(h, k) for h, k in _SPEED_COLUMNS if any(r.get(k) is not None for r in pooled)]
    rows = [
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
    return [
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
        _table(headers, rows),
        "",
    ]


def _round_budget(pooled: list[dict]) -> list[str]:
    gap_rows = round_budget_rows(pooled)
    if not gap_rows:
        return []
    headers = [
        "method",
        "context",
        "t_AR (ms/token)",
        "t_round (ms)",
        "accepted length",
        "predicted decode speed-up",
        "accepted length for 2×",
        "speed-up if every draft were accepted",
    ]
    rows = [
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
    ]
    return [
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
        _table(headers, rows),
        "",
    ]


def _cost_model(fits: list[dict], metadata: dict) -> list[str]:
    base_rank: dict[str, int] = {}
    for i, label in enumerate(metadata.get("methods", [])):
        base_rank.setdefault(label.split(" γ=")[0], i)
    rows = [
        _fit_row(f)
        for f in sorted(fits, key=lambda f: (base_rank.get(f["label"], len(base_rank)), f["context_length"]))
    ]
    headers = [
        "method",
        "context",
        "rounds",
        "c (ms)",
        "t_draft_forward (ms)",
        "draft slope (ms)",
        "verify slope (ms)",
        "R²",
        "note",
    ]
    return [
        "### Cost model",
        "",
        "Least squares over rounds: round time = c + γ·t_draft_forward (Windowed-MTP's model; γ = tokens proposed "
        "in the round), ± standard errors; the draft and verify phases fitted alone show where the per-token cost "
        "goes (a verify slope > 0 is verification cost that grows with γ). Needs >= 2 distinct γ.",
        "",
        _table(headers, rows),
        "",
    ]


def _fit_row(f: dict) -> list:
    """A cost-model row in ms (± standard errors), or why the fit is missing."""
    if f["fit"] is None:
        return [f["label"], f["context_length"], f["n"], "–", "–", "–", "–", "–", f["reason"]]
    rnd, drf, ver = f["fit"]["round"], f["fit"]["draft"], f["fit"]["verify"]
    return [
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


def _memory(pooled: list[dict], metadata: dict) -> list[str]:
    cuda = bool(metadata["cuda_device"])
    rows = [
        [
            r["label"],
            r["context_length"],
            _kib(r["draft_cache_bytes"]),
            _kib(r["target_cache_bytes"]),
            _fmt(r["peak_rss_bytes"] / 2**20, 0) if r["peak_rss_bytes"] else "–",
        ]
        + ([_fmt(r["cuda_peak_bytes"] / 2**20, 0) if r["cuda_peak_bytes"] else "–"] if cuda else [])
        for r in pooled
    ]
    headers = ["method", "context", "draft KV (KiB)", "target KV (KiB)", "peak RSS (MiB)"]
    return [
        "## Memory",
        "",
        "KV-cache bytes (`cache_nbytes`: preallocated buffers count in full) at the end of a run; peak RSS is the "
        "process's maximum so far (monotone over the bench).",
        "",
        _table(headers + (["CUDA peak (MiB)"] if cuda else []), rows),
        "",
    ]


def _passkey(per_task: list[dict]) -> list[str]:
    passkey = [r for r in per_task if r["answer_match_rate"] is not None and r["method"] == "ar"]
    if not passkey:
        return []
    rows = [
        [r["target"], r["task"], r["context_length"], _fmt(r["answer_match_rate"])]
        for r in sorted(passkey, key=lambda r: (r["target"], r["task"], r["context_length"]))
    ]
    return [
        "## Passkey answers (the target's own greedy output; every lossless method gives the same)",
        "",
        _table(["target", "task", "context", "exact key"], rows),
        "",
    ]


def _plots(metadata: dict) -> list[str]:
    if not metadata.get("plots"):
        return []
    return ["## Plots", ""] + [f"![{name}]({name})" for name in metadata["plots"]] + [""]


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
        f"sampling ({metadata['sampling']}): no greedy diff; speed-ups are against AR sampling"
        if metadata.get("sampling")
        else f"greedy diff: all {len(records)} runs identical to the target's greedy output"
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
