"""BudgetDraft training (arXiv 2606.00144): a drafter trained on the full cache and on sparse views of sampled
budgets, each view built by the same cache code the deployed drafter reads.

`BudgetDraftConfig` (a `TrainingArguments`) + `BudgetDraftTrainer` (a `Trainer`); `losses` are pure functions;
`views` builds the training views from the inference caches; `data` packs text, regenerates continuations with
the target and precomputes teacher targets.
Needs the `train` extra (`peft`, `datasets`) for LoRA and data loading.
"""

from . import losses
from .config import BudgetDraftConfig
from .data import (
    BudgetDraftCollator,
    check_row_lengths,
    generate_target_continuations,
    load_text_dataset,
    pack_dataset,
    precompute_teacher_targets,
    sampled_rows,
)
from .trainer import BudgetDraftTrainer, check_vocab_compatible
from .views import (
    SharedPrefix,
    SparseViewSpec,
    full_cache,
    run_shared_prefix,
    view_logits,
    windowed_block_mask,
)

__all__ = [
    "BudgetDraftCollator",
    "BudgetDraftConfig",
    "BudgetDraftTrainer",
    "SharedPrefix",
    "SparseViewSpec",
    "check_row_lengths",
    "check_vocab_compatible",
    "full_cache",
    "generate_target_continuations",
    "load_text_dataset",
    "losses",
    "pack_dataset",
    "precompute_teacher_targets",
    "run_shared_prefix",
    "sampled_rows",
    "view_logits",
    "windowed_block_mask",
]
