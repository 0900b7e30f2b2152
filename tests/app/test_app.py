"""The demo app's event functions and backend, called directly (no server): every method streams both columns,
colours tokens from the per-round accepted counts, reports the stats, stays lossless on greedy runs, and turns bad
input into a message in the page instead of an exception."""

import shutil
import threading
import time

import pytest
import torch

pytest.importorskip("gradio", reason="the demo app needs the `app` extra: pip install 'hf-budgetdraft[app]'")

from app_inputs import run_values as values  # noqa: E402

from hf_budgetdraft.app import AppArguments  # noqa: E402
from hf_budgetdraft.app.app import (  # noqa: E402
    RUN_INPUTS,
    RUN_OUTPUTS,
    build_app,
    on_method_change,
    on_model_change,
    on_source_change,
    request_from_values,
    run_event,
)
from hf_budgetdraft.app.backend import (  # noqa: E402
    DEFAULT_MODEL,
    MODEL_DEMO,
    MODEL_DEMO_BASE,
    MODEL_LOCAL,
    MODEL_SMOKE,
    MODEL_SMOKE_MTP,
    SOURCE_LABELS,
    TOKENIZER_DIR,
    DemoInputError,
    IncrementalDecoder,
    ModelStore,
    RunRequest,
    chunk_origins,
    compare,
    model_choices,
    stream_generate,
    token_origins,
)
from hf_budgetdraft.app.render import acceptance_figure, verdict_markdown  # noqa: E402
from hf_budgetdraft.demo.permuted_vocabulary import permuted_pair  # noqa: E402
from hf_budgetdraft.demo.random_models import smoke_pair, tiny_llama_config  # noqa: E402
from hf_budgetdraft.demo.tasks import TASKS  # noqa: E402

LIMITS = AppArguments(max_context_length=1024, max_new_tokens=64, max_gamma=8, threads=1)


@pytest.fixture(scope="module")
def store():
    store = ModelStore(LIMITS)
    yield store
    store.close()


def final(store, **overrides) -> dict:
    """The last outputs of a run, by name, and how many updates it streamed."""
    updates = list(run_event(store, LIMITS, *values(**overrides)))
    outputs = dict(zip(RUN_OUTPUTS, updates[-1], strict=True))
    outputs["updates"] = len(updates)
    return outputs


def message(store, **overrides) -> str:
    """The status line of a run that must be refused (one update, no exception)."""
    updates = list(run_event(store, LIMITS, *values(**overrides)))
    status = dict(zip(RUN_OUTPUTS, updates[-1], strict=True))["status"]
    assert status.startswith("**⚠"), status
    assert "Traceback" not in status
    return status


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,policy,model",
    [
        ("native", "chunk", MODEL_SMOKE),
        ("sink_window", "chunk", MODEL_SMOKE),
        ("budgeted", "chunk", MODEL_SMOKE),
        ("budgeted", "snapkv", MODEL_SMOKE),
        ("mtp_native", "chunk", MODEL_SMOKE_MTP),
        ("mtp_windowed", "chunk", MODEL_SMOKE_MTP),
    ],
)
def test_every_method_is_lossless_and_reported(store, method, policy, model):
    out = final(store, method=method, policy=policy, model=model)
    assert out["status"].startswith("Done"), out["status"]
    summary = out["raw"]
    spec = summary["speculative"]
    assert summary["greedy_check"] == {"identical": True, "diff_tokens": 0, "compared": 24}
    assert "Identical to the target's own greedy output" in out["verdict"]
    assert spec["new_tokens"] == summary["ar"]["new_tokens"] == 24
    assert spec["rounds"] >= 1 and 1.0 <= spec["mean_accepted_length"] <= spec["gamma"] + 1
    assert spec["draft_cache_bytes"] > 0 and spec["full_draft_cache_bytes"] > 0
    assert summary["speed_up"] > 0 and summary["random_weights"] is True
    for needle in ("speed-up vs AR", "mean accepted length", "acceptance rate", "KV cache"):
        assert needle in out["stats"]
    # every token is coloured, and the colours add up to the per-round accepted counts
    drafted = out["spec_output"].count('data-origin="draft"')
    own = out["spec_output"].count('data-origin="target"')
    assert drafted + own == 24 and own == spec["rounds"]
    assert drafted == round((spec["mean_accepted_length"] - 1) * spec["rounds"])
    assert out["ar_output"].count('data-origin="ar"') == 24
    assert out["plot"] is not None and len(out["plot"].axes[0].patches) == spec["gamma"]


