"""How many tokens a speculative round drafts: the policies, their shared cost fit, the round clock that feeds
them, and one factory (`for_plan`, `for_rows`, `for_mtp`) for the single-sequence loop, the batched loop and MTP.

- `base`: the interface, `FixedDraftLength`, `HeuristicDraftLength` (transformers' schedule);
- `adaptive`: `AdaptiveDraftLength`, chosen online from the call's own costs and acceptance;
- `per_row`: `RowDraftLength` (a γ per row of a batch), `SharedDraftLength`;
- `cost_fit`: `DecayedLinearFit`, the running cost fit the adaptive policies share;
- `clock`: `RoundClock`, a round's draft and verification times.
"""

from .adaptive import AdaptiveDraftLength
from .clock import RoundClock
from .cost_fit import DecayedLinearFit
from .factory import for_mtp, for_plan, for_rows
from .per_row import RowDraftLength, SharedDraftLength
from .policy import DraftLength, FixedDraftLength, HeuristicDraftLength

__all__ = [
    "AdaptiveDraftLength",
    "DecayedLinearFit",
    "DraftLength",
    "FixedDraftLength",
    "HeuristicDraftLength",
    "RoundClock",
    "RowDraftLength",
    "SharedDraftLength",
    "for_mtp",
    "for_plan",
    "for_rows",
]
