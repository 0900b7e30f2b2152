"""The far-context evidence pair in one device run: a target that reads far context, its base drafter, and the
drafter's two fine-tunes through `hf-budgetdraft train` (BudgetDraft's dual loss, and the λ = 0 ablation: the same
data, steps and seed, only the sparse-loss weight differs), packed into files the device tool brings back.

Stages, each a fresh process with its share of the run's time (a failure or a timeout stops the stages that need its
output; `summary.json` says what ran, for how long, and how it ended, rewritten after every stage):

1. `target`: `train_far_target.py train` (induction phase, then rows up to 16K tokens) for `--target-minutes`;
   meanwhile `far_documents.py` writes the fine-tunes' rows on the CPU (prefixes ending where a far dependency
   starts, drawn from the held-out training stream);
2. `drafter`: `train_drafts.py` on the target: its induction phase, then distillation on the far rows, as long as
   the target's, for `--drafter-minutes`;
3. `finetune`: the target's own continuations and its teacher targets computed once and cached, then the dual-loss
   fine-tune (`--sparse-loss-weight`, budgets drawn with the paper's weights) and the λ = 0 one, `--finetune-steps`
   each.

What comes back (`--out`): `summary.json`, and `far_pair.tar.NNN`, parts of at most 15 MiB of one tar holding the
target in bfloat16 (the weights the evaluation reads), the three drafters (`base`, `budgetdraft`, `lambda0`) and
every log. Here:

    python scripts/far_pair.py run --data data/far --out $OUT/far --work /tmp/far --commit C    # on the GPU
    python scripts/far_pair.py unpack --parts <files_at>/far --into runs/far_pair                # back here
    python scripts/far_pair.py run --cpu-smoke --data data/far --out /tmp/o --work /tmp/w         # seconds, tested
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
PART_BYTES = 15 * 1024 * 1024  # the device tool brings back files of at most 16 MiB, 8 in all
PACK_SECONDS = 60  # kept for packing at the end of the run
STAGES = ("target", "drafter", "finetune")
PACKED_DRAFTERS = {"base": "drafts/drafter", "budgetdraft": "finetune_dual", "lambda0": "finetune_lambda0"}
RUN_LOGS = ("target/log.jsonl", "target/summary.json", "drafts/log.jsonl", "drafts/induction.jsonl")
SMOKE = {  # tiny sizes for seconds on CPU (the stages' own smokes)
    "target_minutes": 0.3,
    "drafter_induction_minutes": 0.02,
    "drafter_minutes": 0.05,
    "drafter_length": 64,
    "drafter_batch": 2,
    "prefix_length": 256,
    "continuation_length": 16,
    "documents": 8,
    "finetune_steps": 2,
    "finetune_batch": 2,
    "budgets": [32, 64],
    "budget_weights": [1.0, 1.0],
    "window_length": 16,
}


class Run:
    """The run's clock, work folder and summary (written to `--out/summary.json` after every stage)."""

    def __init__(self, args):
        self.args, self.start = args, time.monotonic()
        self.work, self.out = args.work, args.out
        self.summary = {
            "commit": args.commit,
            "args": {k: str(v) for k, v in vars(args).items()},
            "stages": {},
        }
        for folder in (self.work, self.out):
            folder.mkdir(parents=True, exist_ok=True)

    def seconds_left(self) -> float:
        return self.args.minutes * 60 - PACK_SECONDS - (time.monotonic() - self.start)

    def stage(self, name: str, command: list[str], seconds: float) -> bool:
        """Run `command` for at most `seconds` (and the run's time left), logged to `<work>/<name>.log`."""
        limit = min(seconds, self.seconds_left())
        record = {"command": " ".join(command), "limit_seconds": round(limit)}
        began = time.monotonic()
        if limit <= 0:
            record["status"] = "skipped: the run's time was spent"
        else:
            with open(self.work / f"{name}.log", "w") as log:
                try:
                    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
                    record["status"] = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
                except subprocess.TimeoutExpired:
                    record["status"] = f"timed out after {limit:.0f} s"
        record["seconds"] = round(time.monotonic() - began, 1)
        return self.finish(name, record)

    def finish(self, name: str, record: dict) -> bool:
        """Record how stage `name` ended (`record["status"]`, "ok" or why not) in the summary; whether it is ok."""
        self.summary["stages"][name] = record
        self.write_summary()
        took = f" in {record['seconds']} s" if "seconds" in record else ""
        print(f"{name}: {record['status']}{took}", flush=True)
        return record["status"] == "ok"

    def write_summary(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.start, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2))


def flags(values: dict) -> list[str]:
    """`{"--name": value}` as command-line words; a list value gives several words after its flag."""
    words = []
    for name, value in values.items():
        words += [name, *map(str, value)] if isinstance(value, list) else [name, str(value)]
    return words


def script(name: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / name)]


