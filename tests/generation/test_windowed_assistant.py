"""A Gemma 4 assistant drafting on a sink + window (`cache_implementation="sink_window"`) or a budget + window
(`"budgeted"`) of the target's full-attention states: the output is the target's own, the assistant reads at most
what the cache of that name would hold, and what it cannot do is refused with the reason."""

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from hf_budgetdraft import record_speculation
from hf_budgetdraft.cache.policies import ChunkPolicy
from hf_budgetdraft.generation.windowed_assistant import BudgetRead, SinkWindowRead, read_states

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    sliding_window=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = {"num_sink_tokens": 4, "window_length": 24}
BUDGET = {"budget": 40, "policy_kwargs": {"chunk_size": 8}, "window_length": 16}
READ_AT_MOST = {"sink_window": 4 + 24, "budgeted": 40 + 16}


def random_prompt(length: int, seed: int = 0) -> torch.LongTensor:
    """Token ids past the special ones (a pad id in the prompt would make transformers infer padding)."""
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


NEW_TOKENS = 30


@pytest.fixture(scope="module")
def gemma4():
    """A Gemma 4 target (sliding and full layers) and its assistant, random weights."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gemma4_text",
        **SIZES,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
    )
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    text = dict(
        SIZES,
        model_type="gemma4_text",
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=2,
    )
    try:
        assistant = Gemma4AssistantForCausalLM(
            Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64)
        ).eval()
    except ValueError as error:  # 5.23's text config refuses layers that all reuse keys, as an assistant's do
        pytest.skip(f"transformers {transformers.__version__} cannot build a Gemma 4 assistant: {error}")
    assistant.generation_config.num_assistant_tokens = 4
    return target, assistant


class Oracle:
    """Wraps the assistant's forward: runs it (on the states it is given, whose full-attention length is recorded)
    and replaces its proposal with the target's own next token, wrong at every 5th position, so rounds are accepted
    in part and the loop rolls back."""

    def __init__(self, assistant, reference: torch.LongTensor):
        self.forward, self.reference, self.lengths = assistant.forward, reference, []
        self.position, self.step = None, 0

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        self.lengths.append(kwargs["shared_kv_states"]["full_attention"][0].shape[2])
        position = int(kwargs["position_ids"][0, -1])
        self.step = self.step + 1 if position == self.position else 1
        self.position = position
        index = position + self.step
        token = int(self.reference[0, index]) if index < self.reference.shape[1] else 3
        if index % 5 == 0:
            token = (token + 1) % out.logits.shape[-1]
        out.logits = torch.nn.functional.one_hot(torch.tensor([[token]]), out.logits.shape[-1]).float()
        return out


@pytest.mark.parametrize("cache,cache_config", [("sink_window", WINDOW), ("budgeted", BUDGET), (None, None)])
def test_the_assistant_reads_what_the_cache_holds_and_the_output_is_the_targets(
    gemma4, monkeypatch, cache, cache_config
):
    target, assistant = gemma4
    ids = random_prompt(200)
    call = dict(do_sample=False, max_new_tokens=NEW_TOKENS)
    expected = target.generate(ids, **call)
    oracle = Oracle(assistant, expected)
    monkeypatch.setattr(assistant, "forward", oracle)
    with record_speculation() as stats:
        out = target.generate(
            ids, assistant_model=assistant, cache_implementation=cache, cache_config=cache_config, **call
        )
    assert torch.equal(out, expected)
    if cache is None:  # stock: the whole verified context, growing
        assert max(oracle.lengths) > 200
        return
    assert 0 < sum(stats.accepted_per_round) < sum(stats.proposed_per_round)  # accepted in part
    assert max(oracle.lengths) == READ_AT_MOST[cache]


def test_a_sink_window_read_keeps_the_sink_and_the_last_verified_positions():
    keys = torch.arange(10.0).view(1, 1, 10, 1)
    states = {"full_attention": (keys, -keys), "sliding_attention": (keys[:, :, -3:], keys[:, :, -3:])}
    read = SinkWindowRead(num_sink_tokens=2, window_length=3)
    windowed = read_states(states, 8, read)  # 8, 9: rejected drafts
    assert windowed["full_attention"][0].flatten().tolist() == [0, 1, 5, 6, 7]
    assert windowed["full_attention"][1].flatten().tolist() == [0, -1, -5, -6, -7]
    assert windowed["sliding_attention"] is states["sliding_attention"]
    assert read_states(states, 5, read) == states  # fits: as given
    after_prefill = read_states(states, 11, read)  # states end before it
    assert after_prefill["full_attention"][0].flatten().tolist() == [0, 1, 7, 8, 9]


def test_a_budget_read_chooses_once_per_head_from_the_prompt_then_reads_the_window():
    """Two KV heads whose best chunks differ: each keeps its own; positions after the prompt come from the window,
    the choice made at the first round stands."""
    prompt = torch.zeros(1, 2, 32, 2)
    prompt[0, 0, :, 0] = prompt[0, 1, :, 1] = 0.1  # the last key: the chunk policy's proxy
    prompt[0, 0, 16:24, 0] = prompt[0, 1, 8:16, 1] = 5.0  # head 0 scores chunk 2 best, head 1 chunk 1
    prompt[..., 31, :] = torch.tensor([1.0, 1.0])
    positions = torch.arange(40.0).view(1, 1, 40, 1).expand(1, 2, 40, 1)
    keys = torch.cat([prompt, torch.zeros(1, 2, 8, 2)], 2)
    read = BudgetRead(budget=16, policy=ChunkPolicy(chunk_size=8), window_length=3)
    first = read(keys[:, :, :32], positions[:, :, :32], 33)  # after the prefill: the prompt's 32 states
    assert first[1][0, 0].flatten().tolist() == [*range(8), *range(16, 24)]
    assert first[1][0, 1].flatten().tolist() == list(range(16))
    later_keys = keys.clone()
    later_keys[:, :, :32] = -later_keys[:, :, :32]  # a second choice would now differ: none is made
    later = read(later_keys, positions, 38)  # 38, 39: rejected drafts
    assert later[1][0, 0].flatten().tolist() == [*range(8), *range(16, 24), 35, 36, 37]
    assert later[1][0, 1].flatten().tolist() == [*range(16), 35, 36, 37]
    assert torch.equal(later[0][:, :, :16], first[0])
    just_after = BudgetRead(budget=16, policy="chunk", window_length=8)
    just_after(keys[:, :, :32], positions[:, :, :32], 33)
    assert just_after(keys, positions, 34)[1][0, 0, 16:].flatten().tolist() == [
        32,
        33,
    ]  # from the prompt's end


@pytest.mark.parametrize(
    "call,message",
    [
        (
            dict(cache_implementation="budgeted", cache_config={"policy": "snapkv"}),
            "selects with queries, but a Gemma 4 assistant is handed the target's keys and values only",
        ),
        (dict(cache_implementation="budgeted", cache_config={"budget": 4}), "budget=4 is too small"),
        (
            dict(cache_implementation="budgeted", cache_config={"num_sink_tokens": 4}),
            r"cache_config keys \['num_sink_tokens'\] are not options of a budgeted Gemma 4",
        ),
        (
            dict(cache_config={"budget": 8}),
            r"cache_config keys \['budget'\] are not options of a windowed Gemma 4",
        ),
        (dict(cache_config={"window_length": 0}), r"window_length must be in \[1,"),
        (dict(rows=2), "one unpadded sequence at a time"),
    ],
)
def test_what_a_windowed_assistant_cannot_do_is_refused(gemma4, call, message):
    target, assistant = gemma4
    call = {"cache_implementation": "sink_window", **call}
    ids = random_prompt(60).expand(call.pop("rows", 1), -1)
    with pytest.raises(ValueError, match=message):
        target.generate(ids, assistant_model=assistant, max_new_tokens=4, do_sample=False, **call)
