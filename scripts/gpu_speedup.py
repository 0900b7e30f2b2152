"""The speed-up a GPU's measured costs give (the `cost_curves` section's `speedup` rows) and the tables of
`docs/gpu.md`.

    python scripts/gpu_speedup.py gpu-check-out/gpu_check.json    # the tables, from a check's JSON

Costs go through `hf_budgetdraft.eval.speedup_model` with the bundled drafters' measured per-position acceptance
(`benchmarks/results/ceiling.json`, nearest context) and with BudgetDraft's published acceptance rates taken as equal
at every position: the best draft length per context and its expected speed-up over plain AR.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from hf_budgetdraft.eval.speedup_model import best_draft_length, constant_survival, expected_speedup

CEILING = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ceiling.json"
# BudgetDraft (arXiv 2606.00144): acceptance 79% / 55% / 34% at 4K / 8K / 16K on its best dataset
PAPER_ACCEPTANCE = {4096: 0.79, 8192: 0.55, 16384: 0.34}
SPEEDUP_DRAFTS = ("full_eager", "full_compiled", "budgeted_static_eager", "budgeted_static_compiled")
DRAFT_COLUMNS = (
    "full_eager",
    "full_compiled",
    "sink_window_eager",
    "sink_window_static_eager",
    "sink_window_static_compiled",
    "budgeted_eager",
    "budgeted_static_eager",
    "budgeted_static_compiled",
)


def bundled_acceptance(context: int) -> tuple[int, dict[str, list[float]]]:
    """The bundled drafters' per-position acceptance `S_k` at the nearest measured context (mean over texts)."""
    rows = json.loads(CEILING.read_text())["rows"]
    nearest = min({r["context"] for r in rows}, key=lambda c: abs(c - context))
    by_mode = {}
    for mode in ("greedy", "T0.8"):
        curves = [r["survival"] for r in rows if r["context"] == nearest and r["mode"] == mode]
        by_mode[mode] = [statistics.mean(values) for values in zip(*curves, strict=True)]
    return nearest, by_mode


def speedups(context: int, costs: dict, host: float) -> list[dict]:
    """Best γ and expected speed-up over plain AR per acceptance source and draft step, with and without the
    measured host time a round."""
    verify = costs["verify_s"]
    nearest, bundled = bundled_acceptance(context)
    paper_context = min(PAPER_ACCEPTANCE, key=lambda c: abs(c - context))
    sources = {f"bundled {mode} (measured at {nearest})": s for mode, s in bundled.items()}
    sources[f"paper alpha={PAPER_ACCEPTANCE[paper_context]} (at {paper_context})"] = constant_survival(
        PAPER_ACCEPTANCE[paper_context], len(verify) - 1
    )
    draft_steps = {name: s for name, s in costs["draft_step_s"].items() if name in SPEEDUP_DRAFTS}
    rows = []
    for source, survive in sources.items():
        for draft, step in draft_steps.items():
            for label, overhead in (("device only", 0.0), ("with host time", host)):
                gamma, best = best_draft_length(survive, verify, 0.0, step, overhead)
                rows.append(
                    {
                        "context": context,
                        "acceptance": source,
                        "draft": draft,
                        "host": label,
                        "best_gamma": gamma,
                        "speedup_vs_fast_ar": best,
                        "speedup_vs_plain_generate": best * costs["step_stock_s"] / verify[0],
                        "at_gamma_4": expected_speedup(survive, verify, 0.0, step, 4, overhead),
                    }
                )
    return rows


def markdown(report: dict) -> str:
    """The cost curves of a `gpu_check.json` as the tables `docs/gpu.md` shows."""
    costs, env = report["cost_curves"], report["environment"]
    ms = lambda seconds: f"{1e3 * seconds:.2f}"  # noqa: E731
    lines = [
        f"{env.get('gpu', env['device'])}, torch {env['torch']}, transformers {env['transformers']}; target "
        f"{costs['models']['target_params'] / 1e9:.2f}B, drafter {costs['models']['drafter_params'] / 1e6:.0f}M, "
        f"{costs['models']['dtype']}, random weights. Milliseconds, medians (CUDA events).",
        "",
        "| context | target step (DynamicCache) | verify n = 1 / 2 / 3 / 5 / 8 / 9 / 16 / 17 (one-liner's attention) | "
        "same with `sdpa` | " + " | ".join(f"draft {name}" for name in DRAFT_COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(DRAFT_COLUMNS),
    ]
    picks = [1, 2, 3, 5, 8, 9, 16, 17]
    for c in costs["contexts"]:
        verify = " / ".join(ms(c["verify_s"][n - 1]) for n in picks if n <= len(c["verify_s"]))
        plain = " / ".join(ms(c["verify_sdpa_s"][n - 1]) for n in picks if n <= len(c["verify_sdpa_s"]))
        drafts = [ms(c["draft_step_s"][n]) if n in c["draft_step_s"] else "failed" for n in DRAFT_COLUMNS]
        lines.append(
            f"| {c['context']} | {ms(c['step_stock_s'])} | {verify} | {plain} | " + " | ".join(drafts) + " |"
        )
    drafts = SPEEDUP_DRAFTS
    lines += [
        "",
        "Expected decode speed-up over plain `generate()` (best γ in brackets), device time only:",
        "",
        "| context | acceptance | " + " | ".join(f"draft {d}" for d in drafts) + " |",
        "|---|---|" + "---|" * len(drafts),
    ]
    cells: dict = {}
    for row in costs["speedup"]:
        if row["host"] == "device only":
            cells.setdefault((row["context"], row["acceptance"]), {})[row["draft"]] = row
    for (context, acceptance), by_draft in cells.items():
        values = [
            f"{by_draft[d]['speedup_vs_plain_generate']:.2f} ({by_draft[d]['best_gamma']})"
            if d in by_draft
            else "-"
            for d in drafts
        ]
        lines.append(f"| {context} | {acceptance} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
