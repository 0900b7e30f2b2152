"""`hf-budgetdraft` command line. Sub-commands: `generate` (speculative generation with a sparse draft cache,
checked token-for-token against the target's own greedy output)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from . import record_speculation
from .cache.base import MAX_CACHE_TOKENS
from .random_models import random_pair


@dataclass
class GenerateArguments:
    target: str | None = field(
        default=None, metadata={"help": "Local HF model folder of the target (safetensors)."}
    )
    drafter: str | None = field(default=None, metadata={"help": "Local HF model folder of the drafter."})
    random_models: bool = field(
        default=False,
        metadata={
            "help": "Use a small random Llama pair (no weights needed): checks the machinery, not quality."
        },
    )
    prompt: str | None = field(
        default=None, metadata={"help": "Prompt text (needs a tokenizer in --target)."}
    )
    prompt_file: str | None = field(default=None, metadata={"help": "Read the prompt from this text file."})
    context_length: int = field(
        default=4096, metadata={"help": "Prompt tokens (random prompt, or truncate to)."}
    )
    cache: str = field(
        default="sink_window", metadata={"help": "Draft cache: sink_window | budgeted | full."}
    )
    num_sink_tokens: int = field(default=64, metadata={"help": "sink_window: attention-sink tokens."})
    window_length: int = field(default=1024, metadata={"help": "sink_window/budgeted: recent-window tokens."})
    budget: int = field(default=512, metadata={"help": "budgeted: prefix tokens kept per layer and KV head."})
    policy: str = field(default="chunk", metadata={"help": "budgeted: chunk | streaming | snapkv."})
    gamma: int = field(default=5, metadata={"help": "Draft tokens per round (num_assistant_tokens)."})
    max_new_tokens: int = field(default=64, metadata={"help": "Tokens to generate."})
    threads: int = field(default=2, metadata={"help": "torch threads (set explicitly; see README)."})
    seed: int = field(default=0, metadata={"help": "Seed for random models and prompts."})

    def __post_init__(self):
        if self.cache not in ("sink_window", "budgeted", "full"):
            raise ValueError(f"--cache must be sink_window, budgeted or full, got {self.cache!r}")
        if not 1 <= self.context_length <= MAX_CACHE_TOKENS:
            raise ValueError(
                f"--context_length must be in [1, {MAX_CACHE_TOKENS}], got {self.context_length}"
            )
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"--max_new_tokens must be in [1, 4096], got {self.max_new_tokens}")
        if not 1 <= self.gamma <= 64:
            raise ValueError(f"--gamma must be in [1, 64], got {self.gamma}")
        if self.random_models == bool(self.target and self.drafter):
            raise ValueError("pass either --random_models or both --target and --drafter")


def _load_pair(args: GenerateArguments):
    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, local_files_only=True).eval()

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    return load(args.target), load(args.drafter), tokenizer


def _prompt_ids(args: GenerateArguments, tokenizer, vocab_size: int) -> torch.LongTensor:
    text = args.prompt
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            text = handle.read()
    if text is None:
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (1, args.context_length), generator=generator)
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer: use --target/--drafter model folders")
    return tokenizer(text, return_tensors="pt").input_ids[:, -args.context_length :]


def generate_command(args: GenerateArguments) -> int:
    torch.set_num_threads(args.threads)
    if args.random_models:
        target, drafter = random_pair(args.seed, args.context_length + args.max_new_tokens + 1)
        tokenizer = None
    else:
        target, drafter, tokenizer = _load_pair(args)
    ids = _prompt_ids(args, tokenizer, target.config.vocab_size)
    drafter.generation_config.num_assistant_tokens = args.gamma
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    cache_kwargs = {}
    if args.cache == "sink_window":
        cache_kwargs = dict(
            cache_implementation="sink_window",
            cache_config={"num_sink_tokens": args.num_sink_tokens, "window_length": args.window_length},
        )
    elif args.cache == "budgeted":
        cache_kwargs = dict(
            cache_implementation="budgeted",
            cache_config={"budget": args.budget, "policy": args.policy, "window_length": args.window_length},
        )

    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        expected = target.generate(ids, **common)
        ar_seconds = time.perf_counter() - start
        with record_speculation() as stats:
            start = time.perf_counter()
            out = target.generate(ids, assistant_model=drafter, **common, **cache_kwargs)
            spec_seconds = time.perf_counter() - start

    new = out[0, ids.shape[1] :]
    diff = int((new != expected[0, ids.shape[1] :]).sum())
    print(f"prompt tokens: {ids.shape[1]}  new tokens: {new.numel()}  draft cache: {args.cache}")
    print(tokenizer.decode(new) if tokenizer is not None else f"token ids: {new.tolist()}")
    print(
        f"greedy diff vs the target's own greedy output: {diff} tokens ({'identical' if diff == 0 else 'DIFFERENT'})"
    )
    print(
        f"rounds {stats.rounds}, mean accepted length {stats.mean_accepted_length:.2f}, acceptance rate "
        f"{stats.acceptance_rate:.1%}, draft {stats.draft_seconds:.2f} s, verify {stats.verify_seconds:.2f} s"
    )
    print(
        f"plain AR {ar_seconds:.2f} s, speculative {spec_seconds:.2f} s, speed-up {ar_seconds / spec_seconds:.2f}x "
        f"(one run, {args.threads} threads; use benchmarks/ for measured ratios)"
    )
    return 0 if diff == 0 else 1


COMMANDS = {"generate": (GenerateArguments, generate_command)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            f"usage: hf-budgetdraft {{{','.join(COMMANDS)}}} [--help] [options]\n\n{__doc__}", file=sys.stderr
        )
        return 2
    arguments_class, run = COMMANDS[argv[0]]
    parser = HfArgumentParser(arguments_class, prog=f"hf-budgetdraft {argv[0]}")
    try:
        (args,) = parser.parse_args_into_dataclasses(args=argv[1:])
    except ValueError as error:
        parser.error(str(error))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