def target_command(args, work: Path) -> list[str]:
    values = {
        "--data": args.data,
        "--out": work / "target",
        "--minutes": args.target_minutes,
        "--seed": args.seed,
    }
    return [*script("train_far_target.py"), "train", *flags(values)] + (
        ["--cpu-smoke"] if args.cpu_smoke else []
    )


def documents_command(args, work: Path) -> list[str]:
    values = {"--data": args.data, "--out": work / "documents.jsonl", "--documents": args.documents}
    values |= {"--prefix-length": args.prefix_length, "--continuation-length": args.continuation_length}
    return [*script("far_documents.py"), *flags(values | {"--mix": "1/2/1", "--seed": args.seed})]


def drafter_command(args, work: Path) -> list[str]:
    values = {"--target": work / "target" / "model", "--out": work / "drafts", "--far-data": args.data}
    values |= {"--far-mix": "4/4/2/1", "--induction-minutes": args.drafter_induction_minutes}
    values |= {
        "--minutes": args.drafter_minutes,
        "--steps": args.drafter_steps,
        "--length": args.drafter_length,
    }
    values |= {"--batch": args.drafter_batch, "--seed": args.seed + 1}
    values["--max-position"] = max(args.drafter_length, args.prefix_length + args.continuation_length)
    if args.cpu_smoke:
        values |= {"--induction-rows": 4, "--warmup": 1, "--threads": 2}
    return [*script("train_drafts.py"), *flags(values)]


