"""`hf-budgetdraft export`: the exported sliding-window drafter, loaded with plain `AutoModelForCausalLM` and run on
its own cache, drafts exactly what the original drafter drafts on `SinkWindowCache(num_sink_tokens=0)`."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_budgetdraft import SinkWindowCache
from hf_budgetdraft.cli import main
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.export_drafter import (
    MARKER,
    check_options,
    export_drafter,
    sliding_window_config,
    sliding_window_model,
)

WINDOW = 24  # past tokens a draft step reads; the prompt and the continuation run well past it
PROMPT_TOKENS, NEW_TOKENS = 64, 40


@pytest.fixture(scope="module")
def demo():
    return load_demo_models()


@pytest.fixture(scope="module")
def prompt(demo) -> torch.LongTensor:
    text = DEMO_TEXT.read_text(encoding="utf-8")[20_000:24_000]  # held-out prose
    return demo.tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]  # (1, P)


@pytest.fixture(scope="module")
def exported(demo, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "drafter"
    return export_drafter(demo.drafter, folder, engine="vllm", window_length=WINDOW, tokenizer=demo.tokenizer)


@pytest.fixture(scope="module")
def loaded(exported):
    return AutoModelForCausalLM.from_pretrained(exported).eval()


@torch.no_grad()
def one_token_steps(model, ids: torch.LongTensor, new_tokens: int, cache: SinkWindowCache):
    """Feed `ids` (1, P) one token a forward, then decode `new_tokens` greedily the same way.

    Returns `(prompt_logits (P, V), new_ids (n,), new_logits (n, V))`; `new_logits[i]` produced `new_ids[i]`.
    """
    step_logits = []
    feed = ids[0].tolist()
    tokens = []
    for position in range(ids.shape[1] + new_tokens - 1):
        token = feed[position] if position < len(feed) else tokens[-1]
        out = model(
            torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache, use_cache=True
        )
        step_logits.append(out.logits[0, -1])
        if position >= ids.shape[1] - 1:
            tokens.append(int(step_logits[-1].argmax()))
    logits = torch.stack(step_logits)  # (P + n - 1, V)
    prompt_steps = ids.shape[1]
    return logits[:prompt_steps], torch.tensor(tokens), logits[prompt_steps - 1 :]


def sink_window(model, sinks: int, window: int) -> SinkWindowCache:
    return SinkWindowCache(config=model.config, num_sink_tokens=sinks, window_length=window, slack=1)


def test_export_writes_a_plain_sliding_window_checkpoint(exported, loaded, demo):
    names = {p.name for p in exported.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
        MARKER,
    } <= names
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == WINDOW + 1
    assert config["layer_types"] == ["sliding_attention"] * demo.drafter.config.num_hidden_layers
    record = json.loads((exported / MARKER).read_text())
    assert record["speculative_config"]["method"] == "draft_model"
    assert record["speculative_config"]["model"] == str(exported)
    original, written = demo.drafter.state_dict(), loaded.state_dict()
    assert set(original) == set(written)
    assert all(torch.equal(original[name], written[name]) for name in original)  # only the config changed


def test_exported_drafter_drafts_what_sink_window_drafts(loaded, demo, prompt):
    """The engine's view (one prefill forward on its own sliding mask, then its own cache) against the package's
    `SinkWindowCache` with the same window and no sink, one token a forward."""
    ref_prompt, ref_ids, ref_logits = one_token_steps(
        demo.drafter, prompt, NEW_TOKENS, sink_window(demo.drafter, 0, WINDOW)
    )
    with torch.no_grad():
        prefill = loaded(prompt).logits[0]  # (P, V)
        out = loaded.generate(
            prompt,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    torch.testing.assert_close(prefill, ref_prompt, atol=1e-4, rtol=1e-4)
    assert out.sequences[0, prompt.shape[1] :].tolist() == ref_ids.tolist()
    torch.testing.assert_close(torch.cat(out.logits), ref_logits, atol=1e-4, rtol=1e-4)
    # the window bit: the same drafter on a full cache reads differently from the first position past the window
    with torch.no_grad():
        full = demo.drafter(prompt).logits[0]
    assert (full[WINDOW + 1 :] - prefill[WINDOW + 1 :]).abs().max() > 1e-2
    torch.testing.assert_close(full[: WINDOW + 1], prefill[: WINDOW + 1], atol=1e-4, rtol=1e-4)


def test_sliding_window_counts_the_query_token(demo, prompt):
    """`sliding_window = W + 1` is `SinkWindowCache(window_length=W)`; declaring `W` would read one token less."""
    ref, _, _ = one_token_steps(demo.drafter, prompt, 1, sink_window(demo.drafter, 0, WINDOW))
    with torch.no_grad():
        right = sliding_window_model(demo.drafter, WINDOW)(prompt).logits[0]
        short = sliding_window_model(demo.drafter, WINDOW - 1)(prompt).logits[0]
    torch.testing.assert_close(right, ref, atol=1e-4, rtol=1e-4)
    assert (short - ref).abs().max() > 1e-2


def test_where_engines_differ_from_sink_window(loaded, demo, prompt):
    """The two differences the docs state: the engines keep no sink, and they window inside a multi-token forward
    (the drafter's prefill), where `SinkWindowCache` lets a forward's own tokens see each other."""
    with torch.no_grad():
        engine = loaded(prompt).logits[0]
        one_forward = demo.drafter(prompt, cache=sink_window(demo.drafter, 0, WINDOW)).logits[0]
    with_sink, _, _ = one_token_steps(demo.drafter, prompt, 1, sink_window(demo.drafter, 4, WINDOW))
    past_window = slice(WINDOW + 1, None)
    assert (with_sink[past_window] - engine[past_window]).abs().max() > 1e-2
    assert (one_forward[past_window] - engine[past_window]).abs().max() > 1e-2
    torch.testing.assert_close(one_forward[: WINDOW + 1], engine[: WINDOW + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("engine", "window", "sinks", "tokens", "error"),
    [
        ("tgi", 64, 0, 6, ValueError),
        ("vllm", 0, 0, 6, ValueError),
        ("vllm", True, 0, 6, TypeError),
        ("vllm", 1 << 40, 0, 6, ValueError),
        ("vllm", 64, 4, 6, ValueError),  # vLLM keeps no sink
        ("sglang", 64, -1, 6, ValueError),
        ("sglang", 64, 1 << 40, 6, ValueError),
        ("vllm", 64, 0, 0, ValueError),
        ("vllm", 64, 0, 65, ValueError),
        ("vllm", 64, 0, 6.0, TypeError),
    ],
)
def test_bad_options_are_refused(engine, window, sinks, tokens, error):
    with pytest.raises(error):
        check_options(engine, window, sinks, tokens)


def test_drafters_a_mistral_model_cannot_hold_are_refused(demo):
    with pytest.raises(ValueError, match="glm4_moe"):
        sliding_window_config(demo.target.config, 64)
    biased = demo.drafter.config.__class__(**{**demo.drafter.config.to_dict(), "attention_bias": True})
    with pytest.raises(ValueError, match="attention_bias"):
        sliding_window_config(biased, 64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sliding_window_config(demo.drafter.config, demo.drafter.config.max_position_embeddings)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_drafter(demo.drafter.state_dict(), "unused", engine="vllm")


def test_output_folder_is_never_overwritten_by_accident(demo, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export_drafter(demo.drafter, foreign, engine="vllm", window_length=WINDOW, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(FileExistsError, match="is a file"):
        export_drafter(demo.drafter, foreign / "notes.txt", engine="vllm", window_length=WINDOW)
    folder = export_drafter(demo.drafter, tmp_path / "out", engine="vllm", window_length=WINDOW)
    with pytest.raises(FileExistsError, match="not empty"):
        export_drafter(demo.drafter, folder, engine="sglang", window_length=WINDOW)
    export_drafter(demo.drafter, folder, engine="sglang", window_length=WINDOW, overwrite=True)
    assert json.loads((folder / MARKER).read_text())["engine"] == "sglang"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_cli_export(tmp_path, capsys):
    folder = tmp_path / "sglang"
    argv = [
        "export",
        "--for",
        "sglang",
        "--output_dir",
        str(folder),
        "--window_length",
        "32",
        "--num_sink_tokens",
        "4",
    ]
    assert main(argv) == 0
    record = json.loads((folder / MARKER).read_text())
    assert record["flags"][record["flags"].index("--speculative-draft-window-size") + 1] == "32"
    assert record["flags"][record["flags"].index("--speculative-draft-sink-size") + 1] == "4"
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 33
    assert "sglang.launch_server" in capsys.readouterr().out
    assert main(argv) == 2  # refused: not empty, no --overwrite
    with pytest.raises(SystemExit):  # vLLM has no sink: refused while parsing
        main(["export", "--for", "vllm", "--output_dir", str(tmp_path / "v"), "--num_sink_tokens", "4"])
