"""Write a bench's outputs: `results.json` (every record, the summary, the phase fits, the noise envelope, the
metadata), `results.csv` (the records' scalar fields), `report.md` (`report_markdown`) and the PNG plots
(`plots`); the aggregation is `summary`'s."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from .aggregate import phase_fits, summarize
from .plots import write_plots
from .records import PER_ROUND_FIELDS
from .report_markdown import write_markdown

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
    columns = [k for k in records[0] if k not in PER_ROUND_FIELDS] if records else list(REQUIRED_FIELDS)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for record in records:
            row = dict(record)
            row["acceptance_per_position"] = json.dumps(row.get("acceptance_per_position"))
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})
