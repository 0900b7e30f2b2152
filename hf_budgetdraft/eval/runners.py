"""One runner per decoding method, all measured the same way.

| method (`MethodSpec`)                     | what runs                                                                   |
|-------------------------------------------|-----------------------------------------------------------------------------|
| `ar`                                      | `target.generate(ids)`: plain autoregressive greedy, the reference           |
| `ar`, setup `stock`                       | the same with stock `attn_implementation="sdpa"` (transformers out of the box) |
| `ar`, setup `growable`                    | the same on this package's fast target cache, `cache=GrowableCache(...)`     |
| `assisted`, cache `full` ("native")       | stock transformers assisted generation, the drafter on its own full cache    |
| `assisted`, cache `sink_window`           | the drafter reads sink + window (`cache_implementation="sink_window"`)       |
| `assisted`, cache `budgeted` + policy     | the drafter reads a budgeted selection (`cache_implementation="budgeted"`)   |
| `assisted`, sparse cache, `compiled`      | the same on a static draft cache, the one-token draft step `torch.compile`d  |
| `prompt_lookup`                           | transformers' prompt-lookup decoding (n-gram drafts from the prompt)         |
| `mtp`, cache `full` / `sink_window`       | `generate(use_mtp=True)`: native MTP vs Windowed-MTP (arXiv 2607.21535)       |

Every run decodes exactly `new_tokens` new tokens, greedily unless `sampling` is given, and is timed by
`hf_budgetdraft.runs.timed_call.timed_generate` (the same call the `generate` command and the app time): the generated
tokens, the wall time and the time to the first emitted tokens, the per-round draft/verify times, the draft-side
and target-side KV-cache bytes, the peak RSS and, on CUDA, the peak allocated memory.

`budget` means the number of prefix keys the draft reads: `budgeted` keeps `budget` selected tokens per KV head;
`sink_window` keeps `num_sink_tokens + window_length = budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.spec import DraftSpec
from ..runs.timed_call import AR_SETUPS, RunResult, ar_setup, configure_drafter, timed_generate

METHODS = ("ar", "assisted", "prompt_lookup", "mtp")
DRAFT_CACHES = ("none", "full", "sink_window", "budgeted")
# the sparse caches' default rollback slack: a larger γ needs a larger slack
DEFAULT_SLACK = DraftSpec().slack


@dataclass(frozen=True)
class MethodSpec:
    """What one run does (a column of the benchmark).

    Attributes:
        method (`str`): `ar` | `assisted` | `prompt_lookup` | `mtp`.
        cache (`str`): the draft's cache: `none` (AR, prompt lookup) | `full` | `sink_window` | `budgeted`.
        policy (`str`, *optional*): the budgeted cache's selection policy (`chunk`, `streaming`, `snapkv`, `dynamic`).
        budget (`int`, *optional*): prefix keys the draft reads (see the module docstring).
        gamma (`int`): draft tokens per round (MTP: the number of MTP layers; AR: 0).
        target (`str`): which target model runs (`"target"`, or `"mtp"` for the MTP model).
        drafter (`str`, *optional*): which drafter (assisted only).
        ar_setup (`str`, *optional*): AR only: one of `AR_SETUPS` (`hf_budgetdraft.runs.timed_call.ar_setup`);
            `None` = the target as loaded on transformers' default cache, the reference every run is compared with.
        compiled (`bool`): sparse assisted runs only: the draft cache is static (`cache_config={"static": True}`;
            the drafter must run `budgetdraft_varlen` attention) and its one-token step is `torch.compile`d.
        defaults (`bool`): sparse assisted runs only: the README's one-liner, `generate(ids, assistant_model=drafter,
            cache_implementation=cache)` with nothing else (the `DraftSpec` defaults decide budget, draft length,
            static cache, compilation and verification). Other sparse runs set each of those explicitly.
    """

    method: str
    cache: str = "none"
    policy: str | None = None
    budget: int | None = None
    gamma: int = 0
    target: str = "target"
    drafter: str | None = None
    ar_setup: str | None = None
    compiled: bool = False
    defaults: bool = False

    def __post_init__(self):
        if self.ar_setup is not None and (self.method != "ar" or self.ar_setup not in AR_SETUPS):
            raise ValueError(f"ar_setup must be one of {AR_SETUPS} with method 'ar', got {self.ar_setup!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.cache not in DRAFT_CACHES:
            raise ValueError(f"cache must be one of {DRAFT_CACHES}, got {self.cache!r}")
        if self.defaults:
            if not (
                (self.method == "assisted" and self.cache in ("sink_window", "budgeted"))
                or (self.method == "mtp" and self.cache == "sink_window")
            ):
                raise ValueError(
                    f"defaults=True needs method 'assisted' with a sparse cache or 'mtp' with sink_window, got "
                    f"{self.method!r}/{self.cache!r}"
                )
            return
        if self.cache in ("sink_window", "budgeted") and not (self.budget and self.budget > 0):
            raise ValueError(f"cache={self.cache!r} needs a budget > 0, got {self.budget}")
        if self.cache == "budgeted" and not self.policy:
            raise ValueError("cache='budgeted' needs a policy (chunk, streaming, snapkv or dynamic)")
        if self.compiled and not (self.method == "assisted" and self.cache in ("sink_window", "budgeted")):
            raise ValueError(
                f"compiled=True needs method 'assisted' with a sparse draft cache, got {self.method!r}/{self.cache!r}"
            )

    @property
    def is_native(self) -> bool:
        """Drafting on a full cache: the baseline a sparse draft cache is compared with."""
        return self.method in ("assisted", "mtp") and self.cache == "full"

    @property
    def name(self) -> str:
        """Short name of the method family: `ar`, `native`, `sink_window`, `budgeted/chunk`, `prompt_lookup`,
        `mtp_native`, `mtp_windowed`; a compiled static draft adds `+compiled` (`budgeted/chunk+compiled`)."""
        if self.method == "mtp":
            name = "mtp_native" if self.cache == "full" else "mtp_windowed"
            return f"oneliner/{name}" if self.defaults else name
        if self.defaults:
            return f"oneliner/{self.cache}"
        if self.method == "assisted":
            base = "native" if self.cache == "full" else self.cache
            base = f"{base}/{self.policy}" if self.policy else base
            return f"{base}+compiled" if self.compiled else base
        return f"ar_{self.ar_setup}" if self.ar_setup else self.method

    @property
    def label(self) -> str:
        """Unique, human-readable run label, e.g. `sink_window B=96 γ=4`."""
        parts = [self.name if self.target == "target" else f"{self.target}:{self.name}"]
        if self.drafter and self.drafter != "drafter":
            parts[0] += f"[{self.drafter}]"
        if self.budget is not None:
            parts.append(f"B={self.budget}")
        if self.gamma:
            parts.append(f"γ={self.gamma}")
        return " ".join(parts)

    def native_counterpart(self) -> MethodSpec | None:
        """The full-cache run the same drafter and γ would do (`None` for AR, prompt lookup and native runs)."""
        if self.method not in ("assisted", "mtp") or self.is_native:
            return None
        return MethodSpec(self.method, "full", None, None, self.gamma, self.target, self.drafter)


def sparse_cache_config(
    spec: MethodSpec, num_sink_tokens: int, budgeted_window_length: int, policy_kwargs: dict | None = None
) -> dict:
    """`cache_config` for a `sink_window` / `budgeted` spec (rollback slack >= γ)."""
    config: dict = {}
    if spec.defaults:
        return {}
    if spec.cache == "sink_window":
        if spec.budget <= num_sink_tokens:
            raise ValueError(
                f"budget={spec.budget} must exceed num_sink_tokens={num_sink_tokens} for sink_window "
                "(window_length = budget - num_sink_tokens)"
            )
        config = {"num_sink_tokens": num_sink_tokens, "window_length": spec.budget - num_sink_tokens}
    elif spec.cache == "budgeted":
        config = {"budget": spec.budget, "policy": spec.policy, "window_length": budgeted_window_length}
        if policy_kwargs:
            config["policy_kwargs"] = dict(policy_kwargs)
    else:
        raise ValueError(f"spec {spec.label!r} has no sparse cache")
    if spec.gamma > DEFAULT_SLACK:
        config["slack"] = spec.gamma
    # explicit rows: the drafter's γ (set on its generation config; MTP: its fixed chain), a dynamic cache unless
    # compiled, the target on the bench's attention; only the one-liner rows leave these to the defaults
    if spec.method == "assisted":
        config.update(static=spec.compiled, compile=spec.compiled, fast_verify=False)
    else:
        config.update(draft_length=spec.gamma, fast_verify=False)
    return config


def run_ar(
    target,
    input_ids: torch.LongTensor,
    new_tokens: int,
    setup: str | None = None,
    sampling: dict | None = None,
) -> RunResult:
    """Plain decoding (greedy: the reference every other method must reproduce token for token).

    `setup="stock"` runs it with transformers' own `sdpa` attention (whatever the target was set to, restored
    after); `setup="growable"` on a `GrowableCache` sized for the call (in-place appends); `setup="fast"` both the
    package's `budgetdraft_sdpa` attention and a `GrowableCache` (the fastest plain AR this package has);
    `setup="static"` on transformers' `StaticCache` (compiled by transformers on an accelerator); see
    `hf_budgetdraft.runs.timed_call.ar_setup`."""
    with ar_setup(target, setup, input_ids.shape[1] + new_tokens) as kwargs:
        return timed_generate(target, input_ids, new_tokens, sampling=sampling, **kwargs)


def run_assisted(
    target,
    drafter,
    input_ids: torch.LongTensor,
    new_tokens: int,
    gamma: int | None,
    cache_implementation: str | None = None,
    cache_config: dict | None = None,
    compiled: bool = False,
    confidence_threshold: float = 0.0,
    sampling: dict | None = None,
    tokenizers: dict | None = None,
) -> RunResult:
    """Assisted generation: `cache_implementation=None` is stock transformers ("native", the drafter on its own
    full cache); `"sink_window"` / `"budgeted"` give the drafter a sparse cache (the target keeps a full one);
    `compiled` (with `cache_config["static"]`) compiles the drafter's one-token step; `confidence_threshold` > 0
    stops a round's draft early on an unlikely token (γ is then the maximum). `gamma=None` with a sparse cache:
    the drafter's generation config is left alone and the call's `cache_config` (a `DraftSpec`) decides.
    `tokenizers`: `{"tokenizer": ..., "assistant_tokenizer": ...}` for a drafter with a tokenizer of its own."""
    configure_drafter(drafter, gamma, compiled, confidence_threshold)
    spec = None
    if cache_implementation is not None:
        spec = DraftSpec.from_cache_config(cache_implementation, cache_config)
    return timed_generate(
        target,
        input_ids,
        new_tokens,
        spec=spec,
        sampling=sampling,
        assistant_model=drafter,
        **(tokenizers or {}),
    )


def run_prompt_lookup(
    target,
    input_ids: torch.LongTensor,
    new_tokens: int,
    gamma: int,
    max_matching_ngram_size: int = 2,
    sampling: dict | None = None,
) -> RunResult:
    """transformers' prompt-lookup decoding: drafts of up to γ tokens copied after the last matching n-gram."""
    return timed_generate(
        target,
        input_ids,
        new_tokens,
        sampling=sampling,
        prompt_lookup_num_tokens=gamma,
        max_matching_ngram_size=max_matching_ngram_size,
    )


def run_mtp(
    model,
    input_ids: torch.LongTensor,
    new_tokens: int,
    cache_implementation: str | None = None,
    cache_config: dict | None = None,
    sampling: dict | None = None,
) -> RunResult:
    """`generate(use_mtp=True)`: native MTP (the head attends over its whole cache) or, with
    `cache_implementation="sink_window"`, Windowed-MTP (`cache_config={}`: its one-liner defaults)."""
    kwargs = {}
    if cache_implementation is not None:
        kwargs = {"cache_implementation": cache_implementation, "cache_config": cache_config or {}}
    return timed_generate(model, input_ids, new_tokens, sampling=sampling, use_mtp=True, **kwargs)


def run_method(
    spec: MethodSpec,
    targets: dict,
    drafters: dict,
    input_ids: torch.LongTensor,
    new_tokens: int,
    num_sink_tokens: int,
    budgeted_window_length: int,
    policy_kwargs: dict | None = None,
    confidence_threshold: float = 0.0,
    sampling: dict | None = None,
    tokenizer=None,
    drafter_tokenizers: dict | None = None,
) -> RunResult:
    """Dispatch `spec` to its runner.

    Args:
        spec (`MethodSpec`): the run.
        targets (`dict[str, PreTrainedModel]`): target models by name (`spec.target`).
        drafters (`dict[str, PreTrainedModel]`): drafters by name (`spec.drafter`).
        input_ids (`torch.LongTensor` of shape `(1, L)`): the prompt, on the models' device.
        new_tokens (`int`): tokens to generate.
        num_sink_tokens (`int`): sink of `sink_window` drafts (window = budget − sink).
        budgeted_window_length (`int`): tokens a `budgeted` draft keeps after the prefill, besides the budget.
        policy_kwargs (`dict`, *optional*): per policy name, its hyper-parameters.
        confidence_threshold (`float`): drafters end a round early below this top-token probability (0: never).
        sampling (`dict`, *optional*): sample with these `generate()` settings (e.g. `{"temperature": 0.8}`).
        tokenizer (*optional*): the target's tokenizer, passed with a drafter's own from `drafter_tokenizers`
            (`dict[str, tokenizer]`, by drafter name).
    """
    if spec.target not in targets:
        raise ValueError(f"spec {spec.label!r} needs target model {spec.target!r}; have {sorted(targets)}")
    target = targets[spec.target]
    sparse = spec.cache in ("sink_window", "budgeted")
    cache_config = (
        sparse_cache_config(
            spec, num_sink_tokens, budgeted_window_length, (policy_kwargs or {}).get(spec.policy)
        )
        if sparse
        else None
    )
    if spec.method == "ar":
        return run_ar(target, input_ids, new_tokens, spec.ar_setup, sampling)
    if spec.method == "prompt_lookup":
        return run_prompt_lookup(target, input_ids, new_tokens, spec.gamma, sampling=sampling)
    if spec.method == "mtp":
        cache = spec.cache if sparse else None
        return run_mtp(target, input_ids, new_tokens, cache, cache_config, sampling)
    if spec.drafter not in drafters:
        raise ValueError(f"spec {spec.label!r} needs drafter {spec.drafter!r}; have {sorted(drafters)}")
    return run_assisted(
        target,
        drafters[spec.drafter],
        input_ids,
        new_tokens,
        None if spec.defaults else spec.gamma,
        spec.cache if sparse else None,
        cache_config,
        spec.compiled,
        confidence_threshold,
        sampling,
        _tokenizers(spec.drafter, tokenizer, drafter_tokenizers),
    )


def _tokenizers(drafter: str, tokenizer, drafter_tokenizers: dict | None) -> dict | None:
    """The `generate()` tokenizers of a drafter with a tokenizer of its own (`None`: it reads the target's)."""
    own = (drafter_tokenizers or {}).get(drafter)
    return None if own is None else {"tokenizer": tokenizer, "assistant_tokenizer": own}
