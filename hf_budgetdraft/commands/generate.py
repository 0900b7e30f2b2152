"""`hf-budgetdraft generate`: speculative generation with a sparse draft cache, checked token for token against
the target's own greedy output and timed against plain-AR baselines (the target as loaded, the package's fast AR,
and on an accelerator transformers' compiled static-cache AR) with `hf_budgetdraft.runs.timed_call.timed_generate`.
Several prompts (`--prompt_files`, `--batch_size`) run as one left-padded batch: batched AR, then the batched
one-liner, per-row greedy diffs."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import torch
from transformers import TextStreamer

from ..cache.sizes import MAX_CACHE_TOKENS
from ..demo.documents import DEMO_TEXT
from ..demo.random_models import random_pair
from ..generation.spec import DraftSpec
from ..loading import DTYPES, LoadFlags, drafter_tokenizer, load_model, load_tokenizer
from ..runs.timed_call import RunResult, ar_setup, configure_drafter, timed_generate
from ..runs.token_diff import divergence_margin, tie_tolerance, token_diff

FULL_CACHE_GAMMA = 5  # --cache full: stock assisted generation drafts this many tokens a round
# a greedy divergence is a near-tie when the target's own top-2 gap is within this many units in the last place of
# the model's dtype at a logit of this size (bf16: 1.25; float32: 2e-5)


@dataclass
class _InputFlags:
    """The models and the prompt(s)."""

    target: str | None = field(
        default=None,
        metadata={
            "help": "The target: a local model folder or a hub id (from the Hugging Face cache; safetensors)."
        },
    )
    drafter: str | None = field(
        default=None, metadata={"help": "The drafter: a local model folder or a hub id."}
    )
    random_models: bool = field(
        default=False,
        metadata={
            "help": "Use a small random Llama pair (no weights needed): checks the machinery, not quality."
        },
    )
    demo_models: bool = field(
        default=False,
        metadata={
            "help": "Use the bundled demo target and BudgetDraft drafter; without --prompt/--prompt_file the "
            "prompt is the start of the bundled held-out play (Shakespeare's King John)."
        },
    )
    prompt: str | None = field(
        default=None, metadata={"help": "Prompt text (needs the target's tokenizer); - reads it from stdin."}
    )
    prompt_file: str | None = field(
        default=None, metadata={"help": "Read the prompt from this text file (- : stdin)."}
    )
    chat: bool = field(
        default=False,
        metadata={
            "help": "Wrap the prompt as a user message in the target's chat template (an instruct model)."
        },
    )
    system: str | None = field(
        default=None, metadata={"help": "With --chat: a system message before the prompt."}
    )
    prompt_files: list[str] | None = field(
        default=None,
        metadata={"help": "Several prompt files: one batch, a row per file (batched speculation)."},
    )
    batch_size: int = field(
        default=1,
        metadata={
            "help": "Rows generated at once; > 1 takes that many passages of the text (or random prompts) of "
            "ragged lengths, left-padded (batched speculation). --prompt_files sets it to the file count."
        },
    )
    context_length: int = field(
        default=4096, metadata={"help": "Prompt tokens (random prompt, or truncate to)."}
    )


@dataclass
class _DraftFlags:
    """The draft cache and how a round drafts (unset: the `DraftSpec` defaults)."""

    cache: str = field(
        default="budgeted",
        metadata={
            "help": "Draft cache: budgeted (the default) | sink_window | full (stock assisted generation)."
        },
    )
    budget: int | None = field(
        default=None, metadata={"help": "budgeted: prefix tokens kept per KV head (512)."}
    )
    policy: str | None = field(
        default=None, metadata={"help": "budgeted: chunk (default) | streaming | snapkv | dynamic."}
    )
    num_sink_tokens: int | None = field(default=None, metadata={"help": "sink_window: sink tokens (64)."})
    window_length: int | None = field(
        default=None, metadata={"help": "Recent tokens the draft reads (sink_window 1024, budgeted 256)."}
    )
    draft_length: str = field(
        default="adaptive",
        metadata={
            "help": "Tokens drafted a round: adaptive (default: chosen online, 0 = AR) | heuristic | an int."
        },
    )
    static: str = field(default="auto", metadata={"help": "Static draft cache: auto | true | false."})
    compile: str = field(
        default="auto",
        metadata={
            "help": "Compile the one-token draft step: auto (when it pays) | true (one untimed warm-up run compiles "
            "it first: tens of seconds on CPU) | false."
        },
    )
    fast_verify: bool = field(
        default=True,
        metadata={
            "help": "Verify on budgetdraft_sdpa when the target runs sdpa, and (float32 on CPU) on few-row linear "
            "layers (same results to float rounding)."
        },
    )
    assistant_confidence_threshold: float | None = field(
        default=None,
        metadata={"help": "End a round's draft at a token the drafter gives less than this probability."},
    )


@dataclass
class _DecodingFlags:
    """Decoding, the target's attention and the run."""

    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy decoding."})
    temperature: float = field(default=1.0, metadata={"help": "With --do_sample: the temperature."})
    top_p: float = field(default=1.0, metadata={"help": "With --do_sample: nucleus sampling's p."})
    top_k: int = field(default=50, metadata={"help": "With --do_sample: top-k (0: off)."})
    num_return_sequences: int = field(
        default=1,
        metadata={
            "help": "With --do_sample: samples of the one prompt, drawn in one batched call (the prompt read once)."
        },
    )
    max_new_tokens: int = field(default=256, metadata={"help": "Tokens to generate."})
    threads: int = field(default=2, metadata={"help": "torch threads (set explicitly; see README)."})
    seed: int = field(default=0, metadata={"help": "Seed for random models, prompts and sampling."})


