"""BudgetDraft training end to end on tiny models: the loss goes down, per-budget agreement goes up, the saved
drafter (merged plain HF model and LoRA adapter) reloads and drafts losslessly, checkpoints resume exactly."""

import json

import datasets
import pytest
import torch
from peft import PeftModel
from tiny_models import model_pair, random_prompt
from trainer_helpers import (
    char_tokenizer,
    write_corpus,
)
from transformers import AutoModelForCausalLM

from hf_budgetdraft import record_speculation
from hf_budgetdraft.cli import main
from hf_budgetdraft.trainer import BudgetDraftConfig, BudgetDraftTrainer, precompute_teacher_targets

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX, CONTINUATION = 96, 16


def _rows(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (count, PREFIX + CONTINUATION), generator=generator)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def _args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        prefix_length=PREFIX,
        continuation_length=CONTINUATION,
        budgets=[16, 32, 48],
        budget_weights=[0.4, 0.3, 0.3],
        policy_kwargs={"chunk_size": 4},
        window_length=CONTINUATION,
        learning_rate=3e-3,
        warmup_steps=0,
        per_device_train_batch_size=2,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return BudgetDraftConfig(**{**kwargs, **overrides})


def _greedy_identical(target, drafter, cache_config):
    config = drafter.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 3, "constant"
    config.assistant_confidence_threshold = 0.0
    ids = random_prompt(PREFIX, seed=11)
    expected = target.generate(ids, do_sample=False, max_new_tokens=10)
    with record_speculation() as stats:
        out = target.generate(
            ids,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=10,
            cache_implementation="budgeted",
            cache_config=cache_config,
        )
    assert stats.rounds > 0
    return torch.equal(out, expected)


