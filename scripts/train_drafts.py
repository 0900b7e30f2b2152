"""Distil the demo target's two conventional draft models at once, from one frozen-target forward per batch:

- the base drafter: a small Llama (~1.2M parameters, 2 layers, tied embeddings, same tokenizer) reading a full cache, trained on KL to the
  target's next-token distribution at every position;
- the target's own MTP head (one GLM-4 MTP layer: `enorm`/`hnorm`/`eh_proj` + a decoder block, sharing the
  target's embeddings and LM head): from the target's last hidden state at t and the embedding of token t+1 it
  predicts token t+2, trained on KL to the target's distribution at t+1 — so its draft is the target's greedy
  choice as often as possible, which is what acceptance rewards. The MTP head reads the same full-attention cache
  the native MTP path uses; windowed MTP (arXiv 2607.21535) restricts it at inference only.

Both read the target's training mix (text, passkeys, repeated spans) with PoSE position skips, so both see long
relative distances while sequences stay short. Making the drafter robust to sparse caches is the BudgetDraft
trainer's job (`hf-budgetdraft train`). Resumable: `--resume`. Runs on CUDA when there is one (bf16 autocast; on
CPU, bf16 only where the CPU runs it faster than float32: `--precision`).

For a target that copies (`train_far_target.py`), `--induction-minutes M` first trains the drafter alone on the
induction phase's `repeat` rows (`induction_phase.py`, rows from `--far-data`): distillation alone leaves a small
drafter on the plateau before copying, so it drafts none of what the target copies, at any KV budget.

    python scripts/train_drafts.py --target runs/target/checkpoint --out runs/drafts --threads 2 [--resume]
    python scripts/train_drafts.py --target runs/far/model --out runs/far_drafts --induction-minutes 6 \
        --length 1024 --batch 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import far_target_data
import induction_phase
import torch
import torch.nn.functional as F
import train_precision
from train_target import MTP_MOE, Sampler, lr_at
from transformers import AutoTokenizer, Glm4MoeForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_budgetdraft.generation.mtp_heads import expose_mtp_layers, new_mtp_head, save_pretrained_with_mtp

TRAINING_MIX = [4, 2, 1, 2]  # text / passkey / copy / repeat (Sampler.KINDS)


def drafter_config(tokenizer, max_position: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        # 2 wide layers rather than 4 narrow ones (same size): on CPU a drafter step at this size is per-layer
        # overhead more than arithmetic, and the draft runs gamma times per round
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,  # 1.18M parameters: the whole demo bundle stays under 25 MB
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def mtp_logits(mtp, input_ids, hidden_states, position_ids):
    """MTP depth-0 logits for a whole teacher-forced sequence.

    input_ids / position_ids: (batch, T) tokens 1..T; hidden_states: (batch, T, hidden) the target's last hidden
    states at tokens 0..T-1. Returns (batch, T, vocab): the prediction of tokens 2..T+1. Causal attention comes from
    the attention kernel (no mask), so PoSE position jumps are not read as packed-sequence boundaries.
    """
    embeds = mtp.embed_tokens(input_ids)
    position_embeddings = mtp.rotary_emb(embeds, position_ids=position_ids)
    out = mtp.layers[0](
        embeds,
        hidden_states,
        position_embeddings=position_embeddings,
        attention_mask=None,
        position_ids=position_ids,
        cache=None,
    )
    if mtp.use_shared_post_norm:
        out = mtp.shared_post_norm(out)
    return mtp._project_to_logits(out)


def kl(student_logits, teacher_logits):
    return F.kl_div(
        F.log_softmax(student_logits.float(), -1).flatten(0, 1),
        F.log_softmax(teacher_logits.float(), -1).flatten(0, 1),
        log_target=True,
        reduction="batchmean",
    )


def agreement(student_logits, teacher_logits) -> float:
    return (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean().item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--tokenizer", type=Path, default=Path("hf_budgetdraft/demo/tokenizer"))
    parser.add_argument("--out", type=Path, default=Path("runs/drafts"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="time budget of the distillation after the induction phase (0: none): the schedule runs at the pace "
        "of whichever of --steps and the time ends first",
    )
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--max-position", type=int, default=20480)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--far-data",
        type=Path,
        default=Path("data/far"),
        help="token streams of `train_far_target.py prepare`: the induction phase's rows",
    )
    parser.add_argument(
        "--far-mix",
        help="distil on the far target's rows from --far-data instead (weights text/copy/fact/repeat, e.g. 4/4/2/1)",
    )
    induction_phase.add_arguments(parser, minutes=0.0)
    parser.add_argument("--log-every", type=int, default=50, help="steps between induction-phase log lines")
    train_precision.add_argument(parser)
    args = parser.parse_args()
    induction_phase.check_arguments(parser, args)
    if args.minutes < 0:
        parser.error(f"--minutes must be >= 0 (0: no time budget), got {args.minutes}")
    if args.far_mix:
        try:
            args.far_mix = far_target_data.parse_mix(args.far_mix)
        except ValueError as error:
            parser.error(f"--far-mix: {error}")
    return args


def distill_step(
    target, drafter, mtp, ids, positions, optimizer, parameters, autocast: torch.dtype | None
) -> tuple[float, float, float, float]:
    """One optimizer step of the drafter and the MTP layer towards the target's distribution at every position of
    `ids` `(B, L)`, under `autocast` (`train_precision`: a dtype, or `None` for float32); `(drafter KL, MTP KL,
    drafter top-1 agreement, MTP top-1 agreement)`."""
    mask = torch.ones_like(ids)
    with torch.no_grad(), train_precision.autocast(ids.device, autocast):
        out = target(input_ids=ids, position_ids=positions, attention_mask=mask, output_hidden_states=True)
    teacher, hidden = out.logits, out.hidden_states[-1]
    with train_precision.autocast(ids.device, autocast):
        draft = drafter(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        mtp_draft = mtp_logits(mtp, ids[:, 1:], hidden[:, :-1], positions[:, 1:])
    drafter_loss, mtp_loss = kl(draft, teacher), kl(mtp_draft, teacher[:, 1:])
    (drafter_loss + mtp_loss).backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (
        drafter_loss.item(),
        mtp_loss.item(),
        agreement(draft, teacher),
        agreement(mtp_draft, teacher[:, 1:]),
    )


class FarRows:
    """The far target's rows (`far_target_data.Rows`: text, passages seen again, facts recalled, repeats) drawn in
    `Sampler.sample`'s shape, positions from 0 (no PoSE skip: these rows teach distance by their length)."""

    def __init__(self, rows: far_target_data.Rows, weights: list[float]):
        self.rows, self.rng, self.weights = rows, rows.rng, weights

    def sample(self, length: int, _mix) -> tuple[str, list[int], list[int], list[int]]:
        kind = self.rng.choices(far_target_data.KINDS, weights=self.weights)[0]
        ids, mask = self.rows.sample(length, kind)
        return kind, ids, list(range(len(ids))), mask