@dataclass
class GenerateArguments(LoadFlags, _DecodingFlags, _DraftFlags, _InputFlags):
    """Flags of `hf-budgetdraft generate` (inputs, draft, decoding and loading flags, in that order)."""

    def __post_init__(self):
        super().__post_init__()
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("pass --prompt or --prompt_file, not both")
        if self.system is not None and not self.chat:
            raise ValueError("--system is a chat message: add --chat")
        if self.cache not in ("sink_window", "budgeted", "full"):
            raise ValueError(f"--cache must be sink_window, budgeted or full, got {self.cache!r}")
        if not 1 <= self.context_length <= MAX_CACHE_TOKENS:
            raise ValueError(
                f"--context_length must be in [1, {MAX_CACHE_TOKENS}], got {self.context_length}"
            )
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"--max_new_tokens must be in [1, 4096], got {self.max_new_tokens}")
        threshold = self.assistant_confidence_threshold
        if threshold is not None and not 0.0 <= threshold < 1.0:
            raise ValueError(f"--assistant_confidence_threshold must be in [0, 1), got {threshold}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(
                f"--temperature must be > 0, --top_p in (0, 1], --top_k >= 0; got {self.temperature}, "
                f"{self.top_p}, {self.top_k}"
            )
        from ..generation.batched_loop import MAX_BATCH_SIZE

        if self.prompt_files:
            self.batch_size = len(self.prompt_files)
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"--batch_size must be in [1, {MAX_BATCH_SIZE}], got {self.batch_size}")
        if self.num_return_sequences != 1:
            self._check_samples(MAX_BATCH_SIZE)
        if self.batch_size > 1 and self.cache == "full":
            raise ValueError(
                "--cache full is stock assisted generation, which is single-sequence; use a sparse cache"
            )
        if self.random_models + self.demo_models + bool(self.target and self.drafter) != 1:
            raise ValueError("pass one of --demo_models, --random_models, or both --target and --drafter")
        if self.cache != "full":
            self.draft_spec()  # validate the draft options now, with the spec's own messages

    def _check_samples(self, most: int) -> None:
        if not 1 <= self.num_return_sequences <= most:
            raise ValueError(
                f"--num_return_sequences must be in [1, {most}], got {self.num_return_sequences}"
            )
        if not self.do_sample:
            raise ValueError("--num_return_sequences > 1 samples several answers: add --do_sample true")
        if self.batch_size > 1 or self.cache == "full":
            raise ValueError(
                "--num_return_sequences samples one prompt with a sparse draft cache; drop --batch_size / "
                "--prompt_files and --cache full"
            )

    def draft_spec(self) -> DraftSpec:
        """The `DraftSpec` the flags describe (unset flags keep the spec's defaults)."""
        switches = {"auto": "auto", "true": True, "false": False}
        for name in ("static", "compile"):
            if getattr(self, name) not in switches:
                raise ValueError(f"--{name} must be auto, true or false, got {getattr(self, name)!r}")
        length = self.draft_length
        length = int(length) if length.isdigit() else length
        given = {
            "budget": self.budget,
            "policy": self.policy,
            "num_sink_tokens": self.num_sink_tokens,
            "window_length": self.window_length,
        }
        options = {k: v for k, v in given.items() if v is not None}
        return DraftSpec(
            cache=self.cache,
            static=switches[self.static],
            compile=switches[self.compile],
            draft_length=length,
            fast_verify=self.fast_verify,
            **options,
        )

    def sampling(self) -> dict | None:
        if not self.do_sample:
            return None
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def _load_pair(args: GenerateArguments):
    """`(target, drafter, tokenizer, drafter's tokenizer or None)` named by `--target` / `--drafter` (folders or hub
    ids), through the one loader; the drafter's tokenizer where it is not the target's (the calls then translate
    between the two, as transformers' universal assisted generation does)."""
    tokenizer = load_tokenizer(args.target, args)
    target, drafter = load_model(args.target, args), load_model(args.drafter, args)
    own = drafter_tokenizer(args.drafter, args, target, drafter, tokenizer)
    if own is not None and (args.batch_size > 1 or args.num_return_sequences > 1 or args.prompt_files):
        raise ValueError(
            f"--drafter {args.drafter} has another tokenizer than --target {args.target}, and such a drafter drafts "
            "one sequence at a time: drop --batch_size, --num_return_sequences and --prompt_files"
        )
    return target, drafter, tokenizer, own


