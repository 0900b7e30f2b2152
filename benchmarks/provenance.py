"""Where a benchmark's figures came from: the git commit of the tree it ran on."""

from __future__ import annotations

import subprocess
from pathlib import Path


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
