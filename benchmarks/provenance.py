"""Where a benchmark's figures came from: the git commit of the tree, the machine, the library versions."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch
import transformers

from hf_budgetdraft.eval.machine import machine, on_machine


def git_commit() -> str | None:
    """The checkout's `HEAD` commit (`None` outside a git checkout, e.g. a tree copied without its history)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def run_record(threads: int) -> dict:
    """A benchmark's `meta` entries that say where it ran: `{commit, date, machine, threads, torch,
    transformers}` (`machine`: `hf_budgetdraft.eval.machine.machine()`)."""
    return {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_results(stem: Path, result: dict, table: str, echo: bool = True) -> None:
    """Write a benchmark's `result` to `stem`.json and its Markdown `table` to `stem`.md (creating the folder),
    and print the table unless `echo` is False."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(table.rstrip("\n") + "\n")
    if echo:
        print(table.rstrip("\n"), flush=True)


def run_text(meta: dict) -> str:
    """`"torch 2.13.0+cpu, transformers 5.25.0, 2026-12-06, commit 1a2b3c4, on <machine>"` for a table header."""
    commit = f", commit {meta['commit'][:7]}" if meta.get("commit") else ""
    return f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['date']}{commit}{on_machine(meta)}"
