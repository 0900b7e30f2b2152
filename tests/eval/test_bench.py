"""`hf-budgetdraft bench --preset smoke` end to end: the outputs' schema, every greedy-diff cell 0, and two
deliberate faults — one the output depends on (caught as a nonzero diff), one it must not (draft cache)."""

import csv
import json
import re

import pytest
import torch
from torch_support import needs_traceable_transformers

from hf_budgetdraft.cache import DraftLayer, StaticDraftLayer
from hf_budgetdraft.cli import main
from hf_budgetdraft.demo.random_models import smoke_pair
from hf_budgetdraft.eval import bench_run as bench
from hf_budgetdraft.eval.aggregate import round_budget_rows
from hf_budgetdraft.eval.bench_models import bundled_tokenizer
from hf_budgetdraft.eval.bench_run import BenchArguments, BenchModels, run_bench
from hf_budgetdraft.eval.plots import PLOTS
from hf_budgetdraft.eval.report import REQUIRED_FIELDS
from hf_budgetdraft.eval.runners import MethodSpec, run_ar, sparse_cache_config

EXTRA_FIELDS = (
    "target_cache_bytes",
    "acceptance_rate",
    "draft_seconds",
    "verify_seconds",
    "peak_rss_bytes",
    "threads",
    "first_diff_margin",
)
KEY = (
    "target",
    "drafter",
    "task",
    "sample",
    "method",
    "name",
    "cache",
    "policy",
    "budget",
    "context_length",
    "gamma",
    "repeat",
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-smoke")
    code = main(["bench", "--preset", "smoke", "--output-dir", str(out), "--no_progress"])
    return code, out, json.loads((out / "results.json").read_text())


def test_smoke_writes_every_output(smoke):
    code, out, results = smoke
    assert code == 0
    for name in ("results.json", "results.csv", "report.md", *PLOTS):
        assert (out / name).stat().st_size > 1000, name
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for heading in (
        "## Losslessness",
        "### Noise envelope",
        "## Acceptance",
        "## Speed",
        "### What a round has to buy",
        "### Cost model",
        "## Memory",
    ):
        assert heading in report
    assert "cells identical (0 differing tokens)" in report and "DIFFER" not in report
    assert all(f"]({name})" in report for name in PLOTS)


def test_smoke_records_schema(smoke):
    _, out, results = smoke
    records = results["records"]
    args = results["metadata"]["arguments"]
    methods = results["metadata"]["methods"]
    assert results["metadata"]["tasks"] == ["document", "code", "passkey", "needle_outside_window"]
    cells = len(args["contexts"]) * len(results["metadata"]["tasks"]) * args["samples"]
    assert len(records) == cells * args["repeats"] * len(methods)
    assert len({tuple(r[k] for k in KEY) for r in records}) == len(records)  # one record per cell and repeat
    for record in records:
        missing = [f for f in REQUIRED_FIELDS + EXTRA_FIELDS if f not in record]
        assert not missing, missing
        assert record["new_tokens"] == args["new_tokens"] and record["threads"] == 1
    names = {r["name"] for r in records}
    assert {
        "ar",
        "native",
        "sink_window",
        "budgeted/chunk",
        "budgeted/streaming",
        "budgeted/snapkv",
        "prompt_lookup",
        "mtp_native",
        "mtp_windowed",
        "ar_stock",
        "ar_growable",
        "ar_static",
    } <= names
    assert results["metadata"]["threads"] == 1
    with open(out / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(records) and set(REQUIRED_FIELDS) <= set(rows[0])


def test_every_greedy_diff_cell_is_zero(smoke):
    _, _, results = smoke
    assert all(r["diff_tokens"] == 0 and r["first_diff"] is None for r in results["records"])
    assert all(row["diff_tokens"] == 0 and row["run_to_run"] == 0 for row in results["noise_envelope"])
    kinds = {row["kind"] for row in results["noise_envelope"]}
    assert {"native_vs_ar", "windowed_vs_native", "ar_run_to_run", "ar_setup_vs_ar"} <= kinds


def test_smoke_measurements_are_plausible(smoke):
    """The statistics measure what they claim (each assertion fails on a plausible bug)."""
    _, _, results = smoke
    records, summary = results["records"], results["summary"]
    pooled = {(r["label"], r["context_length"]): r for r in summary if r["task"] == "all"}
    # the smoke drafter agrees with its target on a full cache, a sparse cache costs acceptance
    native = pooled[("native γ=4", 512)]
    sparse = pooled[("sink_window B=32 γ=4", 512)]
    assert native["acceptance_rate"] > 0.6 > sparse["acceptance_rate"] > 0.05
    assert native["acceptance_low"] > sparse["acceptance_high"]  # Wilson intervals separate them
    # position 1 is reached by every round that proposed something (pooled over tasks, repeat 0)
    drafted = sum(
        sum(p > 0 for p in r["proposed_per_round"])
        for r in records
        if r["label"] == "native γ=4" and r["context_length"] == 512 and r["repeat"] == 0
    )
    assert native["acceptance_per_position"][0]["reached"] == drafted

    # memory: the sparse draft caches stay bounded, the full-cache draft grows with the context
    def draft_bytes(label, context):
        return pooled[(label, context)]["draft_cache_bytes"]

    for label in ("sink_window B=96 γ=4", "budgeted/chunk B=96 γ=4", "mtp:mtp_windowed B=96 γ=2"):
        assert 0 < draft_bytes(label, 256) == draft_bytes(label, 512) < draft_bytes("native γ=4", 512)
    assert draft_bytes("native γ=4", 512) > 1.8 * draft_bytes("native γ=4", 256)
    assert pooled[("ar", 512)]["target_cache_bytes"] > pooled[("ar", 256)]["target_cache_bytes"]
    assert pooled[("prompt_lookup γ=4", 256)]["draft_cache_bytes"] == 0
    # AR against itself, the same pass: exactly 1
    assert all(r["speedup_vs_ar"] == 1.0 for r in records if r["name"] == "ar")
    # the AR baselines: the GrowableCache is sized for prompt + new tokens, transformers' cache holds one less
    new = records[0]["new_tokens"]
    for context in (256, 512):
        growable, dynamic = (pooled[(name, context)]["target_cache_bytes"] for name in ("ar_growable", "ar"))
        assert growable * (context + new - 1) == dynamic * (context + new)
    # every run is paired with both baselines of its own repeat
    for r in records:
        if r["target"] == "target":
            assert r["speedup_vs_ar_stock"] > 0 and r["decode_speedup_vs_ar_growable"] > 0
            assert r["decode_speedup_vs_ar_static"] > 0
    assert all(r["speedup_vs_ar_stock"] == 1.0 for r in records if r["name"] == "ar_stock")
    # speculative runs were instrumented: rounds, phase times within the wall time
    for r in records:
        if r["method"] != "ar":
            assert r["rounds"] > 0 and 0 < r["draft_seconds"] + r["verify_seconds"] < r["seconds"]
    # the cost model is fitted where γ varies, and refuses where it cannot (MTP drafts a fixed depth)
    fits = {(f["label"], f["context_length"]): f for f in results["phase_fits"]}
    fit = fits[("sink_window B=96", 512)]["fit"]
    assert fit is not None and fit["draft"]["slope"] > 0 and fit["round"]["slope_se"] > 0
    assert fits[("mtp:mtp_native", 512)]["fit"] is None


def _reduced(tmp_path, **overrides):
    options = dict(
        preset="smoke",
        output_dir=str(tmp_path),
        tasks=["document", "code"],
        contexts=[256],
        methods=["sink_window", "budgeted"],
        budgets=[96],
        policies=["chunk"],
        gammas=[4],
        repeats=1,
        warmup=False,
        plots=False,
        progress=False,
    )
    options.update(overrides)
    return BenchArguments(**options)


def accept_drafts_blindly(model):
    """Test-only fault in the acceptance step: the verification forward's logits are rewritten so that each
    drafted token is the target's argmax — the target "accepts" every draft it is shown, unverified."""
    forward = model.forward

    def faulty_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        length, kept = ids.shape[1], output.logits.shape[1]
        for j in range(kept - 1):  # logits row j predicts input token (length - kept + j + 1)
            drafted = ids[0, length - kept + j + 1]
            output.logits[0, j, drafted] = output.logits[0, j].max() + 10.0
        return output

    model.forward = faulty_forward
    return model


def test_injected_acceptance_fault_is_caught(tmp_path, monkeypatch, capsys):
    target, drafter = smoke_pair(max_position_embeddings=1024)
    models = BenchModels(bundled_tokenizer(), {"target": accept_drafts_blindly(target)}, {"drafter": drafter})
    monkeypatch.setattr(bench, "load_models", lambda args, mtp_dir: models)
    flags = ["--tasks", "document", "code", "--contexts", "256", "--methods", "native", "sink_window"]
    flags += [
        "--budgets",
        "96",
        "--gammas",
        "4",
        "--repeats",
        "1",
        "--no_warmup",
        "--no_plots",
        "--no_progress",
    ]
    code = main(["bench", "--preset", "smoke", "--output-dir", str(tmp_path), *flags])
    assert code == 1  # the bench fails the run
    assert "DIFFER from the target's greedy output" in capsys.readouterr().out
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    by_label = {}
    for record in records:
        by_label.setdefault(record["label"], []).append(record)
    assert all(r["diff_tokens"] == 0 for r in by_label["ar"])  # AR never verifies drafts: unaffected
    for record in by_label["sink_window B=96 γ=4"]:
        assert record["diff_tokens"] > 0 and record["first_diff"] is not None
        assert record["acceptance_rate"] == 1.0  # every draft "accepted"
        assert abs(record["first_diff_margin"]) > 1e-3  # a real change, not an argmax near-tie
    assert "DIFFER" in (tmp_path / "report.md").read_text()


def test_corrupting_the_draft_cache_keeps_the_output_and_lowers_acceptance(tmp_path, monkeypatch):
    clean = run_bench(_reduced(tmp_path / "clean"))

    visible_past, static_step = DraftLayer.visible_past, StaticDraftLayer._step

    def corrupted(self, length=None):  # every key the sparse draft reads is paired with the negated value
        return [(keys, -values) for keys, values in visible_past(self, length)]

    def corrupted_static_step(self, *args):  # the static layers' slot buffers, negated the same way
        keys, values = static_step(self, *args)
        return keys, -values

    monkeypatch.setattr(DraftLayer, "visible_past", corrupted)  # both storages' blocks read through it
    monkeypatch.setattr(StaticDraftLayer, "_step", corrupted_static_step)
    broken = run_bench(_reduced(tmp_path / "broken"))
    assert broken.ok and all(r["diff_tokens"] == 0 for r in broken.records)  # the target verified every token

    def acceptance(result, name):
        rows = [r for r in result.records if r["name"] == name]
        return sum(r["accepted_tokens"] for r in rows) / sum(r["proposed_tokens"] for r in rows)

    for name in ("sink_window", "budgeted/chunk"):
        assert acceptance(broken, name) < 0.6 * acceptance(clean, name), name


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--budgets", "4"], "must exceed --num_sink_tokens=4"),
        (["--gammas", "0"], r"--gammas values must be in \[1, 64\]"),
        (["--contexts", "8"], "--contexts values must be in"),
        (["--policies", "h2o"], "--policies must be among"),
        (["--policy_kwargs", "{bad"], "--policy_kwargs must be JSON"),
        (["--preset", "full"], "--preset full needs --target and --drafter"),
        (["--contexts", *["4096"] * 40, "--repeats", "1000"], "generate\\(\\) calls"),
        (["--assistant_confidence_threshold", "1"], r"must be in \[0, 1\), got 1.0"),
        (["--do_sample", "true", "--temperature", "0"], r"--temperature must be in \(0, 10\], got 0.0"),
    ],
)
def test_bad_bench_arguments(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", *flags])
    assert re.search(message, capsys.readouterr().err)


def test_method_spec_labels_and_errors():
    spec = MethodSpec("assisted", "budgeted", "snapkv", 96, 4, drafter="drafter")
    assert spec.label == "budgeted/snapkv B=96 γ=4" and spec.native_counterpart() == MethodSpec(
        "assisted", "full", gamma=4, drafter="drafter"
    )
    assert (
        MethodSpec("mtp", "sink_window", budget=64, gamma=2, target="mtp").label
        == "mtp:mtp_windowed B=64 γ=2"
    )
    assert MethodSpec("ar").native_counterpart() is None
    assert MethodSpec("ar", ar_setup="stock").label == "ar_stock"
    with pytest.raises(ValueError, match="ar_setup must be one of"):
        MethodSpec("assisted", "full", gamma=2, ar_setup="stock")
    with pytest.raises(ValueError, match="needs a budget"):
        MethodSpec("assisted", "sink_window", gamma=2)
    with pytest.raises(ValueError, match="method must be one of"):
        MethodSpec("medusa")
    compiled = MethodSpec("assisted", "budgeted", "chunk", 96, 4, drafter="drafter", compiled=True)
    assert compiled.label == "budgeted/chunk+compiled B=96 γ=4" and not compiled.native_counterpart().compiled
    assert sparse_cache_config(compiled, 4, 64)["static"] is True
    with pytest.raises(ValueError, match="compiled=True needs method 'assisted' with a sparse draft cache"):
        MethodSpec("assisted", "full", gamma=2, compiled=True)
    oneliner_mtp = MethodSpec("mtp", "sink_window", target="mtp", defaults=True)
    assert (
        oneliner_mtp.label == "mtp:oneliner/mtp_windowed" and sparse_cache_config(oneliner_mtp, 4, 64) == {}
    )
    explicit_mtp = MethodSpec("mtp", "sink_window", budget=64, gamma=1, target="mtp")
    assert sparse_cache_config(explicit_mtp, 4, 64) == {
        "num_sink_tokens": 4,
        "window_length": 60,
        "draft_length": 1,
        "fast_verify": False,
    }  # the fixed chain on the stock target: comparable with native MTP
    with pytest.raises(
        ValueError, match="defaults=True needs method 'assisted' with a sparse cache or 'mtp'"
    ):
        MethodSpec("mtp", "full", target="mtp", defaults=True)


@needs_traceable_transformers
def test_compiled_draft_runs_beside_the_eager_draft_and_stays_lossless(tmp_path):
    """`--compiled_draft`: every sparse draft also runs on a static cache with a compiled (inductor) one-token step,
    interleaved with the eager one; the drafters switch to the varlen attention; outputs stay the target's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    args = BenchArguments(
        preset="smoke",
        output_dir=str(tmp_path),
        contexts=[256],
        budgets=[96],
        gammas=[4],
        policies=["chunk"],
        methods=["budgeted"],
        tasks=["document"],
        compiled_draft=True,
        plots=False,
        progress=False,
    )
    result = run_bench(args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1  # the one-token draft step, compiled once for the whole grid
    labels = {r["label"] for r in result.records}
    assert labels == {"ar", "budgeted/chunk B=96 γ=4", "budgeted/chunk+compiled B=96 γ=4"}
    assert result.ok  # every greedy-diff cell 0
    compiled = [r for r in result.records if r["compiled"]]
    assert compiled and all(r["mean_accepted_length"] > 1 for r in compiled)


def test_confidence_threshold_ends_drafts_early_and_stays_lossless(tmp_path):
    """`--assistant_confidence_threshold`: each drafter stops a round at its first unlikely token, so rounds
    propose fewer than γ tokens (every draft path: stock native, the greedy sparse loop); outputs stay the target's."""
    fixed = run_bench(_reduced(tmp_path / "fixed", methods=["native", "budgeted"], tasks=["document"]))
    early = run_bench(
        _reduced(
            tmp_path / "early",
            methods=["native", "budgeted"],
            tasks=["document"],
            assistant_confidence_threshold=0.99,
        )
    )
    assert fixed.ok and early.ok  # every greedy-diff cell 0

    def proposed_per_round(result, name):
        rows = [r for r in result.records if r["name"] == name]
        return sum(r["proposed_tokens"] for r in rows) / sum(r["rounds"] for r in rows)

    for name in ("native", "budgeted/chunk"):
        assert proposed_per_round(fixed, name) > 3, name  # γ = 4 but where the token budget ends a round
        assert proposed_per_round(early, name) < 0.5 * proposed_per_round(fixed, name), (
            name
        )  # ~1 token a round
    report = (tmp_path / "early" / "report.md").read_text()
    assert "a draft stops below top-token probability 0.99" in report


def test_full_preset_without_data_runs_the_passkey_tasks_only(capsys):
    args = BenchArguments(preset="full", target="some/target", drafter="some/drafter")
    documents, corpus = bench.load_corpus(args)
    assert documents == [] and "passkey tasks only" in corpus
    assert bench._tasks_with_data(args, documents) == ["passkey", "needle_outside_window"]
    assert "skipping task 'code'" in capsys.readouterr().err
    explicit = BenchArguments(preset="full", target="t", drafter="d", tasks=["document"])
    with pytest.raises(ValueError, match="needs --data_files or --dataset_name"):
        bench.load_corpus(explicit)


def test_target_attention_implementation_is_applied_to_the_targets_only(tmp_path):
    args = BenchArguments(
        preset="smoke",
        output_dir=str(tmp_path),
        methods=["native"],
        target_attn_implementation="budgetdraft_sdpa",
    )
    models = bench.load_models(args, None)
    assert all(m.config._attn_implementation == "budgetdraft_sdpa" for m in models.targets.values())
    assert all(m.config._attn_implementation != "budgetdraft_sdpa" for m in models.drafters.values())


def test_ar_baselines_run_stock_sdpa_the_growable_or_the_static_cache_and_restore_the_target(
    tmp_path, monkeypatch
):
    args = BenchArguments(
        preset="smoke", output_dir=str(tmp_path), target_attn_implementation="budgetdraft_sdpa"
    )
    target = bench.load_models(args, None).targets["target"]
    seen = []
    generate = type(target).generate

    def spy(self, *positional, **kwargs):
        cache = kwargs.get("cache_implementation") or type(kwargs.get("cache")).__name__
        seen.append((self.config._attn_implementation, cache))
        return generate(self, *positional, **kwargs)

    monkeypatch.setattr(type(target), "generate", spy)
    ids = torch.randint(3, target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    runs = {setup: run_ar(target, ids, 6, setup) for setup in (None, "stock", "growable", "static")}
    assert seen == [
        ("budgetdraft_sdpa", "NoneType"),
        ("sdpa", "NoneType"),
        ("budgetdraft_sdpa", "GrowableCache"),
        ("budgetdraft_sdpa", "static"),
    ]
    assert target.config._attn_implementation == "budgetdraft_sdpa"  # restored after the stock run
    assert all(torch.equal(run.new_ids, runs[None].new_ids) for run in runs.values())


def test_the_warm_up_covers_every_prompt_length_where_compiles_are_per_shape():
    """On the CPU one prompt warms every method up; on an accelerator (the meta device stands in) one of each
    length, so no cell's first timed repeat compiles."""
    samples = [
        type("Sample", (), {"input_ids": torch.zeros(1, n, dtype=torch.long)})() for n in (8, 16, 8, 32)
    ]
    cells = [(sample, index) for index, sample in enumerate(samples)]
    assert [ids.shape[1] for ids in bench._warm_prompts(cells, "cpu")] == [8]
    warm = bench._warm_prompts(cells, "meta")
    assert sorted(ids.shape[1] for ids in warm) == [8, 16, 32] and {ids.device.type for ids in warm} == {
        "meta"
    }
    assert bench._warm_prompts([], "meta") == bench._warm_prompts([], "cpu") == []


def _pooled(label, method, context, **fields):
    row = dict(label=label, method=method, target="target", context_length=context, gamma=6)
    row.update(
        ar_ms_per_token=None, mean_accepted_length=None, draft_ms_per_round=None, verify_ms_per_round=None
    )
    row.update(fields)
    return row


def test_round_budget_rows_use_stock_ar_and_the_round_phases():
    pooled = [
        _pooled("ar", "ar", 4096, ar_ms_per_token=9.0),
        _pooled("ar_stock", "ar", 4096, ar_ms_per_token=10.0),
        _pooled("ar", "ar", 8192, ar_ms_per_token=12.0),  # no stock AR here: plain AR is the baseline
        _pooled(
            "b", "assisted", 4096, mean_accepted_length=4.0, draft_ms_per_round=5.0, verify_ms_per_round=15.0
        ),
        _pooled(
            "b", "assisted", 8192, mean_accepted_length=3.0, draft_ms_per_round=6.0, verify_ms_per_round=18.0
        ),
        _pooled(
            "b", "assisted", 16384, mean_accepted_length=3.0, draft_ms_per_round=6.0, verify_ms_per_round=18.0
        ),
        _pooled("no phases", "assisted", 4096, mean_accepted_length=3.0),
    ]
    rows = {row["context_length"]: row for row in round_budget_rows(pooled)}
    assert set(rows) == {4096, 8192}  # no baseline at 16K, no phase times for "no phases"
    at_4k = rows[4096]
    assert (at_4k["baseline"], at_4k["ar_ms_per_token"], at_4k["round_ms"]) == ("stock AR", 10.0, 20.0)
    assert at_4k["predicted_speedup"] == pytest.approx(4.0 * 10.0 / 20.0)
    assert at_4k["accepted_length_for_2x"] == pytest.approx(4.0)
    assert at_4k["full_acceptance_speedup"] == pytest.approx(7 * 10.0 / 20.0)
    assert (rows[8192]["baseline"], rows[8192]["accepted_length_for_2x"]) == ("AR", pytest.approx(4.0))


def test_bench_batch_sizes_grid(tmp_path, capsys):
    """`bench --batch_sizes`: batched AR, the loop without drafts, the batched one-liner and the full-cache draft per
    batch size; greedy rows
    identical to batched AR, per-row latency and both caches' bytes recorded."""
    code = main(
        ["bench", "--preset", "smoke", "--batch_sizes", "1", "3", "--contexts", "96", "--new_tokens", "6",
         "--repeats", "1", "--output_dir", str(tmp_path), "--progress", "false"]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "batched.json").read_text())
    records = result["records"]
    assert {(r["batch_size"], r["method"]) for r in records} == {
        (b, m) for b in (1, 3) for m in ("ar", "loop_ar", "speculative", "full_draft")
    }
    for r in records:
        assert r["decode_tokens_per_second"] > 0 and r["row_latency_seconds"] > 0
        if r["method"] != "ar":
            assert r["rows_identical"] == r["batch_size"]
            assert r["target_cache_bytes"] > 0
            assert r["draft_cache_bytes"] > 0 or r["method"] == "loop_ar"
    loop_ar = next(r for r in records if r["batch_size"] == 3 and r["method"] == "loop_ar")
    assert loop_ar["ar_row_share"] == 1.0  # draft_length=0: every row takes a plain AR step every round
    sparse = next(r for r in records if r["batch_size"] == 3 and r["method"] == "speculative")
    full = next(r for r in records if r["batch_size"] == 3 and r["method"] == "full_draft")
    assert sparse["draft_cache_bytes"] != full["draft_cache_bytes"]
    assert "| 96 | 3 | speculative |" in (tmp_path / "batched.md").read_text()


def test_sampling_bench_seeds_methods_alike_and_reports_no_greedy_diff(tmp_path, capsys):
    """`--do_sample`: every run samples (AR too, from the same seed per repeat), the report says token diffs
    check nothing and the command does not fail on them."""
    args = _reduced(tmp_path, methods=["oneliner", "budgeted", "ar_fast"], do_sample=True, temperature=1.0)
    result = run_bench(args)
    assert result.ok and result.metadata["sampling"] == {"temperature": 1.0}
    report = (tmp_path / "report.md").read_text()
    assert "## Sampling (temperature 1.0" in report and "## Losslessness" not in report
    by_label = {}
    for record in result.records:
        by_label.setdefault(record["label"], []).append(record)
    assert {"ar", "ar_fast", "oneliner/budgeted", "budgeted/chunk B=96 γ=4"} <= set(by_label)
    assert any(
        r["diff_tokens"] > 0 for r in result.records
    )  # sampled runs differ from AR's sample: real draws
    greedy = run_bench(_reduced(tmp_path / "greedy", methods=["budgeted"], tasks=["document"]))
    assert greedy.ok and all(r["diff_tokens"] == 0 for r in greedy.records)
    assert (
        main(
            [
                "bench",
                "--preset",
                "smoke",
                "--do_sample",
                "true",
                "--contexts",
                "256",
                "--methods",
                "budgeted",
                "--budgets",
                "96",
                "--gammas",
                "2",
                "--tasks",
                "document",
                "--repeats",
                "1",
                "--warmup",
                "false",
                "--plots",
                "false",
                "--progress",
                "false",
                "--policies",
                "chunk",
                "--output_dir",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    assert "sampling ({'temperature': 0.8}): no greedy diff" in capsys.readouterr().out