def _prompt_text(args: GenerateArguments) -> str | None:
    """The prompt's text: `--prompt`, `--prompt_file`, stdin for `-`, the bundled play for the demo models."""
    if args.prompt == "-" or args.prompt_file == "-":
        return sys.stdin.read()
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            return handle.read()
    if args.prompt is None and args.demo_models:
        return DEMO_TEXT.read_text(encoding="utf-8")
    return args.prompt


def _prompt_ids(args: GenerateArguments, tokenizer, vocab_size: int) -> torch.LongTensor:
    text = _prompt_text(args)
    if text is None:
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (1, args.context_length), generator=generator)
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer: use --target/--drafter (or --demo_models)")
    if args.chat:
        return chat_ids(tokenizer, text, args.system)
    return tokenizer(text, return_tensors="pt").input_ids[:, -args.context_length :]


def chat_ids(tokenizer, text: str, system: str | None = None) -> torch.LongTensor:
    """`text` as the user's message (after `system`'s) in the tokenizer's chat template, ready for the assistant's
    answer: `(1, L)`. The whole message is kept: `--context_length` does not cut a chat."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--chat needs a tokenizer with a chat template; {type(tokenizer).__name__} of this target has none. "
            "Drop --chat to continue the prompt as plain text"
        )
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]


def generate_command(args: GenerateArguments) -> int:
    torch.set_num_threads(args.threads)
    target, drafter, tokenizer, draft_tokenizer = _models(args)
    if args.batch_size > 1 or args.num_return_sequences > 1:
        return _generate_batch(args, target, drafter, tokenizer)
    translated = (
        {} if draft_tokenizer is None else {"tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer}
    )
    ids = _prompt_ids(args, tokenizer, target.config.get_text_config().vocab_size)
    spec = args.draft_spec() if args.cache != "full" else None
    # a sparse cache: the spec decides the draft length; --cache full: stock assisted generation's fixed γ
    configure_drafter(drafter, None if spec is not None else FULL_CACHE_GAMMA)
    accelerated = compiles_on_first_call(target.device)
    if spec is not None and (spec.compile is True or accelerated):
        print("warming up: the one-liner compiles on its first call (one untimed run)", flush=True)
        timed_generate(
            target,
            ids,
            args.max_new_tokens if accelerated else min(args.max_new_tokens, 16),  # the timed run's shapes
            spec=spec,
            sampling=args.sampling(),
            assistant_model=drafter,
            **_threshold(args),
            **translated,
        )
    baselines = _ar_runs(args, target, ids, accelerated)
    spec_run = _speculative_run(args, target, drafter, ids, spec, tokenizer, translated)
    return _report_generate(args, target, tokenizer, ids, baselines, spec_run)


def compiles_on_first_call(device: torch.device) -> bool:
    """Whether the one-liner and transformers' static-cache AR compile on their first call on `device` (an
    accelerator: CUDA graphs), so the command warms both up and compares with the compiled AR as well."""
    return device.type != "cpu"


def _models(args: GenerateArguments):
    """`(target, drafter, tokenizer or None, drafter's own tokenizer or None)` the flags name."""
    if args.random_models or args.demo_models:
        target, drafter, tokenizer = _bundled_pair(args)
        dtype = DTYPES.get(args.dtype)  # auto: as built (float32)
        device = "cpu" if args.device == "auto" else args.device
        for model in (target, drafter):
            model.to(device=device, dtype=dtype).set_attn_implementation(args.attn_implementation)
        return target, drafter, tokenizer, None
    return _load_pair(args)


def _bundled_pair(args: GenerateArguments):
    if args.random_models:
        target, drafter = random_pair(args.seed, args.context_length + args.max_new_tokens + 1)
        return target, drafter, None
    from ..demo import load_demo_models

    demo = load_demo_models()
    return demo.target, demo.drafter_for(args.do_sample), demo.tokenizer


AR_BASELINES = {"stock AR": None, "fast AR": "fast", "static AR (transformers' compiled fast path)": "static"}


def _ar_runs(
    args: GenerateArguments, target, ids: torch.LongTensor, accelerated: bool
) -> dict[str, RunResult]:
    """The plain-AR runs of the prompt by name (`AR_BASELINES`), seeded alike; "stock AR" first (the greedy
    reference). On an accelerator also transformers' static-cache AR, compiled by an untimed run first."""
    length, sampling = args.max_new_tokens, args.sampling()
    ids = ids.to(target.device)
    runs = {}
    for name, setup in AR_BASELINES.items():
        if setup == "static" and not accelerated:
            continue
        with ar_setup(target, setup, ids.shape[1] + length) as kwargs:
            if setup == "static":
                timed_generate(target, ids, length, sampling=sampling, seed=args.seed, **kwargs)
            runs[name] = timed_generate(target, ids, length, sampling=sampling, seed=args.seed, **kwargs)
    return runs


