"""A tiny random LLaVA for the tests that need a vision-language model: a two-layer Llama text model and a one-layer
CLIP tower reading 32 x 32 images in 8 x 8 patches (16 image tokens an image)."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    projection_dim=32,
)


def text_config(vocab_size: int, hidden_size: int = 64) -> LlamaConfig:
    """The text model's config: 2 layers, 4 heads over 2 key/value heads."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


def tiny_llava(
    vocab_size: int, image_token_id: int, hidden_size: int = 64, seed: int = 0, head_scale: float = 4.0
) -> LlavaForConditionalGeneration:
    """Random weights from `seed`, the LM head scaled by `head_scale` (4: greedy margins above float noise)."""
    torch.manual_seed(seed)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text_config(vocab_size, hidden_size),
        image_token_id=image_token_id,
        vision_feature_layer=-1,
    )
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model