def finetune_command(args, work: Path, name: str, sparse_loss_weight: float) -> list[str]:
    """`hf-budgetdraft train` of the base drafter against the target on the far documents."""
    values = {
        "--drafter": work / "drafts" / "drafter",
        "--teacher_model_name_or_path": work / "target" / "model",
    }
    values |= {"--data_files": work / "documents.jsonl", "--pack_across_documents": False}
    values |= {"--prefix_length": args.prefix_length, "--continuation_length": args.continuation_length}
    values |= {"--continuations": "target", "--continuation_batch_size": args.continuation_batch_size}
    values |= {"--teacher_cache_dir": work / "teacher_cache", "--budgets": args.budgets}
    values |= {"--budget_weights": args.budget_weights, "--window_length": args.window_length}
    values |= {"--policy": args.policy}
    values |= {"--sparse_loss_weight": sparse_loss_weight, "--learning_rate": args.finetune_lr}
    values |= {"--warmup_steps": min(30, args.finetune_steps // 10), "--max_steps": args.finetune_steps}
    values |= {"--per_device_train_batch_size": args.finetune_batch, "--report_to": "none"}
    values |= {"--logging_steps": max(1, args.finetune_steps // 40), "--save_strategy": "no"}
    values |= {"--seed": args.seed, "--output_dir": work / name}
    if args.cpu_smoke:
        values |= {"--teacher_dtype": "float32", "--threads": 2}
    else:
        values |= {"--teacher_dtype": "bfloat16", "--bf16": True}
    return [sys.executable, "-m", "hf_budgetdraft.cli", "train", "--precompute_teacher", *flags(values)]


def run(args) -> dict:
    """The stages in order, then the pack; returns the summary."""
    state, work = Run(args), args.work
    with open(work / "documents.log", "w") as documents_log:
        documents = None
        if "finetune" in args.stages:  # CPU work, beside the target's training
            command = documents_command(args, work)
            documents = subprocess.Popen(command, stdout=documents_log, stderr=subprocess.STDOUT)
        ready = True
        if "target" in args.stages:
            ready = state.stage("target", target_command(args, work), args.target_minutes * 60 + 120)
        if "drafter" in args.stages and ready:
            seconds = (args.drafter_induction_minutes + args.drafter_minutes) * 60 + 120
            ready = state.stage("drafter", drafter_command(args, work), seconds)
        if documents is not None:
            ready = _documents_written(state, documents) and ready
    if "finetune" in args.stages and ready:
        for name, weight in (("finetune_dual", args.sparse_loss_weight), ("finetune_lambda0", 0.0)):
            ready = ready and state.stage(
                name, finetune_command(args, work, name, weight), state.seconds_left()
            )
    state.summary["parts"] = pack(args, work)
    state.write_summary()
    return state.summary


def _documents_written(state: Run, documents: subprocess.Popen) -> bool:
    """Wait for the documents' writer within the run's time; recorded as the `documents` stage."""
    try:
        code = documents.wait(timeout=max(1.0, state.seconds_left()))
        status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        documents.kill()
        status = "timed out: the run's time was spent"
    return state.finish("documents", {"status": status})


def _bfloat16_target(work: Path) -> Path | None:
    """The target's weights in bfloat16 (`<work>/target_bf16`), the size the device tool brings back."""
    source = work / "target" / "model"
    if not (source / "config.json").exists():
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    destination = work / "target_bf16"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, use_safetensors=True)
    model.save_pretrained(destination, safe_serialization=True, max_shard_size="15MB")
    AutoTokenizer.from_pretrained(source).save_pretrained(destination)
    return destination


def pack(args, work: Path) -> list[str]:
    """One tar of the run's models and logs, split into `far_pair.tar.NNN` parts of at most `PART_BYTES` in
    `--out`; the names of the parts."""
    members = {"target": _bfloat16_target(work)}
    for name, folder in PACKED_DRAFTERS.items():
        if (work / folder / "config.json").exists():
            members[name] = work / folder
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, folder in members.items():
            if folder is not None:
                for path in sorted(folder.iterdir()):
                    if path.is_file():  # a model folder's files, not its checkpoints
                        tar.add(path, arcname=f"{name}/{path.name}")
        logs = sorted(work.glob("*.log")) + [work / name for name in RUN_LOGS if (work / name).exists()]
        for log in logs:
            tar.add(log, arcname=f"logs/{log.relative_to(work).as_posix().replace('/', '_')}")
    data = buffer.getvalue()
    parts = []
    for index in range(0, len(data), PART_BYTES):
        part = args.out / f"far_pair.tar.{index // PART_BYTES:03d}"
        part.write_bytes(data[index : index + PART_BYTES])
        parts.append(part.name)
    if len(parts) > 7:
        raise ValueError(f"{len(parts)} parts: more than the device tool brings back beside the summary (7)")
    return parts


def unpack(parts: Path, into: Path) -> list[str]:
    """Join `parts/far_pair.tar.NNN` and extract them into `into`; the top-level folders extracted."""
    files = sorted(parts.glob("far_pair.tar.[0-9][0-9][0-9]"))
    if not files:
        raise ValueError(
            f"no far_pair.tar.NNN parts in {parts}; pass the folder the device tool brought back"
        )
    data = b"".join(path.read_bytes() for path in files)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
        return sorted({member.name.split("/")[0] for member in tar.getmembers()})


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    back = sub.add_parser("unpack", help="join and extract the parts a run brought back")
    back.add_argument("--parts", type=Path, required=True)
    back.add_argument("--into", type=Path, required=True)
    go = sub.add_parser("run", help="train the pair")
    go.add_argument(
        "--data", type=Path, default=Path("data/far"), help="train_far_target.py prepare's streams"
    )
    go.add_argument("--out", type=Path, required=True, help="what comes back: summary.json and the parts")
    go.add_argument("--work", type=Path, default=Path("/tmp/far_pair"), help="scratch (checkpoints, caches)")
    go.add_argument(
        "--commit", default="unknown", help="the git commit the run is on (the tree has no history)"
    )
    go.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    go.add_argument("--minutes", type=float, default=7.5, help="the whole run, packing included")
    go.add_argument("--target-minutes", type=float, default=4.0)
    go.add_argument("--drafter-induction-minutes", type=float, default=0.5)
    go.add_argument("--drafter-minutes", type=float, default=1.0, help="the drafter's distillation")
    go.add_argument("--drafter-steps", type=int, default=3000, help="the distillation's schedule length")
    go.add_argument("--drafter-length", type=int, default=16384)
    go.add_argument("--drafter-batch", type=int, default=4)
    go.add_argument("--prefix-length", type=int, default=16320, help="the fine-tune rows' prefix")
    go.add_argument("--continuation-length", type=int, default=64)
    go.add_argument("--documents", type=int, default=1024, help="fine-tune rows")
    go.add_argument("--continuation-batch-size", type=int, default=32)
    go.add_argument("--finetune-steps", type=int, default=400)
    go.add_argument("--finetune-batch", type=int, default=4)
    go.add_argument("--finetune-lr", type=float, default=1e-3)
    go.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    go.add_argument("--budget-weights", type=float, nargs="+", default=[0.4, 0.3, 0.2, 0.1])
    go.add_argument("--window-length", type=int, default=256)
    go.add_argument(
        "--policy", default="chunk", help="the views' selection, a policy name (dynamic: per-query views)"
    )
    go.add_argument("--sparse-loss-weight", type=float, default=0.5)
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--cpu-smoke", action="store_true", help="tiny sizes for seconds on CPU")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.cpu_smoke:
            for name, value in SMOKE.items():
                setattr(args, name, value)
        if not 0 < args.minutes <= 60:
            parser.error(f"--minutes must be in (0, 60], got {args.minutes}")
        # imported here: `unpack` needs neither torch nor the package
        from hf_budgetdraft.cache.policies import POLICIES

        if args.policy not in POLICIES:
            parser.error(f"--policy must be one of {sorted(POLICIES)}, got {args.policy!r}")
        if len(args.budgets) != len(args.budget_weights):
            parser.error(
                f"--budgets ({len(args.budgets)}) and --budget-weights ({len(args.budget_weights)}) differ"
            )
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.command == "unpack":
        print(f"extracted {unpack(args.parts, args.into)} into {args.into}")
        return 0
    summary = run(args)
    print(json.dumps(summary["stages"], indent=2))
    return 0 if all(stage["status"] == "ok" for stage in summary["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
