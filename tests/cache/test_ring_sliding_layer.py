"""`RingSlidingLayer`, the device round's sliding layers of a target: over prefill blocks, verification steps and
rollbacks, a target on its static cache computes the logits it computes without a cache; a step has fixed shapes and
no host read; a rollback past the slack is refused."""

import pytest
import torch
from tiny_families import family_pair
from transformers.cache_utils import StaticLayer

from hf_budgetdraft.cache.ring_sliding_layer import RingSlidingLayer
from hf_budgetdraft.compat import cache_kwargs
from hf_budgetdraft.generation.static_verify import roll_back, static_target_cache

SLACK = 8
# (feed n new tokens) or (roll back k): blocks of more than SLACK tokens (one rolled back into), then steps that wrap
# the ring (window 24 - 1 + SLACK = 31 slots) between rollbacks of every size up to the slack
SCRIPT = [30, 30, -8, 30, 10, 8, -5, 3, 8, -8, 1, 7, -2, 8, -7, 5, -1, 8, 8, -3, 2]


def _fresh_tokens(generator: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=generator)  # (pad id 0 avoided: no inferred padding)


@pytest.mark.parametrize("family", ["gemma3", "cohere2", "gpt_oss"])
def test_blocks_steps_and_rollbacks_give_the_uncached_logits(family):
    """Each forward's logits equal the target's on the whole sequence without a cache; after a rollback the next
    tokens differ from the rolled-back ones, so a stale key read anywhere would show."""
    target, _ = family_pair(family)
    cache = static_target_cache(target.config, 256, SLACK)
    assert [type(layer) for layer in cache.layers] == [RingSlidingLayer, StaticLayer]
    generator = torch.Generator().manual_seed(0)
    sequence = torch.zeros(1, 0, dtype=torch.long)
    with torch.no_grad():
        for move in SCRIPT:
            if move < 0:
                roll_back(cache, -move)  # as the device round rolls back
                sequence = sequence[:, :move]
                continue
            start = sequence.shape[1]
            sequence = torch.cat([sequence, _fresh_tokens(generator, move)], 1)
            positions = torch.arange(start, start + move)[None]
            logits = target(
                input_ids=sequence[:, start:], position_ids=positions, **cache_kwargs(cache), use_cache=True
            ).logits
            expected = target(sequence).logits[:, start:]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            assert int(cache.get_seq_length()) == sequence.shape[1]


def test_a_step_returns_the_whole_ring_in_position_order():
    """A step's keys are the `R` ring slots from `max(end - R, 0)` on, and its mask sizes say so before the write,
    the offset a device tensor (no host read, one shape for every step)."""
    window, slack = 4, 3
    layer = RingSlidingLayer(max_cache_len=64, sliding_window=window, slack=slack)
    ring = window - 1 + slack  # 6

    def feed(first: int, n: int) -> torch.Tensor:
        keys = torch.arange(first, first + n, dtype=torch.float32).reshape(1, 1, n, 1)  # a key = its position
        return layer.update(keys, keys.clone())[0].flatten()

    assert layer.get_mask_sizes(10) == (10, 0)  # a first block: its own tokens
    assert feed(0, 10).tolist() == list(range(10))
    assert layer.get_mask_sizes(10) == (
        window - 1 + 10,
        7,
    )  # a block after it: the window's past, then its tokens
    sizes = layer.get_mask_sizes(2)
    assert sizes[0] == ring and isinstance(sizes[1], torch.Tensor) and int(sizes[1]) == 12 - ring
    assert feed(10, 2).tolist() == list(range(12 - ring, 12))
    layer.crop(-3)  # positions 9-11 rolled back: their slots keep them until rewritten
    # slots of positions 4..9: those of 4 and 5 still hold the rolled-back 10 and 11, below query 9's window (6..9)
    assert feed(9, 1).tolist() == [10, 11, 6, 7, 8, 9]


def test_rollbacks_stay_within_the_slack():
    layer = RingSlidingLayer(max_cache_len=64, sliding_window=4, slack=3)
    for bad in (-4, 1):
        with pytest.raises(ValueError, match=r"between 0 and its slack \(3\)"):
            layer.crop(bad)
    for name, bad in (("sliding_window", 1), ("slack", 0)):
        with pytest.raises(ValueError, match=name):
            RingSlidingLayer(max_cache_len=64, **{"sliding_window": 4, "slack": 3, name: bad})


def test_a_ring_only_where_it_holds_less_than_the_cache():
    """A window that, with the slack, covers the whole cache keeps a plain static layer (exact under the sliding
    mask over absolute positions)."""
    target, _ = family_pair("gemma3")  # sliding_window 24
    assert isinstance(static_target_cache(target.config, 256, 64).layers[0], RingSlidingLayer)
    assert type(static_target_cache(target.config, 64, 64).layers[0]) is StaticLayer
