"""Bundled demo assets, trained offline by `scripts/` (never retrained in CI): the byte-level BPE tokenizer
(`demo/tokenizer`, 2,048 tokens, single-digit numbers) and the demo models (`load_demo_models()`)."""

from .models import DemoModels, load_demo_models

__all__ = ["DemoModels", "load_demo_models"]
