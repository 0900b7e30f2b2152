"""Train the demo models' byte-level BPE tokenizer on the corpus's train split (`tokenizers`).

Digits are split into single tokens, so a pass key of n digits is n tokens (retrieval = copying).

    python scripts/train_tokenizer.py --corpus data/corpus --vocab-size 2048 --out hf_budgetdraft/demo/tokenizer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("hf_budgetdraft/demo/tokenizer"))
    args = parser.parse_args()

    def texts():
        with open(args.corpus / "train.jsonl") as handle:
            for line in handle:
                yield json.loads(line)["text"]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.model_max_length = 1 << 20
    fast.save_pretrained(args.out)
    sample = "The pass key is 48213. Remember it.\ndef f(x):\n    return x"
    print(f"vocab {fast.vocab_size}; sample -> {fast.tokenize(sample)}")


if __name__ == "__main__":
    main()
