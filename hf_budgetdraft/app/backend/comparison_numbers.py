"""The numbers of a finished comparison (JSON-ready): throughput of both runs, the speed-up, acceptance, draft and
verify time, KV-cache bytes against a full draft cache, and the greedy check against plain AR."""

from __future__ import annotations

import math

import torch

from ...generation.stats import SpeculationStats
from ...runs.intervals import acceptance_intervals
from ...runs.token_diff import divergence_margin, token_diff
from .methods import method_title
from .prompts import Prompt
from .request import MTP_METHODS, RunRequest
from .store import ModelPair
from .streaming import RunProgress


def full_kv_bytes(model, tokens: int, mtp: bool = False) -> int | None:
    """Bytes a full (uncompressed) KV cache of `model` would hold for `tokens` tokens, from its config (sliding
    layers capped at their window); with `mtp=True`, the cache of its MTP layers. An estimate for display: models
    with compressed attention (MLA) store less. `None` when the config does not say."""
    try:
        return _full_kv_bytes(model, tokens, mtp)
    except (AttributeError, TypeError, ValueError, StopIteration):
        return None


def _full_kv_bytes(model, tokens: int, mtp: bool) -> int:
    config = model.config.get_mtp_config() if mtp else model.config.get_text_config()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_mtp_layers", 0) or 0) if mtp else int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    types = list(getattr(text, "layer_types", None) or []) if not mtp else []
    window = getattr(text, "sliding_window", None)
    element = next(model.parameters()).element_size()
    total = 0
    for layer in range(layers):
        kind = types[layer] if layer < len(types) else "full_attention"
        sliding = window and kind in ("sliding_attention", "chunked_attention")
        total += 2 * kv_heads * head_dim * (min(tokens, window) if sliding else tokens) * element
    return total


def summarize(
    request: RunRequest,
    pair: ModelPair,
    prompt: Prompt,
    ar: RunProgress,
    spec: RunProgress | None,
    gamma: int,
) -> tuple[dict, list[dict] | None]:
    """The stats panel's numbers (JSON-ready) and the acceptance-per-position rows (Wilson 95% intervals)."""
    summary: dict = {
        "models": pair.title,
        "random_weights": pair.random_weights,
        "prompt_tokens": int(prompt.input_ids.shape[1]),
        "decoding": f"sampling (T={request.temperature})" if request.sampling else "greedy",
        "ar": {
            "new_tokens": len(ar.tokens),
            "seconds": ar.seconds,
            "tokens_per_second": ar.tokens_per_second,
            "decode_tokens_per_second": ar.decode_tokens_per_second,
            "target_cache_bytes": ar.target_cache_bytes,
            "stopped_early": ar.stopped,
        },
    }
    if spec is None:
        return _finite(summary), None
    stats = spec.stats or SpeculationStats()
    summary["speculative"] = _speculative(request, pair, prompt, spec, stats, gamma)
    # decoding, as the bench reports it: the prompt's prefill (the drafter's included) is the same work with or
    # without a draft and would hide the speed-up of a short generation after a long prompt
    summary["speed_up"] = _ratio(spec.decode_tokens_per_second, ar.decode_tokens_per_second)
    summary["speed_up_end_to_end"] = _ratio(spec.tokens_per_second, ar.tokens_per_second)
    if not request.sampling and not (ar.stopped or spec.stopped):
        summary["greedy_check"] = _greedy_check(pair, prompt, ar, spec)
    counts = stats.acceptance_per_position()
    return _finite(summary), acceptance_intervals(counts) if counts else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return (
        numerator / denominator
        if denominator and math.isfinite(numerator) and math.isfinite(denominator)
        else None
    )


def _speculative(
    request: RunRequest,
    pair: ModelPair,
    prompt: Prompt,
    spec: RunProgress,
    stats: SpeculationStats,
    gamma: int,
) -> dict:
    """The speculative run's column of the stats panel."""
    sequence = prompt.input_ids.shape[1] + len(spec.tokens)
    if request.method in MTP_METHODS:
        full_draft = full_kv_bytes(pair.target, sequence, mtp=True)
    else:
        full_draft = full_kv_bytes(pair.drafter_for(request.sampling), sequence)
    return {
        "method": method_title(request, gamma),
        "new_tokens": len(spec.tokens),
        "seconds": spec.seconds,
        "tokens_per_second": spec.tokens_per_second,
        "decode_tokens_per_second": spec.decode_tokens_per_second,
        "rounds": stats.rounds,
        "gamma": gamma,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_rate": stats.acceptance_rate,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "draft_cache_bytes": spec.draft_cache_bytes,
        "full_draft_cache_bytes": full_draft,
        "stopped_early": spec.stopped,
    }


def _greedy_check(pair: ModelPair, prompt: Prompt, ar: RunProgress, spec: RunProgress) -> dict:
    """How many speculative tokens differ from plain AR's, and the target's logit margin at the first one."""
    reference, output = torch.tensor(ar.tokens), torch.tensor(spec.tokens)
    diff = token_diff(output, reference)
    check = {"identical": diff.diff_tokens == 0, "diff_tokens": diff.diff_tokens, "compared": diff.compared}
    if diff.first_diff is not None and diff.first_diff < min(len(reference), len(output)):
        check["first_diff"] = diff.first_diff
        check["margin"] = divergence_margin(pair.target, prompt.input_ids, reference, output, diff.first_diff)
    return check


def _finite(value):
    """`nan`/`inf` → `None`, recursively (the stats travel as JSON)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