def _speculative_run(
    args: GenerateArguments,
    target,
    drafter,
    ids: torch.LongTensor,
    spec: DraftSpec | None,
    tokenizer,
    translated: dict,
) -> RunResult:
    """The speculative run, seeded as the AR runs; its text streams to stdout as it is produced (token ids
    without a tokenizer come in the summary); `translated`: the two tokenizers of a drafter with its own."""
    length, sampling = args.max_new_tokens, args.sampling()
    ids = ids.to(target.device)
    streamer = TextStreamer(tokenizer) if tokenizer is not None else None
    if streamer is not None:
        print("--- generated (the one-liner, streamed) ---", flush=True)
    run = timed_generate(
        target,
        ids,
        length,
        spec=spec,
        sampling=sampling,
        seed=args.seed,
        assistant_model=drafter,
        on_chunk=(lambda chunk, _: streamer.put(torch.tensor(chunk))) if streamer is not None else None,
        **_threshold(args),
        **translated,
    )
    if streamer is not None:
        streamer.end()
        print("---", flush=True)
    return run


def _threshold(args: GenerateArguments) -> dict:
    """`--assistant_confidence_threshold` as the `generate()` argument the draft plan reads."""
    threshold = args.assistant_confidence_threshold
    return {} if threshold is None else {"assistant_confidence_threshold": threshold}


