"""Flags of `hf-budgetdraft demo` / `python -m hf_budgetdraft.app`, and the bounds every visitor input is held to.

Importing this module does not import Gradio, so `hf-budgetdraft` keeps working without the `app` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.sizes import MAX_CACHE_TOKENS

HOST = "127.0.0.1"  # the app never binds anything else; a public link only through Gradio's --share tunnel
_MAX_UPLOAD_BYTES = 64 << 20  # hard ceiling on --max_upload_bytes (a typo cannot accept gigabytes)


@dataclass
class AppArguments:
    """Flags of the demo app. Every `max_*` bounds what a visitor may ask for in the page."""

    port: int = field(default=7860, metadata={"help": "Port on 127.0.0.1 (0: any free port)."})
    share: bool = field(
        default=False,
        metadata={
            "help": "Also open a public *.gradio.live link (needs internet). Off by default: the app listens on "
            "127.0.0.1 only."
        },
    )
    allow_local_models: bool | None = field(
        default=None,
        metadata={
            "help": "Let visitors load model folders from this machine by path (default: yes, except with --share, "
            "where anyone with the link could probe the server's files)."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Let visitors' models run code shipped with their checkpoints (off: transformers' own model "
            "classes only)."
        },
    )
    threads: int = field(default=2, metadata={"help": "torch threads used by the generations."})
    max_context_length: int = field(default=8192, metadata={"help": "Longest prompt a visitor may ask for."})
    max_new_tokens: int = field(default=256, metadata={"help": "Most tokens one generation may produce."})
    max_gamma: int = field(default=16, metadata={"help": "Largest draft length γ."})
    max_window_length: int = field(default=8192, metadata={"help": "Largest draft window."})
    max_budget: int = field(default=8192, metadata={"help": "Largest budgeted draft budget."})
    max_sink_tokens: int = field(default=512, metadata={"help": "Largest attention sink."})
    max_text_chars: int = field(
        default=1_000_000, metadata={"help": "Longest pasted or uploaded text, in characters."}
    )
    max_upload_bytes: int = field(default=2 << 20, metadata={"help": "Largest uploaded file, in bytes."})
    max_model_bytes: int = field(
        default=8 << 30,
        metadata={"help": "Largest local model (sum of its .safetensors files) a visitor may load."},
    )
    max_run_seconds: int = field(
        default=300,
        metadata={"help": "A generation still running after this long is stopped (its output is cut)."},
    )
    queue_size: int = field(
        default=8,
        metadata={"help": "Runs that may wait in the queue (one runs at a time); more are refused."},
    )

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.allow_local_models is None:
            self.allow_local_models = not self.share
        for name, low, high in (
            ("threads", 1, 1024),
            ("max_context_length", 16, MAX_CACHE_TOKENS),
            ("max_new_tokens", 1, 4096),
            ("max_gamma", 1, 64),
            ("max_window_length", 1, MAX_CACHE_TOKENS),
            ("max_budget", 1, MAX_CACHE_TOKENS),
            ("max_sink_tokens", 0, MAX_CACHE_TOKENS),
            ("max_text_chars", 1, 100_000_000),
            ("max_upload_bytes", 1, _MAX_UPLOAD_BYTES),
            ("max_model_bytes", 1, 1 << 40),
            ("max_run_seconds", 1, 86_400),
            ("queue_size", 1, 1000),
        ):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"--{name} must be in [{low}, {high}], got {value}")
