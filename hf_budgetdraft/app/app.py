"""The Gradio page of `hf-budgetdraft demo`: controls on the left; plain AR and the speculative method side by
side on the right, streamed token by token and coloured by where each token came from; the stats panel, the
greedy-diff verdict and the acceptance-per-position plot below them.

`build_app()` only lays out components and wires the event functions of this module, which are plain functions
of the component values (tested directly in `tests/app/test_app.py`); the work happens in `backend.compare`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry calls

import gradio as gr  # noqa: E402

from .arguments import HOST, AppArguments  # noqa: E402
from .backend import (  # noqa: E402
    DEFAULT_MODEL,
    DEFAULT_SPEC,
    DRAFTER_METHODS,
    METHOD_LABELS,
    MODEL_LOCAL,
    MODEL_SMOKE_MTP,
    MTP_METHODS,
    POLICY_NAMES,
    SOURCE_LABELS,
    UPLOAD_SUFFIXES,
    ModelStore,
    RunRequest,
    Snapshot,
    compare,
    devices,
    model_choices,
)
from .render import acceptance_figure, stats_markdown, tokens_html, verdict_markdown  # noqa: E402

# the order of the run event's inputs: RunRequest fields, except `decoding` ("greedy" | "sampling")
RUN_INPUTS = (
    "model",
    "target_path",
    "drafter_path",
    "device",
    "dtype",
    "source",
    "text",
    "upload",
    "depth",
    "context_length",
    "method",
    "policy",
    "num_sink_tokens",
    "window_length",
    "budget",
    "gamma",
    "max_new_tokens",
    "decoding",
    "temperature",
    "seed",
)
# the first run shows the package at a long context: a 4K-token document, enough tokens for decoding to dominate
DEFAULT_CONTEXT_LENGTH, DEFAULT_NEW_TOKENS = 4096, 128
RUN_OUTPUTS = ("status", "prompt", "ar_output", "spec_output", "verdict", "stats", "plot", "raw")

INTRO = """\
# hf-budgetdraft — long-context speculative decoding with a sparse draft cache
The **draft** reads only a sparse KV cache (a sink + a recent window, or a budget of selected tokens); the
**target** verifies every drafted token with its full cache, so greedy output is exactly the target's own.
Both columns stream as tokens are produced: plain AR first, then the speculative run, one after the other on the
same cores so their tokens/s compare. One run at a time: other visitors wait in a queue.
"""

THEME_FONTS = dict(  # system fonts only: the page loads nothing from the internet
    font=["ui-sans-serif", "system-ui", "sans-serif"],
    font_mono=["ui-monospace", "Consolas", "monospace"],
)


# ---------------------------------------------------------------------------------------------------------------
# Event functions (plain functions of component values)
# ---------------------------------------------------------------------------------------------------------------


def request_from_values(*values) -> RunRequest:
    """The `RunRequest` of the run event's input values, given in `RUN_INPUTS` order."""
    if len(values) != len(RUN_INPUTS):
        raise TypeError(f"expected {len(RUN_INPUTS)} values ({', '.join(RUN_INPUTS)}), got {len(values)}")
    named = dict(zip(RUN_INPUTS, values, strict=True))
    decoding = named.pop("decoding")
    named["sampling"] = decoding == "sampling"
    for name in ("target_path", "drafter_path", "text"):
        named[name] = named[name] or ""
    named["device"], named["dtype"] = named["device"] or "cpu", named["dtype"] or "float32"
    named["upload"] = named["upload"] or None
    return RunRequest(**named)


