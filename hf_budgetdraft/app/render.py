"""How the demo app draws a `Snapshot`: coloured tokens (HTML), the stats panel and the verdict (Markdown), and the
acceptance-per-position plot (matplotlib). Pure functions of their arguments; no Gradio."""

from __future__ import annotations

import html
import math

from .backend import SideView

# background per token origin; dark text on each so the page reads the same in light and dark themes
COLOURS = {"draft": "#b7ebc6", "target": "#fcd9a0", "ar": "#e3e7ee"}
ORIGIN_TITLES = {
    "draft": "accepted draft token",
    "target": "the target's own token (correction of a rejected draft, or bonus after a fully accepted one)",
    "ar": "plain AR token",
}
_BOX = (
    "white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;"
    "font-size:13px;line-height:1.7;max-height:420px;overflow-y:auto;padding:8px;border:1px solid #d0d5dd;"
    "border-radius:6px;min-height:80px;background:#ffffff;color:#111827"
)


def legend_html(speculative: bool) -> str:
    """The colour key above an output column."""
    keys = ("draft", "target") if speculative else ("ar",)
    labels = {
        "draft": "accepted draft token",
        "target": "target's token (correction / bonus)",
        "ar": "target token",
    }
    items = "".join(
        f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;width:12px;'
        f'height:12px;border-radius:2px;vertical-align:middle;background:{COLOURS[k]};border:1px solid #9aa3b2">'
        f"</span> {labels[k]}</span>"
        for k in keys
    )
    return f'<div style="font-size:12px;margin:2px 0 6px 0">{items}</div>'


def tokens_html(view: SideView | None, placeholder: str = "") -> str:
    """An output column: its title, colour key, and every generated token in a `<span data-origin=...>` whose
    background says how it came (hover: token index, id and origin).

    Args:
        view (`SideView`, *optional*): the column (`None`: the method was not run).
        placeholder (`str`): what to show without a view.
    """
    if view is None:
        return f'<div style="{_BOX};color:#6b7280">{html.escape(placeholder)}</div>'
    speculative = any(origin != "ar" for origin in view.origins) or not view.title.startswith("Plain AR")
    spans = []
    for index, (piece, token, origin) in enumerate(
        zip(view.pieces, view.token_ids, view.origins, strict=False)
    ):
        spans.append(
            f'<span data-origin="{origin}" title="token {index} (id {token}): {ORIGIN_TITLES[origin]}" '
            f'style="background:{COLOURS[origin]};color:#111827;box-shadow:inset -1px 0 0 rgba(17,24,39,.18)">'
            f"{html.escape(piece)}</span>"
        )
    state = " — generating…" if view.running else ""
    note = f' <span style="color:#6b7280">({html.escape(view.note)})</span>' if view.note else ""
    count = f" — {len(view.token_ids)} tokens" if view.token_ids else ""
    return (
        f'<div class="bd-column"><div style="font-weight:600">{html.escape(view.title)}{count}{state}{note}</div>'
        f"{legend_html(speculative)}"
        f'<div class="bd-tokens" style="{_BOX}">{"".join(spans)}</div></div>'
    )


def _bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if value < 1 << 20:
        return f"{value / 1024:.1f} KiB"
    return f"{value / 2**20:.2f} MiB"


