"""`BudgetDraftConfig`: the training arguments of a BudgetDraft drafter (a `TrainingArguments`).

BudgetDraft, arXiv 2606.00144, §3.2 and §4.1. Defaults are the paper's: prefix 16,128 + continuation 256 tokens,
budgets {256, 512, 1024, 2048} sampled with weights {0.4, 0.3, 0.2, 0.1}, one view per step, λ = 0.5, chunk
policy, hard labels, full fine-tune (lr 1e-5, 150 warm-up steps, cosine). Every knob is a typed field with help
text, so `hf-budgetdraft train --help` (built with `HfArgumentParser`) documents itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.trainer_utils import SchedulerType

from ..cache.policies import POLICIES, get_policy
from ..generation.spec import DraftSpec
from .losses import LOSSES, SOFT_LOSSES
from .views import VIEW_KINDS, SparseViewSpec

PAPER_BUDGETS = [256, 512, 1024, 2048]
PAPER_BUDGET_WEIGHTS = [0.4, 0.3, 0.2, 0.1]


@dataclass
class BudgetDraftConfig(TrainingArguments):
    r"""
    Training arguments of `BudgetDraftTrainer`; every `TrainingArguments` option applies too.

    Loss: `L = L_A + sparse_loss_weight * L_C` over the continuation positions only, where L_A reads the drafter's
    full cache and L_C is the mean over `views_per_step` sparse views, one per budget sampled (without replacement)
    from `budgets` with probabilities proportional to `budget_weights`. A view is the cache `cache_kind` at that
    budget, built by the inference cache's own code (see `hf_budgetdraft.trainer.views`).

    Example:
        >>> args = BudgetDraftConfig(output_dir="out", budgets=[64, 128], budget_weights=[0.5, 0.5],
        ...                          prefix_length=512, continuation_length=64, max_steps=100)
    """

    # --- the method ---
    budgets: list[int] = field(
        default_factory=lambda: list(PAPER_BUDGETS),
        metadata={"help": "KV budgets B of the sparse views: prefix tokens kept per layer and KV head."},
    )
    budget_weights: list[float] = field(
        default_factory=lambda: list(PAPER_BUDGET_WEIGHTS),
        metadata={"help": "Sampling weight of each budget (same length as --budgets; normalised)."},
    )
    views_per_step: int = field(
        default=1,
        metadata={
            "help": "Sparse views per step (distinct budgets, sharing one prefix pass); 1 in the paper."
        },
    )
    sparse_loss_weight: float = field(
        default=0.5,
        metadata={"help": "λ in L = L_A + λ·L_C (0.5 in the paper); 0 trains the full-cache loss only."},
    )
    cache_kind: str = field(
        default="budgeted",
        metadata={
            "help": "Cache the sparse views reproduce: 'budgeted' (BudgetedCache) or 'sink_window' "
            "(SinkWindowCache with num_sink_tokens + a window of budget - num_sink_tokens)."
        },
    )
    policy: str = field(
        default="chunk",
        metadata={
            "help": f"Budgeted views: selection policy, one of {sorted(POLICIES)} (as cache_config['policy'])."
        },
    )
    policy_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Policy hyper-parameters as JSON, e.g. '{\"chunk_size\": 8}' (as cache_config)."},
    )
    window_length: int = field(
        default=256,
        metadata={
            "help": "Budgeted views: the recent window of the deployed cache (cache_config['window_length']). "
            "With window_length >= continuation_length the view is a plain causal block."
        },
    )
    num_sink_tokens: int = field(
        default=64,
        metadata={"help": "sink_window views, and draft_prefill_window chunks: attention-sink tokens."},
    )
    draft_prefill_window: int | None = field(
        default=None,
        metadata={
            "help": "Run the prefix as a drafter deployed with cache_config={'prefill_window': W} prefills: in "
            "chunks of W tokens, each reading the num_sink_tokens sink and the W tokens before it (O(L·W)). None: "
            "full attention over the prefix (the drafter is then deployed with the inference default, "
            "prefill_window='auto')."
        },
    )
    prefix_length: int = field(
        default=16128,
        metadata={"help": "Prefix tokens per row (the prompt the drafter prefills); 16,128 in the paper."},
    )
    continuation_length: int = field(
        default=256,
        metadata={"help": "Continuation tokens per row, where the loss is computed; 256 in the paper."},
    )
    loss: str = field(
        default="hard",
        metadata={
            "help": "'hard': cross-entropy to the teacher's greedy token (greedy verification, the paper); 'soft': "
            "a divergence to the teacher's distribution (sampling verification, see --soft_loss); 'hard+soft': "
            "their sum, for one drafter verified both ways."
        },
    )
    soft_loss: str = field(
        default="tv",
        metadata={
            "help": f"loss='soft': one of {SOFT_LOSSES}. 'tv' = 1 - expected sampling acceptance; 'kl' = forward "
            "KL(p_target || q_drafter), a smooth surrogate; 'tv_kl' = their sum."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "loss='soft'/'hard+soft': the sampling temperature the drafter will be verified at."
        },
    )

    # --- models ---
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The target (teacher) model: a local HF folder or hub name. Frozen."}
    )
    teacher_dtype: str = field(
        default="auto", metadata={"help": "dtype of the teacher: auto | float32 | bfloat16 | float16."}
    )

    # --- PEFT ---
    use_lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters (peft) instead of a full fine-tune (the paper's)."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scaling alpha."})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "LoRA dropout (0 keeps the training view identical to inference)."}
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={
            "help": "Modules to adapt, e.g. q_proj k_proj v_proj o_proj; 'all-linear' = every linear layer."
        },
    )

    # --- TrainingArguments defaults that BudgetDraft changes ---
    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate (1e-5 in the paper)."})
    lr_scheduler_type: SchedulerType | str = field(
        default="cosine", metadata={"help": "Scheduler (cosine in the paper)."}
    )
    warmup_steps: float = field(default=150, metadata={"help": "Warm-up steps (150 in the paper)."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Rows per device (1 in the paper)."}
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Must stay False: the trainer reads input_ids and the precomputed teacher columns."
        },
    )
    use_cache: bool = field(
        default=True, metadata={"help": "Kept True: every branch of a step runs on a KV cache."}
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.policy_kwargs, str):
            try:
                self.policy_kwargs = json.loads(self.policy_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"policy_kwargs must be a JSON object, e.g. '{{\"chunk_size\": 8}}', got {self.policy_kwargs!r} "
                    f"({error})"
                ) from None
        self._check_lengths()
        self._check_budgets()
        self._check_loss()
        self._check_lora()
        if self.activation_checkpointing:
            raise ValueError(
                "activation/gradient checkpointing makes transformers drop the KV cache inside each layer, but every "
                "BudgetDraft branch reads one (the views *are* caches). Drop --gradient_checkpointing/"
                "--activation_checkpointing; memory is "
                "bounded by the continuation, the prefix runs without gradient."
            )
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the precomputed teacher columns (teacher_labels, "
                "teacher_topk_*); leave it False (the default of BudgetDraftConfig)"
            )

    def _check_lengths(self) -> None:
        for name in ("prefix_length", "continuation_length", "window_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def _check_budgets(self) -> None:
        if not self.budgets:
            raise ValueError("budgets is empty; pass at least one, e.g. --budgets 256 512 1024 2048")
        for budget in self.budgets:
            if not isinstance(budget, int) or not 0 < budget < self.prefix_length:
                raise ValueError(
                    f"budget {budget!r} in budgets={self.budgets} must be an int in (0, prefix_length="
                    f"{self.prefix_length}): a budget >= the prefix keeps everything (no sparse view). Lower the "
                    "budget or raise --prefix_length."
                )
        if len(set(self.budgets)) != len(self.budgets):
            raise ValueError(
                f"budgets={self.budgets} has duplicates; list each budget once and weight it instead"
            )
        if len(self.budget_weights) != len(self.budgets):
            raise ValueError(
                f"budget_weights={self.budget_weights} has {len(self.budget_weights)} values but budgets="
                f"{self.budgets} has {len(self.budgets)}; pass one weight per budget, e.g. --budget_weights "
                + " ".join(["1"] * len(self.budgets))
            )
        if any(not math.isfinite(w) or w < 0 for w in self.budget_weights) or sum(self.budget_weights) <= 0:
            raise ValueError(
                f"budget_weights={self.budget_weights} must be finite, >= 0 and sum to > 0 (they are normalised)"
            )
        positive = sum(w > 0 for w in self.budget_weights)
        if not isinstance(self.views_per_step, int) or not 1 <= self.views_per_step <= positive:
            raise ValueError(
                f"views_per_step={self.views_per_step!r} must be in [1, {positive}]: views take distinct budgets and "
                f"{positive} budget(s) have a positive weight. Lower views_per_step or add budgets."
            )
        if not math.isfinite(self.sparse_loss_weight) or self.sparse_loss_weight < 0:
            raise ValueError(f"sparse_loss_weight (λ) must be finite and >= 0, got {self.sparse_loss_weight}")
        if self.cache_kind not in VIEW_KINDS:
            raise ValueError(f"cache_kind must be one of {VIEW_KINDS}, got {self.cache_kind!r}")
        if self.cache_kind == "sink_window":
            if not 0 <= self.num_sink_tokens < min(self.budgets):
                raise ValueError(
                    f"num_sink_tokens={self.num_sink_tokens} must be in [0, min(budgets)={min(self.budgets)}): a "
                    "sink_window view of budget B keeps the sink plus a window of B - num_sink_tokens tokens"
                )
        elif self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        else:
            policy = get_policy(self.policy, **(self.policy_kwargs or {}))
            for budget in self.budgets:
                policy.validate_budget(budget)
        self.draft_spec(self.budgets[0])  # a prefill window the deployed spec refuses is refused here
        self.view_spec()  # a view the spec refuses is refused here

    def _check_loss(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.soft_loss not in SOFT_LOSSES:
            raise ValueError(f"soft_loss must be one of {SOFT_LOSSES}, got {self.soft_loss!r}")
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    def _check_lora(self) -> None:
        if not self.use_lora:
            return
        if self.lora_r < 1:
            raise ValueError(f"lora_r must be >= 1, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_target_modules:
            raise ValueError(
                "lora_target_modules is empty; name modules (e.g. q_proj v_proj) or 'all-linear'"
            )

    @property
    def sequence_length(self) -> int:
        """Tokens per training row: prefix_length + continuation_length."""
        return self.prefix_length + self.continuation_length

    def view_spec(self) -> SparseViewSpec:
        """The sparse-cache description the trainer's views are built from."""
        return SparseViewSpec(
            kind=self.cache_kind,
            policy=self.policy,
            policy_kwargs=self.policy_kwargs,
            window_length=self.window_length,
            num_sink_tokens=self.num_sink_tokens,
        )

    def draft_spec(self, budget: int) -> DraftSpec:
        """The `DraftSpec` that deploys what a view of `budget` trained (the inference defaults otherwise)."""
        if self.cache_kind == "sink_window":
            sizes = {"num_sink_tokens": self.num_sink_tokens, "window_length": budget - self.num_sink_tokens}
        else:
            kwargs = dict(self.policy_kwargs) if self.policy_kwargs else None
            sizes = {"budget": budget, "policy": self.policy, "window_length": self.window_length}
            sizes["policy_kwargs"] = kwargs
        window = {} if self.draft_prefill_window is None else {"prefill_window": self.draft_prefill_window}
        return DraftSpec(cache=self.cache_kind, **window, **sizes)

    def cache_config(self, budget: int) -> dict:
        """The cache sizes of `generate(cache_implementation=self.cache_kind, cache_config=...)` that deploy what a
        view of `budget` trained (`draft_spec(budget)`'s, written out in full)."""
        options = self.draft_spec(budget).cache_kwargs(static=False)
        options = {k: v for k, v in options.items() if k not in ("static", "slack")}
        if self.draft_prefill_window is not None:
            options["prefill_window"] = self.draft_prefill_window
        return options

    def lora_config(self):
        """The `peft.LoraConfig` for `use_lora=True`."""
        from peft import LoraConfig

        targets = self.lora_target_modules
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM",
        )
