"""The induction phase: form a copying head before anything else, for the far target and for its drafters.

A copying (induction) head forms after a plateau counted in optimizer steps, not tokens, much shorter on short rows
and on a small alphabet (`benchmarks/results/far_target/`). So a model is first trained on `repeat` rows only
(`far_target_data.Rows`: random tokens, a quarter of the row written twice, scored on the second copy): short
(`--induction-length`), many steps of few tokens, their alphabet drawn from the `--induction-pool` most frequent
tokens first. Each time the mean loss of the last `WINDOW` steps falls below `--induction-until` the pool grows
`POOL_GROWTH`-fold; once it falls on the whole vocabulary (copying formed) or `--induction-minutes` pass, the
phase ends. `train_far_target.py` runs it before its main schedule, `train_drafts.py` before distilling a drafter
from a target that copies (distillation alone does not leave the plateau within its steps).
"""

from __future__ import annotations

import argparse
import time

import far_target_data as data
import torch
import train_precision

WINDOW = 20
POOL_GROWTH = 4
REPEAT_ONLY = [float(kind == "repeat") for kind in data.KINDS]


def add_arguments(parser: argparse.ArgumentParser, minutes: float) -> None:
    parser.add_argument(
        "--induction-minutes", type=float, default=minutes, help="cap of the induction phase (0: none)"
    )
    parser.add_argument("--induction-length", type=int, default=32, help="row length of the induction phase")
    parser.add_argument("--induction-rows", type=int, default=64, help="rows a step of the induction phase")
    parser.add_argument(
        "--induction-pool",
        type=int,
        default=64,
        help="the induction rows' first token pool (the vocabulary: no widening)",
    )
    parser.add_argument(
        "--induction-until", type=float, default=1.0, help="repeat loss that ends the induction phase early"
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 16 <= args.induction_length <= 4096 or not 1 <= args.induction_rows <= 4096:
        parser.error("--induction-length must be in [16, 4096] and --induction-rows in [1, 4096]")
    if args.induction_pool < data.REPEAT_ALPHABET:
        parser.error(f"--induction-pool must be at least {data.REPEAT_ALPHABET}, got {args.induction_pool}")
    if args.induction_minutes < 0:
        parser.error(f"--induction-minutes must be >= 0, got {args.induction_minutes}")


def lr_warmup(fraction: float, peak: float, warmup: float = 0.1) -> float:
    """Linear warm-up over `warmup` of the phase's cap, then constant."""
    return peak * min(1.0, fraction / warmup)


class Induction:
    """The phase's state: the pool of `rows` (narrowed on entry, restored on `end`) and its record
    `{steps, seconds, formed, loss, pools: {pool: steps when its loss fell below the threshold}}`."""

    def __init__(self, args: argparse.Namespace, rows: data.Rows):
        self.args, self.rows, self.losses = args, rows, []
        self.full_pool = rows.repeat_pool
        rows.repeat_pool = min(args.induction_pool, self.full_pool)
        self.done = False
        self.record = dict(steps=0, seconds=0.0, formed=False, loss=None, pools={})

    def observe(self, loss: float, elapsed: float) -> None:
        """Count one step's loss (every row is a `repeat` row); widen the pool or end when it is low enough."""
        if self.done:
            return
        self.record["steps"] += 1
        self.losses = [*self.losses[-(WINDOW - 1) :], loss]
        mean = sum(self.losses) / len(self.losses)
        self.record["loss"] = round(mean, 4)
        if len(self.losses) < WINDOW or mean >= self.args.induction_until:
            return
        self.record["pools"][self.rows.repeat_pool] = self.record["steps"]
        if self.rows.repeat_pool >= self.full_pool:
            self.record["formed"] = True
            self.end(elapsed)
        else:
            self.rows.repeat_pool, self.losses = min(self.full_pool, self.rows.repeat_pool * POOL_GROWTH), []

    def end(self, elapsed: float) -> None:
        self.done, self.rows.repeat_pool = True, self.full_pool
        self.record["seconds"] = round(elapsed, 1)


def train_step(
    model, optimizer, ids, mask, device, autocast: torch.dtype | None
) -> tuple[float, torch.Tensor]:
    """One step on `ids (B, L + 1)` scored where `mask (B, L)` says, under `autocast` (`train_precision`: a dtype,
    or `None` for float32); `(loss, per-row losses (B,))`."""
    ids, mask = ids.to(device), mask.to(device)
    with train_precision.autocast(device, autocast):
        logits = model(input_ids=ids[:, :-1]).logits
    losses = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
    rows = (losses * mask).sum(1) / mask.sum(1).clamp(min=1)  # every row weighs the same
    loss = rows.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), rows.detach()


def induce(model, optimizer, rows: data.Rows, args, device, log) -> dict:
    """Train `model` on `repeat` rows, under `args.autocast` (the script's resolved `--precision`), until copying
    formed or the cap passed (a cap of 0: no step); `log(record)` every `--log-every` steps (`step, seconds, phase,
    repeat_pool, length, loss, by_kind, tokens`). Returns the phase's record."""
    induction, cap = Induction(args, rows), args.induction_minutes * 60
    start, tokens = time.perf_counter(), 0
    while not induction.done:
        elapsed = time.perf_counter() - start
        if elapsed >= cap:
            induction.end(elapsed)
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_warmup(elapsed / cap, args.lr)
        ids, mask, _ = rows.batch(args.induction_rows, args.induction_length, REPEAT_ONLY)
        loss, _ = train_step(model, optimizer, ids, mask, device, args.autocast)
        tokens += ids.numel()
        pool = rows.repeat_pool
        induction.observe(loss, elapsed)
        if induction.record["steps"] % args.log_every == 0:
            log(
                dict(
                    step=induction.record["steps"],
                    seconds=round(elapsed, 1),
                    phase="induction",
                    repeat_pool=pool,
                    length=args.induction_length,
                    loss=loss,
                    by_kind={"repeat": loss},
                    tokens=tokens,
                )
            )
    return induction.record
