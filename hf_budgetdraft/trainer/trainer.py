"""`BudgetDraftTrainer`: trains a drafter that stays accepted at every KV budget.

BudgetDraft, arXiv 2606.00144, §3.2. One step on a batch of rows `(B, P + C)`:

1. teacher targets — precomputed columns, or the frozen target's full forward under `no_grad`
   (`logits_to_keep=C`): greedy next tokens `(B, C)` and, for the soft loss, its distributions `(B, C, V)`;
2. the drafter runs the prefix `(B, P)` once, without gradient (`run_shared_prefix`);
3. full-cache branch: the continuation `(B, C)` with gradient over a fresh `DynamicCache` of that prefix -> L_A;
4. `views_per_step` sparse views at budgets sampled from `budgets` by `budget_weights`: each is the deployed
   cache (`BudgetedCache`/`SinkWindowCache`) filled by its own `update` on the shared prefix, read by the
   continuation in one block with gradient -> L_C = mean over the views;
5. L = L_A + λ·L_C over the continuation positions only.

Logged (averaged over the logging interval): `loss_full` (L_A), `loss_sparse` (L_C), `loss_sparse/budget_B`,
`agreement/full` and `agreement/budget_B` (drafter argmax == teacher greedy token), and with `loss="soft"` the
expected sampling acceptance `acceptance/...`. Evaluation reads every budget, not a sample.

Multi-GPU: the trainer is a plain `Trainer`, so `accelerate launch` runs it data-parallel::

    accelerate launch --num_processes 8 -m hf_budgetdraft.cli train --teacher_model_name_or_path TARGET \\
        --drafter DRAFTER --data_files books/ --output_dir out --prefix_length 16128 --continuation_length 256

(DDP; every process holds the frozen teacher, or precompute its targets once with `--precompute_teacher`). For
FSDP pass `--fsdp "full_shard auto_wrap"` (or an accelerate FSDP config); the drafter is sharded, the teacher is
replicated (it only runs forward under `no_grad`). Each process draws the same budgets per step (the draw is seeded
by `seed` and the global step, which also makes a resumed run draw the same budgets).
"""

from __future__ import annotations

import copy
import json
import os
from collections import defaultdict

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer

from ..loading import LoadFlags, load_model
from ..quiet import peft_wrapping
from .config import BudgetDraftConfig
from .data import BudgetDraftCollator, check_row_lengths
from .losses import (
    budgetdraft_loss,
    distillation_loss,
    expected_acceptance,
    greedy_agreement,
    teacher_probs_from_logits,
    teacher_probs_from_topk,
)
from .views import full_cache, run_shared_prefix, unwrap_transformers_model, view_logits


