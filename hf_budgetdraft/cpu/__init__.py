"""The CPU speed-ups: what makes a decode step cheaper where per-module Python and thread hand-offs, not device
work, dominate it. The plan turns them on for CPU devices only (`generation/device_rules.py`).

- `few_row_linear`: a float32 target's linear layers as few-row GEMMs on every thread, for one call;
- `lean_step`: a static draft cache's steps straight on a Llama-layout drafter's weights.
"""

from .few_row_linear import few_row_linear, few_row_linear_applies, few_row_linears, runs_few_row
from .lean_step import LeanDraftStep, lean_step_problem, same_logits

__all__ = [
    "LeanDraftStep",
    "few_row_linear",
    "few_row_linear_applies",
    "few_row_linears",
    "lean_step_problem",
    "runs_few_row",
    "same_logits",
]
