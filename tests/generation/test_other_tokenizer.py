"""A drafter with another tokenizer (`tokenizer=` + `assistant_tokenizer=`, transformers' universal assisted
generation) drafting on a sparse cache: greedy output is the target's own, drafts are accepted, sampling keeps the
target's distribution.

The pair with real acceptance is the bundled target with the bundled drafter re-indexed (`demo/permuted_vocabulary.py`):
it drafts what the bundled drafter drafts, under other ids. A random drafter with a BPE trained here covers a
tokenizer that cuts the text differently; character vocabularies sharing some tokens cover sampling."""

import copy
from types import SimpleNamespace

import pytest
import torch
from test_sampling import SAMPLES, chi_square, chi_square_quantile, warped
from tiny_models import model_pair
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_budgetdraft  # noqa: F401  (registers the cache implementations)
from hf_budgetdraft import record_speculation
from hf_budgetdraft.demo import load_demo_models
from hf_budgetdraft.demo.documents import DEMO_TEXT
from hf_budgetdraft.demo.models import DEMO_DIR
from hf_budgetdraft.demo.permuted_vocabulary import permuted_pair
from hf_budgetdraft.generation.other_tokenizer import OtherTokenizerDraftGenerator

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def demo():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return load_demo_models()


@pytest.fixture(scope="module")
def permuted(demo, tmp_path_factory):
    """`(drafter, tokenizer)`: the bundled drafter and tokenizer under permuted ids, in a vocabulary padded by 64."""
    return permuted_pair(demo.drafter, DEMO_DIR / "tokenizer", tmp_path_factory.mktemp("permuted_tokenizer"))


@pytest.fixture(scope="module")
def prompt(demo):
    return demo.tokenizer(DEMO_TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, 5000:6500]


@pytest.fixture(scope="module")
def expected(demo, prompt):
    return demo.target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def _other_tokenizer_call(demo, drafter, tokenizer, ids, **kwargs):
    with record_speculation() as stats:
        out = demo.target.generate(
            ids,
            assistant_model=drafter,
            tokenizer=demo.tokenizer,
            assistant_tokenizer=tokenizer,
            max_new_tokens=kwargs.pop("max_new_tokens", NEW_TOKENS),
            do_sample=False,
            **kwargs,
        )
    return out, stats


@pytest.mark.parametrize("cache", ["budgeted", "sink_window"])
@pytest.mark.parametrize("static", ["auto", False])
def test_a_drafter_with_another_tokenizer_is_lossless_and_accepted(
    demo, permuted, prompt, expected, cache, static
):
    drafter, tokenizer = permuted
    config = {"static": static, "draft_length": 4}
    config |= {"num_sink_tokens": 16, "window_length": 256} if cache == "sink_window" else {}
    out, stats = _other_tokenizer_call(
        demo, drafter, tokenizer, prompt, cache_implementation=cache, cache_config=config
    )
    assert torch.equal(out, expected)
    # the bundled drafter's drafts, translated back (0.8 of them accepted with its own tokenizer)
    assert stats.acceptance_rate > 0.5
    generator = stats.candidate_generator
    assert type(generator).__name__ == "OtherTokenizerDraftGenerator" and generator.restarts == 0
    assert int(generator.prev_assistant_ids.max()) < len(tokenizer)  # padded ids have no text: never drafted
    assert "another tokenizer" in stats.plan.reasons["device_round"]


