"""`scripts/train_far_target.py` and its data (`scripts/far_target_data.py`), prepared on CPU for a GPU run: the
held-out split by content (no evaluation document, nor a 64-token span of one, in training), the rows it draws,
and a training smoke that saves shards the device tool can bring back."""

import json
import re
import subprocess
import sys

import far_target_data as data
import pytest
import safetensors.torch
import torch
from repo_paths import SCRIPTS
from transformers import AutoTokenizer, Glm4MoeForCausalLM, LlamaForCausalLM


def test_held_out_cuts_every_shared_window_and_keeps_the_rest():
    shared = list(range(1000, 1100))
    train = [list(range(0, 300)) + shared + list(range(300, 500)), list(range(2000, 2100))]
    held = [list(range(5000, 5050)) + shared]
    pieces, cut = data.held_out(train, held)
    banned = data._windows(held[0])
    assert cut == len(shared) - data.SPAN + 1
    assert not any(data._windows(p) & banned for p in pieces)
    kept = [t for p in pieces for t in p]
    assert set(range(0, 500)) | set(range(2000, 2100)) <= set(kept)


def test_prepare_holds_the_evaluation_side_out_by_content(tokenizer, corpus, tmp_path):
    summary = data.prepare(tokenizer, corpus, tmp_path)
    assert summary["documents"] == {"train": 5, "eval": 2} and summary["windows_cut"] > 0
    train = data.load_tokens(tmp_path, "train").tolist()
    held = data.load_tokens(tmp_path, "eval").tolist()
    assert not data._windows(train) & data._windows(held)
    stored = safetensors.torch.load_file(str(tmp_path / "train.safetensors"))["tokens"]
    assert stored.dtype == torch.int16  # the bundled vocabulary fits: half the bytes to carry to a GPU
    assert (
        summary["train_tokens"] == len(train)
        and json.loads((tmp_path / "prepare.json").read_text()) == summary
    )


def test_rows_score_what_only_far_context_predicts(tokenizer, corpus, tmp_path):
    data.prepare(tokenizer, corpus, tmp_path)
    rows = data.Rows(tokenizer, data.load_tokens(tmp_path, "train"), seed=0)
    for _ in range(20):
        ids, mask = rows.sample(512, "copy")
        assert len(ids) == 513 and len(mask) == 512
        scored = [i + 1 for i, m in enumerate(mask) if m]  # the tokens predicted
        span = len(scored) + data.COPY_CUE
        repeat = scored[0] - data.COPY_CUE
        source = next(s for s in range(repeat) if ids[s : s + span] == ids[repeat : repeat + span])
        assert repeat - (source + span) >= 64
    for _ in range(20):
        ids, mask = rows.sample(512, "fact")
        answer = tokenizer.decode([ids[i + 1] for i, m in enumerate(mask) if m]).strip()
        text = tokenizer.decode(ids)
        assert len(ids) == 513 and sum(mask) >= 1
        assert text.count(answer) >= 2 and "Question: what is the" in text  # stated earlier, asked at the end
        assert "access code" not in text and "lighthouse" not in text  # never the evaluation's formats
    for length in (32, 512):
        ids, mask = rows.sample(length, "repeat")
        scored = [i + 1 for i, m in enumerate(mask) if m]
        repeat, span = scored[0] - 1, len(scored) + 1
        assert len(ids) == length + 1 and span == (length + 1) // 4 and len(set(ids)) <= data.REPEAT_ALPHABET
        assert any(ids[s : s + span] == ids[repeat : repeat + span] for s in range(repeat - span))
    batch, mask, kinds = rows.batch(4, 256, [1, 1, 1, 1])
    assert batch.shape == (4, 257) and mask.shape == (4, 256) and set(kinds) <= set(data.KINDS)


