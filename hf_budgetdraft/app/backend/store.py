"""The models a visitor can pick, loaded once each: the bundled demo pair, the random smoke models, or local
model folders (checked before loading: safetensors only, bounded size, a shared tokenizer and vocabulary); and the
built-in corpus the document and code tasks read, also loaded once."""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from transformers import AutoTokenizer

from ... import demo as demo_package
from ...demo.corpus import Document
from ...demo.documents import demo_documents
from ...demo.models import DEMO_DIR
from ...demo.random_models import smoke_mtp_model, smoke_pair
from ...generation.mtp_heads import expose_mtp_layers
from ...loading import LoadFlags, load_model, translated_tokenizer
from ...quiet import quiet_transformers
from ..arguments import AppArguments
from .request import (
    DRAFTER_METHODS,
    MODEL_DEMO,
    MODEL_DEMO_BASE,
    MODEL_LABELS,
    MODEL_LOCAL,
    MODEL_SMOKE,
    MODEL_SMOKE_MTP,
    MTP_METHODS,
    DemoInputError,
)

TOKENIZER_DIR = DEMO_DIR / "tokenizer"


@dataclass
class ModelPair:
    """Loaded models of one choice.

    Attributes:
        key (`str`): what identifies it in the store.
        title (`str`): how the page names it.
        tokenizer: the shared tokenizer.
        target (`PreTrainedModel`): verifies every token (full cache).
        drafter (`PreTrainedModel`, *optional*): the draft model (`None`: AR and MTP methods only).
        num_mtp_layers (`int`): the target's MTP depth (0: no MTP methods).
        random_weights (`bool`): random models (they check losslessness and the page, not speed or quality).
        sampling_drafter (`PreTrainedModel`, *optional*): a draft model trained for sampling calls (the bundled
            pair's); `None`: `drafter` drafts for both.
        drafter_tokenizer (*optional*): the drafter's own tokenizer where it is not the target's (the speculative
            calls translate between the two); `None`: the drafter reads the target's tokens.
    """

    key: str
    title: str
    tokenizer: object
    target: torch.nn.Module
    drafter: torch.nn.Module | None
    num_mtp_layers: int = 0
    random_weights: bool = False
    sampling_drafter: torch.nn.Module | None = None
    drafter_tokenizer: object | None = None

    def drafter_for(self, sampling: bool) -> torch.nn.Module | None:
        """The drafter of a greedy or a sampling run."""
        return self.sampling_drafter if sampling and self.sampling_drafter is not None else self.drafter

    def methods(self) -> list[str]:
        """The methods these models can run."""
        methods = ["ar"]
        if self.drafter is not None:
            methods += list(DRAFTER_METHODS)
        if self.num_mtp_layers:
            methods += list(MTP_METHODS)
        return methods


def _bundled_tokenizer():
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise DemoInputError(
            f"the bundled tokenizer is missing from {TOKENIZER_DIR}; reinstall hf-budgetdraft"
        )
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _num_mtp_layers(model) -> int:
    return int(getattr(model.config.get_text_config(), "num_mtp_layers", None) or 0)


