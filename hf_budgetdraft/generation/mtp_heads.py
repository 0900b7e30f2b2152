"""Building an MTP head for a model of any depth: expose its MTP layers, make a fresh head, save it where
transformers' `MtpModel.from_pretrained` finds it (Windowed-MTP, arXiv 2607.21535, drafts with such a head)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.modeling_layers import MtpModel


def expose_mtp_layers(model: PreTrainedModel) -> PreTrainedModel:
    """Let `MtpModel.from_pretrained(model)` find MTP weights stored right after `model`'s own layers.

    transformers finds MTP weights through the class's `_keys_to_ignore_on_load_unexpected` patterns, which name the
    released checkpoints' layer numbers (e.g. 46 and 92 for GLM-4.5); a model of another depth needs its own.
    """
    config = model.config.get_text_config()
    first, count = config.num_hidden_layers, getattr(config, "num_mtp_layers", None) or 0
    patterns = set(model._keys_to_ignore_on_load_unexpected or ())
    patterns |= {rf"model\.layers\.{first + i}\..*" for i in range(count)}
    model._keys_to_ignore_on_load_unexpected = patterns  # instance attribute: the class stays untouched
    return model


def new_mtp_head(model: PreTrainedModel, num_mtp_layers: int | None = None) -> MtpModel:
    """A freshly initialised `MtpModel` for `model` (to train, or random for tests).

    `MtpModel(model, n)` leaves some parameters (e.g. MoE experts and router) as uninitialised `torch.empty`
    memory — garbage, sometimes NaN; every MTP layer is initialised here with the model's own `_init_weights`.
    """
    if num_mtp_layers is None:
        num_mtp_layers = model.config.get_text_config().num_mtp_layers
    mtp = MtpModel(model, num_mtp_layers)
    with torch.no_grad():
        for layer in mtp.layers:
            layer.apply(model._init_weights)
    return mtp


_PER_LAYER_FIELDS = (("layer_types", "mtp_layer_types"), ("mlp_layer_types", "mtp_mlp_layer_types"))
_EXTRAS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"}


def save_pretrained_with_mtp(model: PreTrainedModel, mtp_model: MtpModel, path: str | Path) -> None:
    """Save `model` with its MTP layers in the checkpoint layout `generate(use_mtp=True)` loads.

    transformers loads MTP weights only from `config.name_or_path` (there is no random-init path), so a freshly
    trained (or random, for tests) MTP head must be written into the checkpoint: MTP layer i is stored as decoder
    layer `num_hidden_layers + i` (written through a deeper copy of the model, so transformers' own reverse weight
    conversions apply, e.g. for fused experts) plus its `enorm`/`hnorm`/`eh_proj`/`shared_head.norm`.
    The round trip is verified.
    """
    path = Path(path)
    config = model.config.get_text_config()
    depth = config.num_hidden_layers
    carrier_config = copy.deepcopy(model.config)
    carrier_text_config = carrier_config.get_text_config()
    carrier_text_config.num_hidden_layers = depth + mtp_model.num_mtp_layers
    for main_field, mtp_field in _PER_LAYER_FIELDS:  # the carrier's extra layers are the MTP layers' types
        if getattr(config, main_field, None) is not None:
            setattr(
                carrier_text_config, main_field, [*getattr(config, main_field), *getattr(config, mtp_field)]
            )
    carrier = type(model)(carrier_config)
    carrier.load_state_dict(model.state_dict(), strict=False)
    for i, layer in enumerate(mtp_model.layers):
        carrier.get_decoder().layers[depth + i].load_state_dict(layer.mtp_block.state_dict())
    carrier.save_pretrained(path, safe_serialization=True)
    model.config.save_pretrained(path)  # the real depth

    weights_file = path / "model.safetensors"
    if not weights_file.exists():
        raise ValueError(
            f"expected one unsharded {weights_file}; save smaller models or extend this to shards"
        )
    state = load_file(weights_file)
    for i, layer in enumerate(mtp_model.layers):
        for name, module in layer.named_children():
            if name in _EXTRAS:
                for param_name, tensor in module.state_dict().items():
                    state[f"model.layers.{depth + i}.{_EXTRAS[name]}.{param_name}"] = tensor.detach().clone()
    save_file(state, weights_file, metadata={"format": "pt"})

    main = expose_mtp_layers(type(model).from_pretrained(path))
    reloaded = MtpModel.from_pretrained(main).state_dict()
    for key, tensor in mtp_model.state_dict().items():
        if key in reloaded and not torch.equal(reloaded[key], tensor):
            raise ValueError(f"MTP weight {key} did not survive the save/load round trip")
