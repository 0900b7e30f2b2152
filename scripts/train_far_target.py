"""Train a target that reads far context, within one GPU run of a few minutes, on the offline corpus.

    python scripts/prepare_corpus.py --out data/corpus                                 # CPU, once
    python scripts/train_far_target.py prepare --corpus data/corpus --data data/far      # CPU: ~15 MB of tokens
    python scripts/train_far_target.py train --data data/far --out runs/far --minutes 6  # one GPU run
    python scripts/train_far_target.py train --data data/far --out runs/far2 --init runs/far/model --minutes 6
    python scripts/train_far_target.py train --data D --out O --cpu-smoke                # tiny, on CPU (tested)

Why: the bundled target (`train_target.py`, 2-core CPU) never formed induction heads and retrieves only its
trained passkey format, so a draft's KV budget barely changes what it can predict. A GPU sees tens of times the
tokens those runs did, but a copying head forms after a plateau counted in optimizer steps, shorter on short rows
and on a small alphabet (`benchmarks/results/far_target/`). So the run starts with an induction phase
(`induction_phase.py`): rows of 32 random tokens with a segment written twice, many small steps, the alphabet
widened as their loss falls.
Then the rows (`far_target_data.py`): natural text, passages that reappear 64 tokens to a whole row after they
were seen (scored on the reappearance), facts in invented wordings recalled at the row's end (scored on the
answer) and some of the induction rows; a curriculum of row lengths over the time left (`--lengths`), short rows
first, then long ones, where copying must reach far. The longest rows (16K) outrun the farthest distance the
goals ask for (8K, plus the passage): copying holds to about the trained row length and not beyond (a CPU run at
rows of 2K, `benchmarks/results/far_target/`).

Model: the bundled target's family (`train_target.target_config`: GLM-4 dense layers, partial RoPE with base 1e4 on
half of each head, one MTP layer slot), wider and deeper (`--hidden`, `--layers`; ~17M parameters by default).
AdamW, warm-up then cosine over the time budget (not a step count), bf16 autocast (`--precision`: float32 on a CPU
without bf16 units, `train_precision.py`), every row weighing the same in the loss, seeded. Writes `<out>/model`
(`save_pretrained`, safetensors shards of at most 15 MB: what the device tool brings back) every `--save-minutes`
and at the end, `<out>/log.jsonl` and `<out>/summary.json` (with the steps each induction pool took); `--init`
continues from the main model's weights alone (an optimizer's state does not travel back; an MTP layer of the
weights is not loaded, so it is distilled again afterwards). The held-out measurements (copy by distance, retrieval
in untrained formats, perplexity) run on CPU afterwards (`benchmarks/far_context_skill.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Glm4MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import far_target_data as data  # noqa: E402
import induction_phase  # noqa: E402
import train_precision  # noqa: E402
from train_target import target_config  # noqa: E402

SMOKE = dict(
    hidden=64,
    layers=2,
    heads=2,
    step_tokens=1024,
    lengths="0:64,0.5:128",
    seconds=10.0,
    induction_minutes=0.05,
)


def length_at(fraction: float, schedule: str) -> int:
    """The row length at `fraction` of the time budget: `"0:512,0.3:2048,0.6:8192"` (from-fraction:length)."""
    length = None
    for part in schedule.split(","):
        start, value = part.split(":")
        if fraction >= float(start):
            length = int(value)
    return length


def lr_at(fraction: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` of the time, then cosine from `peak` down to `floor * peak`."""
    if fraction < warmup:
        return peak * fraction / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (fraction - warmup) / (1 - warmup))))
    return peak * (floor + (1 - floor) * cosine)


