"""One loader for every door: a model as the user names it, on the device and in the dtype they choose.

`--target` / `--drafter` name a local folder or a hub id. A hub id is resolved by transformers through
`huggingface_hub`'s cache (`HF_HOME` / `HF_HUB_CACHE`); with `HF_HUB_OFFLINE=1` it is served from that cache
only; a failed load says which name failed and where it was looked up. Weights load as safetensors only, and code
shipped with a checkpoint runs only with `trust_remote_code=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("sdpa", "eager", "budgetdraft_sdpa", "flash_attention_2")


def revision_field():
    """The `--revision` flag every command that loads by name shares."""
    return field(default=None, metadata={"help": "A hub id's branch, tag or commit (default: main)."})


def trust_remote_code_field():
    """The `--trust_remote_code` flag every command that loads by name shares (off by default)."""
    return field(
        default=False,
        metadata={"help": "Run code shipped with a checkpoint (off: only transformers' own model classes)."},
    )


@dataclass
class LoadFlags:
    """How the named models are loaded (the same flags on every command)."""

    device: str = field(
        default="cpu",
        metadata={"help": "cpu | cuda | cuda:N | auto (device_map='auto': spread over the GPUs there are)."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (the checkpoint's own) | float32 | bfloat16 | float16."},
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": f"The attention both models are loaded with: {' | '.join(ATTENTION)}."},
    )
    revision: str | None = revision_field()
    trust_remote_code: bool = trust_remote_code_field()

    def __post_init__(self):
        check_device(self.device)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attn_implementation not in ATTENTION:
            raise ValueError(
                f"--attn_implementation must be one of {ATTENTION}, got {self.attn_implementation!r}"
            )


def check_device(device: str) -> None:
    """Refuse a device string this machine cannot run: not `cpu`, `cuda`, `cuda:N` or `auto`, or no such GPU."""
    if device in ("cpu", "auto"):
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    count = torch.cuda.device_count()
    if count == 0 or (index and int(index) >= count):
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s); use --device cpu")


def load_model(name: str, flags: LoadFlags) -> PreTrainedModel:
    """`name` (a local folder or a hub id) as a causal LM in eval mode, as `flags` say (a vision-language model
    transformers registers for image-text-to-text only, such as LLaVA or Qwen2.5-VL, as that: it reads text
    prompts too)."""
    placement = {"device_map": "auto"} if flags.device == "auto" else {}
    model = _from_pretrained(
        _auto_class(name, flags),
        name,
        dtype=DTYPES.get(flags.dtype, "auto"),
        attn_implementation=flags.attn_implementation,
        revision=flags.revision,
        trust_remote_code=flags.trust_remote_code,
        use_safetensors=True,
        **placement,
    )
    if flags.device != "auto":
        model = model.to(flags.device)
    return model.eval()


def _auto_class(name: str, flags: LoadFlags):
    """`AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a model only that mapping knows."""
    config = _from_pretrained(
        AutoConfig, name, revision=flags.revision, trust_remote_code=flags.trust_remote_code
    )
    vision_language_only = (
        type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING
    )
    return AutoModelForImageTextToText if vision_language_only else AutoModelForCausalLM


def load_tokenizer(name: str, flags: LoadFlags) -> PreTrainedTokenizerBase:
    """The tokenizer stored with `name` (a local folder or a hub id)."""
    return _from_pretrained(
        AutoTokenizer, name, revision=flags.revision, trust_remote_code=flags.trust_remote_code
    )


def drafter_tokenizer(
    drafter_name: str, flags: LoadFlags, target, drafter, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedTokenizerBase | None:
    """The tokenizer stored with the drafter `drafter_name` where speculative calls must translate between it and
    the target's `tokenizer` (`translated_tokenizer`); `None` where the drafter reads the target's tokens (it was
    saved without a tokenizer, or with the target's)."""
    try:
        own = load_tokenizer(drafter_name, flags)
    except (OSError, ValueError):  # saved without a tokenizer: it drafts in the target's
        return None
    return translated_tokenizer(own, tokenizer, target, drafter, drafter_name)


def translated_tokenizer(
    own: PreTrainedTokenizerBase | None,
    tokenizer: PreTrainedTokenizerBase,
    target,
    drafter,
    drafter_name: str,
) -> PreTrainedTokenizerBase | None:
    """`own`, the drafter's tokenizer, where it is not the target's `tokenizer`: speculative calls then pass both
    (`tokenizer=`, `assistant_tokenizer=`) and translate between them; `None` where there is nothing to translate.
    A drafter with another tokenizer but the target's vocabulary size is refused: transformers takes such a pair for
    one tokenizer and would compare its ids as the target's."""
    if own is None:
        return None
    ours, theirs = tokenizer.get_vocab(), own.get_vocab()
    if ours == theirs:
        return None
    size = target.config.get_text_config().vocab_size
    if drafter.config.get_text_config().vocab_size == size:
        differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise ValueError(
            f"incompatible tokenizers: the drafter {drafter_name} has another tokenizer than the target but the "
            f"same vocab_size ({size}; {len(theirs)} against {len(ours)} tokens, e.g. {differing}): transformers "
            "takes such a pair for one tokenizer and compares its ids as the target's. Use a drafter "
            "with the target's tokenizer, or one whose vocabulary size differs (its tokens are then translated "
            "through text)"
        )
    return own


def _from_pretrained(auto_class, name: str, **kwargs):
    """`auto_class.from_pretrained(name, ...)`, its errors saying which name failed and where it was looked up."""
    try:
        return auto_class.from_pretrained(name, **kwargs)
    except OSError as error:
        if Path(name).is_dir():
            where = "a local folder"
        elif name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a hub id is `name` or `owner/name`
            where = f"a path, but there is no folder at {Path(name).expanduser().resolve()}"
        else:
            offline = (
                " only (HF_HUB_OFFLINE=1)" if huggingface_hub.constants.HF_HUB_OFFLINE else " or on the hub"
            )
            where = f"a hub id, looked up in the Hugging Face cache{offline}"
        raise OSError(f"cannot load {name!r} ({where}): {error}") from error
