"""`load_demo_models()`: the bundled, honestly trained demo models (trained on CPU by `scripts/`, never in CI).

- `target`: GLM-4-style (`Glm4MoeForCausalLM`, all 7 main layers dense, partial RoPE), ~10M parameters, with one
  trained MTP layer stored as layer 7 (so `generate(use_mtp=True)` and windowed MTP work on it);
- `base_drafter`: a ~1.3M-parameter Llama distilled from the target on a full cache (the conventional drafter);
- `drafter`: the base drafter after BudgetDraft training (arXiv 2606.00144) for greedy calls, stored as a PEFT LoRA
  adapter on the base drafter and merged on load;
- `sampling_drafter`: the same BudgetDraft training with the sampling loss (total variation + KL to the target's
  distribution) for `do_sample=True` calls, stored and loaded the same way.

Each folder holds a model card (`README.md`: data, exact commands, training time, measured metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..generation.mtp_heads import expose_mtp_layers
from ..loading import DTYPES
from ..quiet import peft_wrapping, quiet_transformers

DEMO_DIR = Path(__file__).resolve().parent


@dataclass
class DemoModels:
    """The bundled tokenizer and models, in eval mode."""

    tokenizer: PreTrainedTokenizerBase
    target: PreTrainedModel
    base_drafter: PreTrainedModel
    drafter: PreTrainedModel
    sampling_drafter: PreTrainedModel

    def drafter_for(self, do_sample: bool) -> PreTrainedModel:
        """The bundled drafter trained for this kind of call: `sampling_drafter` when sampling, else `drafter`."""
        return self.sampling_drafter if do_sample else self.drafter


def _folder(name: str, marker: str = "config.json") -> Path:
    folder = DEMO_DIR / name
    if not (folder / marker).exists():
        raise FileNotFoundError(
            f"the bundled demo model {name!r} is missing from {folder}; reinstall hf-budgetdraft "
            "(the weights ship inside the package)"
        )
    return folder


def _load(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, use_safetensors=True, local_files_only=True
    ).eval()


def load_demo_models(dtype: str | torch.dtype = "float32") -> DemoModels:
    """Load the bundled demo tokenizer, target (with its MTP layer), base drafter and BudgetDraft drafters (greedy and
    sampling).

    Offline, from the package folder. The weights are stored in bfloat16; `dtype` is what they are loaded as
    (float32 by default: exact greedy comparisons on CPU).

    Example:
        >>> demo = load_demo_models()
        >>> out = demo.target.generate(ids, assistant_model=demo.drafter, cache_implementation="budgeted")
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch.dtype, got {dtype!r}")
        dtype = DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer", local_files_only=True)
    with quiet_transformers():  # the target's MTP layer is "unexpected" to the main model: no load report
        target = expose_mtp_layers(_load(_folder("target"), dtype))
        base_drafter = _load(_folder("base_drafter"), dtype)
        drafters = [_merged_adapter(name, dtype, PeftModel) for name in ("drafter", "sampling_drafter")]
    return DemoModels(tokenizer, target, base_drafter, *drafters)


def _merged_adapter(name: str, dtype: torch.dtype, peft_model) -> PreTrainedModel:
    """The base drafter with the bundled LoRA adapter `name` merged in."""
    with peft_wrapping():
        adapter = peft_model.from_pretrained(
            _load(_folder("base_drafter"), dtype),
            _folder(name, marker="adapter_config.json"),
            local_files_only=True,
        )
    return adapter.merge_and_unload().eval()