def main_step(args, fraction: float) -> tuple[int, int, float]:
    """`(row length, rows, learning rate)` of the main schedule's step at `fraction` of its time (what the
    induction phase left of `--minutes`): `--lengths`, `--step-tokens` a step, warm-up then cosine."""
    length = length_at(fraction, args.lengths)
    return length, max(1, args.step_tokens // length), lr_at(fraction, args.lr)


def save(model, tokenizer, out: Path) -> None:
    """`out/model`: the weights in shards the device tool brings back, and the tokenizer (a complete HF folder)."""
    model.save_pretrained(out / "model", safe_serialization=True, max_shard_size="15MB")
    tokenizer.save_pretrained(out / "model")


def train(args) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    args.autocast = train_precision.autocast_dtype(device, args.precision)
    print(f"training in {train_precision.describe(args.autocast)} on {device}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(data.TOKENIZER, local_files_only=True)
    longest = max(int(part.split(":")[1]) for part in args.lengths.split(","))
    if args.init:
        model = Glm4MoeForCausalLM.from_pretrained(args.init, use_safetensors=True)
    else:
        config = target_config(
            tokenizer, 2 * longest, hidden=args.hidden, layers=args.layers, heads=args.heads
        )
        model = Glm4MoeForCausalLM(config)
    model.to(device).train()
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    rows = data.Rows(tokenizer, data.load_tokens(args.data, "train"), args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "log.jsonl").open("a")

    def log(record: dict) -> None:
        record["tokens_per_s"] = round(record["tokens"] / max(record["seconds"], 1e-9))
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        print(record, flush=True)

    start = last_save = time.perf_counter()
    induction = induction_phase.induce(model, optimizer, rows, args, device, log)
    main_from = time.perf_counter() - start
    step, tokens = induction["steps"], induction["steps"] * args.induction_rows * (args.induction_length + 1)
    while (elapsed := time.perf_counter() - start) < args.seconds:
        length, rows_per_step, lr = main_step(
            args, (elapsed - main_from) / max(args.seconds - main_from, 1e-9)
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask, kinds = rows.batch(rows_per_step, length, args.mix_weights)
        loss, per_row = induction_phase.train_step(model, optimizer, ids, mask, device, args.autocast)
        step, tokens = step + 1, tokens + ids.numel()
        if step % args.log_every == 0:
            by_kind = {
                k: float(per_row[[i for i, x in enumerate(kinds) if x == k]].mean()) for k in set(kinds)
            }
            log(
                dict(
                    step=step,
                    seconds=round(elapsed, 1),
                    phase="main",
                    repeat_pool=rows.repeat_pool,
                    length=length,
                    loss=loss,
                    by_kind=by_kind,
                    tokens=tokens,
                )
            )
        if time.perf_counter() - last_save > args.save_minutes * 60:
            save(model, tokenizer, args.out)
            last_save = time.perf_counter()
    save(model, tokenizer, args.out)
    summary = dict(
        steps=step,
        tokens=tokens,
        seconds=round(time.perf_counter() - start, 1),
        induction=induction,
        parameters=parameters,
        device=str(device),
        args={k: str(v) for k, v in vars(args).items()},
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise the corpus, held out by content")
    prep.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    prep.add_argument("--data", type=Path, default=Path("data/far"))
    run = sub.add_parser("train", help="train for a time budget")
    run.add_argument("--data", type=Path, default=Path("data/far"))
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--init", type=Path, help="continue from these weights (a saved <out>/model)")
    run.add_argument("--minutes", type=float, default=6.0, help="the time budget of the training loop")
    run.add_argument("--hidden", type=int, default=400)
    run.add_argument("--layers", type=int, default=8)
    run.add_argument("--heads", type=int, default=10)
    run.add_argument(
        "--step-tokens", type=int, default=65536, help="tokens a step (rows = this / row length)"
    )
    run.add_argument(
        "--lengths", default="0:512,0.2:2048,0.45:8192,0.75:16384", help="from-fraction:row-length"
    )
    run.add_argument("--mix", default="4/4/2/1", help="weights of the row kinds text/copy/fact/repeat")
    induction_phase.add_arguments(run, minutes=2.0)
    run.add_argument("--lr", type=float, default=2e-3)
    train_precision.add_argument(run)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--save-minutes", type=float, default=2.0)
    run.add_argument("--cpu-smoke", action="store_true", help="a tiny model for seconds on CPU")
    args = parser.parse_args(argv)
    if args.command == "train":
        args.seconds = args.minutes * 60
        if args.cpu_smoke:
            for name, value in SMOKE.items():
                setattr(args, name, value)
            args.log_every = 1
        if not 0 < args.seconds <= 3600 or not 64 <= args.step_tokens <= 1 << 22:
            parser.error("--minutes must be in (0, 60] and --step-tokens in [64, 4M]")
        if not 0 <= args.induction_minutes * 60 < args.seconds:
            parser.error(f"--induction-minutes must be in [0, --minutes), got {args.induction_minutes}")
        induction_phase.check_arguments(parser, args)
        try:
            args.mix_weights = data.parse_mix(args.mix)
        except ValueError as error:
            parser.error(f"--mix: {error}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    random.seed(0)
    if args.command == "prepare":
        tokenizer = AutoTokenizer.from_pretrained(data.TOKENIZER, local_files_only=True)
        print(json.dumps(data.prepare(tokenizer, args.corpus, args.data), indent=2))
    else:
        print(json.dumps(train(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
