"""Random-weight Llama models for smoke runs and cost benchmarks (no weights to download).

`random_pair` measures cost and checks losslessness; its drafts are not meant to be accepted (random models attend
everywhere, so a sparse draft rarely agrees with them). `smoke_pair` is built so that its drafter partly agrees
with its target, and `smoke_mtp_model` carries a random MTP head: the models of `hf-budgetdraft bench --preset
smoke`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel


def random_llama_config(num_hidden_layers: int, max_position_embeddings: int) -> LlamaConfig:
    """Hidden 256, GQA 8:2 query/KV heads, RoPE base 1e6: the random drafter shape of the cost benchmarks
    (`benchmarks/draft_step_cost.py`)."""
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


# ---------------------------------------------------------------------------------------------------------------
# Tiny pairs that partly agree (the `bench --preset smoke` models)
# ---------------------------------------------------------------------------------------------------------------

SMOKE_VOCAB_SIZE = 2048  # the bundled demo tokenizer's vocabulary, so smoke prompts are real text
_ATTENTION_OUTPUT_WEIGHT = "self_attn.o_proj.weight"


def _sharpen(model: PreTrainedModel) -> None:
    """Make a tiny random model's greedy decoding non-degenerate (see `tests/tiny_models.py`).

    With transformers' default init a tiny model loops on 2-3 tokens, so every lossless check passes trivially.
    A large init (set in the config), logits scaled x3 (argmax far from ties) and the attention output damped x0.03
    (the residual stream is not drowned) give varied greedy output in which a draft reading a sparse cache agrees
    with the target on some rounds fully, on some partly and on some not at all.
    """
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
        for name, param in model.named_parameters():
            if name.endswith(_ATTENTION_OUTPUT_WEIGHT):
                param.mul_(0.03)


def tiny_llama_config(num_hidden_layers: int, max_position_embeddings: int) -> LlamaConfig:
    """Hidden 64, 4 query / 2 KV heads, init 0.2, vocabulary of the bundled demo tokenizer."""
    return LlamaConfig(
        vocab_size=SMOKE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def smoke_pair(
    seed: int = 0, max_position_embeddings: int = 4096, drafter_noise: float = 0.01
) -> tuple[PreTrainedModel, PreTrainedModel]:
    """A tiny random Llama target (2 layers) and a drafter that partly agrees with it, built in memory.

    The drafter is the target plus Gaussian noise of `drafter_noise` x each weight matrix's standard deviation:
    on a full cache it accepts most but not all of its drafts (an exact copy would accept every one), and reading a
    sparse cache lowers that further — more so at longer context and smaller budget. Both models are `eval()`, fp32, sdpa.

    Args:
        seed (`int`): weights seed (the noise uses `seed + 1`).
        max_position_embeddings (`int`): longest prompt + generation the pair will see.
        drafter_noise (`float`): relative noise on the drafter's weight matrices; 0 gives an exact copy.
    """
    if not 0.0 <= drafter_noise <= 1.0:
        raise ValueError(f"drafter_noise must be in [0, 1], got {drafter_noise}; ~0.01 gives ~70% acceptance")
    torch.manual_seed(seed)
    config = tiny_llama_config(2, max_position_embeddings)
    target = LlamaForCausalLM(config).eval()
    _sharpen(target)
    drafter = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.dim() == 2 and "embed_tokens" not in name:
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * drafter_noise)
    for model in (target, drafter):
        model.set_attn_implementation("sdpa")
    return target, drafter


def smoke_mtp_model(
    path: str | Path, seed: int = 0, num_mtp_layers: int = 2, max_position_embeddings: int = 4096
) -> PreTrainedModel:
    """A tiny GLM-4-style target (2 dense layers) with `num_mtp_layers` random (MoE) MTP layers, saved to `path`.

    transformers' `generate(use_mtp=True)` loads MTP weights only from the checkpoint at `config.name_or_path`,
    so the model is written to `path` (keep it until the last `generate`) and loaded back from there. The MTP head
    is random: it checks the windowed-MTP machinery (lossless output, bounded cache, cost), not acceptance.
    """
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from ..generation.mtp_heads import expose_mtp_layers, new_mtp_head, save_pretrained_with_mtp

    if not 1 <= num_mtp_layers <= 8:
        raise ValueError(f"num_mtp_layers must be in [1, 8], got {num_mtp_layers}")
    torch.manual_seed(seed)
    layers = 2
    config = Glm4MoeConfig(
        vocab_size=SMOKE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # dense main layers; the MTP layers are MoE blocks, as in GLM-4.5
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_mtp_layers=num_mtp_layers,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = Glm4MoeForCausalLM(config).eval()
    _sharpen(model)
    save_pretrained_with_mtp(model, new_mtp_head(model, num_mtp_layers), path)
    loaded = Glm4MoeForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    return expose_mtp_layers(loaded).eval()
