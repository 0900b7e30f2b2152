"""Distil the bundled base drafter from the trained demo target, with a full cache (the conventional drafter).

A small Llama (~1.5M parameters, same tokenizer) learns the target's next-token distributions (KL to the
target's softmax, teacher-forced over the target's own training mix: text, passkeys, repeated spans) at
`--length` tokens. It reads a full cache here; making it robust to sparse caches is the BudgetDraft trainer's job
(`hf-budgetdraft train`). Resumable like `train_target.py`.

    python scripts/train_drafter.py --target runs/target/checkpoint --out runs/drafter --threads 1 [--resume]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from train_target import Sampler, lr_at
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM


def drafter_config(tokenizer, max_position: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--tokenizer", type=Path, default=Path("hf_budgetdraft/demo/tokenizer"))
    parser.add_argument("--out", type=Path, default=Path("runs/drafter"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--max-position", type=int, default=20480)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(args.target, use_safetensors=True).eval()
    checkpoint = args.out / "checkpoint"
    if args.resume and (checkpoint / "state.pt").exists():
        drafter = LlamaForCausalLM.from_pretrained(checkpoint, use_safetensors=True)
        state = torch.load(checkpoint / "state.pt", weights_only=False)
    else:
        drafter, state = LlamaForCausalLM(drafter_config(tokenizer, args.max_position)), None
    drafter.train()
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters", flush=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sampler = Sampler(tokenizer, args.corpus, args.max_position, args.seed)
    step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        sampler.rng.setstate(state["sampler_rng"])

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    while step < args.steps:
        rows = [sampler.sample(args.length) for _ in range(args.batch)]
        ids = torch.tensor([r[0] for r in rows])[:, :-1]
        positions = torch.tensor([r[1] for r in rows])[:, :-1]
        mask = torch.ones_like(ids)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logits = teacher(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = drafter(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        loss = F.kl_div(
            F.log_softmax(logits.float(), -1).flatten(0, 1),
            F.log_softmax(teacher_logits.float(), -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        agreement = (logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean().item()
        record = {"step": step, "kl": round(loss.item(), 4), "top1_agreement": round(agreement, 4)}
        if step % 20 == 0:
            record["seconds"] = round(time.time() - started)
            print(json.dumps(record), flush=True)
        with open(args.out / "log.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        if step % args.save_every == 0 or step == args.steps:
            drafter.save_pretrained(checkpoint, safe_serialization=True)
            state = {"optimizer": optimizer.state_dict(), "step": step, "sampler_rng": sampler.rng.getstate()}
            torch.save(state, checkpoint / "state.pt")


if __name__ == "__main__":
    main()
