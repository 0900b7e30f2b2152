"""Tiny random decoder models for tests: built from configs, no downloads.

Transformers' default init (initializer_range=0.02) makes tiny models loop on 2-3 tokens, so greedy-equivalence
tests would pass trivially. These use a large init (0.2), sharpened logits (lm_head x3, so argmax is far from
ties) and a damped attention output (x0.03, so the residual stream is not drowned by attention): then a drafter
copied from the target's first layers, reading a sparse cache, agrees on some rounds fully, on some partly and
on some not at all — and the equivalence tests can fail. gemma2 has no sdpa path in transformers.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16},
    "phi3": {},
    "olmo2": {},
    "starcoder2": {"sliding_window": None},
    "gpt_neox": {"num_key_value_heads": None, "attention_output_scale": 0.1},
    "granite": {},
}

TARGET_LAYERS = 2
_ATTENTION_OUTPUT = re.compile(r"(self_attn\.o_proj|attention\.dense)\.weight$")


def tiny_config(family: str, num_layers: int = TARGET_LAYERS):
    kwargs = {**COMMON, **FAMILIES[family], "num_hidden_layers": num_layers}
    kwargs.pop("attention_output_scale", None)
    if kwargs.get("num_key_value_heads") is None:
        kwargs.pop("num_key_value_heads")
    return AutoConfig.for_model(family, **kwargs)


@functools.cache
def _pair(family: str, draft_layers: int, seed: int = 0):
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="eager").eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
        for name, param in target.named_parameters():
            if _ATTENTION_OUTPUT.search(name):
                param.mul_(FAMILIES[family].get("attention_output_scale", 0.03))
    drafter = AutoModelForCausalLM.from_config(
        tiny_config(family, draft_layers), attn_implementation="eager"
    ).eval()
    drafter.load_state_dict({k: v for k, v in target.state_dict().items() if k in drafter.state_dict()})
    return target, drafter


def model_pair(
    family: str,
    attn_implementation: str = "sdpa",
    num_assistant_tokens: int | None = 3,
    draft_layers: int = TARGET_LAYERS,
):
    """`(target, drafter)`: the drafter is the target's first `draft_layers` layers plus its head (by default all
    of them, so every rejected draft token is caused by the sparse draft cache). Fresh deep copies per call.
    `num_assistant_tokens=None` leaves the drafter's generation config as loaded (the package's defaults run)."""
    target, drafter = (copy.deepcopy(m) for m in _pair(family, draft_layers))
    for model in (target, drafter):
        model.set_attn_implementation(attn_implementation)
    if num_assistant_tokens is None:
        return target, drafter
    config = drafter.generation_config
    config.num_assistant_tokens = num_assistant_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return target, drafter


def random_prompt(length: int, seed: int = 0, vocab_size: int = 128) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def supports(family: str, attn_implementation: str) -> bool:
    return not (family == "gemma2" and attn_implementation == "sdpa")


def skip_unless_known(model_type: str) -> None:
    """Skip a test whose model family the installed transformers lacks (an older release of the supported range)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")


def skip_unless_static(model) -> None:
    """Skip a test of a static draft cache on a model that cannot run one: its attention layers neither pass their
    kwargs to `cache.update` nor hand the keys it returns to the attention function as they are (DeepSeek-V3
    before transformers 5.24), or add a position bias (Inkling); the one-liner drafts on the dynamic cache there."""
    from hf_budgetdraft.generation.plan import static_cache_problem

    problem = static_cache_problem(model)
    if problem:
        pytest.skip(f"no static draft cache on transformers {transformers.__version__}: {problem}")
