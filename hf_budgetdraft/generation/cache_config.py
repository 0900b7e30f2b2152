"""One parser of `generate(cache_config=...)` for every kind of draft, with the same checks and messages.

- a drafter (`assistant_model=`): `DraftSpec.from_cache_config` (`spec.py`) checks its keys here;
- the model's own MTP head (`use_mtp=True`), a DFlash drafter (`speculation_type="dflash"`) and a Gemma 4 assistant
  (per cache name): `WindowedSpec`, the cache's options plus the run options that kind takes (MTP: `draft_length`,
  `fast_verify`).

Nothing past these reads the raw dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW_OPTIONS = ("num_sink_tokens", "window_length", "slack")
KINDS = {
    # kind -> (what the messages call it, cache options, run options)
    "mtp": ("windowed MTP", (*WINDOW_OPTIONS, "static"), ("draft_length", "fast_verify")),
    "dflash": ("windowed DFlash", WINDOW_OPTIONS, ()),
    "assistant_sink_window": ("a windowed Gemma 4 assistant", ("num_sink_tokens", "window_length"), ()),
    "assistant_budgeted": (
        "a budgeted Gemma 4 assistant",
        ("budget", "policy", "policy_kwargs", "window_length"),
        (),
    ),
}


def check_keys(cache_config: dict | None, accepted: tuple[str, ...], what: str) -> dict:
    """A copy of `cache_config`; keys outside `accepted` are refused, naming them and what is accepted."""
    options = dict(cache_config or {})
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"cache_config keys {unknown} are not options of {what}; accepted: {list(accepted)}")
    return options


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class WindowedSpec:
    """A windowed built-in draft: `kind` (one of `KINDS`), the cache's options as given (`cache_options`, checked
    by the cache class, or the assistant's read, itself), and the run options.

    Args:
        draft_length (`int` or `str`): MTP: `"adaptive"` (default), the head's depth, or 0 (`draft_length.for_mtp`).
        fast_verify (`bool`): MTP: the target verifies on `budgetdraft_sdpa` with a `GrowableCache` (default True).
    """

    kind: str
    cache_options: dict = field(default_factory=dict, hash=False)
    draft_length: int | str = "adaptive"
    fast_verify: bool = True

    @classmethod
    def from_cache_config(cls, kind: str, cache_config: dict | None) -> WindowedSpec:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
        what, cache_keys, run_keys = KINDS[kind]
        options = check_keys(cache_config, cache_keys + run_keys, what)
        run = {name: options.pop(name) for name in run_keys if name in options}
        check_bool("fast_verify", run.get("fast_verify", True))
        return cls(kind=kind, cache_options=options, **run)
