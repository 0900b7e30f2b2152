"""What a speculative `generate()` call asks for: `DraftSpec`, built from `cache_implementation` + `cache_config`.

`generate(ids, assistant_model=drafter, cache_implementation=NAME, cache_config={...})` builds a `DraftSpec` from
`NAME` and `cache_config` (`cache_config.py` checks the keys); the CLI, the bench, the app and the GPU check build
theirs the same way, so every entry point shares one set of defaults. The defaults are the fast path; every automatic
choice has an off switch:

    cache_config={"static": False}        # dynamic draft cache, drafter attention untouched
    cache_config={"lean_step": False}     # draft steps through the drafter's own forward, not its weights directly
    cache_config={"compile": False}       # never torch.compile the one-token draft step ("auto": when it pays)
    cache_config={"draft_length": 6}      # a fixed γ ("adaptive", "heuristic", or an int; 0 = plain AR)
    cache_config={"fast_verify": False}   # the target keeps the attention and linear layers it was loaded with
    cache_config={"prefill_window": None} # the drafter prefills with full attention ("auto": 1024-token chunks)
    cache_config={"device_round": False}  # transformers' loop, the target on a GrowableCache ("auto": on CUDA)
    cache_config={"compile_verify": False} # the device round's verification runs eagerly ("auto": on CUDA)

The remaining keys are the draft cache's own (`SinkWindowCache` / `BudgetedCache` arguments). `plan.py` resolves a
spec into what runs for one call.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.utils import logging

from ..cache import BudgetedCache, SinkWindowCache, get_policy
from ..cache.ragged import RaggedCache
from ..cache.ragged_draft import RaggedBudgetedCache, RaggedSinkWindowCache
from ..cache.windowed_prefill import layers_besides_full_attention
from .cache_config import check_bool, check_keys

logger = logging.get_logger(__name__)
AUTO = "auto"  # a switch decided per call
CACHE_CLASSES = {"sink_window": SinkWindowCache, "budgeted": BudgetedCache}
DRAFT_CACHES = tuple(CACHE_CLASSES)
DRAFT_LENGTH_POLICIES = ("adaptive", "heuristic")
# each cache class's own arguments (besides its config) are its options; their defaults are the spec's
_CACHE_PARAMETERS = {
    name: [p for p in inspect.signature(cls.__init__).parameters.values() if p.name not in ("self", "config")]
    for name, cls in CACHE_CLASSES.items()
}
_CACHE_OPTIONS = {name: tuple(p.name for p in params) for name, params in _CACHE_PARAMETERS.items()}


def cache_defaults(name: str, options: tuple[str, ...]) -> dict:
    """The defaults of the `name` draft cache's `options`, from its class's signature."""
    defaults = {p.name: p.default for p in _CACHE_PARAMETERS[name]}
    return {option: defaults[option] for option in options}


# sink_window keeps a long window, budgeted a short one after the prefill
_DEFAULT_WINDOW = {name: cache_defaults(name, ("window_length",))["window_length"] for name in CACHE_CLASSES}
_RUN_OPTIONS = (
    "lean_step",
    "compile",
    "draft_length",
    "max_draft_length",
    "fast_verify",
    "prefill_window",
    "full_draft_cache",
    "device_round",
    "compile_verify",
)
MAX_DRAFT_LENGTH = 64  # bounds a user-set γ (and the rollback slack it needs)
MAX_PREFILL_WINDOW = 1 << 20
DEFAULT_PREFILL_WINDOW = 1024


def _check_switch(name: str, value) -> None:
    if value != AUTO and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or 'auto', got {value!r}")


@dataclass(frozen=True)
class DraftSpec:
    """How a speculative call drafts: the draft cache, how its step runs, and how many tokens a round drafts.

    Args:
        cache (`str`, defaults to `"budgeted"`): the draft's cache, `"budgeted"` (BudgetDraft, arXiv 2606.00144) or
            `"sink_window"` (Windowed-MTP, arXiv 2607.21535).
        budget (`int`, defaults to 512): `budgeted`: prefix tokens kept per layer and KV head.
        policy (`str`, defaults to `"chunk"`): `budgeted`: `chunk` | `streaming` | `snapkv` (selected once, after the
            prefill) | `dynamic` (selected again at every draft step with its query; keeps the prompt's draft KV;
            single sequences).
        policy_kwargs (`dict`, *optional*): `budgeted`: the policy's hyper-parameters.
        num_sink_tokens (`int`, defaults to 64): `sink_window`: attention-sink tokens.
        window_length (`int`, *optional*): recent tokens the draft reads (default 1024 for `sink_window`, 256 for
            `budgeted`, the cache classes' own defaults).
        slack (`int`, defaults to 32): the longest draft round the cache can roll back.
        static (`bool` or `"auto"`): fixed slot buffers read by `budgetdraft_varlen`; `"auto"` = where the
            slot mask reaches the drafter's attention function (in the kwargs its layers pass to the cache, or with
            the keys they hand it as the cache returned them) and no position bias is added over the keys (most
            families; not Inkling, nor DeepSeek-V3 before transformers 5.24).
        lean_step (`bool` or `"auto"`): run the static cache's draft steps (blocks of up to `slack` tokens) straight
            on the drafter's weights, without transformers' per-module Python (`cpu/lean_step.py`); `"auto"` =
            for a static cache and a drafter of Llama's layout (Llama, Qwen2, Qwen3, ...), checked against the
            drafter's own forward on the first step of each call.
        compile (`bool` or `"auto"`): `torch.compile` the static cache's one-token draft step; `"auto"` = once this
            process has drafted enough eager steps to pay for the compilation (see `compile_policy`).
        draft_length (`int` or `str`, defaults to `"adaptive"`): tokens drafted per round: `"adaptive"` (chosen each
            round from the call's measured costs and acceptance, 0 = a plain AR step), `"heuristic"`
            (transformers' schedule), or a fixed int. `num_assistant_tokens=` passed to `generate()` sets a fixed γ.
        max_draft_length (`int`, *optional*): the most an adaptive or heuristic round drafts (<= `slack`;
            default `min(16, slack)`).
        fast_verify (`bool`, defaults to `True`): for the call, a target loaded with `sdpa` verifies on
            `budgetdraft_sdpa` (no KV copies) and a float32 target on CPU runs its linear layers as few-row GEMMs
            on every thread (`cpu/few_row_linear.py`); results agree to float rounding; for the call only.
        prefill_window (`int`, `None` or `"auto"`): the drafter prefills a prompt longer than this in chunks of
            this many tokens, each reading the `num_sink_tokens` sink and the `prefill_window` tokens before it
            (`cache/windowed_prefill.py`): O(L·W) instead of O(L²). Its keys beyond the first layer then differ
            from a full prefill's, so acceptance can change (never the output); a drafter can be trained on the
            same prefix (`BudgetDraftConfig.draft_prefill_window`). `"auto"` (default): `DEFAULT_PREFILL_WINDOW`
            for a single sequence, a drafter made of full-attention layers and a policy that does not score the
            prefix with the prefill's queries; otherwise `None` (a full prefill). An explicit int is refused with a
            query-scored policy and in batched calls.
        device_round (`bool` or `"auto"`): run the round as device work in the package's own loop
            (`device_loop.py`): the target on a static cache, acceptance on the device, one host read a round;
            `"auto"` = on CUDA, for a single sequence and a target of full-attention and sliding-window layers
            (on masked attention: sdpa, eager, budgetdraft_*), when the call asks nothing that loop does not do
            (see `device_loop.unsupported`).
        compile_verify (`bool` or `"auto"`): compile the device round's verification forward (CUDA graphs on
            CUDA), one graph per verification-length bucket; `"auto"` = on CUDA, or wherever `generate()` is
            given a `compile_config` (which then says how).
        full_draft_cache (`bool`, defaults to `False`): a baseline, not a speed-up: the drafter reads a full ragged
            cache instead of the sparse one `cache` names, in the batched loop whatever the batch size (what a
            sparse draft is measured against: the bench's `full_draft` method).
    """

    cache: str = "budgeted"
    budget: int = 512
    policy: str = "chunk"
    policy_kwargs: dict | None = field(default=None, hash=False)
    num_sink_tokens: int = 64
    window_length: int | None = None
    slack: int = 32
    static: bool | str = AUTO
    lean_step: bool | str = AUTO
    compile: bool | str = AUTO
    draft_length: int | str = "adaptive"
    max_draft_length: int | None = None
    fast_verify: bool = True
    prefill_window: int | str | None = AUTO
    full_draft_cache: bool = False
    device_round: bool | str = AUTO
    compile_verify: bool | str = AUTO

    def __post_init__(self):
        if self.cache not in DRAFT_CACHES:
            raise ValueError(f"cache must be one of {DRAFT_CACHES}, got {self.cache!r}")
        if self.window_length is None:
            object.__setattr__(self, "window_length", _DEFAULT_WINDOW[self.cache])
        _check_switch("static", self.static)
        _check_switch("lean_step", self.lean_step)
        _check_switch("compile", self.compile)
        _check_switch("device_round", self.device_round)
        _check_switch("compile_verify", self.compile_verify)
        for name in ("fast_verify", "full_draft_cache"):
            check_bool(name, getattr(self, name))
        length = self.draft_length
        if isinstance(length, bool) or not (
            length in DRAFT_LENGTH_POLICIES or (isinstance(length, int) and 0 <= length <= MAX_DRAFT_LENGTH)
        ):
            raise ValueError(
                f"draft_length must be 'adaptive', 'heuristic' or an int in [0, {MAX_DRAFT_LENGTH}], got {length!r}"
            )
        if self.max_draft_length is None:
            object.__setattr__(self, "max_draft_length", min(16, self.slack))
        if not 1 <= self.max_draft_length <= self.slack:
            raise ValueError(
                f"max_draft_length={self.max_draft_length} must be in [1, slack={self.slack}]: a round drafts at "
                "most what the cache can roll back; raise slack or lower max_draft_length"
            )
        self._check_prefill_window()
        if isinstance(length, int) and length > self.slack:
            raise ValueError(
                f"draft_length={length} exceeds the draft cache's rollback slack ({self.slack}); pass "
                f"cache_config={{'slack': {length}, ...}} or a smaller draft_length"
            )

    def _check_prefill_window(self) -> None:
        window = self.prefill_window
        if window is None or window == AUTO:
            return
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_PREFILL_WINDOW:
            raise ValueError(
                f"prefill_window must be an int in [1, {MAX_PREFILL_WINDOW}], None or 'auto', got {window!r}"
            )
        if self.query_scored:
            raise ValueError(
                f"prefill_window cannot serve policy={self.policy!r}, which scores the prefix with the prefill's "
                "queries or keeps the whole prompt to select from; use policy='chunk' (query_proxy='last_key') or "
                "'streaming', or drop prefill_window"
            )

    @classmethod
    def from_cache_config(cls, cache_implementation: str, cache_config: dict | None = None) -> DraftSpec:
        """The spec of `generate(cache_implementation=..., cache_config=...)`; unknown keys are refused."""
        if cache_implementation not in DRAFT_CACHES:
            raise ValueError(
                f"cache_implementation must be one of {DRAFT_CACHES}, got {cache_implementation!r}"
            )
        accepted = _CACHE_OPTIONS[cache_implementation] + _RUN_OPTIONS
        options = check_keys(cache_config, accepted, f"cache_implementation={cache_implementation!r}")
        return cls(cache=cache_implementation, **options)

    def cache_kwargs(self, static: bool) -> dict:
        """Keyword arguments of the draft cache class (`SinkWindowCache` / `BudgetedCache`), `static` resolved."""
        options = {name: getattr(self, name) for name in _CACHE_OPTIONS[self.cache] if name != "static"}
        if options.get("policy_kwargs") is None:
            options.pop("policy_kwargs", None)
        return {**options, "static": static}

    def build_cache(self, config, static: bool | None = None):
        """The draft cache this spec describes for a model of `config`; `static=None` takes the spec's switch
        (`"auto"`, unresolved, means dynamic)."""
        static = self.static is True if static is None else static
        return CACHE_CLASSES[self.cache](config=config, **self.cache_kwargs(static))

    def build_ragged_cache(self, config, batch_size: int, capacity: int):
        """The batched (one length per row) form of this spec's draft cache, for `batch_size` rows. A model with no
        full-attention layer (all sliding) keeps its own bounded layers, as the single-sequence caches do."""
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        if "full_attention" not in layer_types:
            logger.warning_once(
                f"{config.model_type!r} has no full-attention layer (layer types {sorted(set(layer_types))}): a batch "
                "drafts on its own sliding windows, nothing is sparsified"
            )
            return RaggedCache(config, batch_size, capacity)
        options = self.cache_kwargs(static=False)
        options.pop("static")
        cls = RaggedBudgetedCache if self.cache == "budgeted" else RaggedSinkWindowCache
        return cls(config=config, batch_size=batch_size, capacity=capacity, **options)

    def to_cache_config(self) -> dict:
        """The `cache_config` dict that `from_cache_config(self.cache, ...)` turns back into this spec (only the
        fields that differ from the defaults)."""
        default = DraftSpec(cache=self.cache)
        names = _CACHE_OPTIONS[self.cache] + _RUN_OPTIONS
        return {n: getattr(self, n) for n in names if getattr(self, n) != getattr(default, n)}

    def replace(self, **changes) -> DraftSpec:
        return dataclasses.replace(self, **changes)

    @property
    def query_scored(self) -> bool:
        """Whether the budgeted policy scores the prefix with the prefill's queries (snapkv, chunk on queries), or
        selects again with every step's (dynamic): the draft's forwards then hand their queries to the cache."""
        return (
            self.cache == "budgeted" and get_policy(self.policy, **(self.policy_kwargs or {})).reads_queries
        )

    def resolved_prefill_window(self, drafter_config) -> int | None:
        """`prefill_window` for a call: `"auto"` decided for a drafter of `drafter_config` (a full draft cache, the
        baseline that reads every past token, prefills in full)."""
        if self.prefill_window != AUTO:
            return self.prefill_window
        applies = (
            not self.full_draft_cache
            and not self.query_scored
            and not layers_besides_full_attention(drafter_config)
        )
        return DEFAULT_PREFILL_WINDOW if applies else None

    def runs_batched(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the batched loop: several rows, or a full draft cache (which only the
        batched loop builds)."""
        return rows > 1 or self.full_draft_cache
