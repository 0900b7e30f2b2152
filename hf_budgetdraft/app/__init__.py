"""The Gradio demo app: `hf-budgetdraft demo` (`hf_budgetdraft.commands.demo`) or `python -m hf_budgetdraft.app`
(needs the `app` extra).

It serves a page on 127.0.0.1 where a visitor picks models (the bundled demo pair when this version has it, the
random smoke pair always, or local model folders), a long context, and a speculative method, and sees plain AR and
the speculative run side by side: tokens coloured by how they came (accepted draft token vs the target's own),
tokens/s and speed-up, acceptance per draft position, draft-cache bytes, and the greedy "identical to the target"
check. The app holds no decoding logic: it calls `generate()` with the library's cache implementations.

- `config`: `AppArguments`, the flags and the bounds on every visitor input (no Gradio import);
- `backend`: the request checks, models, prompts and the streamed AR-vs-speculative comparison, one module
  per concern (no Gradio);
- `render`: HTML / Markdown / matplotlib views of a comparison;
- `app`: the Gradio page (`build_app`) and its event functions.
"""

from __future__ import annotations

from .arguments import HOST, AppArguments


def build_app(*args, **kwargs):
    """`hf_budgetdraft.app.app.build_app` (imports Gradio on first use)."""
    from .app import build_app as _build_app

    return _build_app(*args, **kwargs)


__all__ = ["HOST", "AppArguments", "build_app"]
