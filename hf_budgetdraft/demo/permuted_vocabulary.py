"""A drafter with another tokenizer that drafts as well as a given one, for the tests and benchmarks of drafters with
their own tokenizer (transformers' universal assisted generation): the drafter and its tokenizer re-indexed by one
permutation of the ids, so it drafts what it drafted before under other ids, its vocabulary padded (transformers
tells two tokenizers apart by their models' vocabulary sizes). Built in memory from the bundled files; nothing is
downloaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

PADDING = 64


def permuted_pair(
    drafter: PreTrainedModel, tokenizer_folder: Path, folder: Path, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(drafter, tokenizer)`: a copy of `drafter` with `PADDING` more embedding rows, which never win, and the
    tokenizer in `tokenizer_folder` (a `tokenizer.json` BPE, ids 0-1 special) with the same ids permuted, saved in
    `folder`."""
    size = drafter.config.vocab_size
    order = torch.cat(
        [torch.arange(2), 2 + torch.randperm(size - 2, generator=torch.Generator().manual_seed(seed))]
    )
    spec = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {token: int(order[i]) for token, i in spec["model"]["vocab"].items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text((tokenizer_folder / "tokenizer_config.json").read_text())
    permuted = copy.deepcopy(drafter)
    permuted.resize_token_embeddings(size + PADDING, mean_resizing=False)
    with torch.no_grad():
        for table, source in (
            (permuted.get_input_embeddings(), drafter.get_input_embeddings()),
            (permuted.get_output_embeddings(), drafter.get_output_embeddings()),
        ):
            table.weight.zero_()
            table.weight[order] = source.weight
    return permuted, AutoTokenizer.from_pretrained(folder)
