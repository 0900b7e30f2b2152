"""The demo page in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright with
`executable_path`; no browser download) loads the page, runs one short generation on the bundled demo models, checks that
both outputs, the verdict, the stats and the plot appear, and saves a screenshot.

Set `HF_BUDGETDRAFT_SCREENSHOT=docs/app.png` to also write the README's screenshot.
"""

import os
import re
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("HF_BUDGETDRAFT_CHROMIUM", "/usr/bin/chromium")
if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
    pytest.skip(
        f"headless Chromium is not installed at {CHROMIUM}: `apt-get install chromium chromium-driver` (.ci/run does "
        "this when it runs as root), or point HF_BUDGETDRAFT_CHROMIUM at a Chromium binary",
        allow_module_level=True,
    )
pytest.importorskip("gradio", reason="the demo app needs the `app` extra: pip install 'hf-budgetdraft[app]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install 'hf-budgetdraft[app]' (playwright)")

from hf_budgetdraft.app import AppArguments  # noqa: E402
from hf_budgetdraft.app.app import (  # noqa: E402
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_NEW_TOKENS,
    build_app,
    launch_app,
)

# offline, as root, in a container: no sandbox, no GPU, no background calls to Google's hosts
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
]
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def url():
    args = AppArguments(port=0, threads=2, max_context_length=DEFAULT_CONTEXT_LENGTH, max_new_tokens=256)
    blocks = build_app(args)
    _, local_url, _ = launch_app(blocks, args, prevent_thread_lock=True, quiet=True)
    yield local_url
    blocks.close()
    blocks.hf_budgetdraft_store.close()


@pytest.fixture(scope="module")
def page(url):
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        except sync_api.Error as error:  # a broken browser install is the machine's problem, not the app's
            pytest.skip(f"Chromium at {CHROMIUM} did not start: {str(error).splitlines()[0]}")
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url, wait_until="domcontentloaded")
            yield page
        finally:
            browser.close()


def test_one_generation_in_the_browser(page, tmp_path):
    expect = sync_api.expect
    expect(page.get_by_role("heading", name="hf-budgetdraft")).to_be_visible()
    expect(page.get_by_role("combobox", name="Models")).to_have_value(re.compile("Bundled demo pair"))
    new_tokens = (
        DEFAULT_NEW_TOKENS  # the page's defaults: the run a first visitor sees (the README's screenshot)
    )
    for box, value in (("#context-length", DEFAULT_CONTEXT_LENGTH), ("#max-new-tokens", new_tokens)):
        expect(page.locator(f"{box} input[type=range]")).to_have_value(str(value))
    page.locator("#run").click()
    expect(page.locator("#verdict")).to_contain_text(
        "Identical to the target's own greedy output", timeout=TIMEOUT_MS
    )
    expect(page.locator("#status")).to_contain_text("Done")
    expect(page.locator("#stats")).to_contain_text(f"Prompt: {DEFAULT_CONTEXT_LENGTH} tokens")
    # both columns, every token coloured by where it came from
    expect(page.locator('#ar-output span[data-origin="ar"]')).to_have_count(new_tokens)
    drafted = page.locator('#spec-output span[data-origin="draft"]').count()
    corrected = page.locator('#spec-output span[data-origin="target"]').count()
    assert drafted + corrected == new_tokens and corrected >= 1
    for text in ("speed-up vs AR", "mean accepted length", "acceptance rate", "KV cache"):
        expect(page.locator("#stats")).to_contain_text(text)
    expect(page.locator("#acceptance-plot img")).to_be_visible()
    screenshot = tmp_path / "app.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 20_000
    if os.environ.get("HF_BUDGETDRAFT_SCREENSHOT"):
        target = Path(os.environ["HF_BUDGETDRAFT_SCREENSHOT"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, target)


def test_bad_input_is_a_message_in_the_page(page):
    page.get_by_label("Your text (paste or upload)").check()
    page.locator("#run").click()
    expect = sync_api.expect
    expect(page.locator("#status")).to_contain_text("the text is empty", timeout=TIMEOUT_MS)
    assert "Traceback" not in page.content()
    page.get_by_label("Long document (built-in corpus)").check()  # leave the page as it was
