"""One parser of `cache_config` for every kind of draft: the same checks and messages for a drafter, an MTP head,
a DFlash drafter and a Gemma 4 assistant, and the run options split from the cache's."""

import pytest

from hf_budgetdraft.generation.cache_config import WindowedSpec
from hf_budgetdraft.generation.spec import DraftSpec


@pytest.mark.parametrize(
    "parse,what",
    [
        (lambda config: DraftSpec.from_cache_config("budgeted", config), "cache_implementation='budgeted'"),
        (lambda config: WindowedSpec.from_cache_config("mtp", config), "windowed MTP"),
        (lambda config: WindowedSpec.from_cache_config("dflash", config), "windowed DFlash"),
        (
            lambda config: WindowedSpec.from_cache_config("assistant_sink_window", config),
            "a windowed Gemma 4 assistant",
        ),
        (
            lambda config: WindowedSpec.from_cache_config("assistant_budgeted", config),
            "a budgeted Gemma 4 assistant",
        ),
    ],
    ids=["drafter", "mtp", "dflash", "assistant_sink_window", "assistant_budgeted"],
)
def test_every_kind_refuses_unknown_keys_the_same_way(parse, what):
    with pytest.raises(
        ValueError, match=rf"cache_config keys \['bogus'\] are not options of {what}; accepted: \["
    ):
        parse({"bogus": 1, "window_length": 64})


def test_run_options_are_parsed_once_and_apart_from_the_cache_options():
    spec = WindowedSpec.from_cache_config(
        "mtp", {"window_length": 64, "draft_length": 0, "fast_verify": False}
    )
    assert (
        spec.cache_options == {"window_length": 64} and spec.draft_length == 0 and spec.fast_verify is False
    )
    assert WindowedSpec.from_cache_config("mtp", None) == WindowedSpec("mtp")
    assert WindowedSpec.from_cache_config("dflash", {"slack": 40}).cache_options == {"slack": 40}
    with pytest.raises(ValueError, match="not options of windowed DFlash"):
        WindowedSpec.from_cache_config("dflash", {"draft_length": 1})  # a run option MTP has, DFlash does not
    with pytest.raises(TypeError, match="fast_verify must be a bool, got 'yes'"):
        WindowedSpec.from_cache_config("mtp", {"fast_verify": "yes"})
    with pytest.raises(TypeError, match="fast_verify must be a bool"):
        DraftSpec.from_cache_config("budgeted", {"fast_verify": "yes"})
    with pytest.raises(ValueError, match="kind must be one of"):
        WindowedSpec.from_cache_config("eagle", {})
