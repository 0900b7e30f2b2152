"""Bundled demo assets, trained offline by `scripts/` (never retrained in CI): the byte-level BPE tokenizer
(`demo/tokenizer`, 2,048 tokens, single-digit numbers). The demo target/drafter weights are not bundled yet."""