def check_model_folder(path: str, role: str, max_bytes: int) -> Path:
    """The folder of a visitor's model, or a `DemoInputError` saying what is missing.

    Args:
        path (`str`): what the visitor typed: a folder on the server (`~` is expanded) or a hub id already in the
            server's Hugging Face cache (the app never downloads).
        role (`str`): `"target"` or `"drafter"`, for the message.
        max_bytes (`int`): the most bytes of `.safetensors` weights the server accepts.
    """
    if not path or not path.strip():
        raise DemoInputError(f"enter the {role} model: a folder written by save_pretrained() or a hub id")
    folder = Path(path.strip()).expanduser()
    if not folder.is_dir():
        folder = _cached_snapshot(path.strip(), role)
    if not (folder / "config.json").is_file():
        raise DemoInputError(
            f"{role} model folder {str(folder)!r} has no config.json; it must be a folder written by "
            "model.save_pretrained()"
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise DemoInputError(
            f"{role} model folder {str(folder)!r} has no .safetensors weights; this app loads only safetensors "
            "(never pickled .bin files): re-save it with model.save_pretrained(path)"
        )
    size = sum(p.stat().st_size for p in weights)
    if size > max_bytes:
        raise DemoInputError(
            f"{role} model {str(folder)!r} holds {size / 2**30:.1f} GiB of weights, more than this server's limit "
            f"of {max_bytes / 2**30:.1f} GiB (--max_model_bytes)"
        )
    return folder


def _cached_snapshot(name: str, role: str) -> Path:
    """The folder of hub id `name` in this server's Hugging Face cache (nothing is downloaded)."""
    try:
        return Path(huggingface_hub.snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - a malformed id or a cache miss: the visitor gets one message
        raise DemoInputError(
            f"{role} model {name!r} is neither a folder on the server nor a model in its Hugging Face cache; give "
            "a folder written by save_pretrained() or a hub id downloaded on this machine (the app never downloads)"
        ) from None


def _load_model(folder: Path, role: str, flags: LoadFlags):
    try:
        model = load_model(str(folder), flags)
    except Exception as error:  # noqa: BLE001 - transformers raises many types; the visitor gets one message
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        remote = (
            ""
            if flags.trust_remote_code
            else " Models that need trust_remote_code load only on a server started with --trust_remote_code."
        )
        raise DemoInputError(
            f"could not load the {role} from {str(folder)!r} as a causal LM ({type(error).__name__}: "
            f"{first_line}).{remote}"
        ) from None
    return model


def _local_tokenizers(target_folder: Path, drafter_folder: Path | None) -> tuple:
    """`(target's tokenizer, drafter folder's own tokenizer or None)`, or a `DemoInputError`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001
        raise DemoInputError(
            f"the target folder {str(target_folder)!r} has no usable tokenizer ({type(error).__name__}); save "
            "one next to the model with tokenizer.save_pretrained(path)"
        ) from None
    if drafter_folder is None or not any(
        (drafter_folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return tokenizer, None
    try:
        return tokenizer, AutoTokenizer.from_pretrained(str(drafter_folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001
        raise DemoInputError(
            f"the drafter folder's tokenizer could not be loaded ({type(error).__name__}); remove it to use "
            "the target's, or fix it"
        ) from None


def check_compatible(tokenizer, target, drafter, drafter_tokenizer=None) -> bool:
    """Refuse a drafter whose tokens the calls could not compare with the target's (`DemoInputError`); `True` for a
    drafter with a tokenizer and vocabulary of its own, whose tokens the calls translate through text.

    Args:
        tokenizer: the target's tokenizer.
        target, drafter (`PreTrainedModel`): the pair.
        drafter_tokenizer (*optional*): the drafter folder's own tokenizer, when it has one.
    """
    target_vocab = target.config.get_text_config().vocab_size
    if len(tokenizer) > target_vocab:
        raise DemoInputError(
            f"the target's tokenizer has {len(tokenizer)} tokens but the target's vocabulary has only {target_vocab}; "
            "the folder's tokenizer does not belong to its model"
        )
    if drafter is None:
        return False
    try:
        translated = translated_tokenizer(drafter_tokenizer, tokenizer, target, drafter, "folder") is not None
    except ValueError as error:
        raise DemoInputError(str(error)) from None
    draft_vocab = drafter.config.get_text_config().vocab_size
    if not translated and draft_vocab != target_vocab:
        raise DemoInputError(
            f"incompatible models: the drafter's vocab_size={draft_vocab} differs from the target's {target_vocab}; "
            "a drafter must share the target's tokenizer and vocabulary (speculative decoding compares token ids), "
            "or come with its own tokenizer in its folder (its tokens are then translated through text)"
        )
    return translated


class ModelStore:
    """Loads each model choice once and keeps it (local folders: only the most recent pair, to bound memory), and
    the built-in corpus (`builtin_documents`).

    Args:
        limits (`AppArguments`): sizes the random smoke models and bounds local models.
    """

    def __init__(self, limits: AppArguments):
        self.limits = limits
        self._pairs: dict[str, ModelPair] = {}
        self._lock = threading.Lock()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._documents: tuple[list[Document], str] | None = None
        self._documents_lock = threading.Lock()

    @property
    def max_positions(self) -> int:
        return self.limits.max_context_length + self.limits.max_new_tokens + self.limits.max_gamma + 8

    def get(
        self,
        model: str,
        target_path: str = "",
        drafter_path: str = "",
        device: str = "cpu",
        dtype: str = "float32",
    ) -> ModelPair:
        """The `ModelPair` of a choice, loading it on first use (`DemoInputError` for bad folders); a visitor's own
        pair (`"local"`) loads on `device` in `dtype`."""
        own = f"local:{target_path.strip()}|{drafter_path.strip()}|{device}|{dtype}"
        key = model if model != MODEL_LOCAL else own
        with self._lock:
            if key not in self._pairs:
                if model == MODEL_LOCAL:  # one local pair at a time: a new one replaces the old
                    for old in [k for k in self._pairs if k.startswith("local:")]:
                        del self._pairs[old]
                flags = LoadFlags(device=device, dtype=dtype, trust_remote_code=self.limits.trust_remote_code)
                with quiet_transformers():
                    self._pairs[key] = self._load(model, target_path, drafter_path, key, flags)
            return self._pairs[key]

    def builtin_documents(self) -> tuple[list[Document], str]:
        """The built-in corpus and its name (`hf_budgetdraft.demo.documents.demo_documents`), read on first use."""
        with self._documents_lock:
            if self._documents is None:
                self._documents = demo_documents()
            return self._documents

    def _load(self, model: str, target_path: str, drafter_path: str, key: str, flags: LoadFlags) -> ModelPair:
        if model in (MODEL_DEMO, MODEL_DEMO_BASE):
            return self._load_demo(model, key)
        if model == MODEL_SMOKE:
            target, drafter = smoke_pair(seed=0, max_position_embeddings=self.max_positions)
            return ModelPair(key, MODEL_LABELS[model], _bundled_tokenizer(), target, drafter, 0, True)
        if model == MODEL_SMOKE_MTP:
            # transformers reads MTP weights from the checkpoint folder in every generate(): keep it for the app's life
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="hf_budgetdraft_app_")
            target = smoke_mtp_model(
                Path(self._tmp.name) / "smoke_mtp", seed=0, max_position_embeddings=self.max_positions
            )
            return ModelPair(
                key, MODEL_LABELS[model], _bundled_tokenizer(), target, None, _num_mtp_layers(target), True
            )
        return self._load_local(target_path, drafter_path, key, flags)

    def _load_demo(self, model: str, key: str) -> ModelPair:
        demo = demo_package.load_demo_models()
        base = model == MODEL_DEMO_BASE
        target = demo.target.eval()
        return ModelPair(
            key,
            MODEL_LABELS[model],
            demo.tokenizer,
            target,
            demo.base_drafter if base else demo.drafter,
            num_mtp_layers=_num_mtp_layers(target),
            sampling_drafter=None if base else demo.sampling_drafter,
        )

    def _load_local(self, target_path: str, drafter_path: str, key: str, flags: LoadFlags) -> ModelPair:
        max_bytes = self.limits.max_model_bytes
        target_folder = check_model_folder(target_path, "target", max_bytes)
        drafter_folder = (
            check_model_folder(drafter_path, "drafter", max_bytes) if drafter_path.strip() else None
        )
        tokenizer, drafter_tokenizer = _local_tokenizers(target_folder, drafter_folder)
        target = _load_model(target_folder, "target", flags)
        drafter = _load_model(drafter_folder, "drafter", flags) if drafter_folder is not None else None
        translated = check_compatible(tokenizer, target, drafter, drafter_tokenizer)
        mtp = _num_mtp_layers(target)
        if mtp:
            expose_mtp_layers(target)
        title = f"{target_path.strip()}" + (f" + {drafter_path.strip()}" if drafter_folder else "")
        title += f" ({flags.device}, {target.dtype})".replace("torch.", "")
        own = drafter_tokenizer if translated else None
        return ModelPair(key, title, tokenizer, target, drafter, mtp, False, drafter_tokenizer=own)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
