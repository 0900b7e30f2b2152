"""More tiny random decoder families for the family matrix: hybrid (convolution), all-sliding, MoE, MLA, sinks.

Built like `tiny_models.py` (large init, lm_head x3, damped attention output; the drafter is the target itself, so
every rejected draft token is caused by the sparse draft cache), with a per-family attention-output scale chosen
so that the sparse draft both agrees and disagrees with the target on a 240-token prompt.
"""

from __future__ import annotations

import copy
import functools
import re

import torch
from tiny_models import COMMON, FAMILIES, skip_unless_known
from tiny_models import model_pair as base_model_pair
from transformers import AutoConfig, AutoModelForCausalLM

_MIXED = ["sliding_attention", "full_attention"]
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family: (model_type, config overrides (None drops a COMMON key), attention-output scale)
MORE_FAMILIES: dict[str, tuple[str, dict, float]] = {
    "lfm2": ("lfm2", {"full_attn_idxs": [1]}, 3.0),  # conv layer + attention layer
    "inkling": (  # "hybrid_sliding" + "hybrid" (attention and a short convolution in one layer)
        "inkling_text",
        dict(
            local_layer_ids=[0],
            head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=24,
            n_routed_experts=4,
            n_shared_experts=1,
            rel_extent=64,
            logits_mup_width_multiplier=1.0,
            **_MOE,
        ),
        1.0,
    ),
    "mistral-all-sliding": ("mistral", {"sliding_window": 24}, 0.03),
    "falcon": (
        "falcon",
        dict(num_key_value_heads=None, intermediate_size=None, new_decoder_architecture=True, num_kv_heads=2),
        1.0,
    ),
    "gpt_oss": (  # attention sinks + sliding layers + MoE
        "gpt_oss",
        dict(head_dim=16, sliding_window=24, layer_types=_MIXED, num_local_experts=4, num_experts_per_tok=2),
        0.3,
    ),
    "mixtral": ("mixtral", dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2), 0.03),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, **_MOE), 0.03),
    "deepseek_v3": (  # MLA + MoE
        "deepseek_v3",
        dict(
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_group=1,
            topk_group=1,
            n_routed_experts=4,
            **_MLA,
            **_MOE,
        ),
        0.03,
    ),
    "gemma3": (
        "gemma3_text",
        dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=16, layer_types=_MIXED),
        0.03,
    ),
    "cohere2": ("cohere2", dict(sliding_window=24, layer_types=_MIXED), 1.0),
    "olmo3": ("olmo3", dict(sliding_window=24, layer_types=_MIXED), 0.03),
    "phi": ("phi", dict(num_key_value_heads=None), 1.0),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0]), 0.03),
    "glm4": ("glm4", dict(head_dim=16), 0.03),
    "gpt2": ("gpt2", dict(num_key_value_heads=None, intermediate_size=None), 0.03),
    "hrm_text": ("hrm_text", {}, 0.03),  # its config class redefines the _attn_implementation property
    "nanochat": ("nanochat", {}, 1.0),  # weightless RMSNorms (q/k norms too), a ReLU^2 MLP
}
ALL_FAMILIES = [*FAMILIES, *MORE_FAMILIES]
EAGER_ONLY = {"gpt_oss", "gemma2"}  # no sdpa attention in transformers
_ATTENTION_OUTPUT = re.compile(
    r"(self_attn\.(o_proj|out_proj|dense)|self_attention\.dense|attn\.c_proj)\.weight$"
)


def more_config(family: str, num_layers: int = 2):
    model_type, overrides, _ = MORE_FAMILIES[family]
    skip_unless_known(model_type)
    kwargs = {**COMMON, **overrides, "num_hidden_layers": num_layers}
    for key in [k for k, v in overrides.items() if v is None]:
        kwargs.pop(key)
    return AutoConfig.for_model(model_type, **kwargs)


@functools.cache
def _model(family: str, attention: str) -> torch.nn.Module:
    # built on its attention: families whose attention bypasses transformers' interface (Falcon) cannot switch later
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(more_config(family), attn_implementation=attention).eval()
    scale = MORE_FAMILIES[family][2]
    damped = [p for name, p in model.named_parameters() if _ATTENTION_OUTPUT.search(name)]
    if not damped:
        raise ValueError(f"no attention output projection found in {family}; extend _ATTENTION_OUTPUT")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
        for param in damped:
            param.mul_(scale)
    return model


def attention_for(family: str) -> str:
    return "eager" if family in EAGER_ONLY else "sdpa"


def family_pair(family: str, attention: str | None = None, num_assistant_tokens: int = 3):
    """`(target, drafter)` of any family of `ALL_FAMILIES`, on `attention` (default: sdpa, else eager); the drafter
    is a copy of the target. Fresh deep copies per call."""
    attention = attention or attention_for(family)
    if family in FAMILIES:
        return base_model_pair(family, attention, num_assistant_tokens=num_assistant_tokens)
    target, drafter = (copy.deepcopy(_model(family, attention)) for _ in range(2))
    config = drafter.generation_config
    config.num_assistant_tokens = num_assistant_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    return target, drafter


def kv_sharing_model(model_type: str = "gemma4_text"):
    """A tiny Gemma 4 (or Gemma 3n) whose last two layers reuse the keys/values of the two before them."""
    shape = dict(
        COMMON, head_dim=16, sliding_window=32, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16
    )
    layers = dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
    )
    if model_type == "gemma3n_text":
        layers["activation_sparsity_pattern"] = [0.0] * 4
    config = AutoConfig.for_model(model_type, **shape, **layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model
