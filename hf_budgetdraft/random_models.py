"""Random-weight Llama models for smoke runs and cost benchmarks (no weights to download).

They measure cost and check losslessness; their drafts are not meant to be accepted (random models attend
everywhere, so a sparse draft rarely agrees with them)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def random_llama_config(num_hidden_layers: int, max_position_embeddings: int) -> LlamaConfig:
    """Hidden 256, GQA 8:2 query/KV heads, RoPE base 1e6 — the drafter shape of shared/MEASURED.md."""
    return LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def random_pair(seed: int, max_position_embeddings: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A 4-layer random target and a drafter made of its first 2 layers plus its embeddings and head."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(random_llama_config(4, max_position_embeddings)).eval()
    drafter = LlamaForCausalLM(random_llama_config(2, max_position_embeddings)).eval()
    drafter.load_state_dict({k: v for k, v in target.state_dict().items() if k in drafter.state_dict()})
    return target, drafter
