"""From a request to `generate()` arguments: the decoding ones both runs share, and the speculative method's
(`assistant_model` with a sparse `cache_implementation`, or `use_mtp`)."""

from __future__ import annotations

from ...generation.spec import DraftSpec
from ...runs.timed_call import configure_drafter
from .request import DEFAULT_SPEC, METHOD_LABELS, MTP_METHODS, DemoInputError, RunRequest
from .store import ModelPair


def draft_spec(request: RunRequest) -> DraftSpec:
    """The `DraftSpec` of a drafter request: its cache sizes, and γ = 0 for the adaptive draft length (the
    package's default) or a fixed γ."""
    cache = request.method
    sizes = {"window_length": request.window_length}
    if cache == "budgeted":
        sizes |= {"budget": request.budget, "policy": request.policy}
    else:
        sizes |= {"num_sink_tokens": request.num_sink_tokens}
    gamma = request.gamma or "adaptive"
    slack = max(DEFAULT_SPEC.slack, request.gamma)
    return DraftSpec(cache=cache, draft_length=gamma, slack=slack, **sizes)


def speculative_call(request: RunRequest, pair: ModelPair) -> tuple[dict, int]:
    """`generate()` arguments of the speculative method (beyond the decoding ones) and its γ (0: adaptive)."""
    method = request.method
    if method in MTP_METHODS:
        kwargs: dict = {"use_mtp": True}
        if method == "mtp_windowed":
            kwargs |= {
                "cache_implementation": "sink_window",
                "cache_config": {
                    "num_sink_tokens": request.num_sink_tokens,
                    "window_length": request.window_length,
                },
            }
        return kwargs, pair.num_mtp_layers
    drafter = pair.drafter_for(request.sampling)
    kwargs = {"assistant_model": drafter}
    if pair.drafter_tokenizer is not None:  # a drafter with its own tokenizer: transformers' translation
        kwargs |= {"tokenizer": pair.tokenizer, "assistant_tokenizer": pair.drafter_tokenizer}
    if method in ("sink_window", "budgeted"):  # the request's spec alone decides the draft length
        configure_drafter(drafter, None)
        spec = draft_spec(request)
        kwargs |= {"cache_implementation": spec.cache, "cache_config": spec.to_cache_config()}
    else:  # native: stock assisted generation reads a fixed γ from the drafter (0: transformers' default)
        configure_drafter(drafter, request.gamma or None)
    return kwargs, request.gamma


def method_title(request: RunRequest, gamma: int) -> str:
    """Short name of the speculative run, e.g. `sink_window (S=16, W=256) γ=4`."""
    method = request.method
    if method in ("sink_window", "mtp_windowed"):
        detail = f" (S={request.num_sink_tokens}, W={request.window_length})"
    elif method == "budgeted":
        detail = f" ({request.policy}, B={request.budget}, W={request.window_length})"
    else:
        detail = ""
    return f"{method}{detail} γ={gamma or 'adaptive'}"


def decoding_kwargs(request: RunRequest, tokenizer) -> dict:
    """The `generate()` arguments both runs share: length, padding, and greedy or sampling."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = {"max_new_tokens": request.max_new_tokens, "pad_token_id": pad}
    if request.sampling:
        return kwargs | {"do_sample": True, "temperature": request.temperature, "top_k": 0, "top_p": 1.0}
    return kwargs | {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}


def require_method(request: RunRequest, pair: ModelPair) -> None:
    """A `DemoInputError` when `pair` cannot run the requested method (no drafter, or no MTP layers)."""
    if request.method in pair.methods():
        return
    if request.method in MTP_METHODS:
        raise DemoInputError(
            f"{METHOD_LABELS[request.method]!r} needs a model with MTP layers (config.num_mtp_layers); "
            f"{pair.title!r} has none: choose the smoke MTP model or a checkpoint with an MTP head"
        )
    raise DemoInputError(
        f"{METHOD_LABELS[request.method]!r} needs a drafter and {pair.title!r} has none: enter a drafter folder, "
        "or choose AR only or an MTP method"
    )