def snapshot_outputs(snapshot: Snapshot) -> tuple:
    """The values of `RUN_OUTPUTS` for one snapshot of a comparison."""
    status = snapshot.status if not snapshot.error else f"**{snapshot.status}**"
    prompt = ""
    if snapshot.prompt is not None:
        preview = snapshot.prompt.preview.replace("```", "`‵`")
        prompt = f"{snapshot.prompt.description}\n\n…end of the prompt:\n```text\n{preview}\n```"
    not_run = "Not run: choose a speculative method to compare it with plain AR."
    figure = None
    if snapshot.acceptance:
        method = (snapshot.summary or {}).get("speculative", {}).get("method", "")
        figure = acceptance_figure(snapshot.acceptance, f"Acceptance per draft position — {method}")
    return (
        status,
        prompt,
        tokens_html(snapshot.ar, "Press Run."),
        tokens_html(snapshot.spec, not_run if snapshot.ar is not None else "Press Run."),
        verdict_markdown(snapshot.summary),
        stats_markdown(snapshot.summary),
        figure,
        snapshot.summary,
    )


def run_event(store: ModelStore, limits: AppArguments, *values) -> Iterator[tuple]:
    """The Run button: stream `RUN_OUTPUTS` values while AR and then the speculative method generate.

    Never raises for bad input: the first output (the status line) then says what to fix.
    """
    try:
        request = request_from_values(*values)
    except TypeError as error:  # a client calling the API with the wrong fields
        yield snapshot_outputs(Snapshot(f"⚠ {error}", error=True))
        return
    with contextlib.closing(compare(request, store, limits)) as snapshots:
        for snapshot in snapshots:
            yield snapshot_outputs(snapshot)


def on_model_change(model: str, method: str) -> tuple:
    """Show the model boxes, device and dtype for the visitor's own models; move to a method the chosen models
    have."""
    local = model == MODEL_LOCAL
    if model == MODEL_SMOKE_MTP and method in DRAFTER_METHODS:
        method = "mtp_windowed"
    elif model != MODEL_SMOKE_MTP and model != MODEL_LOCAL and method in MTP_METHODS:
        method = DEFAULT_SPEC.cache
    shown = gr.update(visible=local)
    return shown, shown, shown, shown, gr.update(value=method)


def on_source_change(source: str) -> tuple:
    """Depth for the passkey; text box and upload for the visitor's own text."""
    return (
        gr.update(visible=source == "passkey"),
        gr.update(visible=source == "text"),
        gr.update(visible=source == "text"),
    )


def on_method_change(method: str) -> tuple:
    """Only the knobs of the chosen method: policy and budget for budgeted; sink for sink windows; window for
    every sparse cache; γ for drafter methods (an MTP head drafts as many tokens as it has layers)."""
    sparse = method in ("sink_window", "budgeted", "mtp_windowed")
    return (
        gr.update(visible=method == "budgeted"),
        gr.update(visible=method == "budgeted"),
        gr.update(visible=method in ("sink_window", "mtp_windowed")),
        gr.update(visible=sparse),
        gr.update(visible=method in DRAFTER_METHODS),
    )


def on_decoding_change(decoding: str) -> dict:
    return gr.update(visible=decoding == "sampling")


# ---------------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------------


def build_app(args: AppArguments | None = None, store: ModelStore | None = None) -> gr.Blocks:
    """The demo page, its queue set to one run at a time.

    Args:
        args (`AppArguments`, *optional*): limits and options (defaults: `AppArguments()`).
        store (`ModelStore`, *optional*): where models are loaded and kept (a new one by default).

    Returns:
        `gr.Blocks`: launch it with `launch_app(blocks, args)` (binds 127.0.0.1) or `blocks.launch(...)`.
    """
    args = args or AppArguments()
    store = store or ModelStore(args)
    with gr.Blocks(title="hf-budgetdraft demo", analytics_enabled=False) as blocks:
        gr.Markdown(INTRO)
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=320):
                ui = _model_controls(args) | _context_controls(args)
                with gr.Group():
                    ui |= _method_controls(args) | _decoding_controls(args)
                with gr.Row():
                    ui["run_button"] = gr.Button("Run", variant="primary", elem_id="run")
                    ui["stop_button"] = gr.Button("Stop", variant="stop", elem_id="stop")
            with gr.Column(scale=2, min_width=480):
                ui |= _output_panel()
        _wire_events(ui, store, args)
    blocks.queue(default_concurrency_limit=1, max_size=args.queue_size)
    blocks.hf_budgetdraft_store = store  # for tests and for closing
    return blocks


