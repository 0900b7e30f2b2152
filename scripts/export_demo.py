"""Bundle the trained demo models into `hf_budgetdraft/demo/` (bfloat16 safetensors), measure them as bundled and
write each folder's model card.

    python scripts/export_demo.py --target runs/drafts/target_with_mtp --base-drafter runs/drafts/drafter \
        --adapter runs/budgetdraft/lora_adapter --sampling-adapter runs/budgetdraft_sampling/lora_adapter \
        --commands scripts/demo_commands.json --threads 2

Measured on the bundled (bf16-stored, fp32-loaded) weights: passkey retrieval at several lengths with the needle at
random depth (`hf_budgetdraft.demo.tasks.passkey_sample`, classic filler), eval-split perplexity with 2K, 4K, 8K and
16K-token windows over the same tokens, and each drafter's top-1 agreement with the target on eval text and on the
target's own greedy continuation of it (the text a greedy call drafts), and its expected sampling acceptance
`E[sum_x min(p(x), q(x))]` at temperatures 0.8 and 1.0 on the target's own sampled continuation (the text a
sampling call drafts); the same two on out-of-corpus prose (the licence texts, where the machine ships them).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from train_target import passkey_accuracy

from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import licence_text
from hf_budgetdraft.demo.models import DEMO_DIR

CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")
REPO = Path(__file__).resolve().parents[1]


def export_folder(source: Path, name: str) -> Path:
    """Copy `source`'s configs and its safetensors weights, cast to bfloat16, into `DEMO_DIR/name`."""
    dest = DEMO_DIR / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    weights = sorted(source.glob("*.safetensors"))
    if len(weights) != 1:
        raise ValueError(f"expected one .safetensors file in {source}, found {[w.name for w in weights]}")
    for config in CONFIG_FILES:
        if (source / config).exists():
            shutil.copy(source / config, dest / config)
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(weights[0]).items()
    }
    save_file(state, dest / weights[0].name, metadata={"format": "pt"})
    return dest


def eval_ids(tokenizer, corpus: Path, tokens: int) -> torch.LongTensor:
    text = "".join(json.loads(line)["text"] for line in (corpus / "eval.jsonl").read_text().splitlines())
    ids = tokenizer(text[: tokens * 8]).input_ids
    if len(ids) < tokens:
        raise ValueError(f"the eval split has {len(ids)} tokens, fewer than {tokens}")
    return torch.tensor(ids[:tokens])


@torch.inference_mode()
def perplexity(model, ids: torch.LongTensor, context: int) -> float:
    """Mean next-token perplexity over `ids`, cut into windows of `context` tokens."""
    nll, count = 0.0, 0
    for start in range(0, ids.numel() - 1, context):
        window = ids[start : start + context + 1][None]
        logits = model(window[:, :-1]).logits
        nll += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return math.exp(nll / count)


@torch.inference_mode()
def top1(model, ids: torch.LongTensor, start: int = 0) -> torch.LongTensor:
    """`model`'s next-token argmax at positions >= `start` of `ids` [T]: [T - start]."""
    return model(ids[None]).logits[0, start:].argmax(-1)


def top1_agreement(drafter, target_top1: torch.LongTensor, ids: torch.LongTensor, start: int = 0) -> float:
    """Share of positions >= `start` of `ids` [T] where the drafter's argmax equals `target_top1` [T - start]."""
    return (top1(drafter, ids, start) == target_top1).float().mean().item()


@torch.inference_mode()
def greedy_continuation(target, prefix: torch.LongTensor, new_tokens: int) -> torch.LongTensor:
    """`prefix` [T] followed by the target's own greedy continuation: [T + new_tokens], the text a drafter drafts."""
    out = target.generate(prefix[None], do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0]


@torch.inference_mode()
def sampling_acceptance(
    target, drafter, prefix: torch.LongTensor, new_tokens: int, temperature: float
) -> float:
    """Mean `sum_x min(p(x), q(x))` over the target's own sampled continuation of `prefix` [T] (`new_tokens`
    positions, seeded): what speculative sampling accepts per drafted token, both models at `temperature`."""
    torch.manual_seed(0)
    text = target.generate(
        prefix[None],
        do_sample=True,
        temperature=temperature,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )[0, :-1]
    start = prefix.numel() - 1
    p = (target(text[None]).logits[0, start:] / temperature).softmax(-1)
    q = (drafter(text[None]).logits[0, start:] / temperature).softmax(-1)
    return torch.minimum(p, q).sum(-1).mean().item()


