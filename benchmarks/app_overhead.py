"""Where a streamed token's time goes in the app, with a browser attached: the app's decode rates against the same
calls made directly, interleaved in one process.

    python benchmarks/app_overhead.py --threads 2 --repeats 3 --refresh 0.2 1.0

The app serves on 127.0.0.1 (port 0) in this process; headless Chromium (Debian's `chromium`, driven by Playwright)
loads the page and presses Run with the app's model and method defaults at `--context-length` / `--new-tokens`. The
app's summaries are captured in-process; the direct calls are `timed_generate` on the same prompt: plain AR and the
one-liner with every default. Per app refresh interval (seconds between page updates while tokens stream), the
ratio app / direct of each column's decode tokens/s, median of the paired repeats. Writes
`benchmarks/results/app_overhead.{json,md}`. Run it alone: a second busy process stalls torch's threads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

from hf_budgetdraft.app import AppArguments
from hf_budgetdraft.app.app import build_app, launch_app
from hf_budgetdraft.app.backend import RunRequest
from hf_budgetdraft.app.backend.prompts import build_prompt
from hf_budgetdraft.generation.spec import DraftSpec
from hf_budgetdraft.runs.timed_call import timed_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record, run_text, write_results  # noqa: E402

# the module, not the function of the same name the package exports
compare_module = importlib.import_module("hf_budgetdraft.app.backend.compare")
RESULTS = Path(__file__).resolve().parent / "results"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
]


def capture_summaries() -> list[dict]:
    """Every summary the app computes from now on, appended to the returned list."""
    captured: list[dict] = []
    original = compare_module.summarize

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result[0])
        return result

    compare_module.summarize = recording
    return captured


def browser_run(page, context_length: int, new_tokens: int) -> None:
    from playwright.sync_api import expect

    for box, value in (("#context-length", context_length), ("#max-new-tokens", new_tokens)):
        number = page.locator(f"{box} input[type=number]")
        number.fill(str(value))
        number.press("Enter")
    page.locator("#run").click()
    expect(page.locator("#status")).to_contain_text("Done", timeout=600_000)


def direct_rates(store, args) -> dict:
    pair = store.get("demo")
    request = RunRequest(model="demo", context_length=args.context_length, max_new_tokens=args.new_tokens)
    ids = build_prompt(request.check(store.limits), pair, store.limits, store.builtin_documents).input_ids
    ar = timed_generate(pair.target, ids, args.new_tokens)
    spec = timed_generate(pair.target, ids, args.new_tokens, assistant_model=pair.drafter, spec=DraftSpec())
    return {"ar": ar.decode_tokens_per_second, "speculative": spec.decode_tokens_per_second}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--refresh", type=float, nargs="+", default=[0.2, 1.0])
    parser.add_argument("--out", type=Path, default=RESULTS / "app_overhead")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    torch.set_num_threads(args.threads)
    limits = AppArguments(port=0, threads=args.threads, max_context_length=args.context_length)
    blocks = build_app(limits)
    store = blocks.hf_budgetdraft_store
    _, url, _ = launch_app(blocks, limits, prevent_thread_lock=True, quiet=True)
    captured = capture_summaries()
    default_refresh = compare_module.REFRESH_SECONDS
    rows = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="domcontentloaded")
        browser_run(
            page, args.context_length, args.new_tokens
        )  # warm-up: loads the models, every path runs once
        direct_rates(store, args)
        for repeat in range(args.repeats):
            for refresh in args.refresh:
                compare_module.REFRESH_SECONDS = refresh
                browser_run(page, args.context_length, args.new_tokens)
                rows.append(paired_row("browser", repeat, refresh, captured[-1], direct_rates(store, args)))
        browser.close()
    compare_module.REFRESH_SECONDS = default_refresh
    for repeat in range(args.repeats):  # the same app path with no browser on these cores
        request = RunRequest(model="demo", context_length=args.context_length, max_new_tokens=args.new_tokens)
        *_, last = compare_module.compare(request, store, limits)
        rows.append(
            paired_row(
                "no browser", repeat, compare_module.REFRESH_SECONDS, last.summary, direct_rates(store, args)
            )
        )
    blocks.close()
    store.close()
    write(rows, args)


def paired_row(page: str, repeat: int, refresh: float, app: dict, direct: dict) -> dict:
    row = {"page": page, "repeat": repeat, "refresh_seconds": refresh}
    for column in ("ar", "speculative"):
        row[f"app_{column}"] = app[column]["decode_tokens_per_second"]
        row[f"direct_{column}"] = direct[column]
        row[f"{column}_ratio"] = row[f"app_{column}"] / direct[column]
    print(json.dumps(row), flush=True)
    return row


def write(rows: list[dict], args) -> None:
    meta = {
        "command": "python benchmarks/app_overhead.py " + " ".join(sys.argv[1:]),
        **run_record(args.threads),
    }
    lines = [
        "# The app's decode rates against the same calls made directly (a browser attached)",
        "",
        f"`{meta['command']}` — {args.threads} threads, run alone, {run_text(meta)}; demo pair, "
        f"{args.context_length}-token corpus document, {args.new_tokens} new tokens, the app's defaults "
        "(budgeted, adaptive γ, greedy). Medians of the paired repeats.",
        "",
        "| page | refresh (s) | app AR tok/s | direct AR tok/s | AR app/direct | app one-liner tok/s | direct "
        "one-liner tok/s | one-liner app/direct | app speed-up | direct speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for page, refresh in dict.fromkeys((r["page"], r["refresh_seconds"]) for r in rows):
        cell = [r for r in rows if (r["page"], r["refresh_seconds"]) == (page, refresh)]

        def median(key, cell=cell):
            return statistics.median(r[key] for r in cell)

        lines.append(
            f"| {page} | {refresh} | {median('app_ar'):.1f} | {median('direct_ar'):.1f} | {median('ar_ratio'):.2f} | "
            f"{median('app_speculative'):.1f} | {median('direct_speculative'):.1f} | "
            f"{median('speculative_ratio'):.2f} | "
            f"{statistics.median(r['app_speculative'] / r['app_ar'] for r in cell):.2f} | "
            f"{statistics.median(r['direct_speculative'] / r['direct_ar'] for r in cell):.2f} |"
        )
    write_results(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