@pytest.mark.parametrize("method", ["budgeted", "sink_window"])
def test_adaptive_draft_length_is_the_default_and_lossless(store, method):
    """γ = 0 (the slider's default) runs the package's adaptive draft length, as the one-liner does."""
    out = final(store, method=method, gamma=0)
    assert out["status"].startswith("Done"), out["status"]
    summary = out["raw"]
    assert summary["greedy_check"]["identical"] is True
    assert summary["speculative"]["gamma"] == 0 and "γ=adaptive" in summary["speculative"]["method"]
    assert RunRequest().gamma == 0 and RunRequest().method == "budgeted" and RunRequest().budget == 512


def test_sparse_draft_cache_is_smaller_than_a_full_one(store):
    summary = final(store, method="sink_window", context_length=512, num_sink_tokens=4, window_length=48)[
        "raw"
    ]
    spec = summary["speculative"]
    assert spec["draft_cache_bytes"] < spec["full_draft_cache_bytes"] / 2


def test_ar_only_has_one_column(store):
    out = final(store, method="ar")
    assert out["status"].startswith("Done")
    assert out["ar_output"].count('data-origin="ar"') == 24
    assert "Not run" in out["spec_output"] and out["plot"] is None and out["verdict"] == ""
    assert "speculative" not in out["raw"]


def test_sampling_runs_without_a_token_by_token_check(store):
    out = final(store, decoding="sampling", temperature=0.8, seed=3)
    assert out["status"].startswith("Done")
    assert "greedy_check" not in out["raw"] and "Sampling" in out["verdict"]
    assert out["raw"]["decoding"] == "sampling (T=0.8)"


@pytest.mark.parametrize("source", ["code", "passkey", "needle_outside_window"])
def test_builtin_contexts(store, source):
    out = final(store, source=source, depth=0.25, method="budgeted", policy="streaming")
    assert out["status"].startswith("Done"), out["status"]
    assert SOURCE_LABELS[source] in out["prompt"] and "256 prompt tokens" in out["prompt"]
    if source != "code":
        assert "key" in out["prompt"]


def test_pasted_and_uploaded_text(store, tmp_path):
    out = final(store, source="text", text="The quick brown fox jumps over the lazy dog. " * 40)
    assert out["status"].startswith("Done") and "pasted text: last 256 tokens" in out["prompt"]
    upload = tmp_path / "notes.txt"
    upload.write_text("short text, naïve café — shorter than the context")
    out = final(store, source="text", upload=str(upload))
    assert (
        out["status"].startswith("Done") and "uploaded file" in out["prompt"] and "all of it" in out["prompt"]
    )


def test_streaming_yields_growing_columns(store):
    request = RunRequest(
        context_length=256, num_sink_tokens=4, window_length=48, max_new_tokens=24, method="sink_window"
    )
    snapshots = [
        (len(s.ar.token_ids) if s.ar else 0, len(s.spec.token_ids) if s.spec else 0, s.summary is not None)
        for s in compare(request, store, LIMITS, refresh_seconds=0.0)
    ]
    ar_counts = [a for a, s, _ in snapshots if s == 0 and a > 0]
    spec_counts = [s for _, s, _ in snapshots if s > 0]
    assert len(set(ar_counts)) > 5, "AR streams token by token before the speculative run starts"
    assert len(set(spec_counts)) > 3 and spec_counts == sorted(spec_counts)
    assert snapshots[-1] == (24, 24, True) and not any(done for *_, done in snapshots[:-1])


def test_the_bundled_pair_is_the_default_and_runs(store):
    assert DEFAULT_MODEL == MODEL_DEMO
    keys = [MODEL_DEMO, MODEL_DEMO_BASE, MODEL_SMOKE, MODEL_SMOKE_MTP, MODEL_LOCAL]
    assert [key for _, key in model_choices()] == keys
    assert [key for _, key in model_choices(allow_local=False)] == keys[:-1]
    blocks = build_app(LIMITS, ModelStore(LIMITS))
    dropdown = next(b for b in blocks.blocks.values() if getattr(b, "elem_id", None) == "model")
    assert dropdown.value == MODEL_DEMO
    for model in (MODEL_DEMO, MODEL_DEMO_BASE):
        out = final(store, model=model)
        assert out["status"].startswith("Done") and out["raw"]["random_weights"] is False
        assert "Bundled demo pair" in out["stats"] and out["raw"]["greedy_check"]["identical"]


