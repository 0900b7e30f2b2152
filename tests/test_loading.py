"""The one loader: models named by folder or hub id (offline, from a Hugging Face cache the test builds), each dtype,
device strings, and the generate command's prompts: stdin, --chat with and without a template, streamed text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_llava import tiny_llava
from transformers import (
    AutoTokenizer,
)

from hf_budgetdraft.commands.generate import chat_ids
from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.demo.permuted_vocabulary import permuted_pair
from hf_budgetdraft.loading import LoadFlags, check_device, load_model
from hf_budgetdraft.runs.token_diff import tie_tolerance

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_snapshot(cache: Path, repo_id: str, model_folder: Path, tokenizer=None) -> None:
    """`repo_id` in a Hugging Face hub cache laid out as a download leaves it: refs/main -> a snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(model_folder / name, snapshot / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")
    _hub_snapshot(cache, "someone/long-target", DEMO_DIR / "target", tokenizer)
    _hub_snapshot(cache, "someone/small-drafter", DEMO_DIR / "base_drafter", tokenizer)
    other = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")
    other.add_tokens(["<not-in-the-target>"])
    _hub_snapshot(cache, "someone/foreign-drafter", DEMO_DIR / "base_drafter", other)
    drafter = load_model(str(DEMO_DIR / "base_drafter"), LoadFlags())
    folder = tmp_path_factory.mktemp("permuted")
    permuted, permuted_tokenizer = permuted_pair(drafter, DEMO_DIR / "tokenizer", folder / "tokenizer")
    permuted.save_pretrained(folder / "model")
    _hub_snapshot(cache, "someone/other-tokenizer-drafter", folder / "model", permuted_tokenizer)
    # a LLaVA reading the demo tokenizer's ids: transformers registers it for image-text-to-text only
    tiny_llava(2048, image_token_id=2047).save_pretrained(folder / "vision-language")
    _hub_snapshot(cache, "someone/vision-language-target", folder / "vision-language", tokenizer)
    return cache


def _cli(hub_cache: Path, *flags: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "hf_budgetdraft.cli", "generate", *flags, "--threads", "1"]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_folder_loads_in_each_dtype(dtype):
    model = load_model(str(DEMO_DIR / "base_drafter"), LoadFlags(dtype=dtype))
    assert model.dtype == getattr(torch, dtype) and not model.training
    assert model.config._attn_implementation == "sdpa"


def test_auto_dtype_keeps_the_checkpoints_own():
    folder = DEMO_DIR / "base_drafter"
    model = load_model(str(folder), LoadFlags(dtype="auto"))
    assert model.dtype == getattr(torch, json.loads((folder / "config.json").read_text())["dtype"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(device="gpu"), "--device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
        (dict(device="cuda:x"), "--device must be cpu, cuda, cuda:N or auto"),
        (dict(dtype="int8"), "--dtype must be auto or one of"),
        (dict(attn_implementation="flex"), "--attn_implementation must be one of"),
    ],
)
def test_bad_load_flags_say_what_to_pass(flags, message):
    with pytest.raises(ValueError, match=message):
        LoadFlags(**flags)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_this_machine_lacks_is_refused():
    with pytest.raises(ValueError, match="this machine has 0 CUDA device"):
        check_device("cuda:0")


def test_chat_wraps_the_prompt_in_the_template_or_says_there_is_none():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "tokenizer")
    with pytest.raises(ValueError, match="--chat needs a tokenizer with a chat template"):
        chat_ids(tokenizer, "Who is the king?")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    )
    ids = chat_ids(tokenizer, "Who is the king?", system="Answer briefly.")
    assert ids.shape[0] == 1
    assert tokenizer.decode(ids[0]) == "<system>Answer briefly.\n<user>Who is the king?\n<assistant>"


def test_tie_tolerance_scales_with_the_dtype():
    assert tie_tolerance(torch.float32) < 1e-4 < tie_tolerance(torch.bfloat16) <= 2.0


