"""The `hf-budgetdraft` command line runs end to end and checks its own output against the target's greedy."""

import pytest

from hf_budgetdraft.cli import main


def assert_generate_is_lossless(capsys, *args: str) -> None:
    """`hf-budgetdraft generate *args` exits 0 and reports output identical to the target's own greedy output."""
    code = main(["generate", *args, "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "greedy diff vs the target's own greedy output: 0 tokens (identical)" in out


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


def test_bad_arguments(capsys):
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["generate", "--random_models", "--cache", "dense"])
    assert "--cache must be sink_window, budgeted or full" in capsys.readouterr().err


def test_generate_demo_models_with_fast_target_attention(capsys):
    assert_generate_is_lossless(
        capsys,
        "--demo_models",
        "--context_length", "1024",
        "--max_new_tokens", "16",
        "--cache", "budgeted",
        "--budget", "256",
        "--target_attn_implementation", "budgetdraft_sdpa",
    )  # fmt: skip