def test_a_tokenizer_that_cuts_the_text_otherwise_is_lossless(demo, prompt, expected):
    """A byte-level BPE of 400 tokens trained here and a random drafter: its drafts rarely survive, and their text
    (partial characters, merges with the target's last token) goes through both translations."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([DEMO_TEXT.read_text(encoding="utf-8")[:60_000]], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    )  # fmt: skip
    drafter = LlamaForCausalLM(config).eval()
    for cache_config in ({"draft_length": 4}, {"draft_length": 4, "static": False}):
        out, stats = _other_tokenizer_call(
            demo, drafter, tokenizer, prompt, cache_implementation="budgeted", cache_config=cache_config
        )
        assert torch.equal(out, expected) and sum(stats.proposed_per_round) > 0
    short = prompt[:, :6]  # shorter than what the first round holds back from the prefill
    out, _ = _other_tokenizer_call(
        demo, drafter, tokenizer, short, cache_implementation="budgeted", max_new_tokens=16
    )
    assert torch.equal(out, demo.target.generate(short, max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("metaspace_side", ["drafter", "target"])
def test_drafts_come_back_to_the_target_as_their_text(demo, metaspace_side):
    """The anchored translation of greedy drafts, between the byte-level demo tokenizer and a SentencePiece-style
    one (a Metaspace BPE trained here, which drops the leading space when it decodes a sequence): at 100 cuts of the
    play, the target's tokens of a prefix plus the candidates decode to that prefix's text plus the drafted text."""
    text = DEMO_TEXT.read_text(encoding="utf-8")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.train_from_iterator([text[:80_000]], trainers.BpeTrainer(vocab_size=600, special_tokens=["<eos>"]))
    metaspace = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    target, drafter = (
        (demo.tokenizer, metaspace) if metaspace_side == "drafter" else (metaspace, demo.tokenizer)
    )
    generator = SimpleNamespace(
        target_tokenizer=target, assistant_tokenizer=drafter, target_lookbehind=10, assistant_lookbehind=10,
        main_model_max_length=10**6,
    )  # fmt: skip
    cuts = torch.randint(
        1_000, len(text) - 1_000, (100,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    for start in cuts:
        start = text.index(" ", start)  # a draft starts a word, as a drafter's next token would
        prefix, drafted_text = text[start - 300 : start], text[start : start + 1 + start % 40]
        ids = target(prefix, return_tensors="pt").input_ids
        context = drafter(prefix, return_tensors="pt").input_ids
        drafts = drafter(drafted_text, add_special_tokens=False, return_tensors="pt").input_ids
        drafted = torch.cat([context, drafts], dim=-1)
        candidates = OtherTokenizerDraftGenerator._continuation(generator, ids, drafted, context.shape[1])
        assert candidates is not None and torch.equal(candidates[:, : ids.shape[1]], ids)
        assert target.decode(candidates[0]) == target.decode(ids[0]) + drafted_text


def test_a_rollback_past_what_the_draft_cache_can_undo_prefills_it_again(demo, permuted, prompt):
    drafter, tokenizer = permuted
    _, stats = _other_tokenizer_call(demo, drafter, tokenizer, prompt, cache_implementation="budgeted")
    generator = stats.candidate_generator
    held = generator.cached_ids
    changed = torch.cat([held, held[:, -4:]], dim=-1)
    changed[0, 10] = (changed[0, 10] + 1) % len(tokenizer)  # re-read otherwise 10 tokens in: in the prompt
    generator._roll_back_to_shared_prefix(changed)
    assert generator.restarts == 1
    assert generator.seen_tokens == changed.shape[1] - generator.hold_back
    assert torch.equal(generator.cached_ids, changed[:, : generator.seen_tokens])
    assert int(generator.draft_cache.get_seq_length()) == generator.seen_tokens
    # the held-back tokens enter the ring, as the next draft feeds them: a crop among them needs no re-prefill
    seen = generator.seen_tokens
    generator.steps(changed[:, seen:], seen, None)
    generator.cached_ids, generator.seen_tokens = changed, changed.shape[1]
    generator._roll_back_to_shared_prefix(changed[:, :-3])
    assert generator.restarts == 1 and generator.seen_tokens == changed.shape[1] - 4
    assert int(generator.draft_cache.get_seq_length()) == generator.seen_tokens


def _characters(characters: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer of one token per character, ids in the order given."""
    model = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(characters)}, merges=[]))
    model.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=model)


