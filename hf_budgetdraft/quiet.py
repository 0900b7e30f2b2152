"""Keep the libraries' load-time output (progress bars, load reports, a peft deprecation warning) out of what the
package's own calls print."""

from __future__ import annotations

import contextlib
import warnings

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_transformers():
    """No per-call "Loading weights" bars or load reports (MTP heads are reloaded inside every generate)."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def peft_wrapping():
    """Build a `PeftModel` without transformers' `is_gradient_checkpointing` FutureWarning, and only that one.

    `PeftModel.__init__` reads `model.is_gradient_checkpointing` on the model it wraps; transformers 5 deprecated
    that property for `is_activation_checkpointing` and warns on every read, so wrapping any transformers model
    warns whatever the caller passes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="`is_gradient_checkpointing` is deprecated",
            category=FutureWarning,
            module=r"transformers\.modeling_utils",
        )
        yield