def _report_generate(
    args: GenerateArguments, target, tokenizer, ids: torch.LongTensor, baselines: dict[str, RunResult], spec
) -> int:
    new, stats, ar = spec.new_ids, spec.stats, baselines["stock AR"]
    plan = stats.plan
    print(f"prompt tokens: {ids.shape[1]}  new tokens: {new.numel()}  draft cache: {args.cache}")
    if plan is not None:
        print(
            f"draft plan: {plan.spec} (draft length from {plan.draft_length_source}, confidence threshold "
            f"{plan.confidence_threshold})"
        )
    if tokenizer is None:
        print(f"token ids: {new.tolist()}")
    lossless = True
    if args.do_sample:
        print("sampling: the output keeps the target's distribution (speculative sampling); no greedy diff")
    else:
        lossless = _report_greedy_diff(target, ids, ar.new_ids, new)
    print(
        f"rounds {stats.rounds} ({stats.ar_rounds} plain AR steps), mean accepted length "
        f"{stats.mean_accepted_length:.2f}, acceptance rate {stats.acceptance_rate:.1%}, draft "
        f"{stats.decode_draft_seconds:.2f} s + prefill {stats.draft_prefill_seconds:.2f} s, verify "
        f"{stats.decode_verify_seconds:.2f} s + target prefill {stats.target_prefill_seconds:.2f} s"
    )
    print(
        f"target prefill {ar.first_token_seconds:.2f} s (stock AR), {spec.first_token_seconds:.2f} s (the one-liner, "
        "with the drafter's); the ratios below: end to end, then decoding alone"
    )
    for name, baseline in baselines.items():
        decode = baseline.decode_tokens_per_second, spec.decode_tokens_per_second
        decode_text = f"; decode {decode[1] / decode[0]:.2f}x ({decode[1]:.1f} vs {decode[0]:.1f} tok/s)"
        print(
            f"vs {name}: {spec.seconds:.2f} s vs {baseline.seconds:.2f} s, end to end "
            f"{baseline.seconds / spec.seconds:.2f}x{decode_text if all(decode) else ''}"
        )
    print(f"(one run each, {args.threads} threads; benchmarks/ has measured ratios)")
    return 0 if lossless else 1


def _report_greedy_diff(target, ids: torch.LongTensor, reference: torch.Tensor, output: torch.Tensor) -> bool:
    """Print how the greedy output compares with the target's own; `False` only for a divergence the target's
    logits do not explain as a near-tie (`tie_tolerance`)."""
    diff = token_diff(output, reference)
    if diff.diff_tokens == 0:
        print("greedy diff vs the target's own greedy output: 0 tokens (identical)")
        return True
    margin = divergence_margin(target, ids.to(target.device), reference, output, diff.first_diff)
    tolerance = tie_tolerance(target.dtype)
    tie = abs(margin) <= tolerance
    print(
        f"greedy diff vs the target's own greedy output: {diff.diff_tokens} tokens from position {diff.first_diff}, "
        f"where the target's two tokens are {abs(margin):.3g} apart in logit: "
        + (
            f"a near-tie within {target.dtype}'s rounding ({tolerance:.3g}), not a bug"
            if tie
            else f"beyond {target.dtype}'s rounding ({tolerance:.3g}): DIFFERENT (a bug)"
        )
    )
    return tie