# ---------------------------------------------------------------------------------------------------------------
# Local model folders
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory, store):
    """A saved smoke pair with the bundled tokenizer, a drafter of another vocabulary, a drafter whose own
    tokenizer differs from the target's with the same vocabulary size, and the smoke drafter re-indexed under a
    permuted, padded tokenizer of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("models")
    target, drafter = smoke_pair(seed=0, max_position_embeddings=2048)
    tokenizer = store.get(MODEL_SMOKE).tokenizer
    for name, model in (("target", target), ("drafter", drafter)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    LlamaForCausalLM(_small_vocab_config()).save_pretrained(root / "other_vocab")
    drafter.save_pretrained(root / "other_tokenizer")
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(2048)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(root / "other_tokenizer")
    permuted, permuted_tokenizer = permuted_pair(drafter, TOKENIZER_DIR, root / "permuted")
    permuted.save_pretrained(root / "permuted")
    (root / "empty").mkdir()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text((root / "target" / "config.json").read_text())
    return root


def _small_vocab_config():
    config = tiny_llama_config(1, 2048)
    config.vocab_size = 1024
    return config


def test_local_folders_run(store, folders):
    out = final(
        store, model=MODEL_LOCAL, target_path=str(folders / "target"), drafter_path=str(folders / "drafter")
    )
    assert out["status"].startswith("Done"), out["status"]
    assert out["raw"]["greedy_check"]["identical"] and out["raw"]["random_weights"] is False
    # the target alone runs AR; a drafter method without a drafter is refused with the fix
    assert final(store, model=MODEL_LOCAL, target_path=str(folders / "target"), method="ar")[
        "status"
    ].startswith("Done")
    status = message(store, model=MODEL_LOCAL, target_path=str(folders / "target"))
    assert "needs a drafter" in status and "enter a drafter folder" in status


def test_a_drafter_with_a_tokenizer_of_its_own_runs(store, folders):
    """The drafter folder's own tokenizer (another vocabulary size): the speculative call translates between the
    two tokenizers, and its output is the target's own."""
    paths = {"target_path": str(folders / "target"), "drafter_path": str(folders / "permuted")}
    out = final(store, model=MODEL_LOCAL, **paths)
    assert out["status"].startswith("Done"), out["status"]
    assert out["raw"]["greedy_check"]["identical"]
    assert store.get(MODEL_LOCAL, *paths.values(), "cpu", "auto").drafter_tokenizer is not None


@pytest.mark.parametrize(
    "target,drafter,expected",
    [
        ("", "", "enter the target model"),
        ("missing", "", "neither a folder on the server nor a model in its Hugging Face cache"),
        ("empty", "", "has no config.json"),
        ("no_weights", "", "has no .safetensors weights"),
        ("target", "missing", "drafter model"),
        ("target", "other_vocab", "incompatible models: the drafter's vocab_size=1024"),
        ("target", "other_tokenizer", "incompatible tokenizers"),
    ],
)
def test_bad_local_folders_are_explained(store, folders, target, drafter, expected):
    path = lambda name: str(folders / name) if name else ""  # noqa: E731
    assert expected in message(store, model=MODEL_LOCAL, target_path=path(target), drafter_path=path(drafter))


def test_own_models_by_cached_hub_id_on_a_device_in_a_dtype(store, folders, tmp_path, monkeypatch):
    """The form's own-models path: hub ids served from the server's Hugging Face cache (never downloaded), the
    device and dtype chosen, the same bounds and refusals as folders."""
    import huggingface_hub

    cache = tmp_path / "hub"
    for repo_id, folder in (("someone/target", "target"), ("someone/drafter", "drafter")):
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("0" * 40)
        shutil.copytree(folders / folder, snapshot)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    own = dict(model=MODEL_LOCAL, target_path="someone/target", drafter_path="someone/drafter")
    out = final(store, dtype="bfloat16", **own)
    assert out["status"].startswith("Done"), out["status"]
    pair = store.get(MODEL_LOCAL, "someone/target", "someone/drafter", "cpu", "bfloat16")
    assert pair.target.dtype == pair.drafter.dtype == torch.bfloat16 and "someone/target" in pair.title
    assert "not in" not in out["status"] and out["raw"]["greedy_check"] is not None
    missing = message(store, model=MODEL_LOCAL, target_path="someone/not-downloaded")
    assert "neither a folder on the server nor a model in its Hugging Face cache" in missing
    assert "unknown device 'cuda:7'" in message(store, device="cuda:7", **own)
    assert "unknown dtype 'int8'" in message(store, dtype="int8", **own)


