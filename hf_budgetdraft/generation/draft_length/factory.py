"""One factory for every caller: the draft-length policy of a single-sequence call, of a batch, of windowed MTP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.utils import logging

from .adaptive import AdaptiveDraftLength
from .per_row import RowDraftLength, SharedDraftLength
from .policy import DraftLength, FixedDraftLength, HeuristicDraftLength

if TYPE_CHECKING:
    from ..plan import DraftPlan

logger = logging.get_logger(__name__)


def for_plan(plan: DraftPlan) -> DraftLength:
    """The draft-length policy a plan names."""
    length, maximum = plan.spec.draft_length, plan.spec.max_draft_length
    if length == "adaptive":
        return AdaptiveDraftLength(maximum=maximum)
    if length == "heuristic":
        return HeuristicDraftLength(length=plan.heuristic_start, maximum=maximum)
    return FixedDraftLength(length=int(length))


def for_rows(plan: DraftPlan, rows: int) -> RowDraftLength | SharedDraftLength:
    """The adaptive policy per row, or the plan's explicit length shared by every row."""
    if plan.spec.draft_length == "adaptive":
        return RowDraftLength(maximum=plan.spec.max_draft_length, rows=rows)
    return SharedDraftLength(for_plan(plan))


def for_mtp(length: int | str, num_mtp_layers: int) -> DraftLength | None:
    """The draft-length policy of a windowed-MTP call, from its `cache_config`'s `draft_length`: `"adaptive"` (the
    default) drafts each round only when the policy predicts it pays, for a one-layer head; a deeper head drafts its
    fixed chain (`None`: transformers' own loop), as does `draft_length=num_mtp_layers` (for one layer, through the
    same generator as the adaptive policy, so its catch-up is windowed too); `0` never drafts."""
    if length == "adaptive":
        if num_mtp_layers == 1:
            return AdaptiveDraftLength(maximum=1)
        logger.warning_once(
            f"an adaptive draft length drives one-layer MTP heads; this model's {num_mtp_layers} MTP layers draft "
            "their fixed chain every round"
        )
        return None
    if isinstance(length, int) and not isinstance(length, bool):
        if length == num_mtp_layers:
            return FixedDraftLength(1) if num_mtp_layers == 1 else None
        if length == 0 and num_mtp_layers == 1:
            return FixedDraftLength(0)
    raise ValueError(
        f"windowed MTP takes draft_length 'adaptive', {num_mtp_layers} (its MTP layers, every round) or 0 (never); "
        f"got {length!r}"
    )