def test_lora_training_improves_every_budget_and_saved_drafter_reloads(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    rows = _rows(16)
    args = _args(tmp_path, use_lora=True, lora_r=8, max_steps=30, views_per_step=2)
    trainer = BudgetDraftTrainer(
        model=drafter, teacher=target, args=args, train_dataset=rows, eval_dataset=rows
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()

    assert after["eval_loss"] < 0.7 * before["eval_loss"], (before, after)
    for budget in args.budgets:  # evaluation reads every budget
        key = f"eval_agreement/budget_{budget}"
        assert after[key] > before[key] + 0.1, (key, before[key], after[key])
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert {"loss_full", "loss_sparse", "agreement/full"} <= set(logged[0])
    assert any(key.startswith("agreement/budget_") for key in logged[0])

    paths = trainer.save_drafter()
    summary = json.loads((tmp_path / "out" / "budgetdraft.json").read_text())
    assert summary["cache_config_per_budget"]["32"] == args.cache_config(32)
    merged = AutoModelForCausalLM.from_pretrained(paths["model"]).eval()
    assert not hasattr(merged, "peft_config")
    adapted = PeftModel.from_pretrained(
        model_pair("llama", "sdpa", draft_layers=1)[1], paths["adapter"]
    ).eval()
    ids = random_prompt(PREFIX, seed=12)
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.model(ids).logits
        torch.testing.assert_close(merged(ids).logits, trained, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapted(ids).logits, trained, rtol=1e-4, atol=1e-4)
    cache_config = {**args.cache_config(32), "slack": 8}
    assert _greedy_identical(target, merged, cache_config)
    assert _greedy_identical(target, adapted, cache_config)


def test_dynamic_policy_trains_on_per_query_views_and_deploys(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    rows = _rows(16)
    args = _args(tmp_path, policy="dynamic", use_lora=True, lora_r=8, max_steps=20)
    trainer = BudgetDraftTrainer(
        model=drafter, teacher=target, args=args, train_dataset=rows, eval_dataset=rows
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    for budget in args.budgets:
        key = f"eval_agreement/budget_{budget}"
        assert after[key] > before[key] + 0.1, (key, before[key], after[key])
    merged = AutoModelForCausalLM.from_pretrained(trainer.save_drafter()["model"]).eval()
    cache_config = args.cache_config(32)
    assert cache_config["policy"] == "dynamic"
    assert _greedy_identical(target, merged, {**cache_config, "slack": 8})


def test_precomputed_soft_targets_sink_window_views_resume_exactly(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    rows = precompute_teacher_targets(_rows(8, seed=1), target, PREFIX, CONTINUATION, top_k=8, batch_size=4)
    overrides = dict(
        loss="soft",
        soft_loss="tv_kl",
        cache_kind="sink_window",
        num_sink_tokens=4,
        budgets=[12, 24],
        budget_weights=[1.0, 1.0],
        learning_rate=1e-3,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=2,
    )
    full_run = BudgetDraftTrainer(
        model=drafter, teacher=target, args=_args(tmp_path, **overrides), train_dataset=rows
    )
    full_run.train()
    assert "acceptance/full" in full_run.state.log_history[0]
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists()

    _, fresh = model_pair("llama", "sdpa", draft_layers=1)
    moved = [
        not torch.equal(a, b) for a, b in zip(full_run.model.parameters(), fresh.parameters(), strict=True)
    ]
    assert all(moved), "a full fine-tune updates every parameter"
    resumed = BudgetDraftTrainer(
        model=fresh,
        teacher=target,
        args=_args(tmp_path, **overrides, output_dir=str(tmp_path / "resumed")),
        train_dataset=rows,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    for (name, a), b in zip(full_run.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs after resuming")


def test_cli_train_end_to_end(tmp_path):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    write_corpus(tmp_path / "corpus", num_documents=2, length=500)
    output = tmp_path / "trained"
    code = main(
        [
            "train",
            "--drafter",
            str(tmp_path / "drafter"),
            "--teacher_model_name_or_path",
            str(tmp_path / "target"),
        ]
        + ["--data_files", str(tmp_path / "corpus"), "--output_dir", str(output), "--precompute_teacher"]
        + [
            "--prefix_length",
            "96",
            "--continuation_length",
            "8",
            "--budgets",
            "16",
            "32",
            "--budget_weights",
            "1",
            "1",
        ]
        + ["--policy", "snapkv", "--policy_kwargs", '{"window_size": 4}', "--window_length", "8"]
        + [
            "--use_lora",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--max_steps",
            "2",
            "--logging_steps",
            "1",
        ]
        + ["--report_to", "none", "--use_cpu", "--disable_tqdm", "true", "--threads", "1"]
    )
    assert code == 0
    assert (output / "model.safetensors").exists() and (
        output / "lora_adapter" / "adapter_model.safetensors"
    ).exists()
    assert list((output / "teacher_targets").glob("teacher-targets-*.arrow"))
    reloaded = AutoModelForCausalLM.from_pretrained(output)
    assert reloaded.config.vocab_size == 128
    assert (
        json.loads((output / "budgetdraft.json").read_text())["cache_config_per_budget"]["16"]["policy"]
        == "snapkv"
    )


@pytest.mark.parametrize("views_per_step", [1, 3])
def test_budget_draw_follows_weights_and_is_seeded_by_step(tmp_path, views_per_step):
    target, drafter = model_pair("llama", "sdpa", draft_layers=1)
    args = _args(
        tmp_path,
        budget_weights=[0.7, 0.3, 0.0] if views_per_step == 1 else [1, 1, 1],
        views_per_step=views_per_step,
    )
    trainer = BudgetDraftTrainer(model=drafter, teacher=target, args=args, train_dataset=_rows(2))
    draws = []
    for step in range(400 if views_per_step == 1 else 5):
        trainer.state.global_step = step
        draws.append(trainer.sample_budgets())
    if views_per_step == 1:
        counts = {b: sum(d == [b] for d in draws) for b in args.budgets}
        assert counts[48] == 0 and 0.6 < counts[16] / 400 < 0.8, counts
    else:
        assert all(sorted(d) == [16, 32, 48] for d in draws)
    trainer.state.global_step = 3
    assert (
        trainer.sample_budgets() == draws[3]
    )  # the same step draws the same budgets (resume, every process)