def test_local_folders_refused_when_shared(store):
    shared = AppArguments(share=True)
    assert shared.allow_local_models is False
    updates = list(run_event(store, shared, *values(model=MODEL_LOCAL, target_path="/tmp")))
    assert "does not load model folders by path" in updates[-1][0]


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (dict(source="text", text="   "), "the text is empty"),
        (dict(context_length=4096), "context length = 4096 is outside this app's limits [16, 1024]"),
        (dict(max_new_tokens=0), "max new tokens = 0 is outside"),
        (
            dict(max_new_tokens=65),
            "[1, 64]; pick a value in range (the server sets the upper bound with --max_new_tokens)",
        ),
        (dict(num_sink_tokens=10**6), "upper bound with --max_sink_tokens"),
        (dict(budget=float("inf")), "budget must be an integer"),
        (dict(gamma=99), "γ (draft tokens per round) = 99 is outside"),
        (dict(window_length=2.5), "window length must be an integer"),
        (dict(context_length="many"), "context length must be an integer"),
        (dict(depth=1.5), "passkey depth must be in [0, 1]"),
        (dict(method="lookahead"), "unknown method 'lookahead'"),
        (dict(method="budgeted", policy="h2o"), "unknown policy 'h2o'"),
        (dict(method="mtp_windowed"), "needs a model with MTP layers"),
        (
            dict(source="needle_outside_window", context_length=64, window_length=48),
            "cannot build this context",
        ),
        (dict(source="passkey", context_length=16), "too short for a passkey prompt"),
        (dict(decoding="sampling", temperature=0.0), "temperature must be in"),
        (dict(source="text", text="x" * (LIMITS.max_text_chars + 1)), "more than this app's limit"),
    ],
)
def test_bad_input_becomes_a_message(store, overrides, expected):
    assert expected in message(store, **overrides)


def test_bad_uploads(store, tmp_path):
    small = AppArguments(max_upload_bytes=100, max_context_length=1024, threads=1)
    big, binary, empty = tmp_path / "big.txt", tmp_path / "data.txt", tmp_path / "empty.txt"
    big.write_text("x" * 101)
    binary.write_bytes(b"\x00\x01\x02 not text")
    empty.write_text("  \n")
    for path, expected in (
        (big, "101 bytes, more than this app's limit of 100"),
        (binary, "looks binary"),
        (empty, "is empty"),
        (tmp_path / "gone.txt", "upload it again"),
    ):
        updates = list(run_event(store, small, *values(source="text", upload=str(path), context_length=64)))
        assert expected in updates[-1][0]


def test_wrong_number_of_api_values(store):
    (status, *_) = next(run_event(store, LIMITS, 1, 2, 3))
    assert f"expected {len(RUN_INPUTS)} values" in status


def test_a_library_error_is_shown_not_raised(store, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("window_length must be > 0, got 0; pass a positive window")

    monkeypatch.setattr(store.get(MODEL_SMOKE).target, "generate", refuse)
    status = message(store)
    assert "Plain AR (the target alone) failed: window_length must be > 0" in status


# ---------------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------------


def test_token_origins_from_accepted_counts():
    assert token_origins([2, 0, 3], 7) == ["draft", "draft", "target", "target", "draft", "draft", "draft"]
    assert token_origins([2, 0, 3], 8)[-1] == "target"
    assert token_origins([], 2) == ["target", "target"]
    assert chunk_origins([3, 1, 4]) == token_origins([2, 0, 3], 8)


def test_incremental_decoder_concatenates_to_decode(store):
    tokenizer = store.get(MODEL_SMOKE).tokenizer
    ids = tokenizer("naïve café — 日本語 and ascii", add_special_tokens=False).input_ids
    decoder = IncrementalDecoder(tokenizer)
    for i in range(0, len(ids), 3):
        decoder.extend(ids[i : i + 3])
    pieces = decoder.extend([], final=True)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)


class _SlowSteps:
    """A logits processor that sleeps a little at each decoding step and counts the steps."""

    def __init__(self):
        self.steps = 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        time.sleep(0.01)
        return scores


def _slow_run(store, max_new_tokens=60):
    from transformers import LogitsProcessorList

    slow = _SlowSteps()
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(0))
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "logits_processor": LogitsProcessorList([slow]),
    }
    return slow, ids, kwargs