def _model_controls(args: AppArguments) -> dict:
    """The model selector and the local folder boxes (shown for local models only)."""
    with gr.Group():
        return {
            "model": gr.Dropdown(
                model_choices(args.allow_local_models), value=DEFAULT_MODEL, label="Models", elem_id="model"
            ),
            "target_path": gr.Textbox(
                label="Target: a folder on the server or a hub id in its Hugging Face cache",
                placeholder="/path/to/target or someone/long-target (safetensors; never downloaded)",
                visible=False,
                max_lines=1,
            ),
            "drafter_path": gr.Textbox(
                label="Drafter: folder or cached hub id (empty for AR or MTP)",
                placeholder="/path/to/drafter or someone/small-drafter",
                visible=False,
                max_lines=1,
            ),
            "device": gr.Dropdown(devices(), value="cpu", label="Device", visible=False, elem_id="device"),
            "dtype": gr.Dropdown(
                ["float32", "bfloat16", "float16", "auto"], value="float32", label="dtype", visible=False
            ),
        }


def _context_controls(args: AppArguments) -> dict:
    """The context source, the passkey depth, the visitor's text or file, and the prompt length."""
    with gr.Group():
        return {
            "source": gr.Radio(
                [(label, key) for key, label in SOURCE_LABELS.items()],
                value="document",
                label="Context",
                elem_id="source",
            ),
            "depth": gr.Slider(
                0.0, 1.0, value=0.5, step=0.05, label="Passkey depth (0 = start)", visible=False
            ),
            "text": gr.Textbox(
                label=f"Your text (≤ {args.max_text_chars:,} characters; its last tokens are the prompt)",
                lines=5,
                max_lines=12,
                max_length=args.max_text_chars,
                visible=False,
            ),
            "upload": gr.File(
                label=f"…or upload a text file (≤ {args.max_upload_bytes // 1024:,} KiB)",
                file_types=list(UPLOAD_SUFFIXES),
                type="filepath",
                visible=False,
            ),
            "context_length": gr.Slider(
                16,
                args.max_context_length,
                value=min(DEFAULT_CONTEXT_LENGTH, args.max_context_length),
                step=16,
                label="Context length (prompt tokens)",
                elem_id="context-length",
            ),
        }


def _method_controls(args: AppArguments) -> dict:
    """The method and its draft-cache knobs (budgeted's policy and budget, the sink, the window, γ)."""
    return {
        "method": gr.Dropdown(
            [(label, key) for key, label in METHOD_LABELS.items()],
            value=DEFAULT_SPEC.cache,
            label="Method",
            elem_id="method",
        ),
        "policy": gr.Dropdown(list(POLICY_NAMES), value=DEFAULT_SPEC.policy, label="Budget policy"),
        "budget": gr.Slider(
            1, args.max_budget, value=min(DEFAULT_SPEC.budget, args.max_budget), step=1, label="Budget B"
        ),
        "num_sink_tokens": gr.Slider(
            0,
            args.max_sink_tokens,
            value=min(DEFAULT_SPEC.num_sink_tokens, args.max_sink_tokens),
            step=1,
            label="Sink tokens S",
            visible=False,
        ),
        "window_length": gr.Slider(
            1,
            args.max_window_length,
            value=min(DEFAULT_SPEC.window_length, args.max_window_length),
            step=1,
            label="Window W (recent tokens the draft reads)",
        ),
        "gamma": gr.Slider(
            0, args.max_gamma, value=0, step=1, label="γ (draft tokens per round; 0 = adaptive, the default)"
        ),
    }