def form_copying_head(drafter, rows: far_target_data.Rows, args, device: torch.device) -> dict:
    """The induction phase (`induction_phase.py`) for the drafter alone, before distillation: a drafter distilled
    from a target that copies does not itself learn to copy within the distillation's steps (the plateau), so it
    is first trained on `repeat` rows (cross-entropy on the copy, which is what such a target predicts there).
    Logged to `<out>/induction.jsonl`; returns the phase's record, also written to `<out>/induction.json`."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    with open(args.out / "induction.jsonl", "a") as log:

        def write(record: dict) -> None:
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")

        record = induction_phase.induce(drafter, optimizer, rows, args, device, write)
    (args.out / "induction.json").write_text(json.dumps(record, indent=2))
    print(f"induction phase: {json.dumps(record)}", flush=True)
    return record


def scheduled_step(step: int, seconds: float, args) -> int:
    """Where the learning-rate schedule stands: `step` of `--steps`, or the share of `--minutes` spent if that is
    further on (so a run the time ends still finishes its cosine)."""
    if not args.minutes:
        return step
    return max(step, int(args.steps * seconds / (args.minutes * 60)))


def save_checkpoint(checkpoint: Path, drafter, mtp, optimizer, step: int, sampler) -> None:
    """What `--resume` reads back, written whole before it replaces the previous one."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    state = {
        "drafter": drafter.state_dict(),
        "mtp_layers": mtp.layers.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "sampler_rng": sampler.rng.getstate(),
    }
    torch.save(state, checkpoint / "state.tmp")
    (checkpoint / "state.tmp").rename(checkpoint / "state.pt")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    target = (
        Glm4MoeForCausalLM.from_pretrained(args.target, use_safetensors=True).eval().requires_grad_(False)
    )
    target.config.update(MTP_MOE)  # size of the MTP layer (checkpoints from before MTP_MOE lack it)
    checkpoint = args.out / "checkpoint"
    drafter = LlamaForCausalLM(drafter_config(tokenizer, args.max_position))
    mtp = new_mtp_head(target)
    state = None
    if args.resume and (checkpoint / "state.pt").exists():
        state = torch.load(checkpoint / "state.pt", weights_only=False, map_location="cpu")
        drafter.load_state_dict(state["drafter"])
        mtp.layers.load_state_dict(state["mtp_layers"])
    drafter.train()
    mtp.layers.train()
    print(
        f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, MTP layer: "
        f"{sum(p.numel() for p in mtp.layers.parameters()) / 1e6:.2f}M",
        flush=True,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.autocast = train_precision.autocast_dtype(device, args.precision)
    print(f"training in {train_precision.describe(args.autocast)} on {device}", flush=True)
    for model in (target, drafter, mtp):
        model.to(device)
    parameters = list(drafter.parameters()) + list(mtp.layers.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    inducing = args.induction_minutes > 0 and state is None
    far_rows = None
    if inducing or args.far_mix:  # one token stream for the induction rows and the distillation rows
        tokens = far_target_data.load_tokens(args.far_data, "train")
        far_rows = far_target_data.Rows(tokenizer, tokens, args.seed)
    sampler = (
        FarRows(far_rows, args.far_mix)
        if args.far_mix
        else Sampler(tokenizer, args.corpus, args.max_position, args.seed)
    )
    step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        sampler.rng.setstate(state["sampler_rng"])
        print(f"resumed at step {step}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    if inducing:
        form_copying_head(drafter, far_rows, args, device)
    started, history = time.time(), []
    while step < args.steps and not (args.minutes and time.time() - started >= args.minutes * 60):
        # every position is distilled (KL to the target's distribution), so the samples' loss masks are unused
        _, rows, row_positions, _ = zip(
            *(sampler.sample(args.length, TRAINING_MIX) for _ in range(args.batch)), strict=True
        )
        ids, positions = torch.tensor(rows)[:, :-1].to(device), torch.tensor(row_positions)[:, :-1].to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(scheduled_step(step, time.time() - started, args), args)
        history.append(
            distill_step(target, drafter, mtp, ids, positions, optimizer, parameters, args.autocast)
        )
        step += 1
        if step % 20 == 0:
            means = [round(sum(column) / len(column), 4) for column in zip(*history, strict=True)]
            record = dict(zip(["drafter_kl", "mtp_kl", "drafter_top1", "mtp_top1"], means, strict=True))
            record.update(step=step, seconds=round(time.time() - started))
            history = []
            print(json.dumps(record), flush=True)
            with open(args.out / "log.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(checkpoint, drafter, mtp, optimizer, step, sampler)
    if step % args.save_every and step < args.steps:  # stopped by --minutes
        save_checkpoint(checkpoint, drafter, mtp, optimizer, step, sampler)

    for model in (target, drafter, mtp):
        model.cpu()
    drafter.eval().save_pretrained(args.out / "drafter", safe_serialization=True)
    tokenizer.save_pretrained(args.out / "drafter")
    save_pretrained_with_mtp(expose_mtp_layers(target), mtp.eval(), args.out / "target_with_mtp")
    tokenizer.save_pretrained(args.out / "target_with_mtp")
    print(f"saved {args.out / 'drafter'} and {args.out / 'target_with_mtp'}", flush=True)


if __name__ == "__main__":
    main()