def _vocab_rows(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def check_vocab_compatible(teacher, drafter, teacher_tokenizer=None, drafter_tokenizer=None) -> None:
    """Raise `ValueError` unless teacher and drafter share a vocabulary (sizes, logits width and, when both
    tokenizers are given, the same token -> id map): the drafter's tokens are verified by the teacher id for id."""
    teacher, drafter = unwrap_transformers_model(teacher), unwrap_transformers_model(drafter)
    sizes = {
        "vocab_size": (
            teacher.config.get_text_config().vocab_size,
            drafter.config.get_text_config().vocab_size,
        ),
        "logits width": (_vocab_rows(teacher), _vocab_rows(drafter)),
    }
    for what, (of_teacher, of_drafter) in sizes.items():
        if of_teacher != of_drafter:
            raise ValueError(
                f"teacher {what}={of_teacher} differs from the drafter's {what}={of_drafter}; a drafter must share "
                "the target's tokenizer and vocabulary (pick a drafter from the target's family, or resize its "
                "embeddings to the target's tokenizer before training)"
            )
    if teacher_tokenizer is not None and drafter_tokenizer is not None:
        teacher_vocab, drafter_vocab = teacher_tokenizer.get_vocab(), drafter_tokenizer.get_vocab()
        if teacher_vocab != drafter_vocab:
            differing = sorted(set(teacher_vocab.items()) ^ set(drafter_vocab.items()))[:3]
            raise ValueError(
                f"teacher and drafter tokenizers differ ({len(teacher_vocab)} vs {len(drafter_vocab)} tokens; e.g. "
                f"{differing}); use the target's tokenizer for the drafter"
            )


def _load(model_or_path, what: str, dtype="auto") -> PreTrainedModel:
    if isinstance(model_or_path, str | os.PathLike):
        return load_model(str(model_or_path), LoadFlags(dtype=dtype))
    if not isinstance(model_or_path, nn.Module):
        raise TypeError(f"{what} must be a model or a path, got {type(model_or_path).__name__}")
    return model_or_path


class BudgetDraftTrainer(Trainer):
    """A `Trainer` for BudgetDraft drafters: L = L_A + λ·L_C against a frozen teacher (the target).

    Args:
        model (`PreTrainedModel` or `str`): the drafter (wrapped with LoRA when `args.use_lora`).
        teacher (`PreTrainedModel` or `str`, *optional*): the target; defaults to `args.teacher_model_name_or_path`.
            Frozen and put in eval mode. Not needed when every row carries precomputed `teacher_labels` (and
            top-k targets for the soft loss), but still recommended for the vocabulary check.
        args (`BudgetDraftConfig`): the training arguments.
        train_dataset (`datasets.Dataset`): rows with `input_ids` of at least `prefix_length + continuation_length`
            ids, optionally `teacher_labels` `(C,)` / `teacher_topk_ids`, `teacher_topk_logprobs` `(C, k)`
            (see `hf_budgetdraft.trainer.data`).
        teacher_processing_class (*optional*): the teacher's tokenizer, checked against `processing_class`.
        Other arguments are `Trainer`'s.

    Example:
        >>> args = BudgetDraftConfig(output_dir="out", prefix_length=2048, continuation_length=128,
        ...                          budgets=[128, 256, 512], budget_weights=[0.4, 0.3, 0.3], max_steps=500)
        >>> trainer = BudgetDraftTrainer(model=drafter, teacher=target, args=args, train_dataset=rows)
        >>> trainer.train()
        >>> trainer.save_drafter()  # plain HF model (+ LoRA adapter), loadable by AutoModelForCausalLM
    """

    def __init__(
        self,
        model: PreTrainedModel | str | None = None,
        teacher: PreTrainedModel | str | None = None,
        args: BudgetDraftConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        data_collator=None,
        teacher_processing_class=None,
        **kwargs,
    ):
        if not isinstance(args, BudgetDraftConfig):
            raise TypeError(f"args must be a BudgetDraftConfig, got {type(args).__name__}")
        if model is None:
            raise ValueError("model (the drafter) is required")
        model = _load(model, "model")
        if teacher is None and args.teacher_model_name_or_path is not None:
            teacher = args.teacher_model_name_or_path
        if teacher is None:
            raise ValueError(
                "no teacher: pass teacher=target or set teacher_model_name_or_path (the frozen target verifies the "
                "drafter's tokens; its greedy tokens are the labels)"
            )
        teacher = _load(teacher, "teacher", args.teacher_dtype)
        check_vocab_compatible(teacher, model, teacher_processing_class, processing_class)
        for dataset in (train_dataset, eval_dataset):
            if dataset is not None and not isinstance(dataset, dict):
                check_row_lengths(dataset, args.prefix_length, args.continuation_length)
        if args.use_lora:
            from peft import PeftModel, get_peft_model

            if not isinstance(model, PeftModel):
                with peft_wrapping():  # peft reads a property transformers deprecated: its warning, not ours
                    model = get_peft_model(model, args.lora_config())
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or BudgetDraftCollator(args.prefix_length, args.continuation_length),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        # compute_loss returns a token mean; Trainer then scales it for gradient accumulation
        self.model_accepts_loss_kwargs = False
        self.teacher = teacher.eval().requires_grad_(False)
        if getattr(teacher, "hf_device_map", None) is None:  # a teacher dispatched with device_map stays put
            self.teacher.to(self.args.device)
        self.view_spec = args.view_spec()
        self._budget_weights = torch.tensor(args.budget_weights, dtype=torch.float64)
        self._draw = (-1, 0)  # (global step, draws at that step): seeds the budget draw
        self._metrics: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    # --- the method ---

    def sample_budgets(self) -> list[int]:
        """The budgets of this step's views: `views_per_step` distinct budgets drawn by `budget_weights`, seeded by
        (`seed`, global step, micro-batch), so every process and a resumed run draw the same."""
        step, count = self._draw
        count = count + 1 if step == self.state.global_step else 0
        self._draw = (self.state.global_step, count)
        generator = torch.Generator().manual_seed(
            self.args.seed + 1_000_003 * self.state.global_step + 7_919 * count
        )
        picks = torch.multinomial(
            self._budget_weights, self.args.views_per_step, replacement=False, generator=generator
        )
        return [self.args.budgets[i] for i in picks.tolist()]

    def teacher_targets(
        self, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """`(labels (B, C), probs (B, C, V) or None)` at the continuation positions, precomputed or online."""
        args = self.args
        soft = args.loss != "hard"
        if "teacher_labels" in inputs:
            labels = inputs["teacher_labels"].long()
            if not soft:
                return labels, None
            if "teacher_topk_ids" not in inputs:
                raise ValueError(
                    f"loss={args.loss!r} needs the teacher's distributions, but the precomputed targets hold greedy labels "
                    "only; precompute with top_k > 0 (--teacher_top_k) or drop the precomputed columns"
                )
            probs = teacher_probs_from_topk(
                inputs["teacher_topk_ids"].long(), inputs["teacher_topk_logprobs"], _vocab_rows(self.teacher)
            )
            return labels, probs
        ids = inputs["input_ids"][:, : args.sequence_length]
        with torch.no_grad():
            logits = self.teacher(input_ids=ids, logits_to_keep=args.continuation_length).logits  # (B, C, V)
        return logits.argmax(dim=-1), teacher_probs_from_logits(logits, args.temperature) if soft else None

    def _branch_loss(self, logits: torch.Tensor, labels: torch.LongTensor, probs: torch.Tensor | None):
        args = self.args
        return distillation_loss(logits, labels, probs, args.loss, args.soft_loss, args.temperature)

    def _record(self, mode: str, name: str, logits, labels, probs, loss) -> None:
        """Log this branch's loss, greedy agreement and (soft loss) expected acceptance, averaged over processes."""
        loss_key = "loss_full" if name == "full" else f"loss_sparse/{name}"
        values = {loss_key: loss, f"agreement/{name}": greedy_agreement(logits, labels)}
        if probs is not None:
            values[f"acceptance/{name}"] = expected_acceptance(
                logits, probs, temperature=self.args.temperature
            )
        for key, value in values.items():
            gathered = self.accelerator.gather(value.detach().float().reshape(1))
            self._metrics[mode][key].append(gathered.mean().item())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """L = L_A + λ·L_C for a batch of rows `input_ids (B, P + C)` (see the module docstring)."""
        args = self.args
        prefix_length = args.prefix_length
        ids = inputs["input_ids"]
        if ids.shape[1] < args.sequence_length:
            raise ValueError(
                f"rows have {ids.shape[1]} tokens, fewer than prefix + continuation = {args.sequence_length}"
            )
        prefix = ids[:, :prefix_length]  # (B, P)
        continuation = ids[:, prefix_length : args.sequence_length]  # (B, C)
        mode = "train" if model.training else "eval"
        labels, probs = self.teacher_targets(inputs)

        shared = run_shared_prefix(
            model, prefix, self.view_spec.query_window, args.draft_prefill_window, args.num_sink_tokens
        )
        config = unwrap_transformers_model(model).config
        full_logits = view_logits(model, continuation, full_cache(config, shared))  # (B, C, V)
        loss_full = self._branch_loss(full_logits, labels, probs)
        self._record(mode, "full", full_logits, labels, probs, loss_full)

        view_losses = []
        if mode == "eval" or args.sparse_loss_weight > 0:
            budgets = self.sample_budgets() if mode == "train" else list(args.budgets)
            for budget in budgets:
                view = self.view_spec.build(config, shared, budget)
                logits = view_logits(model, continuation, view)  # (B, C, V)
                view_losses.append(self._branch_loss(logits, labels, probs))
                self._record(mode, f"budget_{budget}", logits, labels, probs, view_losses[-1])
            self._metrics[mode]["loss_sparse"].append(torch.stack(view_losses).mean().item())
        loss = budgetdraft_loss(loss_full, view_losses, args.sparse_loss_weight)
        return (loss, {"logits": full_logits}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
            self._last_eval_metrics = metrics
        self._metrics[mode].clear()
        super().log({**logs, **metrics}, start_time)

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """`Trainer.evaluate` plus L_A, L_C and the agreement at *every* budget (`eval_agreement/budget_B`, ...)."""
        self._last_eval_metrics = {}
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        prefix = f"{metric_key_prefix}_"
        return {
            **metrics,
            **{prefix + key.removeprefix("eval_"): v for key, v in self._last_eval_metrics.items()},
        }

    # --- saving ---

    def save_drafter(self, output_dir: str | None = None) -> dict[str, str]:
        """Save the trained drafter as a plain HF model (safetensors) that `AutoModelForCausalLM.from_pretrained`
        loads (and so vLLM/SGLang as a draft model); with LoRA, the adapter too, in `output_dir/lora_adapter`.

        Returns:
            `dict[str, str]`: `{"model": folder}` (+ `"adapter": folder`).
        """
        output_dir = output_dir or self.args.output_dir
        paths = {"model": output_dir}
        model = self.accelerator.unwrap_model(self.model)
        if not self.args.should_save:
            return paths
        os.makedirs(output_dir, exist_ok=True)
        if hasattr(model, "merge_and_unload"):  # a PeftModel: save the adapter, then a merged copy
            paths["adapter"] = os.path.join(output_dir, "lora_adapter")
            model.save_pretrained(paths["adapter"])
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        args = self.args
        summary = {
            "method": "BudgetDraft (arXiv 2606.00144)",
            "teacher": getattr(self.teacher.config, "name_or_path", None),
            "cache_implementation": args.cache_kind,
            "cache_config_per_budget": {str(b): args.cache_config(b) for b in args.budgets},
            **{
                key: getattr(args, key)
                for key in (
                    "budgets",
                    "budget_weights",
                    "views_per_step",
                    "sparse_loss_weight",
                    "loss",
                    "soft_loss",
                    "prefix_length",
                    "continuation_length",
                    "use_lora",
                )
            },
        }
        with open(os.path.join(output_dir, "budgetdraft.json"), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
        return paths