def _decoding_controls(args: AppArguments) -> dict:
    """How many tokens each run makes, greedy or sampling (and its temperature), and the seed."""
    controls = {
        "max_new_tokens": gr.Slider(
            1,
            args.max_new_tokens,
            value=min(DEFAULT_NEW_TOKENS, args.max_new_tokens),
            step=1,
            label="Max new tokens",
            elem_id="max-new-tokens",
        )
    }
    with gr.Row():
        controls["decoding"] = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding")
        controls["temperature"] = gr.Slider(
            0.05, 5.0, value=1.0, step=0.05, label="Temperature", visible=False
        )
        controls["seed"] = gr.Number(value=0, precision=0, minimum=0, label="Seed")
    return controls


def _output_panel() -> dict:
    """The status line, the two output columns, the verdict, the stats, the plot, the prompt and the raw JSON."""
    panel = {
        "status": gr.Markdown(
            "Choose the models, a context and a method, then press **Run**.", elem_id="status"
        )
    }
    with gr.Row(equal_height=False):
        panel["ar_output"] = gr.HTML(tokens_html(None, "Press Run."), elem_id="ar-output")
        panel["spec_output"] = gr.HTML(tokens_html(None, "Press Run."), elem_id="spec-output")
    panel["verdict"] = gr.Markdown(elem_id="verdict")
    panel["stats"] = gr.Markdown(elem_id="stats")
    panel["plot"] = gr.Plot(
        label="Acceptance per draft position", show_label=False, format="png", elem_id="acceptance-plot"
    )
    with gr.Accordion("Prompt", open=False):
        panel["prompt"] = gr.Markdown(elem_id="prompt")
    with gr.Accordion("Raw numbers (JSON)", open=False):
        panel["raw"] = gr.JSON(elem_id="raw")
    return panel


def _wire_events(ui: dict, store: ModelStore, args: AppArguments) -> None:
    """Run and Stop, and the selectors that show or hide the knobs of what is chosen."""

    def run(*values):
        yield from run_event(store, args, *values)

    run_dependency = ui["run_button"].click(
        run,
        [ui[name] for name in RUN_INPUTS],
        [ui[name] for name in RUN_OUTPUTS],
        api_name="run",
        concurrency_limit=1,
        concurrency_id="generate",
    )
    ui["stop_button"].click(None, None, None, cancels=[run_dependency], api_visibility="private")
    ui["model"].change(
        on_model_change,
        [ui["model"], ui["method"]],
        [ui["target_path"], ui["drafter_path"], ui["device"], ui["dtype"], ui["method"]],
        api_visibility="private",
    )
    ui["source"].change(
        on_source_change, ui["source"], [ui["depth"], ui["text"], ui["upload"]], api_visibility="private"
    )
    knobs = [ui[name] for name in ("policy", "budget", "num_sink_tokens", "window_length", "gamma")]
    ui["method"].change(on_method_change, ui["method"], knobs, api_visibility="private")
    ui["decoding"].change(on_decoding_change, ui["decoding"], ui["temperature"], api_visibility="private")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def launch_app(blocks: gr.Blocks, args: AppArguments, **overrides):
    """Serve `blocks` on 127.0.0.1:`args.port` (a free port for 0); a public link only with `args.share`.

    `overrides` go to `gr.Blocks.launch` (e.g. `prevent_thread_lock=True` in tests); `server_name` cannot be
    overridden.
    """
    if "server_name" in overrides:
        raise ValueError("the demo app binds 127.0.0.1 only; use --share for a public link")
    options = dict(
        server_name=HOST,
        server_port=args.port or free_port(),
        share=args.share,
        max_file_size=args.max_upload_bytes,
        ssr_mode=False,
        show_error=False,
        theme=gr.themes.Soft(**THEME_FONTS),
        css=".bd-tokens span:hover{outline:1px solid #374151}",
    )
    return blocks.launch(**(options | overrides))


def launch(args: AppArguments) -> int:
    """`hf-budgetdraft demo`: build the page and serve it until interrupted."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    blocks = build_app(args)
    try:
        launch_app(blocks, args)
    finally:
        blocks.hf_budgetdraft_store.close()
    return 0