def test_stream_generate_stops_when_closed(store):
    slow, ids, kwargs = _slow_run(store)
    stream = stream_generate(store.get(MODEL_SMOKE).target, ids, kwargs)
    assert len(next(stream).tokens) == 1
    stream.close()  # the visitor left: the worker stops at its next step and is joined
    assert slow.steps < 10
    assert not any(t.name == "hf_budgetdraft-app-generate" for t in threading.enumerate())


def test_stream_generate_cancel(store):
    slow, ids, kwargs = _slow_run(store)
    cancel = threading.Event()
    progress = []
    for step in stream_generate(store.get(MODEL_SMOKE).target, ids, kwargs, cancel=cancel):
        cancel.set()
        progress.append((len(step.tokens), step.done, step.stopped))
    assert progress[-1][1:] == (True, True) and progress[-1][0] < 10


def test_greedy_check_reports_the_first_difference(store):
    from hf_budgetdraft.app.backend import Prompt, RunProgress, summarize

    pair = store.get(MODEL_SMOKE)
    ids = torch.randint(0, 2048, (1, 32), generator=torch.Generator().manual_seed(0))
    ar = RunProgress(
        tokens=[5, 6, 7, 8], chunk_sizes=[1, 1, 1, 1], done=True, seconds=1.0, first_chunk_seconds=0.5
    )
    spec = RunProgress(
        tokens=[5, 6, 9, 8], chunk_sizes=[2, 2], done=True, seconds=0.5, first_chunk_seconds=0.2
    )
    request = RunRequest(method="native", max_new_tokens=4).check(LIMITS)
    summary, _ = summarize(request, pair, Prompt(ids, "test", ""), ar, spec, 4)
    check = summary["greedy_check"]
    assert check["identical"] is False and check["diff_tokens"] == 1 and check["first_diff"] == 2
    assert isinstance(check["margin"], float)
    assert summary["speed_up"] == pytest.approx((2 / 0.3) / (3 / 0.5))  # decoding, after the first chunk
    assert summary["speed_up_end_to_end"] == pytest.approx(2.0)
    assert "Differs from the target's greedy output" in verdict_markdown(summary)


def test_stream_generate_time_limit(store):
    pair = store.get(MODEL_SMOKE)
    ids = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(0))
    *_, last = stream_generate(pair.target, ids, {"max_new_tokens": 50, "do_sample": False}, max_seconds=0.0)
    assert last.done and last.stopped and len(last.tokens) < 50


def test_control_visibility():
    *boxes, method = on_model_change(MODEL_LOCAL, "sink_window")
    assert all(box["visible"] for box in boxes) and len(boxes) == 4 and method["value"] == "sink_window"
    assert not any(box["visible"] for box in on_model_change(MODEL_SMOKE, "budgeted")[:4])
    assert on_model_change(MODEL_SMOKE_MTP, "budgeted")[-1]["value"] == "mtp_windowed"
    assert on_model_change(MODEL_SMOKE, "mtp_native")[-1]["value"] == "budgeted"  # the package's default
    depth, text, upload = on_source_change("passkey")
    assert depth["visible"] and not text["visible"] and not upload["visible"]
    policy, budget, sink, window, gamma = on_method_change("budgeted")
    assert (
        policy["visible"]
        and budget["visible"]
        and not sink["visible"]
        and window["visible"]
        and gamma["visible"]
    )
    policy, budget, sink, window, gamma = on_method_change("mtp_native")
    assert not any(u["visible"] for u in (policy, budget, sink, window, gamma))


def test_request_from_values_and_sources():
    request = request_from_values(*values(decoding="sampling", upload="", text=None))
    assert request.sampling and request.upload is None and request.text == ""
    assert set(TASKS) <= set(SOURCE_LABELS), "every eval task is offered as a context source"
    with pytest.raises(DemoInputError, match="unknown source"):
        RunRequest(source="wiki").check(LIMITS)


def test_render_pieces():
    assert acceptance_figure(None) is None
    verdict = verdict_markdown(
        {
            "speculative": {},
            "decoding": "greedy",
            "greedy_check": {
                "identical": False,
                "diff_tokens": 3,
                "compared": 24,
                "first_diff": 5,
                "margin": 1e-6,
            },
        }
    )
    assert "Differs" in verdict and "first at token 5" in verdict and "near-tie" in verdict


def test_app_arguments_are_bounded():
    with pytest.raises(ValueError, match="--port must be in"):
        AppArguments(port=70000)
    with pytest.raises(ValueError, match="--max_new_tokens must be in"):
        AppArguments(max_new_tokens=0)
    assert AppArguments().allow_local_models is True