def test_generate_takes_hub_ids_offline_a_dtype_and_stdin_and_streams(hub_cache):
    text = (DEMO_DIR / "king_john.txt").read_text(encoding="utf-8")[:6000]
    result = _cli(
        hub_cache,
        *("--target", "someone/long-target", "--drafter", "someone/small-drafter"),
        *("--device", "cpu", "--dtype", "bfloat16", "--prompt_file", "-", "--max_new_tokens", "16"),
        stdin=text,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    out = result.stdout
    streamed = out.index("--- generated (the one-liner, streamed) ---")
    assert streamed < out.index("greedy diff vs the target's own greedy output") < out.index("vs fast AR")
    assert "target prefill" in out


@pytest.mark.parametrize("drafter", ["someone/vision-language-target", "someone/small-drafter"])
def test_generate_takes_a_vision_language_target(hub_cache, drafter):
    """A model transformers registers for image-text-to-text only (LLaVA here) loads as that and reads a text
    prompt, drafted for by itself or by a text drafter: the output is its own."""
    text = (DEMO_DIR / "king_john.txt").read_text(encoding="utf-8")[:3000]
    pair = ("--target", "someone/vision-language-target", "--drafter", drafter)
    result = _cli(hub_cache, *pair, "--prompt_file", "-", "--max_new_tokens", "16", stdin=text)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "greedy diff vs the target's own greedy output: 0 tokens (identical)" in result.stdout


def test_generate_refuses_another_tokenizer_with_the_same_vocabulary_size(hub_cache):
    result = _cli(
        hub_cache,
        *("--target", "someone/long-target", "--drafter", "someone/foreign-drafter", "--prompt", "Hello"),
    )
    assert result.returncode != 0
    assert (
        "someone/foreign-drafter has another tokenizer than the target but the same vocab_size"
        in result.stderr
    )


def test_generate_with_a_drafter_of_another_tokenizer(hub_cache):
    """The drafter's own tokenizer comes with it: the call translates between the two, and the output is the
    target's own; such a drafter drafts one sequence at a time."""
    text = (DEMO_DIR / "king_john.txt").read_text(encoding="utf-8")[:6000]
    pair = ("--target", "someone/long-target", "--drafter", "someone/other-tokenizer-drafter")
    result = _cli(hub_cache, *pair, "--prompt_file", "-", "--max_new_tokens", "24", stdin=text)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "greedy diff vs the target's own greedy output: 0 tokens (identical)" in result.stdout
    result = _cli(hub_cache, *pair, "--prompt", "Hello", "--batch_size", "2")
    assert result.returncode != 0 and "one sequence at a time" in result.stderr


def test_bench_a_drafter_of_another_tokenizer(hub_cache, tmp_path):
    """`bench --preset full` passes a drafter's own tokenizer with the target's to every drafter method, and its
    greedy check (exit 1 on any differing token) passes; its batched grid refuses such a drafter."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    pair = ("--target", "someone/long-target", "--drafter", "someone/other-tokenizer-drafter")
    grid = ("--contexts", "600", "--budgets", "128", "--gammas", "4", "--new_tokens", "12", "--samples", "1")
    flags = (*grid, "--repeats", "1", "--methods", "oneliner", "native", "budgeted", "--tasks", "passkey")
    quiet = ("--no_warmup", "--no_plots", "--no_progress", "--threads", "1")
    command = [sys.executable, "-m", "hf_budgetdraft.cli", "bench", "--preset", "full", *pair, *flags, *quiet]
    done = subprocess.run(
        [*command, "--output-dir", str(tmp_path / "grid")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    records = json.loads((tmp_path / "grid" / "results.json").read_text())["records"]
    assert {r["cache"] for r in records if r["method"] == "assisted"} == {"full", "budgeted"}  # native: full
    assert all(r["diff_tokens"] == 0 for r in records) and len(records) >= 4
    batched = [*command[:6], *pair, "--batch_sizes", "2", "--output-dir", str(tmp_path / "batched")]
    done = subprocess.run(batched, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode != 0 and "drafts one sequence at a time" in done.stderr


def test_generate_with_a_hub_id_missing_from_the_cache_fails_offline(hub_cache):
    result = _cli(
        hub_cache, "--target", "someone/absent", "--drafter", "someone/small-drafter", "--prompt", "Hi"
    )
    assert result.returncode != 0 and "someone/absent" in result.stderr


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model"])
def test_a_path_with_no_folder_says_so(name):
    with pytest.raises(OSError, match="a path, but there is no folder at"):
        load_model(name, LoadFlags())


DOORS = """
import sys
from hf_budgetdraft.commands.export import ExportArguments, _load
from hf_budgetdraft.commands.train import TrainScriptArguments, _train_models
from hf_budgetdraft.eval.bench_args import BenchArguments
from hf_budgetdraft.eval.bench_models import full_models
from hf_budgetdraft.trainer.config import BudgetDraftConfig

target, drafter = "someone/long-target", "someone/small-drafter"
bench = full_models(BenchArguments(preset="full", target=target, drafter=drafter, dtype="bfloat16"))
assert bench.targets["target"].dtype == bench.drafters["drafter"].dtype == __import__("torch").bfloat16
assert bench.tokenizer is not None
exported, tokenizer, _ = _load(ExportArguments(engine="vllm", output_dir=sys.argv[1], drafter=drafter))
assert tokenizer is not None and exported.dtype == __import__("torch").float32
script = TrainScriptArguments(drafter=drafter, data_files=["unused.txt"])
config = BudgetDraftConfig(output_dir=sys.argv[1], teacher_model_name_or_path=target, teacher_dtype="bfloat16",
                           report_to=[])
teacher, student, _, teacher_tokenizer = _train_models(script, config)
assert teacher.dtype == __import__("torch").bfloat16 and teacher_tokenizer is not None
print("doors:", type(bench.targets["target"]).__name__, type(exported).__name__, type(teacher).__name__)
vision = full_models(BenchArguments(preset="full", target="someone/vision-language-target", drafter=drafter))
print("vision-language:", type(vision.targets["target"]).__name__)
"""


def test_bench_export_and_train_take_hub_ids_offline(hub_cache, tmp_path):
    """The same loader behind every door: `bench --preset full`, `export` and `train` resolve hub ids from the cache
    (offline), each in the dtype it was asked for; a vision-language target loads as one."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", DOORS, str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "doors: Glm4MoeForCausalLM LlamaForCausalLM Glm4MoeForCausalLM" in done.stdout
    assert "vision-language: LlavaForConditionalGeneration" in done.stdout
