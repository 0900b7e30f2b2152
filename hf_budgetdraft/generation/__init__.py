"""Speculative decoding on sparse draft caches, as `integration.py` plugs it into transformers' `generate()`.

- `plan`: `DraftSpec`, what a call asks for, and `DraftPlan`, that spec resolved for a target/drafter pair
  (`plan_choices`: how each automatic choice is decided);
- `device_rules`: the plan's device-dependent choices; `compiled_step`: how the draft step compiles, and when;
- `candidate_generator`: `SparseDraftCandidateGenerator`, the drafter on its sparse cache inside assisted generation;
- `draft_steps`: the draft's forwards as step objects (prefill, block, one-token: eager, lean, compiled);
- `draft_length`: how many tokens a round drafts (fixed, transformers' heuristic, adaptive);
- `acceptance`: greedy and speculative-sampling acceptance of a round's drafts;
- `batched_loop`: the ragged batched loop (every row advances by its own accepted count);
- `windowed_mtp`, `dflash`: the model's own MTP head / the DFlash block drafter on a sink + window cache;
- `mtp_heads`: building, exposing and saving an MTP head;
- `stats`: `record_speculation()`, per-round acceptance and cost of any speculative `generate()` call.
"""

from .acceptance import greedy_accept, speculative_accept
from .batched_loop import run_batched, run_sparse_batch
from .candidate_generator import SparseDraftCandidateGenerator
from .compiled_step import draft_step_compile_config
from .dflash import windowed_dflash_cache
from .draft_length import AdaptiveDraftLength, DraftLength, FixedDraftLength, HeuristicDraftLength
from .mtp_heads import expose_mtp_layers, new_mtp_head, save_pretrained_with_mtp
from .plan import DraftPlan, resolve_plan
from .spec import DraftSpec
from .stats import SpeculationStats, record_speculation
from .windowed_mtp import windowed_mtp_cache

__all__ = [
    "AdaptiveDraftLength",
    "DraftLength",
    "DraftPlan",
    "DraftSpec",
    "FixedDraftLength",
    "HeuristicDraftLength",
    "SparseDraftCandidateGenerator",
    "SpeculationStats",
    "draft_step_compile_config",
    "expose_mtp_layers",
    "greedy_accept",
    "new_mtp_head",
    "record_speculation",
    "resolve_plan",
    "run_batched",
    "run_sparse_batch",
    "save_pretrained_with_mtp",
    "speculative_accept",
    "windowed_dflash_cache",
    "windowed_mtp_cache",
]