def _batch_ids(args: GenerateArguments, tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, mask)`: a left-padded batch, one row per prompt file, else `batch_size` passages of the text, or
    `num_return_sequences` copies of the one prompt."""
    from ..runs.batch_call import left_pad, ragged_batch

    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    if args.num_return_sequences > 1:  # the copies transformers makes of the prompt for num_return_sequences
        ids = _prompt_ids(args, tokenizer, vocab_size).repeat(args.num_return_sequences, 1)
        return ids, torch.ones_like(ids)
    if args.prompt_files:
        rows = []
        for path in args.prompt_files:
            with open(path, encoding="utf-8") as handle:
                rows.append(
                    tokenizer(handle.read(), return_tensors="pt").input_ids[0, -args.context_length :]
                )
        return left_pad(rows, pad)
    stream = _prompt_ids(
        dataclasses.replace(args, context_length=MAX_CACHE_TOKENS, batch_size=1, prompt_files=None),
        tokenizer,
        vocab_size,
    )[0]
    if stream.numel() < args.context_length:  # random prompts: one long random stream
        generator = torch.Generator().manual_seed(args.seed)
        stream = torch.randint(0, vocab_size, (args.context_length * 2,), generator=generator)
    return ragged_batch(stream, args.batch_size, args.context_length, pad_token_id=pad, seed=args.seed)


def _generate_batch(args: GenerateArguments, target, drafter, tokenizer) -> int:
    """The batched main job: batched AR on the fast target, then the batched one-liner; per-row greedy diffs. On an
    accelerator also transformers' static-cache batched AR, and each of those two runs once untimed first."""
    from ..runs.batch_call import run_batch, run_batch_static_ar

    ids, mask = _batch_ids(args, tokenizer, target.config.get_text_config().vocab_size)
    ids, mask = ids.to(target.device), mask.to(target.device)
    spec = args.draft_spec()
    options = {
        "cache_implementation": spec.cache,
        "cache_config": spec.to_cache_config(),
        "sampling": args.sampling(),
    }
    accelerated = compiles_on_first_call(target.device)
    if accelerated:
        print("warming up: batched static AR and the one-liner, one untimed run each", flush=True)
        run_batch_static_ar(target, ids, mask, args.max_new_tokens, args.sampling())
        run_batch("speculative", target, drafter, ids, mask, args.max_new_tokens, **options)
    torch.manual_seed(args.seed)
    baselines = {
        "batched AR": run_batch(
            "ar", target, drafter, ids, mask, args.max_new_tokens, sampling=args.sampling()
        )
    }
    if accelerated:
        torch.manual_seed(args.seed)
        static = run_batch_static_ar(target, ids, mask, args.max_new_tokens, args.sampling())
        baselines["batched static AR (transformers' compiled fast path)"] = static
    torch.manual_seed(args.seed)
    spec_run = run_batch("speculative", target, drafter, ids, mask, args.max_new_tokens, **options)
    ar = baselines["batched AR"]
    stats = spec_run.stats
    print(
        f"batch: {ids.shape[0]} rows, prompt tokens {mask.sum(-1).tolist()}, new tokens {args.max_new_tokens} each"
    )
    print(f"draft plan: {stats.plan.spec} (draft length from {stats.plan.draft_length_source})")
    diffs = [int((spec_run.new_ids(i) != ar.new_ids(i)).sum()) for i in range(ids.shape[0])]
    for i, row in enumerate(stats.rows):
        text = (
            tokenizer.decode(spec_run.new_ids(i)[:24])
            if tokenizer is not None
            else spec_run.new_ids(i)[:12].tolist()
        )
        print(
            f"row {i}: {row.mean_accepted_length:.2f} tokens a round, latency {row.latency_seconds:.2f} s, "
            f"greedy diff {'-' if args.do_sample else diffs[i]}: {text!r}"
        )
    for name, baseline in baselines.items():
        decode = spec_run.decode_tokens_per_second, baseline.decode_tokens_per_second
        print(
            f"throughput (all rows, decode): {decode[0]:.1f} vs {name} {decode[1]:.1f} tok/s = "
            f"{decode[0] / decode[1]:.2f}x; end to end {baseline.seconds / spec_run.seconds:.2f}x "
            f"({spec_run.seconds:.2f} s vs {baseline.seconds:.2f} s)"
        )
    if args.do_sample:
        print("sampling: every row keeps the target's distribution (speculative sampling); no greedy diff")
        return 0
    verdict = "identical" if not any(diffs) else "DIFFERENT"
    print(f"greedy diff vs batched AR: {sum(diffs)} tokens over {len(diffs)} rows ({verdict})")
    print(f"(one run each, {args.threads} threads; benchmarks/ has measured ratios)")
    return 0 if not any(diffs) else 1
