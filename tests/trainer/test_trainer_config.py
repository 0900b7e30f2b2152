"""Bad BudgetDraft input fails early with a ValueError that names the value, what was expected and the fix."""

import datasets
import pytest
import torch
from tiny_models import model_pair, random_prompt, tiny_config
from tokenizers import Tokenizer, models
from trainer_helpers import (
    char_tokenizer,
)
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_budgetdraft.cli import main
from hf_budgetdraft.trainer import (
    BudgetDraftCollator,
    BudgetDraftConfig,
    BudgetDraftTrainer,
    check_vocab_compatible,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        prefix_length=64,
        continuation_length=8,
        budgets=[16, 32],
        budget_weights=[0.5, 0.5],
        policy_kwargs={"chunk_size": 4},
        report_to="none",
        use_cpu=True,
    )
    return BudgetDraftConfig(**{**kwargs, **overrides})


def test_defaults_are_the_papers(tmp_path):
    args = BudgetDraftConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert (args.budgets, args.budget_weights) == ([256, 512, 1024, 2048], [0.4, 0.3, 0.2, 0.1])
    assert (args.prefix_length, args.continuation_length, args.sequence_length) == (16128, 256, 16384)
    assert (args.views_per_step, args.sparse_loss_weight, args.policy, args.loss) == (1, 0.5, "chunk", "hard")
    assert (args.learning_rate, args.warmup_steps, args.lr_scheduler_type.value) == (1e-5, 150, "cosine")
    assert args.cache_config(512) == {"budget": 512, "policy": "chunk", "window_length": 256}


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"budgets": [0, 32]}, r"budget 0 .* must be an int in \(0, prefix_length=64\)"),
        ({"budgets": [16, 64]}, r"budget 64 .*Lower the budget or raise --prefix_length"),
        ({"budgets": []}, "budgets is empty"),
        ({"budgets": [16, 16]}, "duplicates"),
        ({"budget_weights": [1.0]}, r"has 1 values but budgets=\[16, 32\] has 2.*--budget_weights 1 1"),
        ({"budget_weights": [1.0, -0.5]}, "must be finite, >= 0 and sum to > 0"),
        ({"budget_weights": [0.0, 0.0]}, "must be finite, >= 0 and sum to > 0"),
        ({"views_per_step": 3}, r"views_per_step=3 must be in \[1, 2\]"),
        ({"views_per_step": 2, "budget_weights": [1.0, 0.0]}, r"views_per_step=2 must be in \[1, 1\]"),
        ({"sparse_loss_weight": -1.0}, "sparse_loss_weight"),
        ({"policy": "h2o"}, "policy must be one of"),
        (
            {"policy_kwargs": None, "budgets": [8, 32]},
            "too small for policy='chunk'",
        ),  # default chunk_size 8 needs budget >= 15
        ({"policy_kwargs": "{chunk_size: 4}"}, "policy_kwargs must be a JSON object"),
        ({"cache_kind": "dense"}, "cache_kind must be one of"),
        (
            {"cache_kind": "sink_window", "num_sink_tokens": 16},
            r"num_sink_tokens=16 must be in \[0, min\(budgets\)",
        ),
        ({"loss": "mse"}, "loss must be one of"),
        ({"soft_loss": "js"}, "soft_loss must be one of"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"continuation_length": 0}, "continuation_length must be an int >= 1"),
        ({"use_lora": True, "lora_r": 0}, "lora_r must be >= 1"),
        ({"activation_checkpointing": True}, "Drop --gradient_checkpointing"),
        ({"remove_unused_columns": True}, "leave it False"),
    ],
)
def test_config_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **overrides)


def test_policy_kwargs_json_string(tmp_path):
    args = _config(tmp_path, policy_kwargs='{"chunk_size": 4}')
    assert args.policy_kwargs == {"chunk_size": 4}
    assert args.view_spec().policy.chunk_size == 4


def test_vocab_mismatch_is_refused(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    small_vocab = tiny_config("llama", 1)
    small_vocab.vocab_size = 96
    other = AutoModelForCausalLM.from_config(small_vocab)
    with pytest.raises(ValueError, match="teacher vocab_size=128 differs from the drafter's vocab_size=96"):
        check_vocab_compatible(target, other)
    rows = datasets.Dataset.from_dict({"input_ids": [random_prompt(72)[0].tolist()]})
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        BudgetDraftTrainer(model=other, teacher=target, args=_config(tmp_path), train_dataset=rows)
    vocab = {chr(i): (i + 1) % 128 for i in range(128)}
    shifted = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    )
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_vocab_compatible(target, drafter, char_tokenizer(), shifted)
    check_vocab_compatible(target, drafter, char_tokenizer(), char_tokenizer())


def test_short_rows_are_refused(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    rows = datasets.Dataset.from_dict(
        {"input_ids": [random_prompt(72)[0].tolist(), random_prompt(70)[0].tolist()]}
    )
    with pytest.raises(
        ValueError, match=r"1 of 2 rows are shorter than .* = 64 \+ 8 = 72 tokens \(row 1 has 70\)"
    ):
        BudgetDraftTrainer(model=drafter, teacher=target, args=_config(tmp_path), train_dataset=rows)
    collate = BudgetDraftCollator(prefix_length=64, continuation_length=8)
    with pytest.raises(ValueError, match="fewer than prefix_length \\+ continuation_length = 72"):
        collate([{"input_ids": list(range(70))}])
    batch = collate([{"input_ids": list(range(80)), "teacher_labels": list(range(8))}])
    assert batch["input_ids"].shape == (1, 72) and batch["teacher_labels"].shape == (1, 8)
    with pytest.raises(ValueError, match="recompute the teacher targets"):
        collate([{"input_ids": list(range(72)), "teacher_labels": list(range(5))}])


def test_soft_loss_needs_distributions_when_precomputed(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    rows = datasets.Dataset.from_dict(
        {"input_ids": [random_prompt(72)[0].tolist()], "teacher_labels": [[1] * 8]}
    )
    trainer = BudgetDraftTrainer(
        model=drafter, teacher=target, args=_config(tmp_path, loss="soft"), train_dataset=rows
    )
    batch = trainer.data_collator([rows[0]])
    with pytest.raises(ValueError, match="precompute with top_k > 0"):
        trainer.compute_loss(trainer.model, batch)
    assert torch.is_tensor(batch["teacher_labels"])


def test_cli_train_errors(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--random_models", "--prefix_length", "64", "--budgets", "64"])
    assert "budget 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--prefix_length", "64", "--budgets", "16"])
    assert "exactly one data source" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--random_models", "--sampled_continuations", "0.5"])
    assert "needs --continuations target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--random_models", "--continuations", "target", "--sampled_continuations", "2"])
    assert "--sampled_continuations must be in [0, 1], got 2.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--random_models", "--continuations", "target", "--continuation_batch_size", "0"])
    assert "--continuation_batch_size must be in [1, 4096], got 0" in capsys.readouterr().err


def test_a_draft_prefill_window_is_deployed_with_the_drafter(tmp_path):
    config = _config(tmp_path, draft_prefill_window=16)
    assert config.draft_spec(32).prefill_window == 16 and config.cache_config(32)["prefill_window"] == 16
    assert "prefill_window" not in _config(tmp_path).cache_config(32)
    with pytest.raises(ValueError, match="scores the prefix with the prefill's queries"):
        _config(tmp_path, draft_prefill_window=16, policy="snapkv", policy_kwargs={"window_size": 4})
