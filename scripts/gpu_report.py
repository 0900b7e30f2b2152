"""The GPU check's JSON document (`Report`): sections, named checks, errors, rewritten to disk after every section
so a check cut short still leaves what it measured."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def _cuda():
    """`torch.cuda` where this process uses a GPU (torch imported, a device present), else None."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_available() else None


class Report:
    """The JSON document: sections, named checks, errors; rewritten to disk after every section."""

    def __init__(self, path: Path, mode: str, time_budget: float, margin_tolerance: float):
        self.path, self.start, self.time_budget = path, time.perf_counter(), time_budget
        self.margin_tolerance = margin_tolerance
        self.data: dict = {"mode": mode, "checks": {}, "errors": [], "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def time_left(self) -> float:
        return self.time_budget - self.elapsed()

    def check(self, name: str, passed: bool, detail=None) -> None:
        self.data["checks"][name] = {"passed": bool(passed), "detail": detail}
        print(
            f"  [{'ok' if passed else 'FAIL'}] {name}" + (f": {detail}" if detail is not None else ""),
            flush=True,
        )

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        print(f"  [skip] {what}: {why}", flush=True)

    def section(self, name: str, function, *args) -> None:
        print(f"== {name} ({self.elapsed():.0f} s)", flush=True)
        began = time.perf_counter()
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        try:
            self.data[name] = function(self, *args)
        except Exception as error:  # a failed section is recorded; the others still run
            self.data["errors"].append(
                {"section": name, "error": repr(error), "traceback": traceback.format_exc()}
            )
            self.check(f"{name}.ran", False, repr(error))
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        self.data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - began, 2)
        if cuda is not None:  # a reading, also after an out-of-memory error: how far the section got
            peak = {"allocated": cuda.max_memory_allocated(), "reserved": cuda.max_memory_reserved()}
            self.data.setdefault("section_peak_gib", {})[name] = {
                k: round(v / 2**30, 2) for k, v in peak.items()
            }
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 2)
        self.data["all_passed"] = not self.data["errors"] and all(
            c["passed"] for c in self.data["checks"].values()
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