def test_a_training_smoke_saves_shards_that_load(tokenizer, corpus, tmp_path):
    data.prepare(tokenizer, corpus, tmp_path / "data")
    out = tmp_path / "run"
    command = [
        sys.executable,
        str(SCRIPTS / "train_far_target.py"),
        "train",
        "--data",
        str(tmp_path / "data"),
    ]
    done = subprocess.run(
        [*command, "--out", str(out), "--cpu-smoke"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in log] == sorted(r["phase"] for r in log)  # induction first, then main
    induction = [r for r in log if r["phase"] == "induction"]
    main = [r for r in log if r["phase"] == "main"]
    assert induction and all(r["length"] == 32 and set(r["by_kind"]) == {"repeat"} for r in induction)
    assert len(main) >= 2 and {64, 128} >= {r["length"] for r in main} and all(r["loss"] > 0 for r in log)
    shards = list((out / "model").glob("*.safetensors"))
    assert shards and all(s.stat().st_size <= 15 * 1024 * 1024 for s in shards)
    model = Glm4MoeForCausalLM.from_pretrained(out / "model", use_safetensors=True)
    assert AutoTokenizer.from_pretrained(out / "model").get_vocab() == tokenizer.get_vocab()
    assert model.config.num_mtp_layers == 1 and model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == len(
        tokenizer
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == log[-1]["step"] and summary["device"] == "cpu"
    assert summary["induction"]["steps"] == len(induction) and summary["induction"]["formed"] is False


def test_the_induction_phase_widens_the_alphabet_and_ends_once_copying_formed(tokenizer):
    import induction_phase
    import train_far_target as script

    args = script.parse(["train", "--out", "o", "--minutes", "10", "--induction-minutes", "2"])
    rows = data.Rows(tokenizer, torch.arange(300).repeat(2), seed=0)
    phase = induction_phase.Induction(args, rows)
    assert rows.repeat_pool == 64 and not phase.done
    assert set(rows.sample(32, "repeat")[0]) <= set(rows.by_frequency[:64])
    for _ in range(3 * induction_phase.WINDOW):
        phase.observe(2.0, 10.0)  # not yet copying: the pool stays
    assert rows.repeat_pool == 64 and phase.record["loss"] == 2.0
    for pool in (64, 256, 300):  # 300 tokens in all
        assert rows.repeat_pool == pool and not phase.done
        for _ in range(induction_phase.WINDOW):
            phase.observe(0.5, 30.0)
    assert phase.done and phase.record["formed"] and phase.record["seconds"] == 30.0
    # the window slides: 14 steps at 0.5 bring the mean of the last 20 below 1.0; a wider pool starts a new window
    assert phase.record["pools"] == {64: 74, 256: 94, 300: 114} and rows.repeat_pool == 300
    capped = induction_phase.Induction(args, rows)
    capped.end(120.0)
    assert capped.done and not capped.record["formed"]
    assert rows.repeat_pool == 300  # the main phase's repeat rows draw from the whole vocabulary
    assert script.main_step(args, 0.0) == (512, 128, 0.0)
    assert script.main_step(args, 0.6)[:2] == (8192, 8) and 0 < script.main_step(args, 0.6)[2] < args.lr
    assert script.main_step(args, 0.8)[:2] == (16384, 4)  # rows longer than the farthest probe (8K + passage)
    with pytest.raises(SystemExit):
        script.parse(["train", "--out", "o", "--mix", "1/1/1"])


def test_the_induction_phase_trains_a_drafter_and_logs_its_steps(tokenizer, monkeypatch):
    """`train_drafts.py --induction-minutes M` runs the same phase on its drafter (any causal LM) first."""
    import induction_phase
    import train_drafts

    drafter = LlamaForCausalLM(train_drafts.drafter_config(tokenizer, 512))  # the drafter train_drafts builds
    before = [p.detach().clone() for p in drafter.parameters()]
    monkeypatch.setattr(sys, "argv", ["train_drafts.py", "--target", "t", "--induction-minutes", "0.01"])
    args = train_drafts.parse_args()
    args.induction_rows, args.log_every, args.autocast = 4, 1, None
    rows = data.Rows(tokenizer, torch.arange(300).repeat(2), seed=0)
    records = []
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr)
    record = induction_phase.induce(drafter, optimizer, rows, args, torch.device("cpu"), records.append)
    assert record["steps"] == len(records) >= 1 and not record["formed"] and record["seconds"] >= 0.6
    assert all(r["phase"] == "induction" and r["length"] == 32 and r["repeat_pool"] == 64 for r in records)
    assert rows.repeat_pool == 300  # restored for what follows
    assert any(not torch.equal(a, b) for a, b in zip(before, drafter.parameters(), strict=True))
    for bad in (["--induction-pool", "8"], ["--far-mix", "1/1"], ["--far-mix", "a/b/c/d"]):
        monkeypatch.setattr(sys, "argv", ["train_drafts.py", "--target", "t", *bad])
        with pytest.raises(SystemExit):
            train_drafts.parse_args()


def test_train_drafts_distils_a_drafter_from_a_far_target_after_its_induction_phase(
    tokenizer, corpus, tmp_path
):
    """`train_drafts.py --induction-minutes M --far-mix ...`, tiny, end to end: the phase's log, distillation
    steps on the far rows, a drafter and a target with its MTP layer saved that load."""
    from train_target import MTP_MOE, target_config

    data.prepare(tokenizer, corpus, tmp_path / "data")
    target = Glm4MoeForCausalLM(target_config(tokenizer, 512, hidden=32, layers=2, heads=2))
    target.config.update(MTP_MOE)
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / "drafts"
    command = [sys.executable, str(SCRIPTS / "train_drafts.py"), "--target", str(tmp_path / "target")]
    command += ["--out", str(out), "--far-data", str(tmp_path / "data"), "--far-mix", "1/1/1/1"]
    command += ["--induction-minutes", "0.02", "--induction-rows", "4", "--log-every", "1"]
    command += ["--steps", "20", "--length", "64", "--batch", "2", "--warmup", "2", "--save-every", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    induction = [json.loads(line) for line in (out / "induction.jsonl").read_text().splitlines()]
    assert induction and all(r["phase"] == "induction" for r in induction)
    assert json.loads((out / "induction.json").read_text())["steps"] == len(induction)
    distilled = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in distilled] == [20] and distilled[0]["drafter_kl"] > 0
    drafter = LlamaForCausalLM.from_pretrained(out / "drafter", use_safetensors=True)
    assert drafter(torch.tensor([[1, 2, 3]])).logits.shape[-1] == len(tokenizer)
    assert (out / "target_with_mtp" / "config.json").exists()


def test_far_documents_end_their_prefix_where_the_far_dependency_starts(tokenizer, corpus, tmp_path):
    """`far_documents.py`: packed as `hf-budgetdraft train` packs them (one row per document), a copy row's
    continuation is a passage seen >= 64 tokens before its reappearance began, a fact row's prefix ends on the
    question whose answer was planted in its first half, and every row is exactly the ids it was built from."""
    import far_documents

    from hf_budgetdraft.trainer import load_text_dataset, pack_dataset

    data.prepare(tokenizer, corpus, tmp_path / "data")
    out, prefix, continuation = tmp_path / "docs.jsonl", 256, 32
    lengths = ["--prefix-length", str(prefix), "--continuation-length", str(continuation)]
    args = ["--data", str(tmp_path / "data"), "--out", str(out), "--documents", "24", "--mix", "1/1/1"]
    assert far_documents.main(args + lengths) == 0
    kinds = [json.loads(line)["kind"] for line in out.read_text().splitlines()]
    documents = load_text_dataset(data_files=[str(out)])
    rows = pack_dataset(documents, tokenizer, prefix + continuation, across_documents=False)["input_ids"]
    assert len(rows) == 24 and {"text", "copy", "fact"} == set(kinds)
    for ids, kind in zip(rows, kinds, strict=True):
        head, tail = ids[:prefix], ids[prefix:]
        if kind == "copy":
            gap = far_documents.GAP
            assert any(  # a cue of c tokens inside the prefix, the passage >= gap tokens before it
                ids[s : s + c + continuation] == ids[prefix - c :]
                for c in range(data.COPY_CUE, far_documents.MAX_CUE + 1)
                for s in range(prefix - 2 * c - continuation - gap + 1)
            )
        elif kind == "fact":
            pattern = r"what is the (\w+) of (\w+ \w+)\? Answer: the \1 of \2 is$"
            asked = re.search(pattern, tokenizer.decode(head))
            stated = re.search(
                rf"The {asked[1]} of {asked[2]} is (\w+)\.", tokenizer.decode(head[: prefix // 2 + 40])
            )
            assert tokenizer.decode(tail).startswith(" " + stated[1])
    for bad in (
        ["--prefix-length", "100", "--continuation-length", "64"],
        ["--mix", "1/1/1/1"],
        ["--continuation-length", "8"],
        ["--documents", "0"],
    ):
        with pytest.raises(SystemExit):
            far_documents.parse(["--out", str(out), *bad])


def test_a_time_budget_paces_the_drafters_schedule():
    """`train_drafts.py --minutes`: the learning-rate schedule stands at the further of the steps done and the share
    of the time spent, so a run the time ends still finishes its cosine."""
    import argparse

    import train_drafts

    paced = argparse.Namespace(steps=1000, minutes=2.0)
    assert train_drafts.scheduled_step(10, 60.0, paced) == 500  # half the time spent, few steps done
    assert train_drafts.scheduled_step(600, 60.0, paced) == 600  # the steps ran ahead of the clock
    assert train_drafts.scheduled_step(10, 60.0, argparse.Namespace(steps=1000, minutes=0.0)) == 10