def _number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def stats_markdown(summary: dict | None) -> str:
    """The stats panel: AR vs speculative throughput, speed-up, acceptance, timing split, KV-cache bytes."""
    if not summary:
        return ""
    ar, spec = summary["ar"], summary.get("speculative")
    header = "| | Plain AR | " + (f"Speculative: {spec['method']} |" if spec else "|")
    rows = [header, "|---|---|" + ("---|" if spec else "")]

    def row(name: str, ar_value: str, spec_value: str = "") -> None:
        rows.append(f"| {name} | {ar_value} |" + (f" {spec_value} |" if spec else ""))

    row("new tokens", str(ar["new_tokens"]), str(spec["new_tokens"]) if spec else "")
    row("time", _number(ar["seconds"], 2, " s"), _number(spec["seconds"], 2, " s") if spec else "")
    row(
        "tokens/s (with prefill)",
        _number(ar["tokens_per_second"]),
        _number(spec["tokens_per_second"]) if spec else "",
    )
    row(
        "tokens/s after the first token",
        _number(ar["decode_tokens_per_second"]),
        _number(spec["decode_tokens_per_second"]) if spec else "",
    )
    if spec:
        row(
            "**speed-up vs AR** (decoding: tokens/s after the first token)",
            "1.00×",
            f"**{_number(summary.get('speed_up'), 2, '×')}**",
        )
        row("end to end (prefill included)", "1.00×", _number(summary.get("speed_up_end_to_end"), 2, "×"))
        row(
            "mean accepted length (tokens per verification)",
            "1",
            f"{_number(spec['mean_accepted_length'], 2)} over {spec['rounds']} rounds (γ = {spec['gamma'] or 'adaptive'})",
        )
        row(
            "acceptance rate (accepted / proposed drafts)", "", _number(100 * spec["acceptance_rate"], 1, "%")
        )
        row(
            "draft / verify time",
            "",
            f"{_number(spec['draft_seconds'], 3, ' s')} / {_number(spec['verify_seconds'], 3, ' s')}",
        )
        draft, full = spec.get("draft_cache_bytes"), spec.get("full_draft_cache_bytes")
        share = f" ({100 * draft / full:.0f}% of it)" if draft and full else ""
        row(
            "KV cache",
            f"target: {_bytes(ar.get('target_cache_bytes'))}",
            f"draft: {_bytes(draft)} vs ≈{_bytes(full)} for a full draft cache{share}",
        )
    else:
        row("KV cache", f"target: {_bytes(ar.get('target_cache_bytes'))}")
    lines = [
        f"**Prompt:** {summary['prompt_tokens']} tokens · **decoding:** {summary['decoding']} · "
        f"**models:** {summary['models']}",
        "",
        *rows,
    ]
    if summary.get("random_weights"):
        lines += [
            "",
            "_Random weights: acceptance and speed-up say nothing about a trained pair; the smoke drafter is as "
            "large as its target, so no speed-up is expected. Losslessness is what these models check._",
        ]
    return "\n".join(lines)


def verdict_markdown(summary: dict | None) -> str:
    """The "identical to the target" line: greedy diff of the speculative output against plain AR."""
    if not summary or "speculative" not in summary:
        return ""
    check = summary.get("greedy_check")
    if check is None:
        if summary["decoding"].startswith("sampling"):
            return (
                "**Sampling:** the two runs draw different tokens, so they are not compared token by token; "
                "speculative sampling keeps the target's distribution."
            )
        return "A run stopped early, so the outputs are not compared."
    if check["identical"]:
        return (
            f"✓ **Identical to the target's own greedy output** — {check['compared']} of {check['compared']} "
            "tokens equal (greedy diff 0)."
        )
    where = f", first at token {check['first_diff']}" if "first_diff" in check else ""
    margin = (
        f" The target's logit gap there is {check['margin']:.2e} (a near-tie if tiny: numerical noise; large: a bug)."
        if check.get("margin") is not None
        else ""
    )
    return f"✗ **Differs from the target's greedy output** in {check['diff_tokens']} tokens{where}.{margin}"


def acceptance_figure(rows: list[dict] | None, title: str = ""):
    """Bar chart of the conditional acceptance per draft position k (Wilson 95% intervals; `n` = rounds that
    reached k, printed at the foot of each bar). A `matplotlib.figure.Figure` (no pyplot state), or `None` without rows."""
    if not rows:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 2.8), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    positions = [row["position"] for row in rows]
    rates = [row["rate"] if math.isfinite(row["rate"]) else 0.0 for row in rows]
    lower = [
        max(0.0, r - row["low"]) if math.isfinite(row["low"]) else 0.0
        for r, row in zip(rates, rows, strict=True)
    ]
    upper = [
        max(0.0, row["high"] - r) if math.isfinite(row["high"]) else 0.0
        for r, row in zip(rates, rows, strict=True)
    ]
    axes.bar(positions, rates, color="#4caf7a", yerr=[lower, upper], capsize=3, ecolor="#374151")
    for position, row in zip(positions, rows, strict=True):
        axes.text(
            position, 0.03, f"n={row['reached']}", ha="center", va="bottom", fontsize=8, color="#111827"
        )
    axes.set_ylim(0, 1.15)
    axes.set_xticks(positions)
    axes.set_xlabel("draft position k")
    axes.set_ylabel("P(accept k | 1..k-1 accepted)")
    axes.set_title(title or "Acceptance per draft position (95% Wilson intervals)", fontsize=10)
    axes.grid(axis="y", alpha=0.3)
    return figure
