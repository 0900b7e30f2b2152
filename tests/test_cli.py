"""The `hf-budgetdraft` command line runs end to end and checks its own output against the target's greedy."""

import re

import pytest
import torch
from torch_support import needs_traceable_transformers

from hf_budgetdraft.cli import main
from hf_budgetdraft.commands import generate as generate_module


def _field(pattern: str, out: str) -> float:
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in the output:\n{out}"
    return float(match.group(1))


def assert_generate_is_lossless(capsys, *args: str) -> str:
    """`hf-budgetdraft generate *args` exits 0, reports output identical to the target's own greedy output, and
    prints the prompt/new-token counts and the speculation statistics with values in their possible ranges."""
    code = main(["generate", *args, "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert _field(r"greedy diff vs the target's own greedy output: (\d+) tokens \(identical\)", out) == 0
    flags = {flag: value for flag, value in zip(args, args[1:], strict=False) if flag.startswith("--")}
    assert _field(r"prompt tokens: (\d+)", out) == int(flags["--context_length"])
    assert _field(r"new tokens: (\d+)", out) == int(flags["--max_new_tokens"])
    gamma = int(flags["--draft_length"]) if flags.get("--draft_length", "").isdigit() else 16
    rounds = _field(r"rounds (\d+) \(", out)
    assert 1 <= rounds <= int(flags["--max_new_tokens"])
    # every round yields the accepted drafts plus the target's own token: between 1 and gamma + 1
    assert 1 <= _field(r"mean accepted length (\d+\.\d+),", out) <= gamma + 1
    # accepted drafts = (mean accepted length - 1) x rounds; each drafting round proposed at most gamma of them
    rate = _field(r"acceptance rate (\d+\.\d)%", out)
    accepted = (_field(r"mean accepted length (\d+\.\d+),", out) - 1) * rounds
    drafting = rounds - _field(r"\((\d+) plain AR steps\)", out)
    assert 0 <= rate <= 100 and (rate > 0 or accepted < 1)
    if drafting:
        assert rate >= 100 * (accepted - 0.005 * rounds) / (gamma * drafting) - 0.05
    return out


@pytest.mark.parametrize("cache", ["sink_window", "budgeted", "full"])
def test_generate_random_models(cache, capsys):
    assert_generate_is_lossless(
        capsys,
        "--random_models",
        "--context_length", "300",
        "--max_new_tokens", "6",
        "--cache", cache,
        "--window_length", "64",
        "--num_sink_tokens", "4",
        "--budget", "64",
    )  # fmt: skip


def test_generate_on_an_accelerator_warms_up_and_compares_with_the_compiled_static_ar(capsys, monkeypatch):
    """On an accelerator the one-liner and transformers' static-cache AR compile on their first call: each is run
    once untimed at the timed run's shapes, and the static AR is a baseline (an accelerator faked here: on the CPU
    transformers runs the static cache eagerly)."""
    timed, calls = generate_module.timed_generate, []

    def recorded(model, ids, new_tokens, **kwargs):
        calls.append((new_tokens, kwargs.get("cache_implementation"), "assistant_model" in kwargs))
        return timed(model, ids, new_tokens, **kwargs)

    monkeypatch.setattr(generate_module, "compiles_on_first_call", lambda device: True)
    monkeypatch.setattr(generate_module, "timed_generate", recorded)
    out = assert_generate_is_lossless(
        capsys,
        "--random_models",
        "--context_length", "300",
        "--max_new_tokens", "6",
        "--budget", "64",
        "--window_length", "64",
    )  # fmt: skip
    assert "warming up: the one-liner compiles on its first call" in out
    assert re.search(r"vs static AR \(transformers' compiled fast path\): .* end to end \d", out)
    one_liner, stock, fast, static = (6, None, True), (6, None, False), (6, None, False), (6, "static", False)
    assert calls == [one_liner, stock, fast, static, static, one_liner]  # warm-ups first, untimed


def test_a_batch_on_an_accelerator_warms_up_and_compares_with_the_compiled_static_ar(capsys, monkeypatch):
    """The batched job on an accelerator (faked: on the CPU transformers runs the static cache eagerly): transformers'
    static-cache batched AR and the batched one-liner run once untimed, then the static AR is a baseline beside
    batched AR, its rows the same as the other baseline's."""
    import hf_budgetdraft.runs.batch_call as batch_call

    static_runs, static = [], batch_call.run_batch_static_ar

    def recorded(*args, **kwargs):
        static_runs.append(static(*args, **kwargs))
        return static_runs[-1]

    monkeypatch.setattr(generate_module, "compiles_on_first_call", lambda device: True)
    monkeypatch.setattr(batch_call, "run_batch_static_ar", recorded)
    args = ["--random_models", "--batch_size", "2", "--context_length", "200", "--max_new_tokens", "6"]
    code = main(["generate", *args, "--budget", "64", "--window_length", "64", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "warming up: batched static AR and the one-liner" in out
    assert _field(r"greedy diff vs batched AR: (\d+) tokens over 2 rows \(identical\)", out) == 0
    assert re.search(r"vs batched static AR \(transformers' compiled fast path\) [\d.]+ tok/s = [\d.]+x", out)
    assert len(static_runs) == 2 and torch.equal(static_runs[0].sequences, static_runs[1].sequences)


def test_no_command_prints_the_usage():
    assert main([]) == 2


@needs_traceable_transformers
def test_generate_with_a_compiled_draft_step_and_a_confidence_stop(capsys):
    """`--compile true`: a static draft cache whose one-token step compiles once (in the untimed warm-up run) and
    is reused by the timed one; `--assistant_confidence_threshold` ends drafts early; the output stays the target's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = assert_generate_is_lossless(
        capsys,
        "--random_models",
        "--context_length", "300",
        "--max_new_tokens", "12",
        "--cache", "budgeted",
        "--budget", "64",
        "--compile", "true",
        "--draft_length", "4",
        "--assistant_confidence_threshold", "0.05",
    )  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert "confidence threshold 0.05" in out  # the flag reaches the draft plan
    assert graphs == 1


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cache", "dense"], "--cache must be sink_window, budgeted or full"),
        (["--static", "maybe"], "--static must be auto, true or false"),
        (["--draft_length", "99"], "draft_length must be 'adaptive', 'heuristic' or an int in"),
        (["--do_sample", "true", "--temperature", "0"], "--temperature must be > 0"),
        (["--assistant_confidence_threshold", "1.5"], r"must be in \[0, 1\), got 1.5"),
        (["--num_return_sequences", "3"], "add --do_sample true"),
        (["--do_sample", "true", "--num_return_sequences", "0"], r"must be in \[1, 256\], got 0"),
        (["--do_sample", "true", "--num_return_sequences", "2", "--batch_size", "2"], "drop --batch_size"),
    ],
)
def test_bad_generate_arguments(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--random_models", *flags])
    assert re.search(message, capsys.readouterr().err)


def test_generate_demo_models_with_defaults(capsys):
    """The README's main job on a short prompt: every default on, the plan printed, both AR baselines reported."""
    assert_generate_is_lossless(
        capsys,
        "--demo_models",
        "--context_length", "1024",
        "--max_new_tokens", "16",
    )  # fmt: skip


def test_generate_demo_models_sampling(capsys):
    code = main(
        ["generate", "--demo_models", "--context_length", "512", "--max_new_tokens", "12", "--do_sample", "true",
         "--temperature", "0.8", "--threads", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "keeps the target's distribution" in out and "greedy diff vs" not in out
    assert _field(r"new tokens: (\d+)", out) == 12 and "draft_length='adaptive'" in out
    assert 1 <= _field(r"mean accepted length (\d+\.\d+),", out) <= 17


def test_generate_several_samples_of_one_prompt(capsys):
    """`--num_return_sequences 3`: the prompt's copies sampled in one batched call, against batched AR sampling."""
    code = main(
        ["generate", "--demo_models", "--context_length", "512", "--max_new_tokens", "8", "--do_sample", "true",
         "--num_return_sequences", "3", "--threads", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and _field(r"batch: (\d+) rows", out) == 3
    assert re.search(r"prompt tokens \[512, 512, 512\]", out) and "keeps the target's distribution" in out


def test_generate_a_batch_of_prompt_files(tmp_path, capsys):
    """Several prompts: one left-padded batch, batched AR then the batched one-liner, every row's greedy diff."""
    from hf_budgetdraft.demo.documents import DEMO_TEXT

    text = DEMO_TEXT.read_text(encoding="utf-8")
    files = []
    for i, (start, length) in enumerate(((0, 3000), (20000, 1800), (40000, 2500))):
        path = tmp_path / f"prompt{i}.txt"
        path.write_text(text[start : start + length], encoding="utf-8")
        files.append(str(path))
    code = main(
        ["generate", "--demo_models", "--prompt_files", *files, "--max_new_tokens", "12", "--threads", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert _field(r"batch: (\d+) rows", out) == 3
    assert _field(r"greedy diff vs batched AR: (\d+) tokens over 3 rows \(identical\)", out) == 0
    rows = re.findall(r"row \d: (\d+\.\d+) tokens a round, latency (\d+\.\d+) s, greedy diff (\d+)", out)
    assert len(rows) == 3 and all(1 <= float(t) <= 17 and d == "0" for t, _, d in rows)
    assert _field(r"= (\d+\.\d+)x", out) > 0
