"""`hf-budgetdraft demo`: serve the Gradio app (`hf_budgetdraft.app`) on 127.0.0.1 until interrupted; its flags
are `AppArguments`, the bounds every visitor input is held to."""

from __future__ import annotations

from ..app.arguments import AppArguments


def demo_command(args: AppArguments) -> int:
    """Serve the demo page until interrupted (needs the `app` extra: Gradio and matplotlib)."""
    try:
        from ..app.app import launch
    except ImportError as error:
        if (error.name or "").split(".")[0] in ("gradio", "gradio_client", "matplotlib"):
            raise SystemExit(
                f"hf-budgetdraft demo needs {error.name}: pip install 'hf-budgetdraft[app]'"
            ) from None
        raise
    return launch(args)