def card(title: str, body: str, metrics: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in metrics.items())
    return f"# {title}\n\n{body.strip()}\n\n## Measured (bundled bf16 weights, loaded in fp32, CPU)\n\n| metric | value |\n|---|---|\n{rows}\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, required=True, help="target folder with its MTP layer")
    parser.add_argument("--base-drafter", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True, help="the BudgetDraft LoRA adapter folder")
    parser.add_argument(
        "--sampling-adapter", type=Path, required=True, help="the sampling drafter's LoRA adapter folder"
    )
    parser.add_argument(
        "--commands", type=Path, required=True, help="JSON: per model, its card title, prose file, commands"
    )
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--passkey-lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--passkey-samples", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)

    export_folder(args.target, "target")
    export_folder(args.base_drafter, "base_drafter")
    export_folder(args.adapter, "drafter")
    export_folder(args.sampling_adapter, "sampling_drafter")
    demo = load_demo_models()
    started = time.time()
    drafters = ("base_drafter", "drafter", "sampling_drafter")
    metrics = {"target": {}, **{name: {} for name in drafters}}
    for length in (int(x) for x in args.passkey_lengths.split(",")):
        accuracy = passkey_accuracy(demo.target, demo.tokenizer, length, args.passkey_samples, seed=10_000)
        metrics["target"][f"passkey @{length} ({args.passkey_samples} keys, random depth)"] = (
            f"{accuracy:.0%}"
        )
        print(f"passkey @{length}: {accuracy:.0%}", flush=True)
    ids = eval_ids(demo.tokenizer, args.corpus, 16384)
    for context in (2048, 4096, 8192, 16384):
        ppl = perplexity(demo.target, ids, context)
        metrics["target"][f"eval perplexity, {context}-token windows (same 16,384 tokens)"] = f"{ppl:.2f}"
        print(f"perplexity @{context}: {ppl:.2f}", flush=True)
    on_policy = greedy_continuation(demo.target, ids[:2048], 256)[:-1]
    target_top1, target_on_policy_top1 = top1(demo.target, ids[:2048]), top1(demo.target, on_policy, 2047)
    # out-of-corpus prose (held out from every bundled model), where this machine has it
    prose = licence_text()
    prose_ids = demo.tokenizer(prose, return_tensors="pt").input_ids[0, :2048] if prose else None
    if prose_ids is not None:
        prose_on_policy = greedy_continuation(demo.target, prose_ids, 256)[:-1]
        prose_top1 = top1(demo.target, prose_on_policy, 2047)
    for name in drafters:
        agreement = top1_agreement(getattr(demo, name), target_top1, ids[:2048])
        metrics[name]["top-1 agreement with the target, 2,048 eval tokens, full cache"] = f"{agreement:.1%}"
        agreement = top1_agreement(getattr(demo, name), target_on_policy_top1, on_policy, 2047)
        metrics[name][
            "top-1 agreement on the target's own greedy continuation (256 tokens after those 2,048)"
        ] = f"{agreement:.1%}"
        for temperature in (0.8, 1.0):
            accept = sampling_acceptance(demo.target, getattr(demo, name), ids[:2048], 256, temperature)
            metrics[name][
                f"expected sampling acceptance at T {temperature} on the target's own sampled continuation (256 "
                "tokens after those 2,048)"
            ] = f"{accept:.1%}"
        if prose_ids is not None:
            agreement = top1_agreement(getattr(demo, name), prose_top1, prose_on_policy, 2047)
            metrics[name][
                "out-of-corpus prose (the licence texts): top-1 agreement on the target's own greedy continuation "
                "(256 tokens after their first 2,048)"
            ] = f"{agreement:.1%}"
            accept = sampling_acceptance(demo.target, getattr(demo, name), prose_ids, 256, 0.8)
            metrics[name][
                "out-of-corpus prose (the licence texts): expected sampling acceptance at T 0.8 on the target's own "
                "sampled continuation"
            ] = f"{accept:.1%}"
    parameters = {
        name: sum(p.numel() for p in getattr(demo, name).parameters()) for name in ("target", *drafters)
    }
    commands = json.loads(args.commands.read_text())
    for name, info in commands.items():
        metrics[name]["parameters"] = f"{parameters[name] / 1e6:.2f}M"
        metrics[name]["training time (2-core CPU)"] = info["training_time"]
        # the card's prose lives in docs/model_cards/, the commands and training time in the JSON
        description = (REPO / info["card"]).read_text(encoding="utf-8").strip()
        body = description + "\n\n## Reproduce\n\n```bash\n" + "\n".join(info["commands"]) + "\n```\n"
        (DEMO_DIR / name / "README.md").write_text(card(info["title"], body, metrics[name]))
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    print(f"bundle: {total / 1e6:.1f} MB; measured in {time.time() - started:.0f} s")
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
