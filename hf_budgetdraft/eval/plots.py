"""The bench's PNG plots (matplotlib on an Agg canvas; no pyplot state is touched), from the summary rows pooled
over tasks, at the largest γ of each drafting method: acceptance vs context length per budget, speed-up vs
budget, phase costs vs context."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PLOTS = ("acceptance_vs_context.png", "speedup_vs_budget.png", "phase_costs_vs_context.png")


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


@dataclass
class _PlotRows:
    """What the plots draw: `pooled` (every row pooled over tasks) and `rows` (the drafting rows at each method's
    largest γ), with the sparse `series` `(target, drafter, name)`, the contexts and the budgets."""

    pooled: list[dict]
    rows: list[dict]
    series: list[tuple]
    contexts: list[int]
    budgets: list[int]

    @classmethod
    def of(cls, summary: list[dict]) -> _PlotRows | None:
        pooled = [r for r in summary if r["task"] == "all"]
        drafted = [r for r in pooled if r["method"] in ("assisted", "mtp")]
        if not drafted:
            return None
        top_gamma: dict[tuple, int] = {}
        for r in drafted:
            key = (r["target"], r["drafter"], r["method"])
            top_gamma[key] = max(top_gamma.get(key, 0), r["gamma"])
        rows = [r for r in drafted if r["gamma"] == top_gamma[(r["target"], r["drafter"], r["method"])]]
        return cls(
            pooled=pooled,
            rows=rows,
            series=sorted({(r["target"], r["drafter"], r["name"]) for r in rows if r["budget"] is not None}),
            contexts=sorted({r["context_length"] for r in pooled}),
            budgets=sorted({r["budget"] for r in rows if r["budget"] is not None}),
        )

    def native_of(self, target, drafter, context=None) -> list[dict]:
        """The full-cache rows of one target and drafter (at one context, if given), by context length."""
        return sorted(
            (
                r
                for r in self.rows
                if r["budget"] is None
                and (r["target"], r["drafter"]) == (target, drafter)
                and (context is None or r["context_length"] == context)
            ),
            key=lambda r: r["context_length"],
        )


def write_plots(directory: Path, summary: list[dict]) -> list[str]:
    """The three PNGs (`PLOTS`) under `directory`; returns the names written (none without a drafting method)."""
    data = _PlotRows.of(summary)
    if data is None:
        return []
    for draw, name in zip((_acceptance_plot, _speedup_plot, _phase_plot), PLOTS, strict=True):
        draw(data).savefig(directory / name, dpi=110)
    return list(PLOTS)


def _acceptance_plot(data: _PlotRows):
    """Acceptance vs context length: one panel per sparse method, one line per budget, full cache dashed."""
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    figure, axes = _figure(len(data.series))
    for ax, (target, drafter, name) in zip(axes, data.series, strict=False):
        mine = [r for r in data.rows if (r["target"], r["drafter"], r["name"]) == (target, drafter, name)]
        for i, budget in enumerate(data.budgets):
            line = sorted(
                (r for r in mine if r["budget"] == budget and r["acceptance_rate"] is not None),
                key=lambda r: r["context_length"],
            )
            if line:
                ys = [r["acceptance_rate"] for r in line]
                err = _yerr(ys, [r["acceptance_low"] for r in line], [r["acceptance_high"] for r in line])
                xs = [r["context_length"] for r in line]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colors(i), label=f"B={budget}")
        native = [r for r in data.native_of(target, drafter) if r["acceptance_rate"] is not None]
        if native:
            xs, ys = [r["context_length"] for r in native], [r["acceptance_rate"] for r in native]
            ax.plot(xs, ys, "k--", marker="x", label="full cache (native)")
        ax.set_title(f"{_series_name(target, drafter, name)}, γ={mine[0]['gamma']}", fontsize=9)
        _log2_axis(ax, data.contexts, "context length (tokens)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("acceptance rate (Wilson 95%)")
        ax.legend(fontsize=7)
    return figure


def _speedup_plot(data: _PlotRows):
    """Speed-up vs budget: one panel per context; full-cache drafting and prompt lookup as horizontal lines."""
    figure, axes = _figure(len(data.contexts))
    for ax, context in zip(axes, data.contexts, strict=True):
        _sparse_speedups(ax, data, context)
        for target, drafter in sorted({(r["target"], r["drafter"]) for r in data.rows}, key=str):
            for r in data.native_of(target, drafter, context):
                style = "--" if target == "target" else "-."
                ax.axhline(
                    r["speedup_vs_ar"],
                    color="k",
                    linestyle=style,
                    label=_series_name(target, drafter, r["name"]),
                )
        lookup = [r for r in data.pooled if r["method"] == "prompt_lookup" and r["context_length"] == context]
        if lookup:
            best = max(lookup, key=lambda r: r["gamma"])
            ax.axhline(
                best["speedup_vs_ar"], color="grey", linestyle=":", label=f"prompt lookup γ={best['gamma']}"
            )
        ax.axhline(1.0, color="k", linewidth=0.6)
        _log2_axis(ax, data.budgets, "budget (prefix keys the draft reads)")
        ax.set_title(f"context {context}", fontsize=9)
        ax.set_ylabel("speed-up vs AR (bootstrap 95%)")
        ax.legend(fontsize=6)
    return figure


def _sparse_speedups(ax, data: _PlotRows, context: int) -> None:
    """One line per sparse series at `context`: speed-up vs AR over the budget, bootstrap error bars."""
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    for i, (target, drafter, name) in enumerate(data.series):
        line = sorted(
            (
                r
                for r in data.rows
                if (r["target"], r["drafter"], r["name"]) == (target, drafter, name)
                and r["context_length"] == context
            ),
            key=lambda r: r["budget"],
        )
        if line:
            ys = [r["speedup_vs_ar"] for r in line]
            err = _yerr(ys, [r["speedup_vs_ar_low"] for r in line], [r["speedup_vs_ar_high"] for r in line])
            ax.errorbar(
                [r["budget"] for r in line],
                ys,
                yerr=err,
                marker="o",
                capsize=3,
                color=colors(i % 10),
                label=_series_name(target, drafter, name),
            )


def _phase_plot(data: _PlotRows):
    """Phase costs vs context: draft / verify ms per round (medians), AR ms per token for scale."""
    from matplotlib import colormaps

    figure, axes = _figure(2, width=5.4, height=4.0)
    keys = sorted({(r["target"], r["drafter"], r["name"], r["budget"] or 0) for r in data.rows}, key=str)
    styles = {"native": "--", "sink_window": "-", "mtp_native": "--", "mtp_windowed": "-"}
    for i, (target, drafter, name, budget) in enumerate(keys):
        line = sorted(
            (
                r
                for r in data.rows
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
        (r for r in data.pooled if r["method"] == "ar" and r["target"] == "target" and r["ar_ms_per_token"]),
        key=lambda r: r["context_length"],
    )
    if ar:
        xs, ys = [r["context_length"] for r in ar], [r["ar_ms_per_token"] for r in ar]
        axes[1].plot(xs, ys, "k:", marker="s", label="AR ms/token")
    for ax, title in zip(axes, ("draft phase per round", "verify phase per round"), strict=True):
        _log2_axis(ax, data.contexts, "context length (tokens)")
        ax.set_title(title + " (largest γ; medians, first round excluded)", fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=6, ncols=2)
    return figure
