"""Text -> packed rows -> teacher targets computed once (datasets.map) and reloaded from the cache."""

import json

import datasets
import pytest
import torch
from tiny_models import model_pair
from trainer_helpers import (
    EOS,
    char_tokenizer,
    write_corpus,
)

from hf_budgetdraft.trainer import (
    generate_target_continuations,
    load_text_dataset,
    pack_dataset,
    precompute_teacher_targets,
    sampled_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_load_and_pack_local_text(tmp_path):
    write_corpus(tmp_path, num_documents=3, length=300)
    (tmp_path / "notes.jsonl").write_text(json.dumps({"text": "j" * 50, "id": 1}) + "\n", encoding="utf-8")
    documents = load_text_dataset(data_files=[str(tmp_path)])
    texts = sorted(documents["text"], key=len)
    assert len(texts) == 4 and texts[0] == "j" * 50 and len(texts[-1]) == 300  # whole files, folders recursed
    tokenizer = char_tokenizer()
    rows = pack_dataset(documents, tokenizer, sequence_length=100)
    stream = [
        t for text in documents["text"] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert rows["input_ids"] == [stream[i : i + 100] for i in range(0, len(stream) - 99, 100)]
    per_document = pack_dataset(documents, tokenizer, sequence_length=100, across_documents=False)
    assert (
        len(per_document) == 3 * 3
    )  # 301 tokens per 300-char file -> 3 rows each; the 51-token one is dropped
    assert all(EOS not in tokenizer.decode(row[:-1]) for row in per_document["input_ids"])


def test_data_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text_dataset(data_files=[str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="no .txt"):
        load_text_dataset(data_files=[str(tmp_path)])
    with pytest.raises(ValueError, match="exactly one of"):
        load_text_dataset()
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="pass --text_column"):
        load_text_dataset(data_files=[str(tmp_path / "a.jsonl")])
    short = datasets.Dataset.from_dict({"text": ["tiny"]})
    with pytest.raises(ValueError, match="Add text or lower the lengths"):
        pack_dataset(short, char_tokenizer(), sequence_length=100)


def test_teacher_targets_are_computed_once_and_cached(tmp_path):
    target, _ = model_pair("llama", "sdpa", draft_layers=1)
    generator = torch.Generator().manual_seed(0)
    rows = datasets.Dataset.from_dict(
        {"input_ids": torch.randint(0, 128, (3, 40), generator=generator).tolist()}
    )
    with torch.no_grad():
        logits = target(torch.tensor(rows["input_ids"])).logits[:, 32:38]  # positions P .. P + C - 1
    calls = []
    target.register_forward_hook(lambda *_: calls.append(1))
    labelled = precompute_teacher_targets(rows, target, 32, 6, top_k=4, batch_size=2, cache_dir=str(tmp_path))
    assert len(calls) == 2  # 3 rows in batches of 2
    assert labelled["teacher_labels"] == logits.argmax(-1).tolist()
    top = logits.log_softmax(-1).topk(4, dim=-1)
    assert labelled["teacher_topk_ids"] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor(labelled["teacher_topk_logprobs"]), top.values, rtol=1e-5, atol=1e-5
    )

    again = precompute_teacher_targets(rows, target, 32, 6, top_k=4, batch_size=2, cache_dir=str(tmp_path))
    assert len(calls) == 2, "the second call must load the cached targets, not run the teacher"
    assert again["teacher_labels"] == labelled["teacher_labels"]
    with torch.no_grad():
        target.lm_head.weight.mul_(1.5)  # new teacher weights: the cache must not be reused
    precompute_teacher_targets(rows, target, 32, 6, top_k=4, batch_size=2, cache_dir=str(tmp_path))
    assert len(calls) == 4


def test_target_continuations_are_the_targets_own_greedy_tokens(tmp_path):
    target, _ = model_pair("llama", "sdpa", draft_layers=1)
    generator = torch.Generator().manual_seed(1)
    rows = datasets.Dataset.from_dict(
        {"input_ids": torch.randint(0, 128, (2, 40), generator=generator).tolist()}
    )
    prefixes = torch.tensor(rows["input_ids"])[:, :32]
    with torch.no_grad():
        expected = [
            target.generate(p[None], do_sample=False, max_new_tokens=6, min_new_tokens=6)[0].tolist()
            for p in prefixes
        ]
    assert expected != [
        row[:38] for row in rows["input_ids"]
    ]  # the random text is not what the target writes
    regenerated = generate_target_continuations(rows, target, 32, 6, batch_size=2, cache_dir=str(tmp_path))
    assert regenerated["input_ids"] == expected  # decoded as one batch, each row the target's own greedy text
    calls = []
    target.register_forward_hook(lambda *_: calls.append(1))
    again = generate_target_continuations(rows, target, 32, 6, batch_size=2, cache_dir=str(tmp_path))
    assert not calls and again["input_ids"] == expected  # loaded from the cache, not regenerated
    with pytest.raises(ValueError, match="shorter than prefix_length"):
        generate_target_continuations(rows, target, 32, 9)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        generate_target_continuations(rows, target, 32, 6, batch_size=0)


def test_sampled_rows_spread_the_share_evenly():
    assert sampled_rows(8, 0.0) == [False] * 8 and sampled_rows(8, 1.0) == [True] * 8
    assert sampled_rows(8, 0.5) == [False, True] * 4
    assert sum(sampled_rows(10, 0.3)) == 3
    with pytest.raises(ValueError, match="sampled_fraction must be in"):
        sampled_rows(4, 1.5)


def test_sampled_continuations_are_the_targets_seeded_samples(tmp_path):
    target, _ = model_pair("llama", "sdpa", draft_layers=1)
    generator = torch.Generator().manual_seed(2)
    rows = datasets.Dataset.from_dict(
        {"input_ids": torch.randint(0, 128, (4, 40), generator=generator).tolist()}
    )
    prefixes = torch.tensor(rows["input_ids"])[:, :32]
    with torch.no_grad():
        greedy = target.generate(prefixes[[0, 2]], do_sample=False, max_new_tokens=6, min_new_tokens=6)
        torch.manual_seed(7)  # the seed of the first (only) batch
        sampled = target.generate(
            prefixes[[1, 3]], do_sample=True, temperature=1.3, max_new_tokens=6, min_new_tokens=6
        )
    out = generate_target_continuations(
        rows,
        target,
        32,
        6,
        batch_size=4,
        cache_dir=str(tmp_path),
        sampled_fraction=0.5,
        temperature=1.3,
        seed=7,
    )
    assert out["input_ids"] == [
        greedy[0].tolist(),
        sampled[0].tolist(),
        greedy[1].tolist(),
        sampled[1].tolist(),
    ]
    assert sampled.tolist() != target.generate(prefixes[[1, 3]], do_sample=False, max_new_tokens=6).tolist()
    all_greedy = generate_target_continuations(rows, target, 32, 6, batch_size=4, cache_dir=str(tmp_path))
    assert all_greedy["input_ids"][1] != out["input_ids"][1]  # another cache entry, not the sampled one
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate_target_continuations(rows, target, 32, 6, sampled_fraction=0.5, temperature=0.0)
