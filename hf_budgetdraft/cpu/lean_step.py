"""`LeanDraftStep`: a draft step of a Llama-layout drafter run straight on its weights.

A drafter of a million parameters spends most of an eager decode step in Python — module calls, hooks, mask
helpers, output dataclasses, config lookups — not in its matmuls. This step computes the same thing as
`drafter(input_ids, position_ids=..., cache=...)` for a block of up to `slack` tokens (a round's catch-up and its
one-token steps): the same `nn.Linear` weights, the family's own RMSNorm, rotary embedding and activation modules,
the cache layers' `update`, and the `budgetdraft_varlen` attention function a static draft cache needs. It does not
copy weights, so a drafter trained between calls drafts with its current weights.

Only the draft runs it: a mismatch could lower acceptance, never change the output. Still, a family can share
Llama's module names and compute something else (Granite scales the residual stream and the logits), so
`SparseDraftCandidateGenerator` checks the first lean step of every call against the drafter's own forward and
drafts with the drafter's forward if they disagree.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from ..attention.varlen import budgetdraft_varlen_attention_forward

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj"}
ATTENTION_NORMS = {"q_norm", "k_norm"}  # per-head query/key RMSNorm (Qwen3)
MLP_PROJECTIONS = {"gate_proj", "up_proj", "down_proj"}
TOLERANCE = 1e-3  # of the largest logit: what the first-step check accepts as the same logits


def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear  # not a PEFT / quantised layer, which computes something else


def _layer_problem(layer: nn.Module) -> str | None:
    if _children(layer) != LAYER_PARTS:
        return f"decoder layers made of {sorted(_children(layer))}, not {sorted(LAYER_PARTS)}"
    attention, mlp = layer.self_attn, layer.mlp
    parts = _children(attention)
    if parts - ATTENTION_PROJECTIONS - ATTENTION_NORMS or not parts >= ATTENTION_PROJECTIONS:
        return f"attention made of {sorted(_children(attention))}"
    if not all(_plain_linear(getattr(attention, name)) for name in ATTENTION_PROJECTIONS):
        return "attention projections that are not plain nn.Linear (an unmerged adapter, a quantised layer)"
    if attention.q_proj.out_features != attention.o_proj.in_features:
        # Qwen3-Next / Qwen3.5 project a gate beside the queries and scale the attention output by it
        return "a query projection wider than the attention output (a gated attention)"
    for name in ATTENTION_NORMS & _children(attention):
        weight = getattr(getattr(attention, name), "weight", None)  # NanoChat's norms have none
        if weight is not None and weight.shape[-1] != attention.head_dim:
            return f"a {name} over the whole projection, not per head"
    if _children(mlp) - {"act_fn"} != MLP_PROJECTIONS or not all(
        _plain_linear(getattr(mlp, name)) for name in MLP_PROJECTIONS
    ):
        return f"an MLP made of {sorted(_children(mlp))}, not a gated one of plain nn.Linear"
    if not hasattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb"):
        return "no apply_rotary_pos_emb in its modeling file"
    if not getattr(attention, "use_rope", True):
        return "attention layers without rotary embeddings (SmolLM3's NoPE layers)"
    return None


def lean_step_problem(model: nn.Module) -> str | None:
    """Why `LeanDraftStep` cannot run `model` (`None`: it can): it needs a causal LM of pre-norm decoder layers
    with gated MLPs, rotary embeddings in every layer and full attention only (Llama, Mistral without a sliding
    window, Qwen2, Qwen3, ...)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if decoder is None or not _plain_linear(getattr(model, "lm_head", None)):
        return f"{type(model).__name__} has no decoder or no plain lm_head"
    if type(getattr(decoder, "embed_tokens", None)) is not nn.Embedding:
        return f"{type(model).__name__} has no plain embedding table"
    if getattr(decoder, "rotary_emb", None) is None or getattr(decoder, "norm", None) is None:
        return f"{type(model).__name__} has no shared rotary embedding or no final norm"
    config = model.config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(config)
    if set(layer_types) != {"full_attention"} or getattr(config, "sliding_window", None) is not None:
        return f"{type(model).__name__} has layers besides full attention ({sorted(set(layer_types))})"
    for layer in decoder.layers:
        problem = _layer_problem(layer)
        if problem is not None:
            return f"{type(model).__name__} has {problem}"
    return None


class LeanDraftStep:
    """`step(input_ids, position_ids, cache)` = the last position's logits of `model` on that block, written to
    `cache` as `model(...)` would write it.

    Args:
        model (`PreTrainedModel`): a drafter `lean_step_problem` accepts (else `ValueError` with the reason).
    """

    def __init__(self, model: nn.Module):
        problem = lean_step_problem(model)
        if problem is not None:
            raise ValueError(
                f"the lean draft step cannot run this drafter: {problem}. Use cache_config={{'lean_step': False}}"
            )
        self.model = model
        self.decoder = getattr(model, getattr(model, "base_model_prefix", "model"))
        self.apply_rope = [
            sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb
            for layer in self.decoder.layers
        ]

    def _attention(self, attention, rope, x, cos, sin, cache) -> torch.Tensor:
        """`x (B, q, E)` -> the attention block's output `(B, q, E)`, its keys/values written to `cache`."""
        shape = (*x.shape[:2], -1, attention.head_dim)
        query = attention.q_proj.forward(x).view(shape)
        key = attention.k_proj.forward(x).view(shape)
        if hasattr(attention, "q_norm"):
            query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
        value = attention.v_proj.forward(x).view(shape).transpose(1, 2)
        query, key = rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        kwargs = {}  # a static cache layer hands its slot mask to the attention function through these
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
        out, _ = budgetdraft_varlen_attention_forward(
            attention, query, key, value, None, scaling=attention.scaling, **kwargs
        )
        return attention.o_proj.forward(out.reshape(*x.shape[:2], -1))

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor, cache) -> torch.Tensor:
        """`input_ids`, `position_ids` `(B, q)` -> logits `(B, V)` of the last position."""
        decoder = self.decoder
        hidden = decoder.embed_tokens.forward(input_ids)  # (B, q, E)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        for layer, rope in zip(decoder.layers, self.apply_rope, strict=True):
            x = layer.input_layernorm.forward(hidden)
            hidden = hidden + self._attention(layer.self_attn, rope, x, cos, sin, cache)
            mlp, x = layer.mlp, layer.post_attention_layernorm.forward(hidden)
            hidden = hidden + mlp.down_proj.forward(
                mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x)
            )
        return F.linear(
            decoder.norm.forward(hidden[:, -1]), self.model.lm_head.weight, self.model.lm_head.bias
        )


def same_logits(lean: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether the lean step's logits match the model's own within float rounding (`TOLERANCE` of the largest)."""
    scale = float(reference.abs().max()) or 1.0
    return bool(torch.allclose(lean.float(), reference.float(), rtol=TOLERANCE, atol=TOLERANCE * scale))
