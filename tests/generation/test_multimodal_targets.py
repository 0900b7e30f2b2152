"""A multimodal target (an image in the prompt) with a text drafter: the output is the target's own greedy output on
the image, wherever the call runs. transformers' loop feeds the target the image (`pixel_values`, or its encoding in
`mm_encoder_outputs` from 5.25 on) and multimodal positions; the package's own loops (the batched loop, the device
round) and its chunked prefill feed ids and counted positions only, so a call with such inputs runs transformers'
loop, or is refused where it has none."""

import copy
from types import SimpleNamespace

import pytest
import torch
from resolved_plans import cuda_rules_on_cpu
from tiny_llava import tiny_llava
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from hf_budgetdraft import record_speculation
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation import drafter_media
from hf_budgetdraft.generation.device_loop import unsupported
from hf_budgetdraft.generation.model_inputs import uncarried_inputs

TEXT = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
IMAGE_TOKEN, PATCHES = 190, 16  # LLaVA: a 32 x 32 image in 8 x 8 patches, one token each
CACHES = {"budgeted": {"budget": 32}, "sink_window": {"num_sink_tokens": 4, "window_length": 24}}
NEW_TOKENS = 30


def _text_drafter(target, config) -> torch.nn.Module:
    """A text model holding the target's language model and head: it accepts where the text decides."""
    drafter = AutoModelForCausalLM.from_config(config).eval()
    weights = {
        name.replace("model.language_model.", "model."): value
        for name, value in target.state_dict().items()
        if "language_model" in name or name.startswith("lm_head")
    }
    drafter.load_state_dict(weights, strict=False)
    return drafter


@pytest.fixture(scope="module")
def llava():
    target = tiny_llava(TEXT["vocab_size"], IMAGE_TOKEN)
    return target, _text_drafter(target, LlamaConfig(**TEXT))


def image_prompt(seed: int, before: int = 10, after: int = 300) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat(
        [
            torch.randint(1, 180, (1, before), generator=generator),
            torch.full((1, PATCHES), IMAGE_TOKEN),
            torch.randint(1, 180, (1, after), generator=generator),
        ],
        1,
    )


def an_image(seed: int, images: int = 1) -> torch.Tensor:
    return torch.randn(images, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs)


def speculate(target, drafter, ids, name="budgeted", cache_config=None, **kwargs):
    config = {**CACHES[name], **(cache_config or {})}
    return greedy(
        target, ids, assistant_model=drafter, cache_implementation=name, cache_config=config, **kwargs
    )


@pytest.mark.parametrize("name", sorted(CACHES))
def test_an_image_prompt_gives_the_targets_own_output(llava, name):
    target, drafter = llava
    for seed in range(2):
        ids, pixels = image_prompt(seed), an_image(seed)
        with record_speculation() as stats:
            out = speculate(target, drafter, ids, name, pixel_values=pixels)
        assert torch.equal(out, greedy(target, ids, pixel_values=pixels))
        assert sum(stats.accepted_per_round) > 0  # the drafter drafts: the rounds ran


def test_the_image_changes_the_output(llava):
    """Without this, the tests above would pass with the image dropped."""
    target, _ = llava
    ids = image_prompt(0)
    assert not torch.equal(
        greedy(target, ids, pixel_values=an_image(0)), greedy(target, ids, pixel_values=an_image(5))
    )


@pytest.mark.parametrize("cache_config", [{}, {"full_draft_cache": True}], ids=["batch", "full_draft_cache"])
def test_the_batched_loop_refuses_an_image_rather_than_drop_it(llava, cache_config):
    target, drafter = llava
    ids = image_prompt(2)
    rows = 1 if cache_config else 2
    with pytest.raises(ValueError, match=r"would drop\. Generate one sequence at a time"):
        speculate(
            target,
            drafter,
            ids.expand(rows, -1),
            cache_config=cache_config,
            pixel_values=an_image(2, rows),
            attention_mask=torch.ones(rows, ids.shape[1], dtype=torch.long),
        )


def test_a_chunked_prefill_keeps_the_image(llava):
    """`prefill_chunk_size` would feed the prompt's chunks without the image: such a prompt is verified whole."""
    target, drafter = llava
    ids, pixels = image_prompt(3), an_image(3)
    out = speculate(target, drafter, ids, prefill_chunk_size=64, pixel_values=pixels)
    assert torch.equal(out, greedy(target, ids, pixel_values=pixels))


