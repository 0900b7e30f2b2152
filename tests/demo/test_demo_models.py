"""The bundled demo models (`hf_budgetdraft.demo.load_demo_models`): offline load, size, model cards, the target's
held-out perplexity and passkey retrieval, and speculative greedy output token-identical to the target's own —
base drafter on a full cache, BudgetDraft drafter on sparse caches, and the target's MTP head native and windowed."""

import math
import subprocess
import sys
import warnings

import pytest
import torch

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.demo.tasks import passkey_sample

PASSKEY_PROMPTS, PASSKEY_HITS = 8, 7


@pytest.fixture(scope="module")
def demo():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return load_demo_models()


def test_bundle_is_complete_small_and_documented():
    files = [f for f in DEMO_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    assert sum(f.stat().st_size for f in files) <= 25 * 1024**2
    for name in ("target", "base_drafter", "drafter", "sampling_drafter"):
        card = (DEMO_DIR / name / "README.md").read_text()
        assert "## Reproduce" in card and "python " in card and "training time" in card


def test_load_demo_models_offline(demo):
    assert demo.target.config.model_type == "glm4_moe" and demo.target.config.num_mtp_layers == 1
    assert demo.base_drafter.config.vocab_size == demo.target.config.vocab_size == len(demo.tokenizer)
    assert 1e6 <= sum(p.numel() for p in demo.base_drafter.parameters()) <= 3e6
    for drafter in (demo.drafter, demo.sampling_drafter):
        assert not hasattr(drafter, "peft_config")  # merged into a plain model
        # the BudgetDraft adapter changed the drafter
        base, trained = demo.base_drafter.state_dict(), drafter.state_dict()
        assert any(not torch.equal(base[k], trained[k]) for k in base)
    assert (
        demo.drafter_for(do_sample=True) is demo.sampling_drafter and demo.drafter_for(False) is demo.drafter
    )
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_demo_models(dtype="int4")


def test_loading_warns_about_nothing():
    """Loading the bundled models, the LoRA adapter included, raises no warning (peft's own read of a deprecated
    transformers property is filtered where the adapter is wrapped, and only that one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_demo_models()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def test_demo_imports_nothing_from_eval():
    code = "import sys, hf_budgetdraft.demo; print(sorted(m for m in sys.modules if m.startswith('hf_budgetdraft.eval')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_target_models_held_out_text(demo):
    """The bundled target has learned English verse: on the held-out play its next-token perplexity is far below
    a uniform guess over the 2,048-token vocabulary (measured: see the target's model card)."""
    ids = demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, 2000:3024]
    with torch.inference_mode():
        loss = demo.target(ids, labels=ids).loss.item()
    assert math.exp(loss) < 150


def test_target_retrieves_passkeys(demo):
    """The short passkey check: 5-digit keys at random depth in 1,024-token prompts (classic haystack); the
    greedy answer must be exact."""
    hits = 0
    for seed in range(PASSKEY_PROMPTS):
        sample = passkey_sample(demo.tokenizer, 1024, seed=90_000 + seed)
        with torch.inference_mode():
            out = demo.target.generate(
                sample.input_ids, max_new_tokens=sample.answer_ids.shape[1], do_sample=False, pad_token_id=0
            )
        hits += int(torch.equal(out[0, sample.input_ids.shape[1] :], sample.answer_ids[0]))
    assert hits >= PASSKEY_HITS, f"{hits}/{PASSKEY_PROMPTS} passkeys retrieved"


@pytest.mark.parametrize(
    "drafter_name, cache, cache_config",
    [
        ("base_drafter", None, None),
        ("drafter", "budgeted", {"budget": 256, "window_length": 64, "policy": "chunk"}),
        ("drafter", "sink_window", {"num_sink_tokens": 16, "window_length": 128}),
        ("sampling_drafter", "budgeted", {}),
        ("mtp", None, None),
        ("mtp", "sink_window", {"num_sink_tokens": 16, "window_length": 128}),
    ],
)
def test_speculative_output_equals_target_greedy(demo, drafter_name, cache, cache_config):
    ids = demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, 5000:6500]
    expected = demo.target.generate(ids, max_new_tokens=40, do_sample=False)
    kwargs = {"cache_implementation": cache, "cache_config": cache_config} if cache else {}
    if drafter_name == "mtp":
        kwargs["use_mtp"] = True
    else:
        kwargs["assistant_model"] = getattr(demo, drafter_name)
    out = demo.target.generate(ids, max_new_tokens=40, do_sample=False, **kwargs)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("draft", ["drafter", "mtp"])
def test_stop_strings_end_a_speculative_call_where_they_end_the_targets(demo, draft):
    """`stop_strings` needs `tokenizer=`, which alone is not universal assisted generation (that takes an
    `assistant_tokenizer=` too): the call runs, and stops at the token where the target's own call stops, also when
    the string ends inside a round."""
    ids = demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, 5000:6500]
    free = demo.target.generate(ids, max_new_tokens=40, do_sample=False)
    words = demo.tokenizer.decode(free[0, ids.shape[1] :]).split()
    stop = next(w for w in words[len(words) // 2 :] if len(w) > 3)  # a word late in the continuation
    kwargs = {"max_new_tokens": 40, "do_sample": False, "stop_strings": [stop], "tokenizer": demo.tokenizer}
    expected = demo.target.generate(ids, **kwargs)
    if draft == "mtp":
        speculative = {"use_mtp": True, "cache_config": {"num_sink_tokens": 16, "window_length": 128}}
        speculative["cache_implementation"] = "sink_window"
    else:
        speculative = {"assistant_model": demo.drafter, "cache_implementation": "budgeted"}
    out = demo.target.generate(ids, **speculative, **kwargs)
    assert expected.shape[1] < free.shape[1] and torch.equal(out, expected)
    if draft == "drafter":
        with pytest.raises(ValueError, match="assistant_tokenizer"):
            demo.target.generate(ids, **speculative, assistant_tokenizer=demo.tokenizer, **kwargs)