def test_sampling_with_another_tokenizer_keeps_the_target_distribution():
    """Speculative sampling over the tokens both vocabularies hold: the target's tokenizer has 128 characters, the
    drafter's (a padded vocabulary of 136) 120 of them under permuted ids and 8 the target lacks, so some target
    tokens can never be drafted and some drafter tokens are suppressed. The first two sampled tokens follow the
    target's exact marginals (a chi-square test, as `test_sampling.py`)."""
    target, tiny = model_pair("llama", "sdpa", num_assistant_tokens=3, draft_layers=1)
    characters = [chr(0x4E00 + i) for i in range(136)]
    order = torch.cat([torch.arange(8, 128), torch.arange(128, 136)])[torch.randperm(128)]
    drafter_characters = [characters[int(i)] for i in order]  # the drafter's id j is the character order[j]
    drafter = copy.deepcopy(tiny)
    drafter.resize_token_embeddings(136, mean_resizing=False)
    with torch.no_grad():
        for table, source in (
            (drafter.model.embed_tokens, tiny.model.embed_tokens),
            (drafter.lm_head, tiny.lm_head),
        ):
            table.weight.zero_()
            known = order < 128
            table.weight[:128][known] = source.weight[order[known]]
    prompt = "".join(
        characters[int(i)] for i in torch.randint(8, 128, (64,), generator=torch.Generator().manual_seed(5))
    )
    target_tokenizer, drafter_tokenizer = _characters(characters[:128]), _characters(drafter_characters)
    ids = target_tokenizer(prompt, return_tensors="pt").input_ids
    kwargs = {"temperature": 1.0, "top_k": 0}
    with torch.no_grad():
        first = warped(target(ids).logits[0, -1:], **kwargs)[0]  # p(t1)
        continued = torch.cat([ids.expand(first.numel(), -1), torch.arange(first.numel())[:, None]], dim=1)
        second = (first[:, None] * warped(target(continued).logits[:, -1], **kwargs)).sum(0)  # p(t2)
    torch.manual_seed(0)
    counts, drafted = torch.zeros(2, first.numel()), 0
    for _ in range(SAMPLES):
        with record_speculation() as stats:
            out = target.generate(
                ids, assistant_model=drafter, tokenizer=target_tokenizer, assistant_tokenizer=drafter_tokenizer,
                do_sample=True, max_new_tokens=2, cache_implementation="budgeted", cache_config={"budget": 16},
                **kwargs,
            )  # fmt: skip
        drafted += sum(stats.proposed_per_round)
        counts[0, out[0, -2]] += 1
        counts[1, out[0, -1]] += 1
    assert drafted > SAMPLES // 2  # drafts were proposed, translated token for token
    for position, probs in enumerate((first, second)):
        stat, df = chi_square(counts[position], probs)
        assert stat < chi_square_quantile(df), f"token {position}: chi2={stat:.1f} with df={df}"


@pytest.mark.parametrize(
    ("kwargs", "rows", "match"),
    [
        ({}, 2, "one sequence at a time"),
        ({"cache_config": {"full_draft_cache": True}}, 1, "full_draft_cache"),
    ],
)
def test_what_a_drafter_with_another_tokenizer_refuses(demo, permuted, prompt, kwargs, rows, match):
    drafter, tokenizer = permuted
    call = {"do_sample": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        demo.target.generate(
            prompt[:, :64].expand(rows, -1),
            assistant_model=drafter,
            tokenizer=demo.tokenizer,
            assistant_tokenizer=tokenizer,
            cache_implementation="budgeted",
            max_new_tokens=4,
            **call,
        )


def test_a_padded_prompt_is_refused_with_another_tokenizer(demo, permuted, prompt):
    drafter, tokenizer = permuted
    mask = torch.ones(1, 64, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="padded"):
        demo.target.generate(
            prompt[:, :64],
            attention_mask=mask,
            assistant_model=drafter,
            tokenizer=demo.tokenizer,
            assistant_tokenizer=tokenizer,
            cache_implementation="budgeted",
            max_new_tokens=4,
            do_sample=False,
        )