def test_a_continued_conversation_shows_an_image_in_its_second_turn(llava):
    """Turn one (text) prefilled into a cache; turn two adds an image: the output is the target's own continuing
    that cache."""
    target, drafter = llava
    first = torch.randint(1, 180, (1, 200), generator=torch.Generator().manual_seed(4))
    second = torch.cat([first, image_prompt(4, before=5, after=40)], 1)
    pixels = an_image(4)

    def after_first_turn():
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(first, **cache_kwargs(cache), use_cache=True)
        return cache

    expected = greedy(target, second, pixel_values=pixels, **cache_kwargs(after_first_turn()))
    assert torch.equal(expected, greedy(target, second, pixel_values=pixels))
    out = speculate(target, drafter, second, pixel_values=pixels, **cache_kwargs(after_first_turn()))
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def qwen2_vl():
    """A Qwen2-VL target: multimodal rotary positions (3-D `position_ids`, shifted past an image)."""
    torch.manual_seed(0)
    text = {
        **TEXT,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    }
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=190,
        video_token_id=191,
        vision_start_token_id=192,
        vision_end_token_id=193,
    )
    target = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter_config = Qwen2Config(**{**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    return target, _text_drafter(target, drafter_config)


def qwen2_vl_prompt(seed: int, image: bool) -> tuple[torch.LongTensor, dict]:
    """A prompt with a 56 x 56 image (4 x 4 patches merged 2 x 2: 4 image tokens) or none, and its inputs."""
    generator = torch.Generator().manual_seed(seed)
    parts = [torch.randint(1, 180, (1, 10), generator=generator)]
    if image:
        parts.append(torch.tensor([[192, 190, 190, 190, 190, 193]]))
    parts.append(torch.randint(1, 180, (1, 300), generator=generator))
    ids = torch.cat(parts, 1)
    if not image:
        return ids, {}
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=generator)
    types = (ids == 190).int()
    return ids, {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": types,
    }


@pytest.mark.parametrize("image", [True, False], ids=["image", "text"])
def test_multimodal_positions_give_the_targets_own_output(qwen2_vl, image):
    """With an image, the target's positions past it are shifted (the loops could not count them): transformers'
    loop runs. Text alone has counted positions on every axis: the device round, forced, runs it too."""
    target, drafter = qwen2_vl
    ids, inputs = qwen2_vl_prompt(5, image)
    expected = greedy(target, ids, **inputs)
    assert torch.equal(speculate(target, drafter, ids, **inputs), expected)
    if not image:
        with record_speculation() as stats:
            out = speculate(target, drafter, ids, cache_config={"device_round": True})
        assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"


def test_a_padded_text_batch_on_a_multimodal_target_runs_batched(qwen2_vl):
    target, drafter = qwen2_vl
    ids = torch.cat([qwen2_vl_prompt(6, False)[0], qwen2_vl_prompt(7, False)[0]])
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    call = dict(attention_mask=mask, pad_token_id=0)
    assert torch.equal(speculate(target, drafter, ids, **call), greedy(target, ids, **call))


def test_what_the_loops_do_not_carry():
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    counted = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    carried = {
        "attention_mask": mask,
        "position_ids": counted,
        "mm_encoder_outputs": {},
        "token_type_ids": torch.zeros_like(ids),
        "use_cache": True,
        "logits_to_keep": 1,
        "cache": DynamicCache(),
    }
    assert uncarried_inputs(carried, ids) == []
    assert uncarried_inputs({**carried, "position_ids": counted.expand(3, 2, 5)}, ids) == []
    assert uncarried_inputs({**carried, "position_ids": counted.expand(3, 2, 5)[:, :1]}, ids) == [
        "position_ids"
    ]
    shifted = counted.expand(3, 2, 5).clone()
    shifted[1:, :, 3:] -= 1
    assert uncarried_inputs({**carried, "position_ids": shifted}, ids) == ["position_ids"]
    extra = {
        "pixel_values": torch.ones(1),
        "mm_token_type_ids": torch.ones_like(ids),
        "mm_encoder_outputs": {"a": 1},
    }
    assert uncarried_inputs({**carried, **extra}, ids) == [
        "mm_encoder_outputs",
        "mm_token_type_ids",
        "pixel_values",
    ]
    # the device round's prefill takes what transformers' loop feeds its first forward only; nothing else
    target = SimpleNamespace(config=LlamaConfig())  # (only a passed cache reads the target's layers)
    assert unsupported(target, GenerationConfig(), {"pixel_values": torch.ones(1)}, ids[:1]) is None
    assert unsupported(target, GenerationConfig(), {"image_grid_thw": torch.ones(1, 3)}, ids[:1]) == (
        "model inputs it does not feed the target (['image_grid_thw'])"
    )
    given = DynamicCache()
    given._is_user_defined = True  # as transformers marks a cache its caller passed
    assert unsupported(
        target, GenerationConfig(), {"pixel_values": torch.ones(1), **cache_kwargs(given)}, ids[:1]
    ) == ("['pixel_values'] in a call continuing a cache it was given")


# ---------------------------------------------------------------------------------------------------------------
# a multimodal drafter reads the image itself
# ---------------------------------------------------------------------------------------------------------------


def _image_call(family: str) -> tuple[torch.LongTensor, dict]:
    if family == "llava":
        return image_prompt(1), {"pixel_values": an_image(1)}
    if family == "qwen2_vl":
        return qwen2_vl_prompt(5, image=True)
    # a video of 2 frames of 4 x 4 patches, merged 2 x 2: 8 video tokens
    generator = torch.Generator().manual_seed(5)
    before, after = (torch.randint(1, 180, (1, n), generator=generator) for n in (10, 300))
    ids = torch.cat([before, torch.tensor([[192] + [191] * 8 + [193]]), after], 1)
    return ids, {
        "pixel_values_videos": torch.randn(2 * 16, 3 * 2 * 14 * 14, generator=generator),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "mm_token_type_ids": (ids == 191).int() * 2,
    }


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_vl-video"])
def test_a_multimodal_drafter_reads_the_image(family, request, monkeypatch):
    """A vision-language drafter (here the target itself, its cache holding the whole prompt) encodes the prompt's
    image or video with its own tower: every draft is accepted. Fed the ids alone it drafts blind to it and is
    rejected in part; a text drafter is given nothing but the ids; the kept media do not outlive the call."""
    target, text_drafter = request.getfixturevalue(family.split("-")[0])
    drafter = copy.deepcopy(target)
    ids, inputs = _image_call(family)
    expected = greedy(target, ids, **inputs)
    whole = {"budget": 2048, "draft_length": 4}

    def run(model):
        with record_speculation() as stats:
            assert torch.equal(speculate(target, model, ids, cache_config=whole, **inputs), expected)
        return stats

    stats = run(drafter)
    assert {"pixel_values", "pixel_values_videos"} & set(stats.runtime["drafter_media"])
    assert sum(stats.accepted_per_round) == sum(stats.proposed_per_round) > 0
    assert drafter_media._KEPT.get() is None
    assert run(text_drafter).runtime["drafter_media"] == []
    monkeypatch.setattr(drafter_media, "for_drafter", lambda model, kwargs: {})
    blind = run(drafter)
    assert sum(blind.accepted_per_round) < sum(blind.proposed_per_round)


@pytest.fixture
def cuda_loops():
    """CUDA's choices about loops (the device round), on the CPU; the verification and the draft step eager
    (compiling is slow here, and not what these tests are about)."""
    with cuda_rules_on_cpu():
        yield {"compile_verify": False, "compile": False}


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_vl-video"])
def test_the_device_round_takes_an_image_prompt(family, request, cuda_loops):
    """The device round's prefill is the forward transformers' loop gives the image (its encoding, the prompt's
    token types and multimodal positions): the output is the target's own, with a text drafter and with a drafter
    equal to the target reading the image itself, which accepts every draft."""
    target, text_drafter = request.getfixturevalue(family.split("-")[0])
    ids, inputs = _image_call(family)
    expected = greedy(target, ids, **inputs)
    whole = {"budget": 2048, "draft_length": 4, **cuda_loops}
    for drafter, reads_media in ((text_drafter, False), (copy.deepcopy(target), True)):
        with record_speculation() as stats:
            out = speculate(target, drafter, ids, cache_config=whole, **inputs)
        assert torch.equal(out, expected) and stats.runtime["loop"] == "device_round"
        read = set(stats.runtime["drafter_media"]) & {"pixel_values", "pixel_values_videos"}
        assert bool(read) == reads_media
    assert sum(stats.accepted_per_round) == sum(stats.proposed_per_round) > 0


def test_the_device_round_verifies_at_the_targets_own_positions(qwen2_vl, cuda_loops):
    """Past an image a Qwen2-VL target's text positions run 2 behind its token count: the prefill is given the
    prompt's multimodal positions, and each verification continues from its last."""
    target, drafter = qwen2_vl
    ids, inputs = qwen2_vl_prompt(5, image=True)
    seen, kept = [], []

    def record(module, args, kwargs):
        seen.append(kwargs.get("position_ids"))
        kept.append(kwargs.get("logits_to_keep"))

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with record_speculation() as stats:
            speculate(target, drafter, ids, cache_config={"draft_length": 4, **cuda_loops}, **inputs)
    finally:
        hook.remove()
    assert stats.runtime["loop"] == "device_round"
    assert seen[0].shape == (4, 1, ids.shape[1])  # the prefill: the prompt's own positions
    assert kept[0] == 1  # and its last position's logits only
    assert seen[1].flatten()[0].item() == ids.shape[1] - 2  # the first verification, at the prompt's end


def test_the_device_round_leaves_a_continued_image_conversation_to_transformers_loop(llava, cuda_loops):
    """A second turn bringing an image to a cache its caller prefilled runs transformers' loop, the plan says why."""
    target, drafter = llava
    first = torch.randint(1, 180, (1, 200), generator=torch.Generator().manual_seed(4))
    second = torch.cat([first, image_prompt(4, before=5, after=40)], 1)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(first, **cache_kwargs(cache), use_cache=True)
    with record_speculation() as stats:
        speculate(
            target, drafter, second, pixel_values=an_image(4), cache_config=cuda_loops, **cache_kwargs(cache)
        )
    assert not stats.plan.device_round
    assert "in a call continuing a cache it was given" in stats.plan.reasons["device_round"]


def test_a_multimodal_drafter_continues_at_its_own_positions(qwen2_vl):
    """Past an image a Qwen2-VL model's text positions run behind its token count (4 image tokens take 2
    positions): the drafter computes its prefill's positions itself and drafts on at the target's own."""
    target, _ = qwen2_vl
    drafter = copy.deepcopy(target)
    ids, inputs = qwen2_vl_prompt(5, image=True)
    seen = []
    hook = drafter.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    try:
        speculate(target, drafter, ids, cache_config={"budget": 2048, "draft_length": 4}, **inputs)
    finally:
        hook.remove()
    shift = int(target.model.rope_deltas)
    assert shift == -2 and seen[0] is None  # the prefill: positions of its own
    assert seen[1].flatten()[0].item() == ids.shape[1] + shift  # the first draft step, past the prompt


def test_a_multimodal_drafter_continuing_a_conversation_reads_its_ids(llava):
    """A second turn continuing a prefilled cache brings only its own image, where the drafter reads the whole
    conversation (two images): the drafter reads the ids, and the output is the target's own."""
    target, _ = llava
    drafter = copy.deepcopy(target)
    first = image_prompt(6, before=5, after=100)
    second = torch.cat([first, image_prompt(4, before=5, after=40)], 1)

    def after_first_turn():
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(first, pixel_values=an_image(6), **cache_kwargs(cache), use_cache=True)
        return cache

    expected = greedy(target, second, pixel_values=an_image(4), **cache_kwargs(after_first_turn()))
    with record_speculation() as stats:
        out = speculate(target, drafter, second, pixel_values=an_image(4), **cache_kwargs(after_first_turn()))
    assert torch.equal(out, expected) and stats.runtime["drafter_media"] == []


def test_a_smaller_multimodal_drafter_encodes_the_image_itself(llava):
    """A drafter of another hidden size with a tower of its own: it encodes the image itself (transformers' assisted
    loop would hand it the target's encodings, of the target's size), and the output is the target's own."""
    target, _ = llava
    small = tiny_llava(TEXT["vocab_size"], IMAGE_TOKEN, hidden_size=32, seed=1, head_scale=1.0)
    ids, inputs = _image_call("llava")
    with record_speculation() as stats:
        out = speculate(target, small, ids, **inputs)
    assert torch.equal(out, greedy(target, ids, **inputs))
    assert stats.runtime["drafter_media"] == ["pixel_values"] and stats.rounds > 0
